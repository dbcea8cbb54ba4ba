"""Every recipe in recipes/ loads, validates at the world size it is written for, and fits its
hardware according to `megappo plan` (config only; no model is built, no weights are needed).

GPU recipes declare their hardware in header comments that this test reads:
  # world_size: 8        (ranks the recipe is laid out for)
  # gpu_mem_gib: 80      (memory per GPU)
A recipe without them (the CPU ones) runs on parallel.tp * parallel.pp ranks.
"""

import glob
import os
import re

import pytest

from megappo.config import load_config
from megappo.plan import make_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
GPU_RECIPES = {"qwen2.5-7b-ppo-8gpu.yaml", "llama3.1-8b-grpo-8gpu.yaml", "qwen2.5-72b-ppo-64gpu.yaml",
               "llama3.3-70b-ppo-64gpu.yaml"}


def header(path: str) -> dict[str, str]:
    """`# key: value` lines of the recipe's leading comment block."""
    found = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            m = re.match(r"#\s*(world_size|gpu_mem_gib):\s*(\S+)\s*$", line)
            if m:
                found[m.group(1)] = m.group(2)
    return found


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_is_valid_and_fits(path):
    cfg = load_config(path)
    cfg.require_training_data()
    h = header(path)
    world = int(h.get("world_size", cfg.parallel.tp * cfg.parallel.pp))
    cfg.validate_world(world)
    plan = make_plan(cfg, world, gpu_mem_gib=float(h.get("gpu_mem_gib", 80)))
    assert plan.fits, plan.fixes


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipe_declares_its_hardware(name):
    path = os.path.join(REPO, "recipes", name)
    with open(path) as f:
        text = f.read()
    assert text.startswith("#")
    comment = text.split("\nmodel:")[0]
    assert "Hardware:" in comment and "Other hardware:" in comment
    assert set(header(path)) == {"world_size", "gpu_mem_gib"}
    cfg = load_config(path)
    assert cfg.model.dtype == "bfloat16" and cfg.model.layer_spec == "te" and cfg.rollout.engine == "sglang"
    assert cfg.model.path.startswith("/models/") and cfg.data.train_files[0].endswith(".parquet")
    assert set(cfg.reward.functions) <= {"gsm8k", "math_boxed"}
    assert {"tp_size", "mem_fraction_static"} <= set(cfg.rollout.sglang)
    if int(header(path)["world_size"]) >= 64:
        assert cfg.parallel.tp * cfg.parallel.pp > 8 and cfg.parallel.use_distributed_optimizer
        # twice the GPUs: the same layout with dp=2 still fits
        assert make_plan(cfg, 2 * int(header(path)["world_size"])).fits


def test_recipes_cover_the_algorithms():
    cfgs = {os.path.basename(p): load_config(p) for p in RECIPES}
    assert {"demo-cpu.yaml", "smollm2-arithmetic-cpu.yaml"} | GPU_RECIPES <= set(cfgs)
    ppo = cfgs["qwen2.5-7b-ppo-8gpu.yaml"]
    assert ppo.use_critic and ppo.algorithm.adv_estimator == "gae"
    grpo = cfgs["llama3.1-8b-grpo-8gpu.yaml"]
    assert grpo.algorithm.adv_estimator == "grpo" and not grpo.use_critic and grpo.actor.use_kl_loss
    assert grpo.roles == ("actor", "ref")
