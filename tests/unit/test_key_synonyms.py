"""Key names from other trainers (learning_rate, max_steps, num_generations, ...) get one line naming
megappo's key and the fix, through the real config path (megappo.config.key_synonyms, megappo.config.loading)."""

import pathlib

import pytest
import yaml

from megappo.config import ConfigError
from megappo.config.key_synonyms import SYNONYMS
from megappo.config.loading import _is_key, config_from_dict, load_config

DEMO = str(pathlib.Path(__file__).resolve().parents[2] / "recipes/demo-cpu.yaml")


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(DEMO, list(overrides))
    return str(raised.value)


@pytest.mark.parametrize("name", sorted(SYNONYMS))
def test_every_synonym_written_at_the_top_names_megappos_key(name):
    """Each entry's last candidate is a key megappo has; written alone it is what the error suggests."""
    key = SYNONYMS[name][-1]
    assert _is_key(key), (name, key)
    assert refusal(f"{name}=7") == f"unknown config key '{name}': did you mean '{key}'? Fix: write {key}=7."


def _in_section(name: str) -> list[tuple[str, str]]:
    """(written, expected): `name` in the section of megappo's key, and in the critic's where it has that key too."""
    key = SYNONYMS[name][-1]
    section = key.rpartition(".")[0]
    cases = [(f"{section}.{name}", key)]
    if key.startswith("actor.") and _is_key("critic." + key[len("actor."):]):
        cases.append((f"critic.{section[len('actor.'):]}.{name}".replace("critic..", "critic."),
                      "critic." + key[len("actor."):]))
    return [(w, k) for w, k in cases if not _is_key(w)]  # kl_coef is megappo's own under kl_ctrl


@pytest.mark.parametrize("name", sorted(n for n, c in SYNONYMS.items() if len(c) > 1 and _in_section(n)))
def test_every_synonym_written_in_megappos_section_names_that_sections_key(name):
    """Written in the section of megappo's key (actor.optim.learning_rate), and in the critic's when
    it has the same key (critic.optim.learning_rate -> critic.optim.lr): that section's key."""
    for written, expected in _in_section(name):
        assert refusal(f"{written}=1") == (f"unknown config key '{written}': did you mean '{expected}'? Fix: write "
                                           f"{expected}=1.")


@pytest.mark.parametrize("written,expected", [
    ("actor.optim.learning_rate", "actor.optim.lr"),  # the case
    ("critic.optim.max_grad_norm", "critic.grad_clip"),  # clipping is the role's, not the optimizer's
    ("actor.optim.epsilon", "actor.optim.eps"),  # Adam's epsilon under an optimizer ...
    ("actor.epsilon", "actor.clip_ratio"),  # ... TRL's clip range elsewhere
    ("critic.model_path", "critic.path"),
    ("trainer_max_steps.max_steps", "run.total_steps"),
])
def test_a_synonym_is_resolved_from_the_section_it_is_written_in(written, expected):
    assert refusal(f"{written}=1") == f"unknown config key '{written}': did you mean '{expected}'? Fix: write {expected}=1."


def test_a_recipe_file_gets_the_same_suggestion():
    data = yaml.safe_load(open(DEMO))
    data["actor"].setdefault("optim", {})["learning_rate"] = 1e-3
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data)
    assert str(raised.value) == ("unknown config key 'actor.optim.learning_rate': did you mean 'actor.optim.lr'? "
                                 "Fix: rename it to actor.optim.lr.")


def test_typos_and_verl_names_keep_their_own_messages():
    assert refusal("actor.optim.lrr=1").startswith("unknown config key 'actor.optim.lrr'. Did you mean 'actor.optim.lr'?")
    assert load_config(DEMO, ["critic.optim.lr_warmup_steps=3"]).critic.optim.warmup_steps == 3  # verl's, read
    assert "did you mean" not in refusal("actor.no_such_thing=1")


def test_under_a_verl_section_a_synonym_is_named_too():
    assert refusal("trainer.max_steps=3") == ("unknown config key 'trainer.max_steps': did you mean 'run.total_steps'? "
                                              "Fix: write run.total_steps=3.")
    data = yaml.safe_load(open(DEMO))
    data["trainer"] = {"max_steps": 3, "no_such_key": 1}
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data)
    assert "  trainer.max_steps -> run.total_steps\n  trainer.no_such_key: megappo has no such key" in str(raised.value)
