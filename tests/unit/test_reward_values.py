"""What your own reward function returns and how long it takes: NaN / inf refused (or scored 0
and counted under reward.bad_value_policy=warn), huge values warned once, a hung call ended at
reward.timeout_s naming the function and the row (megappo.rewards)."""

import threading
import time

import pytest

from megappo import rewards
from megappo.config import ConfigError, RewardConfig
from megappo.data.prompts import RowOrigin, numbered
from megappo.rewards import score_batch
from megappo.user_code import UserCodeError

MINE = '''
import time

def by_answer(response, ground_truth, extra):
    return {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "huge": 1e30}.get(ground_truth, 1.0)

def hangs(response, ground_truth, extra):
    if ground_truth == "hang":
        time.sleep(30)
    return 1.0

def swallows(response, ground_truth, extra):  # a broad except does not hide the timeout
    try:
        time.sleep(30)
    except Exception:
        return 0.0
'''


@pytest.fixture
def mine(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(MINE)
    monkeypatch.chdir(tmp_path)
    return lambda fn: f"mine.py:{fn}"


def checks(**fields) -> rewards.RewardChecks:
    """The checks a run builds from its recipe's reward section."""
    return rewards.RewardChecks.of(RewardConfig(**fields))


@pytest.mark.parametrize("answer,shown", [("nan", "nan"), ("inf", "inf"), ("-inf", "-inf")])
def test_non_finite_reward_is_refused_naming_the_function_and_row(mine, answer, shown):
    with pytest.raises(UserCodeError) as raised:
        score_batch([mine("by_answer")], None, ["a", "b"], ["1", answer], [{}, {}], rows=[RowOrigin("t.jsonl", 4), RowOrigin("t.jsonl", 11)])
    assert str(raised.value) == (f"reward function 'mine.py:by_answer' returned {shown}, not a finite number on "
                                 "t.jsonl:11 (training row). Fix: return a finite float, or set reward.bad_value_policy=warn to score such "
                                 "responses 0.")


def test_warn_policy_scores_zero_warns_once_and_counts(mine, capsys):
    warn = checks(bad_value_policy="warn")
    got = score_batch([mine("by_answer")], [2.0], list("abcd"), ["nan", "1", "inf", "nan"], [{}] * 4, rows=numbered("data.builtin=digit_successor", 4, "builtin"),
                      checks=warn)
    assert got == [0.0, 2.0, 0.0, 0.0]
    assert warn.bad_values == 3
    err = capsys.readouterr().err
    assert err == ("megappo: warning: reward function 'mine.py:by_answer' returned nan on "
                   "data.builtin=digit_successor row 1 (training row, built-in, no file); "
                   "reward.bad_value_policy=warn: such responses are scored 0 (warned once; counted in "
                   "reward/bad_values).\n")


def test_huge_reward_passes_with_one_warning_naming_the_function(mine, capsys):
    assert score_batch([mine("by_answer")], None, ["a", "b"], ["huge", "huge"], [{}, {}], rows=numbered("t.parquet", 2, "parquet", "validation")) == [1e30, 1e30]
    err = capsys.readouterr().err
    assert err.count("megappo: warning:") == 1
    assert err.startswith("megappo: warning: reward function 'mine.py:by_answer' returned 1e+30 on t.parquet row 1 (validation row), beyond "
                          "|reward| > 1e+06 (warned once)")


@pytest.mark.parametrize("fn", ["hangs", "swallows"])
def test_a_hung_call_ends_at_the_timeout_naming_function_row_and_limit(mine, fn):
    start = time.monotonic()
    with pytest.raises(UserCodeError) as raised:
        score_batch([mine(fn)], None, ["a", "b"], ["1", "hang"], [{}, {}], rows=[RowOrigin("t.jsonl", 2), RowOrigin("t.jsonl", 8)], checks=checks(timeout_s=0.5))
    assert time.monotonic() - start < 5
    assert str(raised.value) == (f"reward function 'mine.py:{fn}' did not return within reward.timeout_s=0.5 s on "
                                 f"t.jsonl:{2 if fn == 'swallows' else 8} (training row). Fix: make it return sooner on such responses, or "
                                 "raise reward.timeout_s (0: no limit).")


def test_off_the_main_thread_the_call_runs_on_a_daemon_thread(mine):
    caught = []

    def score():
        try:
            score_batch([mine("hangs")], None, ["a"], ["hang"], [{}], rows=[RowOrigin("t.jsonl", 3)], checks=checks(timeout_s=0.5))
        except UserCodeError as e:
            caught.append(str(e))

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(10)
    assert caught and "did not return within reward.timeout_s=0.5 s on t.jsonl:3 (training row)" in caught[0]
    assert all(t.daemon for t in threading.enumerate() if t.name == "megappo-reward-call")
    # the timer is gone and a fast call goes through on the main thread
    assert score_batch([mine("hangs")], None, ["a"], ["1"], [{}]) == [1.0]


def test_timeout_zero_is_no_limit_and_negative_is_refused(mine):
    assert rewards.call_with_timeout(lambda: 7, 0) == 7
    with pytest.raises(ConfigError, match=r"timeout_s=-1.0 must be >= 0"):
        RewardConfig(timeout_s=-1)


def test_a_relative_reward_path_is_the_file_of_the_current_directory(tmp_path, monkeypatch):
    """`mine.py:score` is loaded once per working directory: another directory's mine.py is another function
    (the loaded function was once cached by the name alone)."""
    for value in (1, 2):
        (tmp_path / str(value)).mkdir()
        (tmp_path / str(value) / "mine.py").write_text(f"def score(response, ground_truth, extra):\n    return {value}\n")
    for value in (1, 2, 1):
        monkeypatch.chdir(tmp_path / str(value))
        assert rewards.get_reward_fn("mine.py:score")("r", "g", {}) == value
