"""Your own reward function in reward.functions: `file.py:fn` or `module:fn`, megappo's or verl's signature."""

import pathlib

import pytest

from megappo import cli
from megappo.config import ConfigError
from megappo.data.prompts import RowOrigin
from megappo.rewards import get_reward_fn, reads, score_batch
from megappo.user_code import UserCodeError

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes" / "demo-cpu.yaml")

VERL_STYLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "my_sums":
        return 0.25
    return {"score": 1.0 if solution_str.strip() == ground_truth else 0.0, "acc": True}
'''
MEGAPPO_STYLE = '''
def first_digit(response, ground_truth, extra):
    return float(response[:1] == str(ground_truth)) * extra.get("weight", 1)

def words(response, ground_truth, extra):
    return "one"

def needs_unit(response, ground_truth, extra):
    return float(response == extra["unit"])
'''


def test_file_functions_with_megappo_and_verl_signatures(tmp_path, monkeypatch):
    (tmp_path / "verl_reward.py").write_text(VERL_STYLE)
    (tmp_path / "mine.py").write_text(MEGAPPO_STYLE)
    monkeypatch.chdir(tmp_path)
    verl = "verl_reward.py:compute_score"
    # verl's arguments by name, the data source included; a dict's "score" is the score
    assert score_batch([verl], None, ["7", " 7 ", "8", "7"], ["7"] * 4, [{}] * 4,
                       ["my_sums", "my_sums", "my_sums", "other"]) == [1.0, 1.0, 0.0, 0.25]
    assert score_batch(["mine.py:first_digit", "exact_match"], [2.0, 1.0], ["3x", "3"], ["3", "3"],
                       [{"weight": 0.5}, {}]) == [1.0, 3.0]
    assert score_batch([f"{tmp_path}/mine.py:first_digit"], None, ["3"], ["3"], [{}]) == [1.0]  # absolute path
    with pytest.raises(UserCodeError, match=r"reward function 'mine.py:words' returned 'one' \(str\), not a number "
                                            "on t.jsonl:7 \\(training row\\). Fix: return a float"):
        score_batch(["mine.py:words"], None, ["3"], ["3"], [{}], rows=[RowOrigin("t.jsonl", 7)])
    with pytest.raises(UserCodeError) as raised:  # what it raises names it and the row, and keeps the cause
        score_batch(["exact_match", "mine.py:needs_unit"], None, ["3", "4"], ["3", "4"], [{"unit": "3"}, {}], rows=[RowOrigin("t.jsonl", 5), RowOrigin("v.parquet", 9, "parquet", "validation")])
    assert str(raised.value) == ("reward function 'mine.py:needs_unit' raised KeyError: 'unit' on v.parquet row 9 (validation row). Fix: correct "
                                 "that code (its traceback is above).")
    assert isinstance(raised.value.cause, KeyError) and raised.value.__cause__ is raised.value.cause
    assert reads("mine.py:first_digit") == ("reward_model.ground_truth",)  # as verl's reward manager reads it
    assert reads("reasoning_gym") == ("extra_info.task", "extra_info.entry")


def test_module_function_is_imported_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scores.py").write_text(MEGAPPO_STYLE)
    monkeypatch.chdir(tmp_path)
    assert get_reward_fn("my_rewards_pkg.scores:first_digit")("5", "5", {}) == 1.0


BAD = {
    "no file": ("nope.py:score", "file 'nope.py' does not exist (relative paths start at {tmp}). Fix: write "
                                 "reward.functions=[path/to/file.py:function]"),
    "no function": ("own.py:score", "'own.py' has no function 'score' (it has ['first_digit', 'needs_unit', 'words'])"),
    "no module": ("no_such_module_xyz:score", "cannot import 'no_such_module_xyz'"),
    "module raises": ("broken.py:score", "importing 'broken.py' raised ZeroDivisionError: division by zero. Fix: "
                                         "correct that file."),
    "not FILE:FN": ("'own.py:'", "reward function 'own.py:' in reward.functions is not FILE.py:FUNCTION"),
    "unknown name": ("exact_matc", "unknown reward function 'exact_matc' in reward.functions. Did you mean "
                                   "'exact_match'?"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_reward_function_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys, case):
    # own.py: a name no other test loads (a function is loaded once per name; tests/unit/test_row_numbers.py's
    # mine.py has a `score`, which a test run after it in the same process would otherwise be given)
    (tmp_path / "own.py").write_text(MEGAPPO_STYLE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    name, needle = BAD[case]
    code = cli.main(["train", DEMO, f"run.output_dir={tmp_path / 'run'}", f"reward.functions=[{name}]"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("megappo: error: ") and "Fix" in err, err
    assert needle.replace("{tmp}", str(tmp_path)) in err
    assert not (tmp_path / "run").exists()
