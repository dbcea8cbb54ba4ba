"""Routing replay: with the engine's routes replayed, the trainer's log-probs of the engine's tokens
equal the engine's within 1e-5 even where its own routers would choose other experts
(workers/replay_worker.py), at EP2 (over DP2) and PP2."""

import pytest

from tests.distributed._launch import run_torchrun


@pytest.mark.parametrize("layout", [pytest.param(("1", "1", "2"), id="ep2"),
                                    pytest.param(("1", "2", "1"), id="pp2")])
def test_replayed_routes_match_the_engine(layout):
    out = run_torchrun("replay_worker.py", 2, *layout, timeout=600)
    assert "ALL OK" in out
    for kind in ("packed", "padded"):
        assert f"OK {kind} replayed log-probs = engine's" in out
    assert "OK update with replay" in out
