"""Every recipe in recipes/ loads, validates on the hardware it declares, and fits it according to
`megappo plan` run as a user would, without flags; so does every variant (other hardware) the recipe
lists (config only; no model is built, no weights are needed).

Recipes declare their hardware as config (`hardware: {device, nodes, gpus_per_node, gpu_memory_gib}`)
and the other hardware their header suggests as `variants: {name: [overrides]}`.
"""

import glob
import os

import pytest
import yaml

from megappo import cli
from megappo.config import load_config
from megappo.plan.planner import make_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
GPU_RECIPES = {"qwen2.5-7b-ppo-8gpu.yaml", "llama3.1-8b-grpo-8gpu.yaml", "qwen2.5-72b-ppo-64gpu.yaml",
               "llama3.3-70b-ppo-64gpu.yaml", "qwen3-8b-ppo-8gpu.yaml", "qwen3-30b-a3b-grpo-32gpu.yaml",
               "llama3.3-70b-lora-grpo-8gpu.yaml", "qwen2.5-7b-dapo-8gpu.yaml"}
VARIANTS = [(path, name) for path in RECIPES for name in load_config(path).variants]


def header(path: str) -> str:
    """The recipe's leading comment block."""
    lines = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line)
    return "".join(lines)


def plan_cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_plan_without_flags_fits_the_recipes_hardware(path, capsys):
    code, out = plan_cli(capsys, path)
    assert code == 0, out
    cfg = load_config(path)
    hw = cfg.hardware
    assert out.startswith(f"hardware: {hw.describe(hw.nodes * hw.gpus_per_node)} (the recipe's hardware section)")
    assert f"layout: world {hw.nodes * hw.gpus_per_node} = " in out and "\nfits: " in out


@pytest.mark.parametrize("path,variant", VARIANTS, ids=[f"{os.path.basename(p)}:{v}" for p, v in VARIANTS])
def test_every_variant_fits(path, variant, capsys):
    code, out = plan_cli(capsys, path, "--variant", variant)
    assert code == 0, out
    assert "\nfits: " in out and f"(the recipe's hardware section with --variant {variant})" in out
    assert variant in header(path), f"the header's 'Other hardware' does not describe variant {variant}"


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_declares_its_hardware(path):
    with open(path) as f:
        raw = yaml.safe_load(f)
    assert {"gpus_per_node", "gpu_memory_gib"} <= set(raw["hardware"]), "set the hardware the recipe is sized for"
    cfg = load_config(path)
    cfg.require_training_data()
    cfg.validate_world(cfg.hardware_world_size)
    assert make_plan(cfg).fits
    if os.path.basename(path) in GPU_RECIPES:
        assert cfg.hardware.device == "gpu" and cfg.variants, "a GPU recipe lists other hardware as variants"
    else:
        assert cfg.hardware.device == "cpu" and cfg.hardware_world_size == 2  # the CPU demos' 2 gloo ranks


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipe_header(name):
    path = os.path.join(REPO, "recipes", name)
    comment = header(path)
    assert "Hardware:" in comment and "Other hardware:" in comment
    assert "--world-size" not in comment  # the hardware section is the world; no flag to remember
    cfg = load_config(path)
    # LoRA adapts Megatron's local layers (TE's fused ones are not adapted: docs/lora.md)
    spec = "local" if cfg.actor.lora.enabled else "te"
    assert cfg.model.dtype == "bfloat16" and cfg.model.layer_spec == spec and cfg.rollout.engine == "sglang"
    assert cfg.model.path.startswith("/models/") and cfg.data.train_files[0].endswith(".parquet")
    assert set(cfg.reward.functions) <= {"gsm8k", "math_boxed"}
    assert {"tp_size", "mem_fraction_static"} <= set(cfg.rollout.sglang)
    if cfg.hardware_world_size >= 64:
        assert cfg.parallel.tp * cfg.parallel.pp > 8 and cfg.parallel.use_distributed_optimizer
        # twice the GPUs: the same layout with dp=2 still fits
        assert load_config(path, variant="128gpu").hardware_world_size == 128


def test_recipes_cover_the_algorithms():
    cfgs = {os.path.basename(p): load_config(p) for p in RECIPES}
    assert {"demo-cpu.yaml", "smollm2-arithmetic-cpu.yaml"} | GPU_RECIPES <= set(cfgs)
    ppo = cfgs["qwen2.5-7b-ppo-8gpu.yaml"]
    assert ppo.use_critic and ppo.algorithm.adv_estimator == "gae"
    grpo = cfgs["llama3.1-8b-grpo-8gpu.yaml"]
    assert grpo.algorithm.adv_estimator == "grpo" and not grpo.use_critic and grpo.actor.use_kl_loss
    assert grpo.roles == ("actor", "ref")
    moe = cfgs["qwen3-30b-a3b-grpo-32gpu.yaml"]  # MoE: experts split over 8 GPUs, 16 per GPU
    assert moe.parallel.ep == 8 and moe.algorithm.adv_estimator == "grpo"
    plan = make_plan(moe)
    assert plan.dims.num_experts == 128 and plan.ep == 8
    dapo = cfgs["qwen2.5-7b-dapo-8gpu.yaml"]  # docs/dapo.md: verl's DAPO example's settings
    assert dapo.algorithm.adv_estimator == "grpo" and dapo.roles == ("actor",) and dapo.rollout.n == 16
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high, dapo.actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    fg, ob = dapo.algorithm.filter_groups, dapo.reward.overlong_buffer
    assert fg.enable and fg.metric == "acc" and fg.max_num_gen_batches == 10
    assert dapo.data.gen_batch_size == 3 * dapo.data.train_batch_size
    assert ob.enable and (ob.len, ob.penalty_factor, dapo.rollout.max_new_tokens) == (4096, 1.0, 20480)
    assert cfgs["demo-moe-cpu.yaml"].parallel.ep == 2 and cfgs["qwen3-8b-ppo-8gpu.yaml"].use_critic


def test_docs_variant_table_is_the_planners():
    """docs/planner.md lists every recipe's hardware and variants with the planned total per GPU."""
    import re

    with open(os.path.join(REPO, "docs", "planner.md")) as f:
        text = f.read()
    rows, recipe_name = {}, None
    for m in re.finditer(r"^\|\s*([\w.-]*)\s*\|\s*(`([\w-]+)`|\(none\))\s*\|.*\|\s*([\d.]+) GiB \|$", text, re.M):
        recipe_name = m.group(1) or recipe_name
        rows[(recipe_name, m.group(3))] = float(m.group(4))
    expected = {(os.path.basename(p)[:-5], v) for p in RECIPES if os.path.basename(p) in GPU_RECIPES
                for v in [None, *load_config(p).variants]}
    assert set(rows) == expected
    for (name, variant), total in rows.items():
        plan = make_plan(load_config(os.path.join(REPO, "recipes", name + ".yaml"), variant=variant))
        assert round(plan.total / 2**30, 1) == total, (name, variant)
