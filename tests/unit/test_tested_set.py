"""The tested set (constraints-tested.txt, tools/tested_set.py) against setup.py: every requirement
of megappo[test] is pinned there, at a version setup.py's range allows; and drift's wording."""

import importlib.util
import os

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("tested_set", os.path.join(REPO, "tools", "tested_set.py"))
tested_set = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tested_set)


def test_every_requirement_is_pinned_within_its_range():
    # a requirement added to setup.py without `tools/tested_set.py freeze` (docs/install.md) fails here
    pins = tested_set.read_tested(tested_set.TESTED)
    for line in tested_set.setup_requirements(["test"]):
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == "torch":  # the Makefile's TORCH pins it
            assert name not in pins
            continue
        assert name in pins, f"{name} is not in constraints-tested.txt. Fix: python tools/tested_set.py freeze"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name], str(req.specifier))


def test_drift_lines():
    tested = {"transformers": "5.24.0", "wandb": "0.31.0", "gone": "1.0"}
    now = {"transformers": "5.25.0", "wandb": "0.31.0", "tzdata": "2026.6"}
    assert tested_set.drift(now, tested) == ["gone 1.0 (tested; not installed now)", "transformers 5.24.0 -> 5.25.0",
                                             "tzdata 2026.6 (not in the tested set)"]
    assert tested_set.drift(tested, tested) == []
