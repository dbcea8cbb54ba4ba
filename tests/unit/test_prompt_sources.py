"""The demo recipe with your own files: `data.train_files=[...]` replaces the recipe's `data.builtin`."""

import pathlib

import pytest

from megappo.config import ConfigError, config_from_dict, load_config

DEMO = str(pathlib.Path(__file__).resolve().parents[2] / "recipes/demo-cpu.yaml")


def test_an_override_of_one_prompt_source_replaces_the_recipes_other():
    cfg = load_config(DEMO, ["data.train_files=[my.jsonl]"])  # was: "data.builtin and data.train_files are both set"
    assert cfg.data.train_files == ["my.jsonl"] and cfg.data.builtin is None
    cfg = load_config(DEMO, ["data.train_files=[my.jsonl]", "data.builtin=digit_successor"])  # the later one wins
    assert cfg.data.builtin == "digit_successor" and cfg.data.train_files == []
    assert load_config(DEMO, ["data.train_files=[]"]).data.builtin == "digit_successor"  # an empty list replaces nothing


def test_both_in_one_recipe_is_still_an_error():
    with pytest.raises(ConfigError, match="data.builtin and data.train_files are both set"):
        config_from_dict({"model": {"path": "/m"}, "data": {"builtin": "digit_successor", "train_files": ["a.jsonl"]}})
