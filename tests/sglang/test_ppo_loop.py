"""The PPO loop with real SGLang generating on CPU: `megappo train recipes/demo-cpu.yaml
rollout.engine=sglang` learns the demo task, and the engine's log-probs of the sampled tokens
equal the Megatron actor's within 1e-5 at every step (fp32)."""

import json

from tests.e2e.test_cli_demo import cli


def test_demo_learns_with_sglang(tmp_path):
    code, out = cli("train", "recipes/demo-cpu.yaml", "rollout.engine=sglang", "rollout.sglang.max_total_tokens=4096",
                    "model.dtype=float32", f"run.output_dir={tmp_path}", "run.total_steps=100", "run.val_every=0",
                    "checkpoint.save_every=0", "logging.progress_bar=false", timeout=1800)
    assert code == 0, out[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    assert len(rows) == 100
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    curve = [round(sum(r["critic/score/mean"] for r in rows[i:i + 10]) / 10, 2) for i in range(0, 100, 10)]
    assert first <= 0.2, first
    # SGLang's sampling is not seeded (docs/engines.md), so every run is another draw: the demo's
    # 10-step means reach 0.84-0.98 by step 100 with either engine across seeds and then may dip
    # a little (a policy that collapsed on a wrong digit for one prompt): the best window counts
    assert max(curve) >= 0.8, f"the demo did not learn with SGLang: 10-step means {curve}"
    worst = max(r["rollout/logprob_diff_max"] for r in rows)
    assert worst <= 1e-5, f"engine/trainer log-prob mismatch {worst:.2e} > 1e-5"
    # SGLang started from the initial weights on disk, with the tokenizer's EOS (1), not LlamaConfig's
    # default (2, the built-in tokenizer's <bos>), since SGLang also stops at the config's EOS
    init = json.loads((tmp_path / "engine-init" / "config.json").read_text())
    assert (init["eos_token_id"], init["bos_token_id"], init["pad_token_id"]) == (1, 2, 0)
