"""The `hardware` section and `variants` of a recipe (megappo.config) and how `megappo plan` uses
them: validation with the fix named, the world size and memory taken from the recipe, variants
applied before the command line's overrides, the CPU plan (host memory per gloo rank), and the
mismatch warning `megappo train` prints."""

import pytest

from megappo.config import ConfigError, HardwareConfig, config_from_dict, load_config
from megappo.plan.planner import CPU_RESERVE_GIB, GIB, RESERVE_GIB, make_plan, total_params

TINY = {"hf_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
                      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "max_position_embeddings": 64}}


def recipe(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("hardware,needle", [
    ({"nodes": 0}, "hardware.nodes=0 must be >= 1. Fix: set hardware.nodes=1 or more."),
    ({"gpus_per_node": 0}, "hardware.gpus_per_node=0 must be >= 1."),
    ({"gpu_memory_gib": 0}, "hardware.gpu_memory_gib=0.0 must be > 0 (GiB per GPU). Fix: e.g. hardware.gpu_memory_gib=80."),
    ({"nodes": 2}, "hardware.nodes=2 needs hardware.gpus_per_node (the ranks of each node). Fix: set "
                   "hardware.gpus_per_node=8"),
    ({"device": "tpu"}, "hardware.device: 'tpu' is not one of ['gpu', 'cpu']"),
    ({"gpu": 8}, "unknown config key 'hardware.gpu'. Fix: remove it or use one of the valid keys. Valid keys: "
                   "['device', 'nodes', 'gpus_per_node', 'gpu_memory_gib', 'peak_tflops']."),
])
def test_bad_hardware_names_the_fix(hardware, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": TINY, "hardware": hardware})
    assert needle in str(e.value)


def test_world_size_and_memory_come_from_the_hardware():
    cfg = config_from_dict({"model": TINY, "parallel": {"tp": 2}, "data": {"train_batch_size": 16},
                            "actor": {"ppo_mini_batch_size": 16, "micro_batch_size": 2},
                            "critic": {"ppo_mini_batch_size": 16, "micro_batch_size": 2},
                            "hardware": {"nodes": 2, "gpus_per_node": 4, "gpu_memory_gib": 40}})
    assert cfg.hardware_world_size == 8
    plan = make_plan(cfg)
    assert (plan.world_size, plan.dp, plan.gpu_mem) == (8, 4, 40 * GIB)
    assert plan.hardware == "2 nodes x 4 GPUs of 40 GiB (the recipe's hardware section)"
    flags = make_plan(cfg, 4, gpu_mem_gib=80)
    assert (flags.world_size, flags.gpu_mem) == (4, 80 * GIB)
    assert flags.hardware == "2 nodes x 2 GPUs of 80 GiB (--world-size and --gpu-mem; the rest from the recipe's " \
                             "hardware section)"
    # no hardware section: one data-parallel replica on 80 GiB, as before
    assert make_plan(config_from_dict({"model": TINY, "parallel": {"tp": 2}})).world_size == 2
    bad = config_from_dict({"model": TINY, "parallel": {"tp": 2}, "hardware": {"gpus_per_node": 3}})
    with pytest.raises(ConfigError, match=r"world size 3 is not a multiple of parallel.tp\*parallel.pp = 2\*1\. .*"
                                          r"\(world size 3 = hardware.nodes x hardware.gpus_per_node: set "
                                          r"hardware.gpus_per_node / hardware.nodes to match, or pass --world-size\)"):
        make_plan(bad)


def test_variants_apply_before_the_command_line(tmp_path):
    path = recipe(tmp_path, "model: {hf_config: {vocab_size: 32}}\nhardware: {gpus_per_node: 8}\n"
                            "variants:\n  small: [hardware.gpus_per_node=4, parallel.tp=2]\n")
    assert load_config(path, variant="small").hardware.gpus_per_node == 4
    cfg = load_config(path, ["parallel.tp=1"], variant="small")
    assert (cfg.hardware.gpus_per_node, cfg.parallel.tp) == (4, 1)
    with pytest.raises(ConfigError, match=r"recipe '.*r.yaml' has no variant 'big'. Fix: choose one of \['small'\]"):
        load_config(path, variant="big")
    with pytest.raises(ConfigError, match=r"variants.x: 'parallel.tp' is not a KEY=VALUE override of this recipe"):
        config_from_dict({"model": TINY, "variants": {"x": ["parallel.tp"]}})
    with pytest.raises(ConfigError, match=r"variants.x: 'variants.y=\[\]' is not a KEY=VALUE override"):
        config_from_dict({"model": TINY, "variants": {"x": ["variants.y=[]"]}})


def test_plan_names_the_variant_its_hardware_came_from(tmp_path, capsys):
    """`megappo plan R --variant small` took its GPUs and memory from the variant: the first line says so."""
    from megappo.cli import main

    model = "{architectures: [LlamaForCausalLM], model_type: llama, vocab_size: 32, hidden_size: 64, " \
            "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}"
    path = recipe(tmp_path, f"model: {{hf_config: {model}}}\nhardware: {{gpus_per_node: 1, gpu_memory_gib: 80}}\n"
                            "variants:\n  small: [hardware.gpu_memory_gib=40]\n")
    main(["plan", path, "--variant", "small"])
    assert "hardware: 1 GPU of 40 GiB (the recipe's hardware section with --variant small)\n" \
        in capsys.readouterr().out
    main(["plan", path])
    assert "hardware: 1 GPU of 80 GiB (the recipe's hardware section)\n" in capsys.readouterr().out


def test_cpu_plan_counts_host_memory_per_rank():
    cpu = load_config("recipes/demo-cpu.yaml")
    assert cpu.hardware == HardwareConfig(device="cpu", nodes=1, gpus_per_node=2, gpu_memory_gib=2.0)
    plan = make_plan(cpu)
    assert plan.reserve == CPU_RESERVE_GIB * GIB and not plan.fused_attention  # auto on CPU: local layers
    assert plan.host_engine == total_params(plan.dims) * 4  # the hf engine's fp32 model on rank 0
    assert plan.hardware == "1 node x 2 ranks of 2 GiB of host memory (the recipe's hardware section)"
    gpu = make_plan(load_config("recipes/demo-cpu.yaml", ["hardware.device=gpu"]))
    assert gpu.reserve == RESERVE_GIB * GIB and gpu.fused_attention and gpu.host_engine == 0
    assert gpu.total - gpu.peak_activation.activations > plan.total - plan.peak_activation.activations


def test_train_mismatch_warning_only_where_the_recipe_says():
    def cfg(**hardware):
        return config_from_dict({"model": TINY, "hardware": hardware})

    assert cfg(gpus_per_node=8).hardware_mismatch(4, "r.yaml").startswith(
        "r.yaml is sized for 8 GPUs (1 node x 8 GPUs of 80 GiB: its hardware section) but this run has 4 ranks")
    assert cfg(gpus_per_node=8).hardware_mismatch(8, "r.yaml") is None
    assert cfg().hardware_mismatch(4, "r.yaml") is None  # the recipe names no hardware
    assert cfg(device="cpu", gpus_per_node=2).hardware_mismatch(1, "r.yaml") is None


def test_train_starts_a_gpu_recipes_hardware_itself(capsys, monkeypatch):
    """Without torchrun and --world-size, `megappo train` starts the GPUs a GPU recipe names (not one
    replica: the Qwen 7B recipe's TP=4 on its 8 GPUs is dp=2, which its memory plan counts on); a CPU
    recipe, or one without hardware, starts one data-parallel replica as before; a recipe for several
    nodes is refused with the launcher to use."""
    from megappo import cli

    assert load_config("recipes/qwen2.5-7b-ppo-8gpu.yaml").launch_world_size == 8
    assert load_config("recipes/qwen2.5-7b-ppo-8gpu.yaml", variant="4gpu").launch_world_size == 4
    assert load_config("recipes/demo-cpu.yaml", ["parallel.tp=1"]).launch_world_size == 1
    assert config_from_dict({"model": TINY, "parallel": {"tp": 2}}).launch_world_size == 2
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["train", "recipes/llama3.3-70b-ppo-64gpu.yaml"]) == 2
    assert capsys.readouterr().err == (
        "megappo: error: recipes/llama3.3-70b-ppo-64gpu.yaml is sized for 8 nodes x 8 GPUs of 80 GiB (its hardware "
        "section); megappo train starts ranks on this machine only. Fix: launch it with "
        "tools/launch/slurm_multinode.sbatch or --launcher ray, or pass --world-size N for this machine.\n")
