"""A sampler class named in the config (data.sampler.class_path / .class_name, verl's keys): each epoch's
prompt order is what the class yields, a resumed sampler continues exactly where the first left off (its
epochs replayed), and a class megappo cannot use is an error naming the fix, before any rank starts."""

import pytest

from megappo.config import ConfigError, load_config
from megappo.data.prompts import ClassOrder, DataError, PromptSampler
from megappo.trainer.preflight import check_inputs

SAMPLERS = '''
import random


class Seeded:
    """A new permutation each epoch from one seeded generator (torch's RandomSampler with a generator does this)."""

    def __init__(self, data_source, data_config):
        self.n, self.rng = len(data_source), random.Random(data_config["seed"])

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)


class Hardest:
    """Prompts with the longest ground truth first (a fixed curriculum, no update)."""

    def __init__(self, data_source, data_config):
        self.order = sorted(range(len(data_source)), key=lambda i: -len(str(data_source[i])))

    def __iter__(self):
        yield from self.order


class Curriculum(Seeded):
    def update(self, batch):
        pass


class Short(Seeded):
    def __iter__(self):
        return iter([0, 1])


class Outside(Seeded):
    def __iter__(self):
        return iter(range(1, self.n + 1))
'''
EXAMPLES = ["a", "bbbb", "cc", "ddd", "e", "ffffff"]


@pytest.fixture
def samplers(tmp_path):
    (tmp_path / "samplers.py").write_text(SAMPLERS)
    return str(tmp_path / "samplers.py")


def test_each_epoch_is_the_classs_order(samplers):
    sampler = PromptSampler(6, 2, order=ClassOrder(samplers, "Hardest", EXAMPLES, {"seed": 3}))
    assert [sampler.next_batch() for _ in range(3)] == [[5, 1], [3, 2], [0, 4]]
    assert sampler.next_batch() == [5, 1]  # the next epoch iterates the instance again


def test_a_resumed_sampler_continues_the_same_order(samplers):
    first = PromptSampler(6, 4, order=ClassOrder(samplers, "Seeded", EXAMPLES, {"seed": 3}))
    seen = [first.next_batch() for _ in range(3)]  # one batch per epoch (6 // 4): epochs 0, 1, 2
    assert len({tuple(b) for b in seen}) > 1  # the order changes from epoch to epoch
    state = first.state_dict()
    resumed = PromptSampler(6, 4, order=ClassOrder(samplers, "Seeded", EXAMPLES, {"seed": 3}))
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(3)] == [first.next_batch() for _ in range(3)]


@pytest.mark.parametrize("name,error", [
    ("Curriculum", "has an update(batch) method: a curriculum sampler"),
    ("Missing", "has no class 'Missing'"),
    ("Short", "yielded 2 indices for 6 prompts. Fix: yield 6 indices in [0, 6)"),
    ("Outside", "yielded 6 indices, [6] outside [0, 6) for 6 prompts"),
])
def test_a_sampler_megappo_cannot_use_is_an_error_naming_the_fix(samplers, name, error):
    with pytest.raises((ConfigError, DataError)) as e:
        PromptSampler(6, 2, order=ClassOrder(samplers, name, EXAMPLES, {"seed": 3})).next_batch()
    assert error in str(e.value) and "Fix: " in str(e.value)


def test_verls_sampler_keys_are_megappos_and_checked_before_the_run(samplers):
    cfg = load_config("recipes/demo-cpu.yaml", [f"data.sampler.class_path={samplers}",
                                                "data.sampler.class_name=Seeded"])
    assert (cfg.data.sampler.class_path, cfg.data.sampler.class_name) == (samplers, "Seeded")
    check_inputs(cfg, 2)
    with pytest.raises(ConfigError, match="curriculum sampler"):
        check_inputs(load_config("recipes/demo-cpu.yaml", [f"data.sampler.class_path={samplers}",
                                                           "data.sampler.class_name=Curriculum"]), 2)
    with pytest.raises(ConfigError, match="a sampler class needs both"):
        load_config("recipes/demo-cpu.yaml", [f"data.sampler.class_path={samplers}"])
