"""Rollout engine replicas (megappo.rollout.replicas) over real gloo ranks: workers/replicas_worker.py.

At TP2 x PP2 (4 ranks; 4 replicas, one per rank, and 2, on ranks 0 and 2, the second at pipeline
stage 1) and DP2 (2 ranks, 2 replicas): every replica holds the actor's weights bit for bit after a
sync gathered from its own pipeline's ranks, the split generation gives one engine's tokens bitwise,
and a replica that loads corrupted weights fails the sync on every rank.
"""

import pytest

from tests.distributed._launch import run_torchrun


@pytest.mark.parametrize("nproc,tp,pp,counts", [(4, 2, 2, (4, 2)), (2, 1, 1, (2,))], ids=["tp2xpp2", "dp2"])
def test_replicas(nproc, tp, pp, counts):
    out = run_torchrun("replicas_worker.py", nproc, tp, pp, *counts)
    assert "ALL OK" in out
    for count in counts:
        assert out.count(f"OK R={count} replica on rank") == count
        assert f"OK R={count} same tokens as one engine (greedy=False" in out
        assert f"OK R={count} same tokens as one engine (greedy=True" in out
        assert out.count(f"OK R={count} corrupted replica detected") == nproc
