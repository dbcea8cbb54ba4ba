"""SGLang's distributed weight sync (sync_mode=distributed), over gloo, with an engine stand-in.

workers/update_group_worker.py: megappo's trainer side for real (Megatron actor, bridge,
SGLangEngine, the update group) against two processes that receive as SGLang's TP
workers do. The real SGLang path is tests/unit/test_sglang_engine.py (GPU).
"""

from tests.distributed._launch import run_torchrun


def test_distributed_sync_to_engine_workers():
    out = run_torchrun("update_group_worker.py", 1, timeout=240)
    assert "ALL OK" in out
    for label in ("flattened", "per-tensor"):
        for check in (f"{label} sync bit-exact", f"{label} second sync bit-exact",
                      f"{label} corrupted transfer detected", f"{label} engine failure raised"):
            assert f"OK {check}" in out, check
