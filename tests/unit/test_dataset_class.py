"""A dataset class named in the config (data.custom_cls.path / .name, verl's keys): its rows read in place of
the files', checked and tokenized as theirs are, each error naming the class and the fix."""

import json

import pytest

from megappo.config import ConfigError, load_config
from megappo.data.prompts import DataError, class_rows, read_rows
from megappo.trainer.preflight import check_inputs, load_prompts
from megappo.data.tokenizer import load_tokenizer

ROWS_CLASS = '''
import json

class QuestionRows:
    """Maps {"question", "answer"} JSONL rows into verl's layout, as a verl custom dataset would."""

    def __init__(self, data_files, config):
        self.rows = []
        for path in data_files:
            for line in open(path):
                q = json.loads(line)
                self.rows.append({"prompt": [{"role": "user", "content": q["question"]}], "data_source": "mine",
                                  "reward_model": {"style": "rule", "ground_truth": q["answer"]},
                                  "extra_info": {"prompt_key": config["prompt_key"]}})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Streamed:
    def __init__(self, data_files, config):
        self.files = data_files

    def __iter__(self):
        yield {"prompt": "1 2 3", "reward_model": {"ground_truth": "4"}, "data_source": "s"}


class Tensors(QuestionRows):
    def __getitem__(self, i):
        return [1, 2, 3]


class Broken:
    def __init__(self, data_files, config):
        raise KeyError("question")


class Opaque:
    def __init__(self, data_files, config):
        pass
'''


@pytest.fixture
def data(tmp_path):
    (tmp_path / "rows.py").write_text(ROWS_CLASS)
    with open(tmp_path / "q.jsonl", "w") as f:
        for q, a in (("3 4 5", "6"), ("6 7 8", "9")):
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return tmp_path


def test_the_class_reads_the_files_into_rows(data):
    rows, origins = read_rows([str(data / "q.jsonl")], dataset=(str(data / "rows.py"), "QuestionRows"),
                              config={"prompt_key": "prompt"})
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["6", "9"]
    assert rows[0]["prompt"] == [{"role": "user", "content": "3 4 5"}]
    assert rows[0]["extra_info"]["prompt_key"] == "prompt"
    assert str(origins[1]) == f"row 2 of {data / 'rows.py'}:QuestionRows" and origins[1].split == "training"
    rows, origins = class_rows(str(data / "rows.py"), "Streamed", ["hub/dataset"], {}, "data.val_files")
    assert rows == [{"prompt": "1 2 3", "reward_model": {"ground_truth": "4"}, "data_source": "s"}]
    assert origins[0].split == "validation"


@pytest.mark.parametrize("name,error", [
    ("Missing", "has no class 'Missing'. Fix: set data.custom_cls.path"),
    ("Tensors", "row 1 (data.train_files) is a list, not a dict. Fix: return each row as a dict in verl's layout"),
    ("Broken", "raised KeyError: 'question'. Fix: correct that class"),
    ("Opaque", "has neither len() and [i] nor iteration"),
])
def test_a_class_megappo_cannot_read_is_an_error_naming_the_fix(data, name, error):
    with pytest.raises((ConfigError, DataError), match=error.replace("(", "\\(").replace(")", "\\)")
                       .replace("[", "\\[").replace("]", "\\]")):
        class_rows(str(data / "rows.py"), name, [str(data / "q.jsonl")], {"prompt_key": "prompt"})


def test_a_run_reads_its_prompts_through_the_class(data):
    """The demo's recipe with verl's two keys: the prompts are the class's rows, tokenized; the files are the
    class's to read (a name megappo could not open passes the input check)."""
    cfg = load_config("recipes/demo-cpu.yaml", [f"data.train_files=[{data / 'q.jsonl'}]", "data.builtin=null",
                                                 "data.val_files=[]", "run.val_before_train=false", "run.val_every=0",
                                                 f"data.custom_cls.path={data / 'rows.py'}",
                                                 "data.custom_cls.name=QuestionRows"])
    train, val, _ = load_prompts(cfg, load_tokenizer(cfg.model.tokenizer_path))
    assert [e.ground_truth for e in train] == ["6", "9"] and val == []
    assert str(train[0].origin) == f"row 1 of {data / 'rows.py'}:QuestionRows"
    with pytest.raises(ConfigError, match="has no class 'Nope'"):
        check_inputs(load_config("recipes/demo-cpu.yaml", [
            "data.builtin=null", "data.train_files=[hub/questions]", "run.val_every=0", "run.val_before_train=false",
            f"data.custom_cls.path={data / 'rows.py'}", "data.custom_cls.name=Nope"]), 2)
    with pytest.raises(ConfigError, match="data.builtin=digit_successor generates the rows"):
        load_config("recipes/demo-cpu.yaml", [f"data.custom_cls.path={data / 'rows.py'}", "data.custom_cls.name=X"])
    with pytest.raises(ConfigError, match="a dataset class needs both"):
        load_config("recipes/demo-cpu.yaml", [f"data.custom_cls.path={data / 'rows.py'}"])
