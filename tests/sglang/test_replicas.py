"""Two real SGLang engines as rollout replicas on CPU (rollout.replicas=2; docs/engines.md#replicas):
`megappo train recipes/demo-cpu.yaml rollout.engine=sglang rollout.replicas=2` on 2 gloo ranks, an
SGLang engine started by each rank.

One run that ends the way a lost replica ends a run: steps 1-2 train on both engines, then rank 1's
SGLang processes (scheduler, detokenizer) are killed. Before the kill, every step's 64 prompts were
split 32 / 32 and both parts came back (`perf/replica_prompts_min`, which ReplicaSet reports from
the parts it joined), each weight sync was verified on each replica (rollout.verify_every=1: a
mismatch on either would have ended the run), and the engines' log-probs of all 64 samples equal the
trainer's within 1e-5 (fp32), so replica 1 generated with exactly the trainer's weights. After the
kill, rank 0's next request to replica 1 (step 3's generation, or the sync after it when that part
was already generated) fails on rank 1 (EngineCrashed, sent back as an error reply), and the run ends
with exit 1 and one error line, naming the replica, and nothing of it left running.

A run with replicas that ends normally is test_one_step_off.py's one_step_off case.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil

from tests import prefork
from tests.e2e.test_rank_death import REPO, env, kill_all, marked

KILL_AFTER, STEPS = 2, 8  # the run would go on past step KILL_AFTER: it is the kill that ends it
ARGS = ["rollout.engine=sglang", "rollout.replicas=2", "rollout.verify_every=1", "rollout.sglang.max_total_tokens=4096",
        "model.dtype=float32", f"run.total_steps={STEPS}", "run.val_before_train=false", "run.val_every=0",
        "checkpoint.save_every=0", "logging.progress_bar=false"]


def step_rows(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = [json.loads(line) for line in open(path).read().splitlines() if line.endswith("}")]
    return [r for r in rows if "critic/score/mean" in r]


def test_two_sglang_replicas_generate_verify_and_a_dead_one_ends_the_run(tmp_path):
    out, mark, log = str(tmp_path / "run"), uuid.uuid4().hex, tmp_path / "run.log"
    cmd = [sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", f"run.output_dir={out}", *ARGS]
    with open(log, "w") as sink:  # a file, not a pipe: a process left behind would hold a pipe open
        proc = prefork.popen(cmd, env=env(mark), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.time() + 600
        while len(step_rows(out)) < KILL_AFTER:
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {KILL_AFTER}:\n" \
                                        f"{log.read_text()[-6000:]}"
            assert time.time() < deadline, f"no step {KILL_AFTER} after 600 s:\n{log.read_text()[-6000:]}"
            time.sleep(0.1)
        rank1 = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
        assert len(rank1) == 1, rank1
        engine = {" ".join(p.cmdline()).strip(): p for p in rank1[0].children()}  # SGLang names its processes
        engine = {name: p for name, p in engine.items() if name.startswith("sglang::")}
        assert sorted(engine) == ["sglang::detokenizer", "sglang::scheduler"], engine
        for p in engine.values():
            p.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=300)
        output = log.read_text()
        deadline = time.time() + 10  # SIGKILLed processes take a moment to disappear
        while marked(mark) and time.time() < deadline:
            time.sleep(0.1)
        left = marked(mark)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_all(mark)

    # both replicas generated: rank 1's engine was started and served half of every step's prompts
    assert " rollout_replicas=2 (ranks 0, 1)\n" in output, output[-6000:]
    rows = step_rows(out)
    assert KILL_AFTER <= len(rows) < STEPS, output[-6000:]
    assert [r["perf/replica_prompts_min"] for r in rows] == [32.0] * len(rows)  # 64 prompts, 32 each
    # both received verified weights: every sync verified on both (or the run had ended), and replica 1's
    # samples' log-probs are the trainer's as closely as replica 0's
    worst = max(r["rollout/logprob_diff_max"] for r in rows)
    assert worst <= 1e-5, f"engine/trainer log-prob mismatch {worst:.2e} > 1e-5"
    # the dead replica ends the run: exit 1, the last error line names it, nothing left running
    assert code == 1, output[-6000:]
    errors = [line for line in output.splitlines() if line.startswith("megappo: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "megappo: error: rollout replica 1 (global rank 1): the sglang rollout engine crashed"), output[-6000:]
    assert not left, "processes of the run left after it ended:\n" + "\n".join(left)


def test_two_sglang_replicas_of_their_own_receive_broadcast_weights(tmp_path):
    """Disaggregated replicas (rollout.sync_mode=distributed): each leader's engine takes its weights over a
    weight-update group of its own (gloo on CPU), opened once at its first sync and reused: SGLang logs one
    'init custom process group' per engine (at log level info). The run ends (it hung at its exit once: a
    thread of the sender's kept the rank alive). Every sync is verified on both replicas (verify_every=1), both
    generate half of every step's prompts, and their log-probs equal the trainer's within 1e-5 at every step
    (rollout.mode=sync: the engines hold exactly the weights the trainer just updated)."""
    from tests.e2e.test_cli_demo import cli

    steps = 3
    code, out = cli("train", "recipes/demo-cpu.yaml", f"run.output_dir={tmp_path}", *ARGS[:4],
                    "rollout.sync_mode=distributed", "rollout.sglang.log_level=info", "model.dtype=float32",
                    f"run.total_steps={steps}",
                    "run.val_before_train=false", "run.val_every=0", "checkpoint.save_every=0",
                    "logging.progress_bar=false", timeout=900)
    assert code == 0, out[-6000:]
    assert " rollout_replicas=2 (ranks 0, 1)\n" in out, out[-6000:]
    assert out.count("init custom process group") == 2, out[-6000:]  # one group per engine, reused
    rows = step_rows(str(tmp_path))
    assert len(rows) == steps
    assert [r["perf/replica_prompts_min"] for r in rows] == [32.0] * steps
    worst = max(r["rollout/logprob_diff_max"] for r in rows)
    assert worst <= 1e-5, f"engine/trainer log-prob mismatch {worst:.2e} > 1e-5"
