"""One row, one number, in every message: a JSONL row is named by its file's line as editors show it
(1-based, blank lines counted), a Parquet row by its 1-based row number, a built-in source's row as
such (no file); the broken-JSON error, the data check, the prompt-length check and an error in the
user's reward function (training or validation, with the prompt) name the same row the same way."""

import json

import pytest
import torch

from megappo.data.prompts import DataError
from megappo.config import RewardConfig, load_config
from megappo.rewards.scoring import Scorer
from megappo.trainer.preflight import load_prompts
from megappo.data.tokenizer import load_tokenizer
from megappo.types import RolloutBatch
from megappo.user_code import UserCodeError

TOK = load_tokenizer("builtin:digits")
REWARD = '''
def score(response, ground_truth, extra):
    if ground_truth == "9":
        raise ValueError("no scorer for 9")
    return 0.0
'''


def row(prompt, truth):
    return {"prompt": prompt, "reward_model": {"ground_truth": truth}}


GOOD = [row("1>", "2"), row("2>", "3")]
#: the file's lines: a blank line 2, so the third row is on line 4
LINES = [json.dumps(GOOD[0]), "", json.dumps(GOOD[1]), None]


def jsonl(path, bad: str) -> str:
    path.write_text("\n".join(bad if line is None else line for line in LINES) + "\n")
    return str(path)


def parquet(path, bad: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([*GOOD, bad]), str(path))
    return str(path)


def prompts(*overrides):
    cfg = load_config("recipes/demo-cpu.yaml", ["data.builtin=null", "rollout.max_new_tokens=4", *overrides])
    return load_prompts(cfg, TOK)


def reward_error(examples, tmp_path, monkeypatch) -> str:
    """The trainer's scoring of one response per example (megappo.rewards.scoring.Scorer) with a reward
    function that raises on the ground truth 9."""
    (tmp_path / "mine.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    n = len(examples)
    batch = RolloutBatch(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1),
                         response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1, dtype=torch.long),
                         rollout_log_probs=torch.zeros(n, 1), finish_reasons=["stop"] * n,
                         prompt_index=torch.arange(n), examples=examples)
    scorer = Scorer(RewardConfig(functions=["mine.py:score"]), TOK, max_new_tokens=1)
    with pytest.raises(UserCodeError) as raised:
        scorer.generation_scores(batch)
    return str(raised.value)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_jsonl_row_is_its_line_in_every_message(tmp_path, monkeypatch, split):
    key = "data.train_files" if split == "train" else "data.val_files"
    files = {"data.train_files": [str(tmp_path / "ok.jsonl")]}
    (tmp_path / "ok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD))

    def run(bad: str, *overrides):
        path = jsonl(tmp_path / f"{split}.jsonl", bad)
        chosen = dict(files, **{key: [path]})
        return path, prompts(*(f"{k}=[{','.join(v)}]" for k, v in chosen.items()), *overrides)

    with pytest.raises(DataError) as raised:
        run('{"prompt": "3>",')
    assert str(raised.value).startswith(f"{tmp_path}/{split}.jsonl:4 is not valid JSON")
    with pytest.raises(DataError) as raised:
        run(json.dumps({"question": "3>", "reward_model": {"ground_truth": "4"}}))
    assert f"e.g. {tmp_path}/{split}.jsonl:4: keys ['question', 'reward_model']" in str(raised.value)
    with pytest.raises(DataError) as raised:
        run(json.dumps(row("3>3>3>3>", "4")), "data.long_prompt_policy=error", "data.max_prompt_length=4")
    assert str(raised.value).startswith(f"{tmp_path}/{split}.jsonl:4: prompt has 8 tokens > data.max_prompt_length=4")
    path, (train, val, _) = run(json.dumps(row("3>", "9")))
    split_name = "training" if split == "train" else "validation"
    assert reward_error(train if split == "train" else val, tmp_path, monkeypatch) == (
        f"reward function 'mine.py:score' raised ValueError: no scorer for 9 on {path}:4 ({split_name} row, prompt "
        "'3>'). Fix: correct that code (its traceback is above).")


def test_a_parquet_row_is_its_row_number_in_every_message(tmp_path, monkeypatch):
    def run(bad: dict, *overrides):
        path = parquet(tmp_path / "t.parquet", bad)
        return path, prompts(f"data.train_files=[{path}]", *overrides)

    with pytest.raises(DataError) as raised:
        run({"question": "3>", "reward_model": {"ground_truth": "4"}})
    assert f"e.g. {tmp_path}/t.parquet row 3: " in str(raised.value)
    with pytest.raises(DataError) as raised:
        run(row("3>3>3>3>", "4"), "data.long_prompt_policy=error", "data.max_prompt_length=4")
    assert str(raised.value).startswith(f"{tmp_path}/t.parquet row 3: prompt has 8 tokens")
    path, (train, _, _) = run(row("3>", "9"))
    assert f"raised ValueError: no scorer for 9 on {path} row 3 (training row, prompt '3>')." in reward_error(
        train, tmp_path, monkeypatch)


def test_a_builtin_row_says_it_has_no_file(tmp_path, monkeypatch):
    train, val, _ = prompts("data.builtin=digit_successor", "data.builtin_size=64", "data.builtin_val_size=32")
    bad_train = next(i for i, e in enumerate(train) if e.ground_truth == "9")
    bad_val = next(i for i, e in enumerate(val) if e.ground_truth == "9")
    assert reward_error(train, tmp_path, monkeypatch).endswith(
        f"on data.builtin=digit_successor row {bad_train + 1} (training row, built-in, no file, prompt '8>'). Fix: "
        "correct that code (its traceback is above).")
    assert f"on data.builtin=digit_successor row {bad_val + 1} (validation row, built-in, no file, prompt '8>')" in \
        reward_error(val, tmp_path, monkeypatch)
