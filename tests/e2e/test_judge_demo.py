"""A judge-rewarded run through the CLI: the CPU demo (2 gloo ranks) scored only by `reward.functions=[judge]`,
whose endpoint is the local judge server started by its one command with the deterministic stand-in
(`--stand-in exact`: "Score: 1" when the reference answer occurs in the response; a model small enough for
CI cannot judge). Every response is judged over HTTP and the demo learns from those scores."""

import json
import os
import socket
import subprocess
import sys

from tests.e2e._runs import REPO, train
STEPS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_demo_learns_from_a_judge_over_http(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "megappo.rollout.judge_server", "--stand-in", "exact",
                               "--port", str(port)], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert "megappo judge server: http://127.0.0.1" in server.stdout.readline()
        proc = train("recipes/demo-cpu.yaml", f"run.output_dir={tmp_path}", "logging.progress_bar=false",
                     f"run.total_steps={STEPS}", "run.val_every=0", "run.val_before_train=false",
                     "reward.functions=[judge]", f"reward.judge.url=http://127.0.0.1:{port}",
                     "reward.judge.max_concurrent=16")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert len(steps) == STEPS
    first = sum(r["critic/score/mean"] for r in steps[:5]) / 5
    last = sum(r["critic/score/mean"] for r in steps[-5:]) / 5
    assert first <= 0.3 and last >= first + 0.3, f"the judge-rewarded demo did not learn: {first:.3f} -> {last:.3f}"
    for r in steps:  # every response judged, none failed or unparseable
        assert r["reward/judge/failed"] == r["reward/judge/unparseable"] == 0 and r["reward/judge/latency_s"] > 0
