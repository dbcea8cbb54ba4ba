"""Context parallelism (4 gloo ranks): every pass at CP=2 (DP2 x CP2, TP2 x CP2, PP2 x CP2, PP2 x VPP2 x CP2)
and CP=4 equals CP=1 on the same packed batch, and checkpoints and the exported weights cross CP
(workers/context_parallel_worker.py says what each check compares). One launch: the CP=1 reference
is computed in it, each layout built over the same ranks."""

from tests.distributed._launch import run_torchrun

LAYOUTS = ("dp2cp2", "tp2cp2", "pp2cp2", "vpp2cp2", "cp4")
BF16 = ("dp2cp2", "tp2cp2")
CHECKS = ("token stats", "chunked head token stats", "IS weight batch mean", "actor update", "actor after update", "chunked head update",
          "chunked head after update", "values", "critic update", "critic after update", "scores")


def test_context_parallel_equals_cp1_and_checkpoints_cross_cp(tmp_path):
    out = run_torchrun("context_parallel_worker.py", 4, *LAYOUTS, f"--bf16={','.join(BF16)}",
                       f"--checkpoint={tmp_path}", timeout=1200)
    assert f"ALL OK {' '.join(LAYOUTS)}" in out, out[-4000:]
    for layout in LAYOUTS:
        for check in CHECKS:
            assert f"OK {layout} float32 {check} " in out, (layout, check)
        if layout != "vpp2cp2":  # the interleaved schedule cannot run a batch of one sequence
            assert f"OK {layout} float32 one sequence " in out, layout
    for layout in BF16:
        for check in CHECKS:
            assert f"OK {layout} bfloat16 {check} " in out, (layout, check)
    for check in ("lora recompute update", "lora recompute after update", "selective recompute update",
                  "selective recompute after update", "tied chunked head update", "tied chunked head after update"):
        assert f"OK dp2cp2 float32 {check} " in out, check
    for rank in (0, 1, 3):
        for check in ("export at cp=2 = cp=1 (HF weights)", "cp=2 checkpoint loaded at cp=1",
                      "cp=1 checkpoint loaded at cp=2"):
            assert f"OK rank {rank} {check} bit for bit" in out, (rank, check)
    for rank in range(4):
        for check in ("cp=2 optimizer state loaded at cp=1", "cp=1 optimizer state loaded at cp=2"):
            assert f"OK rank {rank} {check} bit for bit" in out, (rank, check)
    assert "OK resumed at cp=1 next update" in out and "OK resumed at cp=2 next update" in out
