"""Every recipe in recipes/ loads and validates (config only; no model is built)."""

import glob
import os

import pytest

from megappo.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_is_valid(path):
    cfg = load_config(path)
    cfg.require_training_data()
    cfg.validate_world(cfg.parallel.tp * cfg.parallel.pp)


def test_there_are_recipes():
    assert {"demo-cpu.yaml", "smollm2-arithmetic-cpu.yaml"} <= {os.path.basename(p) for p in RECIPES}
