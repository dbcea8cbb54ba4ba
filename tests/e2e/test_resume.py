"""Exact resume through the CLI (2 gloo ranks, bf16 as every GPU recipe): a run killed while
saving a checkpoint and resumed from the previous one ends bit-identical to a run that went
straight through; the checkpoint also resumes at another parallel layout (TP=2; the actor at CP=2), and
exports bf16.

Setting: the CPU demo in bfloat16 at DP=2 with the distributed optimizer (so optimizer state,
float32 master weights included, is sharded), critic + GAE, a reference model with an adaptive
KL coefficient in the reward (controller state), validation every 2 steps; 4 steps,
checkpoints every 2. (fp32 exact resume: tests/e2e/test_dynamic_sampling.py (async, critic warmup),
test_multiturn_demo.py and tests/distributed/test_checkpoint.py.)
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from megappo.models.precision import COMPARE_TOL
from tests import prefork
from tests.e2e._runs import hf_weights, metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["model.dtype=bfloat16", "run.total_steps=4", "checkpoint.save_every=2", "checkpoint.save_hf_at_end=true", "run.val_every=2",
        "logging.progress_bar=false", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=10", "algorithm.kl_ctrl.target_kl=0.001"]
DP2 = ["parallel.tp=1", "parallel.use_distributed_optimizer=true", "actor.micro_batch_size=16",
       "critic.micro_batch_size=16"]


def command(out, *extra):
    return [sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", "recipes/demo-cpu.yaml",
            f"run.output_dir={out}", *ARGS, *extra]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    e.pop("WORLD_SIZE", None)
    return e


def run(cmd, timeout=400):
    proc = prefork.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def kill_during_save(cmd, partial: str, timeout=400) -> None:
    """Start `cmd` and SIGKILL it with every process it started (torchrun puts its ranks in
    their own sessions) as soon as `partial` (a checkpoint directory being written) appears."""
    kill_when(cmd, lambda: os.path.isdir(partial), f"saving {partial}", timeout)


def kill_when(cmd, ready, what: str, timeout=400) -> None:
    """Start `cmd` and SIGKILL it with every process it started as soon as `ready()` is true."""
    proc = prefork.popen(cmd, env=env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while not ready():
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
            assert time.time() < deadline, f"not {what} after {timeout}s"
            time.sleep(0.002)
    finally:
        tree = psutil.Process(proc.pid)
        for p in [tree, *tree.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(0.5)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    run(command(out, *DP2))
    return out


def test_kill_during_save_then_resume_is_bit_identical(straight, tmp_path):
    out = str(tmp_path / "killed")
    ckpts = os.path.join(out, "checkpoints")
    kill_during_save(command(out, *DP2), os.path.join(ckpts, "step_00000004.partial"))
    # the kill hit the step-4 save: `latest` still names the complete step-2 checkpoint
    assert open(os.path.join(ckpts, "latest")).read() == "step_00000002"
    assert not os.path.exists(os.path.join(ckpts, "step_00000004"))

    log = run(command(out, *DP2))
    assert "resumed from" in log and "step 2" in log
    assert "\ndone: 2 steps this launch (4 of 4 in the run), final critic/score/mean=" in log
    assert metrics(out) == metrics(straight)  # steps 1-2 kept, 3-4 recomputed: same numbers
    for role in ("actor", "critic"):
        a, b = hf_weights(os.path.join(straight, "hf", role)), hf_weights(os.path.join(out, "hf", role))
        assert a.keys() == b.keys()
        unequal = [k for k in a if not torch.equal(a[k], b[k])]
        assert not unequal, f"{role}: {unequal[:3]}"
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("step_")) == ["step_00000002", "step_00000004"]


def test_going_back_to_an_earlier_checkpoint_replays_it_exactly(straight, tmp_path):
    """checkpoint.resume_from=2 in a finished run's directory: step 4's checkpoint and the metric log are moved
    aside, steps 3-4 are trained again to the same numbers and weights, and the same command run again
    continues the new branch (here: nothing to do) rather than going back a second time."""
    out = str(tmp_path / "back")
    shutil.copytree(straight, out)
    ckpts = os.path.join(out, "checkpoints")
    log = run(command(out, *DP2, "checkpoint.resume_from=2"))
    assert f"going back to {os.path.join(ckpts, 'step_00000002')} (step 2, checkpoint.resume_from)" in log
    aside = os.path.join(ckpts, "superseded", os.listdir(os.path.join(ckpts, "superseded"))[0])
    assert sorted(os.listdir(aside)) == ["metrics.jsonl", "samples.jsonl", "step_00000004"]
    assert metrics(out) == metrics(straight)  # steps 3-4 again, bit for bit
    with open(os.path.join(aside, "metrics.jsonl")) as f:
        assert f.read() == open(os.path.join(straight, "metrics.jsonl")).read()
    for role in ("actor", "critic"):
        a, b = hf_weights(os.path.join(straight, "hf", role)), hf_weights(os.path.join(out, "hf", role))
        assert all(torch.equal(a[k], b[k]) for k in a), role
    with open(os.path.join(ckpts, "step_00000004", "trainer_state.json")) as f:
        assert json.load(f)["branch"] == {"from": os.path.realpath(os.path.join(ckpts, "step_00000002"))}
    again = run(command(out, *DP2, "checkpoint.resume_from=2"), timeout=120)
    assert "nothing to do: " in again and "step_00000004 is at step 4" in again
    assert len(os.listdir(os.path.join(ckpts, "superseded"))) == 1


def test_val_only_validates_a_checkpoint_and_leaves_the_run_as_it_was(straight, tmp_path):
    """run.val_only in a finished run's directory: step 2's checkpoint (checkpoint.resume_from), then the latest
    (step 4), each validated once, to the numbers the run logged at those steps; nothing trained, saved, moved
    or cut back; the validations kept side by side in val_only/metrics.jsonl."""
    out = str(tmp_path / "eval")
    shutil.copytree(straight, out)
    before = {name: open(os.path.join(out, name)).read() for name in ("metrics.jsonl", "samples.jsonl")}
    ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
    for extra in (["checkpoint.resume_from=2"], []):
        log = run(command(out, *DP2, "run.val_only=true", *extra))
        assert "megappo: run.val_only: validating " in log and "done: validated at step " in log
    assert {name: open(os.path.join(out, name)).read() for name in before} == before
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ckpts
    rows = metrics(os.path.join(out, "val_only"))
    assert [r["step"] for r in rows] == [2, 4]
    logged = {r["step"]: r for r in metrics(straight)}
    for row in rows:
        want = {k: v for k, v in logged[row["step"]].items() if k.startswith(("val/", "val-core/", "val-aux/"))}
        assert want and {k: v for k, v in row.items() if k != "step"} == want


def test_resume_at_another_layout(straight, tmp_path):
    """The DP=2 distributed-optimizer checkpoint of step 2 continues at TP=2 (resharded on load)."""
    out = tmp_path / "tp2"
    shutil.copytree(os.path.join(straight, "checkpoints", "step_00000002"), out / "checkpoints" / "step_00000002")
    (out / "checkpoints" / "latest").write_text("step_00000002")
    run(command(str(out), "parallel.tp=2", "parallel.use_distributed_optimizer=true", "run.total_steps=3"))
    got, ref = metrics(str(out))[-1], metrics(straight)[3]
    assert got["step"] == ref["step"] == 3
    # the same samples (the engine's tokens do not depend on the layout); losses computed in bf16 in another
    # order: within bf16 rounding (megappo.models.precision.COMPARE_TOL)
    assert got["critic/score/mean"] == ref["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/ppo_kl", "critic/vf_loss", "actor/reward_kl_penalty_coeff"):
        if key in ref:
            assert abs(got[key] - ref[key]) <= COMPARE_TOL["bfloat16"] * max(1.0, abs(ref[key])), (key, got[key], ref[key])


def test_resume_with_the_actor_at_context_parallelism(straight, tmp_path):
    """The same step-2 checkpoint continues with the actor's sequences split over both ranks
    (actor.parallel.cp=2: its distributed optimizer sharded over dp x cp, megappo.parallel.context)."""
    out = tmp_path / "cp2"
    shutil.copytree(os.path.join(straight, "checkpoints", "step_00000002"), out / "checkpoints" / "step_00000002")
    (out / "checkpoints" / "latest").write_text("step_00000002")
    printed = run(command(str(out), *DP2, "actor.parallel.cp=2", "run.total_steps=3"))
    assert "actor tp=1 pp=1 cp=2 dp=1" in printed and "resumed from" in printed, printed[-3000:]
    got, ref = metrics(str(out))[-1], metrics(straight)[3]
    assert got["step"] == ref["step"] == 3
    assert got["critic/score/mean"] == ref["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss", "actor/reward_kl_penalty_coeff"):
        if key in ref:
            assert abs(got[key] - ref[key]) <= COMPARE_TOL["bfloat16"] * max(1.0, abs(ref[key])), (key, got[key], ref[key])


def test_resume_refuses_a_changed_algorithm(straight, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(os.path.join(straight, "checkpoints"), out / "checkpoints")
    proc = prefork.run(command(str(out), *DP2, "algorithm.adv_estimator=reinforce_plus_plus"), env=env(),
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot resume from" in proc.stderr and "algorithm.adv_estimator: checkpoint 'gae' vs now" in proc.stderr
    assert not (out / "metrics.jsonl").exists()  # refused before anything was written


def test_rerun_of_a_finished_run_has_nothing_to_do(straight):
    proc = prefork.run(command(straight, *DP2), env=env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "nothing to do: " in proc.stdout and "at step 4 and run.total_steps=4" in proc.stdout
    assert [r["step"] for r in metrics(straight)] == [0, 1, 2, 3, 4]  # the log is untouched


def test_export_a_checkpoint_to_hf(straight, tmp_path):
    """`megappo export RUN_DIR OUT` writes the latest checkpoint's actor: the same tensors as
    the end-of-training export (checkpoint.save_hf_at_end)."""
    out = tmp_path / "hf_actor"
    proc = prefork.run([sys.executable, "-m", "megappo.cli", "export", straight, str(out)], env=env(), cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = hf_weights(os.path.join(straight, "hf", "actor")), hf_weights(str(out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in b.values())  # the weights the run trained, in their dtype
    again = prefork.run([sys.executable, "-m", "megappo.cli", "export", straight, str(out)], env=env(), cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists and is not empty; pass --overwrite" in again.stderr


def files(root, skip=("megappo.lock",)):
    """Every file under root (relative path -> bytes)."""
    out = {}
    for d, _, names in os.walk(root):
        for name in names:
            if name not in skip:
                with open(os.path.join(d, name), "rb") as f:
                    out[os.path.relpath(os.path.join(d, name), root)] = f.read()
    return out


def test_a_fresh_run_never_overwrites_an_earlier_runs_results(straight, tmp_path):
    """A finished run's directory, then a checkpoint.resume=off run killed before its first checkpoint, then
    the same directory's rerun (no checkpoint to resume): each fresh run first moves the earlier one's files
    into superseded/ (megappo.trainer.earlier_runs), byte for byte, and says so in one line."""
    from megappo.trainer.earlier_runs import OUTPUT_ENTRIES

    assert set(os.listdir(straight)) <= set(OUTPUT_ENTRIES)  # every name a real run writes is known
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    earlier = files(out)
    aside = out / "superseded"
    kill_when(command(str(out), *DP2, "checkpoint.resume=off", "run.total_steps=2"),
              lambda: aside.is_dir() and (out / "metrics.jsonl").exists(), "started")
    killed = files(out)
    assert not any(k.startswith("checkpoints" + os.sep + "step_") for k in killed)  # before its first checkpoint
    console = run(command(str(out), *DP2, "run.total_steps=1"))
    first, second = sorted(os.listdir(aside))
    assert files(aside / first) == earlier  # the finished run, every byte
    assert files(aside / second) == {k: v for k, v in killed.items() if not k.startswith("superseded")}  # killed run's
    assert "megappo: an earlier run's files (config.json, metrics.jsonl" in console
    assert f"are now in {aside / second}: this run starts fresh (no checkpoint to resume); nothing was deleted." \
        in console
    assert [r["step"] for r in metrics(out)] == [0, 1]


def test_a_verl_default_local_dir_run_keeps_its_metrics_beside_its_checkpoints(straight, tmp_path):
    """verl's trainer.default_local_dir is the run's directory: a verl-style run started from a recipe whose
    run.output_dir holds a finished run writes everything to its own directory, and the finished run is
    untouched (the sequence that once truncated the demo's metrics.jsonl)."""
    demo = tmp_path / "demo"
    shutil.copytree(straight, demo)
    before = files(demo)
    recipe = tmp_path / "demo-cpu.yaml"
    with open(os.path.join(REPO, "recipes", "demo-cpu.yaml")) as f:
        text = f.read()
    assert "  output_dir: runs/demo-cpu\n" in text
    recipe.write_text(text.replace("  output_dir: runs/demo-cpu\n", f"  output_dir: {demo}\n"))
    verl_dir = tmp_path / "ckpts" / "proj" / "exp"
    console = run([sys.executable, "-m", "megappo.cli", "train", "--world-size", "2", str(recipe), *ARGS, *DP2,
                   "run.total_steps=1", f"trainer.default_local_dir={verl_dir}"])
    assert "trainer.default_local_dir -> run.output_dir" in console
    assert files(demo) == before
    assert [r["step"] for r in metrics(verl_dir)] == [0, 1]
    assert os.path.isdir(verl_dir / "checkpoints" / "step_00000001")
