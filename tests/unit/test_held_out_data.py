"""Validation sets are held out: a built-in source's validation prompts are never training
prompts (at the recipes' sizes, as megappo.trainer.setup builds them); for your own files, validation
rows that repeat a training prompt (with an environment: all an episode receives of the row)
are reported at start-up."""

import glob
import json
import os

import pytest

from megappo.config import load_config
from megappo.data.prompts import NOT_HELD_OUT, DataError, builtin_rows, builtin_splits, load_rows, prompt_identity
from megappo.trainer.data_check import shared_prompts, warn_shared_prompts
from megappo.trainer.preflight import _prompt_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
SMALL_ARITHMETIC = {"max_terms": 2, "max_digits": 1, "operators": ["+", "-"], "allow_parentheses": False,
                    "allow_negation": False}


def prompts(rows):
    return {prompt_identity(r["prompt"]) for r in rows}


def builtin_data():
    """(name, data config) of every recipe with a built-in source, and the defaults of each source."""
    out = []
    for path in RECIPES:
        d = load_config(path).data
        if d.builtin:
            out.append((os.path.basename(path), d))
    demo = dict(out)["demo-cpu.yaml"]
    for spec, args in [("reasoning_gym:basic_arithmetic", {}), ("reasoning_gym:chain_sum", {})]:
        out.append((f"{spec} {args} at default sizes", type(demo)(builtin=spec, builtin_args=args)))
    return out


@pytest.mark.parametrize("name,d", builtin_data(), ids=lambda x: x if isinstance(x, str) else "")
def test_builtin_validation_prompts_are_not_training_prompts(name, d):
    train, val = _prompt_rows(d)  # what megappo.trainer.setup trains and validates on (megappo.trainer.preflight.load_prompts)
    assert len(train) == d.builtin_size and len(val) == d.builtin_val_size
    assert train == builtin_rows(d.builtin, d.builtin_size, d.seed, d.builtin_args)  # training rows as before
    if d.builtin in NOT_HELD_OUT:
        # digit_successor, lookup, code_expression: the task is its 10 prompts, all in training; nothing is left to hold out
        form = {"digit_successor": "{}>", "lookup": "{}?", "code_expression": "{}="}[d.builtin]
        assert prompts(train) == prompts(val) == {prompt_identity(form.format(i)) for i in range(10)}
        return
    assert prompts(train) & prompts(val) == set()
    assert _prompt_rows(d) == (train, val)  # the same rows again: a resumed run validates on the same set


def test_validation_rows_are_the_seed_plus_one_stream_without_training_prompts():
    spec = "reasoning_gym:basic_arithmetic"
    train, val = builtin_splits(spec, 64, 8, 1, SMALL_ARITHMETIC)
    stream = builtin_rows(spec, 200, 2, SMALL_ARITHMETIC)
    assert val == [r for r in stream if prompt_identity(r["prompt"]) not in prompts(train)][:8]
    # the defect: drawn independently from seed + 1, validation shared prompts with training
    assert prompts(stream[:8]) & prompts(train)


def test_a_task_with_too_few_prompts_to_hold_out_is_refused():
    # 2 one-digit terms, + or -: 242 distinct prompts, all in a training set of 2048
    with pytest.raises(DataError, match="few distinct prompts.*Fix: lower data.builtin_size"):
        builtin_splits("reasoning_gym:basic_arithmetic", 2048, 8, 1, SMALL_ARITHMETIC)


def write_jsonl(path, prompts_):
    with open(path, "w") as f:
        for p in prompts_:
            f.write(json.dumps({"prompt": p, "reward_model": {"ground_truth": "1"}}) + "\n")
    return str(path)


def write_parquet(path, prompts_):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": p}],
                                          "reward_model": {"ground_truth": "1"}} for p in prompts_]), str(path))
    return str(path)


def test_shared_prompts_of_your_files_are_reported_in_one_line(tmp_path, capsys):
    train = load_rows([write_jsonl(tmp_path / "train.jsonl", ["1+1=", "2+2=", "3+3=", "4+4="])])
    # validation in parquet as chat messages: '2+2=' twice and '4+4=' are the training prompts again
    val_path = write_parquet(tmp_path / "val.parquet", ["2+2=", "5+5=", "2+2=", "4+4=", "6+6="])
    val = load_rows([val_path], "data.val_files")
    assert shared_prompts(train, val) == ([0, 2, 3], ["2+2=", "4+4="])
    line = warn_shared_prompts(train, val, train_source="data.train_files [train.jsonl]",
                               val_source=f"data.val_files [{val_path}]")
    out = capsys.readouterr().out
    assert out == line + "\n" and "\n" not in line
    assert line.startswith("megappo: warning: 3 of 5 rows of data.val_files")
    assert "(2 distinct prompts)" in line and "'2+2='" in line and "'4+4='" in line
    assert "Fix: remove these prompts from data.val_files" in line


def test_disjoint_files_print_nothing(tmp_path, capsys):
    train = load_rows([write_jsonl(tmp_path / "train.jsonl", ["1+1=", "2+2="])])
    val = load_rows([write_jsonl(tmp_path / "val.jsonl", ["3+3=", "2+2= "])])  # not exactly a training prompt
    assert warn_shared_prompts(train, val) is None
    assert capsys.readouterr().out == ""


def test_one_shared_prompt_is_said_in_the_singular(capsys):
    line = warn_shared_prompts([{"prompt": "1+1="}], [{"prompt": [{"role": "user", "content": "1+1="}]}])
    assert line.startswith("megappo: warning: 1 of 1 row of data.val_files (1 distinct prompt) have")


def lookup_row(prompt, key, value, source="lookup"):
    return {"data_source": source, "prompt": prompt, "extra_info": {"key": key},
            "reward_model": {"style": "env", "ground_truth": value}}


def test_with_an_environment_a_row_repeats_only_when_its_whole_episode_input_does(capsys):
    """rollout.env: the same prompt with other extra_info, ground truth or data_source starts another episode
    (the lookup demo's '3?' hides a value drawn per row), so only rows equal in all of them are reported."""
    train = [lookup_row("3?", 3, "7"), lookup_row("4?", 4, "1")]
    val = [lookup_row("3?", 3, "2"),  # another ground truth: what the environment answers differs
           lookup_row("3?", 5, "7"),  # another extra_info
           lookup_row("3?", 3, "7", source="other"),  # another data_source
           lookup_row("4?", 4, "1"), lookup_row("4?", 4, "1"),  # the training row's episode again, twice
           {**lookup_row("3?", 3, "7"), "prompt": [{"role": "user", "content": "3?"}]}]  # its chat form: the same
    assert shared_prompts(train, val, env="lookup") == ([3, 4, 5], ["4?", "3?"])
    line = warn_shared_prompts(train, val, env="lookup")
    assert capsys.readouterr().out == line + "\n"
    assert line == ("megappo: warning: 3 of 6 rows of data.val_files (2 distinct inputs) start the same episode as a "
                    "row of the training data (the same prompt, ground truth, extra_info and data_source: all "
                    "rollout.env=lookup receives), so val/score is not a held-out measure; e.g. '4?', '3?'. Fix: "
                    "remove these rows from data.val_files (or from the training data).")
    # single-turn, the model sees the prompt alone: every '3?' and '4?' repeats one
    assert shared_prompts(train, val, env="single_turn") == shared_prompts(train, val) == ([0, 1, 2, 3, 4, 5],
                                                                                           ["3?", "4?"])
    assert warn_shared_prompts(train, val[:3], env="lookup") is None


def test_the_start_up_check_compares_what_the_recipes_environment_receives(tmp_path, capsys):
    """megappo.trainer.preflight.load_prompts on the multi-turn demo (rollout.env=lookup) with your files: the lookup
    prompts '0?'..'9?' repeat, the values behind them (the ground truths) differ; only a true copy is reported."""
    from megappo.data.prompts import lookup_rows
    from megappo.trainer.preflight import load_prompts
    from megappo.data.tokenizer import load_tokenizer

    train = lookup_rows(32, seed=1)
    other_value = [{**r, "reward_model": {"style": "env", "ground_truth": str((int(r["reward_model"]["ground_truth"]) + 1)
                                                                              % 10)}} for r in train[:3]]
    val = [train[5], *other_value]  # a copy of a training row, then three training prompts with other values
    for name, rows in (("train", train), ("val", val)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(os.path.join(REPO, "recipes", "demo-multiturn-cpu.yaml"),
                      ["data.builtin=null", f"data.train_files=[{tmp_path}/train.jsonl]",
                       f"data.val_files=[{tmp_path}/val.jsonl]"])
    load_prompts(cfg, load_tokenizer(cfg.model.tokenizer))
    [line] = [line for line in capsys.readouterr().out.splitlines() if "megappo: warning" in line]
    assert line.startswith("megappo: warning: 1 of 4 rows of data.val_files") and "(1 distinct input)" in line, line
    assert f"e.g. {train[5]['prompt']!r}. Fix: remove these rows" in line
