"""The exact-answer reward for reasoning-gym (beside the package's partial credit), the
`critic/score/...` breakdown (fully correct responses, functions logged but not trained on),
and the progress line's ETA from step times only."""

import pytest
import torch

from megappo.config import ConfigError, load_config
from megappo.data.prompts import builtin_rows
from megappo.metrics.sinks import Progress
from megappo.rewards.scoring import score_metrics
from megappo.trainer.preflight import check_inputs
from megappo.rewards import READS, REWARD_FUNCTIONS, final_answer_matches, score_batch


def arithmetic_rows():
    """Rows of reasoning-gym (a test extra; absent on a GPU machine that only carries megappo's wheels)."""
    pytest.importorskip("reasoning_gym")
    return builtin_rows("reasoning_gym:basic_arithmetic", 8, seed=1, args={"max_terms": 2, "max_digits": 1})


@pytest.mark.parametrize("response,answer,right", [
    ("5 - 9 = -4", "-4", True),              # worked, then the answer
    ("The answer is 12.", "12", True),
    ("-4", "-4", True),
    ("-4.0", "-4", True),
    ("It is 1,000 apples", "1000", True),
    ("3/4", "3/4", True),
    ("\\boxed{-4}", "-4", True),
    ("5 - 9 = -1", "-4", False),             # wrong answer, worked
    ("-14", "-4", False),
    ("14", "4", False),                     # the right digit inside a wrong number
    ("12-5", "-5", False),                  # '-' after a digit is an operator: the final number is 5
    ("-4, no: 3", "-4", False),              # the final number counts
    ("", "-4", False),
    ("x = a + b.", "a+b", True),             # not a number: the final expression
    ("The answer is: yes", "yes", True),
    ("\\boxed{x^2}", "x^2", True),
    ("x = a - b", "a+b", False),
])
def test_final_answer_by_hand(response, answer, right):
    assert final_answer_matches(response, answer) is right


def test_exact_answer_beside_partial_credit_on_reasoning_gym_rows():
    row = next(r for r in arithmetic_rows() if r["extra_info"]["entry"]["metadata"]["expression"].count(" ") == 2)
    answer, extra = row["reward_model"]["ground_truth"], row["extra_info"]
    expression = extra["entry"]["metadata"]["expression"]
    worked = f"{expression} = {answer}"
    wrong = f"{answer}9"  # holds the answer's characters
    partial = score_batch(["reasoning_gym"], None, [answer, worked, wrong], [answer] * 3, [extra] * 3)
    exact = score_batch(["reasoning_gym_exact"], None, [answer, worked, wrong], [answer] * 3, [extra] * 3)
    assert partial[0] == 1.0 and 0 < partial[1] < 0.5 and partial[2] > 0  # what hid the learning
    assert exact == [1.0, 1.0, 0.0]
    assert "reasoning_gym_exact" in REWARD_FUNCTIONS and READS["reasoning_gym_exact"] == ("reward_model.ground_truth",)


def test_score_breakdown_counts_fully_correct_responses_and_logs_metric_functions():
    texts = ["1 + 2 = 3", "3", "33", "The answer is 3."]
    gts, extras, sources = ["3"] * 4, [{"finish_reason": "stop"}] * 4, ["x"] * 4
    scores = torch.tensor(score_batch(["exact_match"], None, texts, gts, extras))  # trained on: 0, 1, 0, 0
    m = score_metrics("critic/score", scores, ["reasoning_gym_exact"], texts, gts, extras, sources)
    assert m == {"critic/score/frac_correct": 0.25, "critic/score/reasoning_gym_exact": 0.75}
    half = torch.tensor([0.5, 0.5 + 0.5, 1.0, 0.999])  # a weighted sum of 1.0 counts, 0.999 does not
    assert score_metrics("val/score", half, [], texts, gts, extras, sources) == {"val/score/frac_correct": 0.5}


def test_metric_functions_is_a_checked_config_field(tmp_path):
    cfg = load_config("recipes/demo-cpu.yaml", ["reward.metric_functions=[exact_match]"])
    assert cfg.reward.metric_functions == ["exact_match"] and cfg.reward.functions == ["digit_successor"]
    bad = load_config("recipes/demo-cpu.yaml", ["reward.metric_functions=[reasoning_gym_exactt]"])
    with pytest.raises(ConfigError, match="unknown reward function 'reasoning_gym_exactt'.*reasoning_gym_exact"):
        check_inputs(bad, 2)


def test_eta_counts_step_times_only(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("time.time", lambda: now[0])
    monkeypatch.setattr("time.perf_counter", lambda: now[0])
    bar = Progress(total=10, enabled=False)
    assert bar.text(0).endswith("0/10 steps  ? s/step  ETA ?")
    now[0] += 80.0  # start-up and the validation before the first step
    for step in (1, 2):
        now[0] += 2.0
        line = bar.update(step, 2.0)
    assert line.endswith("2/10 steps  2.0 s/step  ETA 16s")
    now[0] += 3.0
    assert bar.update(3, 5.0).endswith("3/10 steps  3.0 s/step  ETA 21s")
