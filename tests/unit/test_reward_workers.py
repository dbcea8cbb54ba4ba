"""Reward workers (reward.num_workers, megappo.rewards.workers): the functions called in spawned processes
give the same scores, fields, checks and errors as rank 0 calling them one response after another."""

import math
import textwrap

import pytest

from megappo.cli import _user_traceback
from megappo.data.prompts import RowOrigin
from megappo.rewards.workers import RewardWorkers
from megappo.rewards import RewardChecks, score_records
from megappo.user_code import UserCodeError

REWARDS = textwrap.dedent('''
    import os
    import time


    def graded(response, ground_truth, extra):
        return {"score": len(response) / 10, "acc": response == ground_truth, "pred": response[:3]}


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl's signature
        return 1.0 if solution_str.endswith(str(ground_truth)) else 0.0


    class BadAnswer(ValueError):
        pass


    def strict(response, ground_truth, extra):
        if response == "boom":
            return 1 / 0
        if response == "own":
            raise BadAnswer("no answer in " + response)
        if response == "slow":
            time.sleep(30)
        if response == "nan":
            return float("nan")
        if response == "die":
            os._exit(3)
        if response == "lambda":
            return {"score": 1.0, "how": lambda: 1}
        return 0.5
''')


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def batch(responses):
    n = len(responses)
    return (responses, [r[-1:] for r in responses], [{"i": i} for i in range(n)], ["src"] * n,
            [RowOrigin("train.jsonl", i + 1, "jsonl", "training") for i in range(n)])


def test_the_workers_score_as_rank_0_does(rewards_file):
    names = [f"{rewards_file}:graded", f"{rewards_file}:compute_score", "exact_match"]
    responses = [f"answer {i % 7}" for i in range(50)] + ["7", ""]
    read = batch(responses)
    serial = score_records(names, [1.0, 0.5, 2.0], *read)
    workers = RewardWorkers(names, 2, timeout_s=30)
    try:
        scoring = workers.start(*read[:4])
        parallel = score_records(names, [1.0, 0.5, 2.0], *read, outcomes=scoring.outcomes())
    finally:
        workers.close()
    assert parallel == serial
    assert parallel.fields[51] == {"acc": True, "pred": ""} and parallel.values[50] == [0.1, 1.0, 1.0]


def test_errors_timeouts_and_bad_values_are_the_same_as_rank_0s(rewards_file):
    name = f"{rewards_file}:strict"
    workers = RewardWorkers([name], 2, timeout_s=0.5)
    try:
        for responses, expected in ((["ok", "ok", "boom", "ok"], "raised ZeroDivisionError: division by zero on "
                                                                 "train.jsonl:3 (training row)"),
                                    (["ok", "slow"], "did not return within reward.timeout_s=0.5 s on "
                                                     "train.jsonl:2 (training row)")):
            read = batch(responses)
            for outcomes in (None, workers.start(*read[:4]).outcomes()):
                with pytest.raises(UserCodeError) as e:
                    score_records([name], None, *read, checks=RewardChecks(timeout_s=0.5), outcomes=outcomes)
                assert f"reward function '{name}' {expected}" in str(e.value)
        # what the user's code raised in a worker comes with its frames: the CLI prints them as its traceback
        read = batch(["boom"])
        with pytest.raises(UserCodeError) as e:
            score_records([name], None, *read, outcomes=workers.start(*read[:4]).outcomes())
        printed = _user_traceback(e.value)
        assert f'File "{rewards_file}", line 20, in strict' in printed and printed.endswith(
            "ZeroDivisionError: division by zero\n")
        # an exception class of the user's file (the trainer's process cannot import it by name): its name, text
        # and frames
        read = batch(["own"])
        with pytest.raises(UserCodeError, match=r"raised BadAnswer: no answer in own on train.jsonl:1"):
            score_records([name], None, *read, outcomes=workers.start(*read[:4]).outcomes())
        # NaN with bad_value_policy=warn: scored 0 and counted, in the trainer's process as before
        read = batch(["nan", "ok", "nan"])
        checks = RewardChecks(bad_value_policy="warn")
        got = score_records([name], None, *read, checks=checks, outcomes=workers.start(*read[:4]).outcomes())
        assert got.totals == [0.0, 0.5, 0.0] and checks.bad_values == 2 and not math.isnan(sum(got.totals))
    finally:
        workers.close()


def test_a_result_that_cannot_travel_or_a_worker_that_dies_is_one_clear_error(rewards_file):
    name = f"{rewards_file}:strict"
    workers = RewardWorkers([name], 1, timeout_s=5)
    try:
        read = batch(["lambda"])
        with pytest.raises(UserCodeError, match=r"strict' returned a dict \(.*\), which a reward worker cannot send "
                                                r"back on train.jsonl:1 \(training row\)\. Fix: return a number, or a "
                                                r"dict of numbers and strings"):
            score_records([name], None, *read, outcomes=workers.start(*read[:4]).outcomes())
        read = batch(["ok", "die"])
        with pytest.raises(UserCodeError, match=r"a reward worker process died while scoring .* Fix: run with "
                                                r"reward.num_workers=0"):
            score_records([name], None, *read, outcomes=workers.start(*read[:4]).outcomes())
    finally:
        workers.close()
