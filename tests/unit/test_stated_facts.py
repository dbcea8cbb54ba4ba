"""Numbers the docs state about the code, checked against the code.

The demo's random-policy score: `megappo.data.prompts.random_policy_score` works it out exactly from
the demo recipe's tokenizer, vocabulary, response length and reward functions; every "random
policy" in README.md, docs/, recipes/ and benchmarks/RESULTS.md must quote that number."""

import glob
import os
import random
import re

import yaml

from megappo.config import load_config
from megappo.data.prompts import builtin_rows, random_policy_score
from megappo.rewards import score_batch
from megappo.data.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "recipes", "demo-cpu.yaml")
STATED = re.compile(r"random policy[^0-9]{0,40}?(\d+\.\d+|\d+/\d+)", re.IGNORECASE)


def demo_setup():
    cfg = load_config(DEMO)
    tok = load_tokenizer(cfg.model.tokenizer)
    rows = builtin_rows(cfg.data.builtin, cfg.data.builtin_size, cfg.data.seed)

    def reward(text, gt, extra):
        return score_batch(cfg.reward.functions, cfg.reward.function_weights, [text], [gt], [extra])[0]

    with open(DEMO) as f:
        vocab = yaml.safe_load(f)["model"]["hf_config"]["vocab_size"]
    return cfg, tok, rows, reward, vocab


def demo_random_score() -> float:
    cfg, tok, rows, reward, vocab = demo_setup()
    return random_policy_score(rows, reward, tok, cfg.rollout.max_new_tokens, vocab_size=vocab)


def test_random_policy_score_matches_sampling():
    """The enumeration against plain sampling of uniform tokens (stopping at EOS)."""
    cfg, tok, rows, reward, vocab = demo_setup()
    exact = random_policy_score(rows, reward, tok, cfg.rollout.max_new_tokens, vocab_size=vocab)
    rng = random.Random(0)
    n, total = 20000, 0.0
    for _ in range(n):
        row, ids = rng.choice(rows), []
        while len(ids) < cfg.rollout.max_new_tokens and (not ids or ids[-1] != tok.eos_token_id):
            ids.append(rng.randrange(vocab))
        reason = "stop" if ids[-1] == tok.eos_token_id else "length"
        total += reward(tok.decode(ids, skip_special_tokens=True), row["reward_model"]["ground_truth"],
                        {"finish_reason": reason})
    sigma = (exact * (1 - exact) / n) ** 0.5
    assert abs(total / n - exact) < 4 * sigma + 1e-9, (total / n, exact)


def test_docs_state_the_demo_random_policy_score():
    exact = demo_random_score()
    files = [os.path.join(REPO, "README.md"), DEMO, os.path.join(REPO, "benchmarks", "RESULTS.md"),
             *glob.glob(os.path.join(REPO, "docs", "*.md"))]
    found = []
    for path in files:
        if not os.path.exists(path):
            continue
        text = " ".join(open(path).read().split())
        for m in re.finditer(r"random policy", text, re.IGNORECASE):
            stated = STATED.match(text, m.start())
            where = f"{os.path.relpath(path, REPO)}: ...{text[m.start():m.start() + 80]}..."
            assert stated, f"{where} mentions a random policy without its score ({exact:.3f})"
            value = stated.group(1)
            if "/" in value:
                num, den = value.split("/")
                assert abs(int(num) / int(den) - exact) < 1e-12, f"{where} states {value}, the code gives {exact:.4f}"
            else:
                decimals = len(value.split(".")[1])
                assert float(value) == round(exact, decimals), f"{where} states {value}, the code gives {exact:.4f}"
            found.append(os.path.relpath(path, REPO))
    assert "README.md" in found and "recipes/demo-cpu.yaml" in found, found
