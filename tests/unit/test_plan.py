"""megappo.plan.planner: layout checks that name the fix, and memory numbers worked out by hand."""

import json
import os
import subprocess
import sys

import pytest

from megappo.cli import main
from megappo.config import ConfigError, config_from_dict
from megappo.models.hf_config import ModelConfigError, dims_from_hf
from megappo.plan.planner import (CPU_RESERVE_GIB, ENGINE_RESERVE_GIB, GIB, KNOWN_MODELS, RESERVE_GIB, chunks_in_flight,
                          format_plan, layer_activation_bytes,
                          layers_in_flight,
                          make_plan, total_params)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN7B = dims_from_hf(KNOWN_MODELS["Qwen2.5-7B"])

# Qwen2.5-7B by hand (hidden 3584, FFN 18944, 28 layers, 28 heads / 4 KV heads of 128, vocab 152064, untied):
#   QKV 3584 * (3584 + 2 * 512) = 16,515,072 + bias 4,608; O 3584 * 3584 = 12,845,056;
#   MLP 3 * 3584 * 18944 = 203,685,888; two norms 7,168  ->  233,057,792 per layer, x 28 = 6,525,618,176
#   embedding and LM head 152064 * 3584 = 544,997,376 each; final norm 3,584
QWEN7B_PARAMS = 6_525_618_176 + 2 * 544_997_376 + 3_584  # = 7,615,616,512 (HF reports 7.62B)


def recipe(**sections):
    """A Qwen2.5-7B PPO config; `sections` replace whole top-level sections."""
    data = {"model": {"path": "/nonexistent/Qwen2.5-7B-Instruct", "dtype": "bfloat16", "layer_spec": "te"},
            "actor": {"ppo_mini_batch_size": 8, "micro_batch_size": 1},
            "critic": {"ppo_mini_batch_size": 8, "micro_batch_size": 1},
            "rollout": {"engine": "hf", "max_new_tokens": 1024},
            "data": {"max_prompt_length": 512, "train_batch_size": 8}}
    data.update(sections)
    return config_from_dict(data)


def test_parameter_counts_of_the_known_models():
    # public parameter counts (Llama's are exact: 8,030,261,248 and 70,553,706,496)
    expected = {"Qwen2.5-7B": QWEN7B_PARAMS, "Llama-3.1-8B": 8_030_261_248, "Llama-3.3-70B-Instruct": 70_553_706_496,
                "Qwen2.5-72B": 72.71e9, "SmolLM2-135M": 134.5e6}
    for name, n in expected.items():
        assert total_params(dims_from_hf(KNOWN_MODELS[name])) == pytest.approx(n, rel=1e-3), name
    assert total_params(QWEN7B) == QWEN7B_PARAMS


def test_7b_actor_memory_by_hand_tp1():
    """tp=1, pp=1, bf16, no distributed optimizer: 2 + 4 + 4 + 8 = 18 bytes per parameter."""
    plan = make_plan(recipe(), world_size=1)
    actor = {r.role: r for r in plan.roles}["actor"]
    assert actor.params == QWEN7B_PARAMS
    assert actor.weights == 2 * QWEN7B_PARAMS  # bf16
    assert actor.grads == 4 * QWEN7B_PARAMS  # fp32 main_grad
    assert actor.master == 4 * QWEN7B_PARAMS and actor.adam == 8 * QWEN7B_PARAMS
    assert (actor.weights + actor.grads + actor.optimizer) / GIB == pytest.approx(127.67, abs=0.01)
    # activations, s = 512 + 1024 = 1536, b = 1, bf16, fused attention, all 28 layers on one stage:
    #   per token 4 * 3584 (norm, QKV and FC1 inputs) + (3584 + 2 * 512 + 3584 + 3 * 18944) = 79,360 elements,
    #   x 2 bytes x 1536 tokens = 243,793,920 bytes per layer, x 28 = 6,826,229,760;
    #   logits 1536 * 152064 * (2 + 3 * 4) bytes = 3,269,984,256
    assert actor.activations == 6_826_229_760 + 3_269_984_256
    critic = {r.role: r for r in plan.roles}["critic"]
    assert critic.params == QWEN7B_PARAMS - 544_997_376 + 3_584 + 1  # value head instead of the LM head
    assert not plan.fits  # 2 x 127.7 GiB on one 80 GiB GPU


def test_7b_chunked_lm_head_by_hand():
    """model.lm_head_chunk_tokens: the LM head's part of a pass is one chunk's logits, not the micro-batch's.
    Packed micro-batches of 16384 tokens (16384 / 1536 sequences of 1536), tp=1, bf16:
      today:   16384 * 152064 * (2 + 3 * 4) bytes = 34,879,832,064 (the [16384, 152064] logits and copies)
      chunked: 1024 * 152064 * (2 + 3 * 4) = 2,179,989,504, plus the actor's (training) weight-gradient
               product 152064 * 3584 * 2 = 1,089,994,752; the reference (forward only) without it."""
    def roles(chunk):
        cfg = recipe(model={"path": "/nonexistent/Qwen2.5-7B-Instruct", "dtype": "bfloat16", "layer_spec": "te",
                            "lm_head_chunk_tokens": chunk},
                     actor={"ppo_mini_batch_size": 8, "max_tokens_per_micro_batch": 16384},
                     algorithm={"use_kl_in_reward": True})
        return {r.role: r for r in make_plan(cfg, world_size=1).roles}

    today, chunked = roles(0), roles(1024)
    assert today["actor"].activations - chunked["actor"].activations == pytest.approx(
        34_879_832_064 - 2_179_989_504 - 1_089_994_752)
    assert today["ref"].activations - chunked["ref"].activations == pytest.approx(34_879_832_064 - 2_179_989_504)
    assert roles(10**6)["actor"].activations == pytest.approx(today["actor"].activations + 1_089_994_752)


def test_7b_sharded_by_hand():
    """tp=4 with sequence parallel, dp=2 with the distributed optimizer."""
    cfg = recipe(parallel={"tp": 4, "sequence_parallel": True, "use_distributed_optimizer": True})
    actor = {r.role: r for r in make_plan(cfg, world_size=8).roles}["actor"]
    per_layer = (16_515_072 + 4_608 + 12_845_056 + 203_685_888) / 4 + 7_168
    n = 28 * per_layer + 2 * 544_997_376 / 4 + 3_584
    assert actor.params == pytest.approx(n)
    assert actor.grads == pytest.approx(4 * n)
    assert actor.master == pytest.approx(4 * n / 2) and actor.adam == pytest.approx(8 * n / 2)
    # sequence parallel splits the 4h replicated elements as well: 79,360 / 4 per token
    assert actor.activations == pytest.approx(28 * 2 * 1536 * 79_360 / 4 + 1536 * 152064 / 4 * 14)


def test_per_role_layouts_are_planned_per_role():
    """The critic at its own tp=2 (dp=4) next to a tp=4 actor: its shard is the tp=2 one."""
    cfg = recipe(parallel={"tp": 4, "use_distributed_optimizer": True}, critic={
        "ppo_mini_batch_size": 8, "micro_batch_size": 1, "parallel": {"tp": 2}})
    roles = {r.role: r for r in make_plan(cfg, world_size=8).roles}
    per_layer = (16_515_072 + 4_608 + 12_845_056 + 203_685_888) / 2 + 7_168
    n = 28 * per_layer + 544_997_376 / 2 + 3_584 + 3_585  # embedding shard, final norm, value head
    assert roles["critic"].params == pytest.approx(n)
    assert roles["critic"].adam == pytest.approx(8 * n / 4)  # distributed optimizer over the critic's dp=4
    assert roles["actor"].params < roles["critic"].params


def test_unfused_attention_adds_korthikanti_score_term():
    kw = dict(seq=2048, micro=2, tp=2, sequence_parallel=False, act_bytes=2)
    extra = (layer_activation_bytes(QWEN7B, fused_attention=False, **kw)
             - layer_activation_bytes(QWEN7B, fused_attention=True, **kw))
    assert extra == 5 * 28 * 2048 * 2048 * 2 / 2  # 5 a s^2 b bytes, / tp


def test_pipeline_micro_batches_in_flight():
    assert layers_in_flight(80, pp=8, vpp=None, rank=0, micro_batches=32) == 80  # 10 layers x 8 (1F1B)
    assert layers_in_flight(80, pp=8, vpp=None, rank=7, micro_batches=32) == 10
    assert layers_in_flight(80, pp=8, vpp=None, rank=0, micro_batches=3) == 30
    # interleaved: (pp - 1) * 2 + (vpp - 1) * pp + 1 = 23 chunks of 5 layers on the first rank
    assert layers_in_flight(80, pp=8, vpp=2, rank=0, micro_batches=32) == 115


# Qwen2.5-7B at tp=1, s = 1536, b = 1, bf16, fused attention (test_7b_actor_memory_by_hand_tp1): a whole
# layer keeps 243,793,920 bytes, a layer input 1536 * 3584 * 2 = 11,010,048 bytes; logits 3,269,984,256
LAYER, INPUT, LOGITS = 243_793_920, 11_010_048, 3_269_984_256


@pytest.mark.parametrize("recompute,activations", [
    ({}, 28 * LAYER),
    ({"granularity": "full"}, 28 * INPUT + LAYER),  # every layer's input, one layer rebuilt at a time
    ({"granularity": "full", "num_layers": 4}, 7 * INPUT + 4 * LAYER),  # 7 groups of 4, a group rebuilt
    ({"granularity": "full", "method": "block", "num_layers": 4}, 4 * INPUT + 24 * LAYER + LAYER),
    # mlp: per token 79,360 - 3 * 18944 = 22,528 elements kept, x 2 bytes x 1536 tokens = 69,206,016 per layer
    ({"granularity": "selective", "modules": ["mlp"]}, 28 * 69_206_016),
    ({"granularity": "selective"}, 28 * LAYER),  # core_attn: fused attention keeps no scores anyway
])
def test_recomputation_by_hand(recompute, activations):
    plan = make_plan(recipe(actor={"ppo_mini_batch_size": 8, "micro_batch_size": 1, "recompute": recompute}),
                     world_size=1)
    actor = {r.role: r for r in plan.roles}["actor"]
    assert actor.activations == activations + LOGITS
    assert actor.phase == "actor update" + (f", {recompute['granularity']} recomputation" if recompute else "")
    full = 28 * INPUT + LAYER
    assert actor.recompute_saving == (0 if recompute.get("granularity") == "full" else activations - full)


def test_selective_core_attn_drops_the_unfused_score_term():
    kw = dict(seq=2048, micro=2, tp=2, sequence_parallel=False, act_bytes=2)
    assert (layer_activation_bytes(QWEN7B, fused_attention=False, recomputed=("core_attn",), **kw)
            == layer_activation_bytes(QWEN7B, fused_attention=True, **kw))


def test_full_recomputation_in_a_pipeline():
    """pp=2 (14 layers per stage), 1F1B: the first stage holds 2 micro-batches of its chunk; sequence
    parallelism at tp=2 splits the kept layer inputs too."""
    cfg = recipe(parallel={"tp": 2, "pp": 2, "sequence_parallel": True},
                 actor={"ppo_mini_batch_size": 8, "micro_batch_size": 1,
                        "recompute": {"granularity": "full", "num_layers": 7}})
    plan = make_plan(cfg, world_size=4)
    assert plan.stage == "first" and chunks_in_flight(pp=2, vpp=None, rank=0, micro_batches=8) == 2
    layer = layer_activation_bytes(QWEN7B, seq=1536, micro=1, tp=2, sequence_parallel=True, act_bytes=2,
                                   fused_attention=True)
    actor = {r.role: r for r in plan.roles}["actor"]
    # 2 micro-batches x 2 group inputs (each split over tp), plus one group of 7 layers rebuilt; no logits here
    assert actor.activations == pytest.approx(2 * 2 * INPUT / 2 + 7 * layer, rel=1e-12)


def test_recomputation_layers_checked_by_the_planner():
    with pytest.raises(ModelConfigError, match=r"actor.recompute.num_layers=3 does not divide the 28 layers of one "
                                               r"pipeline chunk"):
        make_plan(recipe(actor={"ppo_mini_batch_size": 8, "recompute": {"granularity": "full", "num_layers": 3}}),
                  world_size=1)
    with pytest.raises(ModelConfigError, match=r"critic.recompute.num_layers=20 is more than the 14 layers"):
        make_plan(recipe(parallel={"pp": 2}, critic={"ppo_mini_batch_size": 8, "recompute": {
            "granularity": "full", "method": "block", "num_layers": 20}}), world_size=2)


def test_layout_errors_name_the_fix():
    with pytest.raises(ModelConfigError, match=r"num_attention_heads=28 is not divisible by tp=8.*Fix: choose "
                                               r"parallel.tp from \[1, 2, 4\]"):
        make_plan(recipe(parallel={"tp": 8}), world_size=8)
    with pytest.raises(ModelConfigError, match=r"num_hidden_layers=28 is not divisible by pp=3"):
        make_plan(recipe(parallel={"pp": 3}), world_size=3)
    with pytest.raises(ConfigError, match=r"world size 6 is not a multiple of parallel.tp\*parallel.pp = 4\*1"):
        make_plan(recipe(parallel={"tp": 4}), world_size=6)
    with pytest.raises(ConfigError, match=r"actor: a mini-batch of 8 sequences does not split over dp=4 replicas in "
                                          r"micro-batches of 4"):
        make_plan(recipe(actor={"ppo_mini_batch_size": 8, "micro_batch_size": 4, "packing": False}), world_size=4)
    sglang = {"engine": "sglang", "sglang": {"tp_size": 8}}
    with pytest.raises(ModelConfigError, match=r"rollout.sglang.tp_size=8 does not split num_attention_heads=28.*"
                                               r"Fix: choose rollout.sglang.tp_size from \[1, 2, 4\]"):
        make_plan(recipe(rollout=sglang), world_size=8)
    with pytest.raises(ConfigError, match="mem_fraction_static=1.5 must be in"):
        make_plan(recipe(rollout={"engine": "sglang", "sglang": {"mem_fraction_static": 1.5}}), world_size=1)


def test_architecture_sources(tmp_path):
    with pytest.raises(ModelConfigError, match=r"model.path=/models/my-model has no config.json and 'my-model' is "
                                               r"not a built-in model.*Fix: pass --hf-config"):
        make_plan(recipe(model={"path": "/models/my-model"}), world_size=1)
    # a config.json in model.path wins over the built-in table; --hf-config wins over both
    small = {**KNOWN_MODELS["SmolLM2-135M"]}
    model_dir = tmp_path / "Qwen2.5-7B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(small))
    plan = make_plan(recipe(model={"path": str(model_dir)}), world_size=1)
    assert plan.dims.hidden_size == 576 and plan.model.endswith("config.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(KNOWN_MODELS["Llama-3.1-8B"]))
    plan = make_plan(recipe(model={"path": str(model_dir)}), world_size=1, hf_config=str(other))
    assert plan.dims.hidden_size == 4096
    # the built-in table is an explicit, case-insensitive match on the directory name, not a substring
    assert make_plan(recipe(model={"path": "/m/qwen2.5-7b-instruct/"}), world_size=1).dims.hidden_size == 3584
    with pytest.raises(ModelConfigError, match="not a built-in model"):
        make_plan(recipe(model={"path": "/m/Qwen2.5-7B-Instruct-finetuned"}), world_size=1)


def test_distributed_sync_keeps_the_engine_off_the_trainer_gpus():
    """sync_mode=distributed: SGLang runs on GPUs of its own, so no trainer GPU carries its pool;
    its tp size is checked against the heads only, not against the trainer's world."""
    cfg = dict(parallel={"tp": 4, "sequence_parallel": True, "use_distributed_optimizer": True},
               data={"max_prompt_length": 512, "train_batch_size": 8})
    colocated = make_plan(recipe(rollout={"engine": "sglang", "sglang": {"tp_size": 4}}, **cfg), world_size=4)
    separate = make_plan(recipe(rollout={"engine": "sglang", "sync_mode": "distributed", "sglang": {"tp_size": 4}},
                                **cfg), world_size=4)
    assert colocated.engine is not None and separate.engine is None
    assert separate.total < colocated.total
    assert "sync_mode=distributed: on GPUs of its own" in format_plan(separate)
    two = make_plan(recipe(rollout={"engine": "sglang", "sync_mode": "distributed", "sglang": {"tp_size": 2}},
                           parallel={"tp": 1}), world_size=1)
    assert two.engine is None
    with pytest.raises(ModelConfigError, match="does not split"):
        make_plan(recipe(rollout={"engine": "sglang", "sync_mode": "distributed", "sglang": {"tp_size": 8}}),
                  world_size=8)
    # the suggestions are not bounded by the trainer's world: the engine's GPUs are its own
    with pytest.raises(ModelConfigError, match=r"choose rollout.sglang.tp_size from \[1, 2, 4, 28\]"):
        make_plan(recipe(rollout={"engine": "sglang", "sync_mode": "distributed", "sglang": {"tp_size": 3}}),
                  world_size=2)
    # disaggregated replicas: 4 engines of tp 2 led by ranks 0, 4, 8, 12 of 2 nodes, so each node needs 2 x 2 GPUs
    # beyond its 8 trainer GPUs; the leaders but rank 0 stage each update in host memory; no trainer GPU holds one
    four = make_plan(recipe(rollout={"engine": "sglang", "sync_mode": "distributed", "replicas": 4,
                                     "sglang": {"tp_size": 2}}, parallel={"tp": 2},
                            hardware={"nodes": 2, "gpus_per_node": 8}), world_size=16)
    text = format_plan(four)
    assert four.engine is None and four.placement.engine_ranks == frozenset()
    assert ("rollout: 4 replicas of an sglang engine of tp 2 on GPUs of their own (4 a node at most, after its 8 "
            "trainer GPUs); ranks 4, 8, 12 stage each update whole") in text, text


def test_cli_exit_codes(capsys):
    path = os.path.join(REPO, "recipes", "qwen2.5-7b-ppo-8gpu.yaml")
    assert main(["plan", path, "--world-size", "8"]) == 0
    assert "fits:" in capsys.readouterr().out
    # options before or after the overrides
    assert main(["plan", path, "--world-size", "8", "parallel.use_distributed_optimizer=false"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", path, "parallel.tp=8", "--world-size", "8"]) == 2
    assert "megappo: error: the parallel layout does not fit the model" in capsys.readouterr().err
    assert main(["plan", path, "--world-size", "8", "--gpu-mem", "40"]) == 1


def test_plan_imports_neither_torch_nor_megatron():
    code = ("import sys; from megappo.cli import main; "
            "rc = main(['plan', 'recipes/llama3.1-8b-grpo-8gpu.yaml', '--world-size', '8']); "
            "assert rc == 0, rc; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_moe_parameters_split_over_expert_parallel_ranks():
    from megappo.models.hf_config import dims_from_hf
    from megappo.plan.planner import KNOWN_MODELS, stage_params, total_params

    d = dims_from_hf(KNOWN_MODELS["Qwen3-30B-A3B"])
    assert 30.0e9 < total_params(d) < 31.0e9  # "30B"
    assert 3.0e9 < total_params(d, active=True) < 3.6e9  # "A3B": top-8 of 128 experts
    experts = 48 * 128 * 3 * 2048 * 768  # every layer's experts
    full = stage_params(d, tp=1, pp=1, stage="all", value_head=False, divisible_by=128)
    ep8 = stage_params(d, tp=1, pp=1, stage="all", value_head=False, divisible_by=128, ep=8)
    assert abs((full - ep8) - experts * 7 / 8) < 1e3  # each EP rank holds 1/8 of the experts
    dense = dims_from_hf(KNOWN_MODELS["Qwen3-8B"])
    assert 8.0e9 < total_params(dense) < 8.4e9 and total_params(dense, active=True) == total_params(dense)


def test_hf_engine_on_the_gpu_by_hand():
    """rollout.engine=hf beside a GPU trainer: rank 0's GPU holds the engine's bf16 weights, and its KV
    cache of a step's samples counts as a phase (sync, dynamic decode) or on top of the activations
    (one_step_off; or the CUDA-graph decode, rollout.hf_decode=graphs, which keeps it; auto once it picks graphs).
    Qwen2.5-7B, s = 512 + 1024 = 1536, 8 prompts x n=4: 32 rows x 1536 positions x 2 (K, V) x 28 layers
    x 4 KV heads x 128 x 2 bytes = 2,818,572,288 bytes."""
    kv = 32 * 1536 * 2 * 28 * 4 * 128 * 2
    rollout = {"engine": "hf", "max_new_tokens": 1024, "n": 4, "hf_decode": "dynamic"}
    sync = make_plan(recipe(rollout=rollout), world_size=1, gpu_mem_gib=400)
    assert sync.gpu_engine == 2 * QWEN7B_PARAMS and sync.gpu_engine_kv == kv == 2_818_572_288
    assert sync.phases == max(sync.peak_activation.activations, kv)
    overlapped = make_plan(recipe(rollout={**rollout, "mode": "one_step_off"}), world_size=1, gpu_mem_gib=400)
    assert overlapped.total - sync.total == pytest.approx(min(sync.peak_activation.activations, kv))
    for decode in ("auto", "graphs"):  # auto: graphs on a GPU for this dense Qwen2 (the cache is kept)
        kept = make_plan(recipe(rollout={**rollout, "hf_decode": decode}), world_size=1, gpu_mem_gib=400)
        assert kept.gen_overlaps and kept.total == overlapped.total
    host = make_plan(recipe(rollout={**rollout, "placement": "separate", "hf_decode": "auto"}), world_size=1,
                     gpu_mem_gib=400)
    assert host.gpu_engine == host.gpu_engine_kv == 0
    assert sync.total - host.total == pytest.approx(2 * QWEN7B_PARAMS + max(0, kv - sync.peak_activation.activations))
    text = format_plan(sync)
    assert "hf engine on rank 0's GPU" in text and "hf engine weights 14.2" in text
    tiny_batch = make_plan(recipe(rollout={**rollout, "n": 1}, data={"max_prompt_length": 64, "train_batch_size": 8}),
                           world_size=1, gpu_mem_gib=400)
    assert tiny_batch.phases == tiny_batch.peak_activation.activations  # a small cache hides under the activations


def test_lora_memory_by_hand():
    """Qwen2.5-7B GRPO with a KL loss, actor.lora rank 8 on all linears, tp=1: per layer A and B of
    qkv 8*3584 + (3584 + 2*512)*8, proj 8*3584 + 3584*8, fc1 8*3584 + 2*18944*8, fc2 8*18944 + 3584*8
    = 634,880 numbers, x 28 layers = 17,776,640 adapters: the only gradients (fp32) and optimizer state
    (fp32 master + Adam moments); the reference is the actor's base, so it holds no weights."""
    lora = {"rank": 8, "alpha": 16}
    grpo = dict(algorithm={"adv_estimator": "grpo"}, rollout={"engine": "hf", "max_new_tokens": 1024, "n": 2},
                actor={"ppo_mini_batch_size": 8, "micro_batch_size": 1, "use_kl_loss": True, "lora": lora})
    full = {r.role: r for r in make_plan(recipe(**{**grpo, "actor": {**grpo["actor"], "lora": {}}}), world_size=1).roles}
    roles = {r.role: r for r in make_plan(recipe(**grpo), world_size=1).roles}
    adapters = 17_776_640
    actor = roles["actor"]
    assert actor.params == full["actor"].params + adapters and actor.weights == actor.params * 2
    assert (actor.grads, actor.master, actor.adam) == (adapters * 4, adapters * 4, adapters * 8)
    assert actor.activations == full["actor"].activations and actor.phase.endswith(", LoRA r=8")
    assert roles["ref"].weights == 0 and roles["ref"].activations == full["ref"].activations
    assert full["ref"].weights == full["actor"].weights and roles["ref"].phase == "ref forward (the actor's base)"
    saved = {r.role: r for r in make_plan(recipe(**{**grpo, "actor": {**grpo["actor"], "lora": {
        **lora, "modules_to_save": ["lm_head"]}}}), world_size=1).roles}["actor"]
    assert saved.grads == (adapters + 152_064 * 3584) * 4  # lm_head trains fully (vocab padded to 152,064)


# -- rollout replicas: an engine on each replica's ranks (megappo.rollout.replicas) ---------------------

SGLANG_2X2 = {"engine": "sglang", "max_new_tokens": 1024, "replicas": 2,
              "sglang": {"tp_size": 2, "mem_fraction_static": 0.4}}


def test_replica_leaders_are_the_runs():
    """The planner places replica i where megappo.rollout.replicas starts it: rank i * world // replicas."""
    from megappo.plan.planner import replica_leaders
    from megappo.rollout.replicas import leaders

    for world, replicas in [(8, 1), (8, 2), (8, 3), (8, 8), (64, 8), (16, 5)]:
        assert replica_leaders(world, replicas) == leaders(world, replicas)


def test_sglang_replicas_hold_an_engine_on_every_gpu_of_their_span():
    """rollout.replicas=2 x sglang tp 2 on 8 GPUs (tp 2 x dp 4): replica i is led by rank i * 8 / 2 and spans
    ranks [4i, 4i + 2). Those 4 GPUs each hold weights / 2 and the KV cache in SGLang's pool (0.4 of what
    the trainer leaves free) plus the engine reserve; the other 4 the trainer only. With one replica,
    ranks 0-1 alone: the same worst GPU."""
    par = {"tp": 2, "sequence_parallel": True, "use_distributed_optimizer": True}
    plan = make_plan(recipe(parallel=par, rollout=SGLANG_2X2), world_size=8, gpu_mem_gib=80)
    assert plan.placement.leaders == (0, 4) and plan.placement.engine_ranks == {0, 1, 4, 5}
    start = sum(r.weights + r.grads + r.master for r in plan.roles) + RESERVE_GIB * GIB
    assert plan.engine.pool == pytest.approx(0.4 * (80 * GIB - start))
    assert plan.engine.weights == pytest.approx(QWEN7B_PARAMS * 2 / 2)  # bf16 over the replica's 2 GPUs
    trainer = plan.static + plan.peak_activation.activations + RESERVE_GIB * GIB
    engine = trainer + plan.engine.pool + ENGINE_RESERVE_GIB * GIB
    assert plan.total == pytest.approx(engine)
    kinds = {ranks: (rank, total) for ranks, rank, total in plan.gpus}
    assert kinds == {(0, 1, 5): (0, pytest.approx(engine)), (4,): (4, pytest.approx(engine)),
                     (2, 3, 6, 7): (2, pytest.approx(trainer))}
    text = format_plan(plan)
    assert "rollout: 2 replicas of an sglang engine of tp 2 on ranks 0-1 | 4-5 (4 of 8 GPUs); rank 4 stages" in text
    staged = QWEN7B_PARAMS * 2 / GIB  # the whole bf16 model, in rank 4's host memory
    assert f"each update whole ({staged:.1f} GiB) until it applies it, in host memory: {staged:.1f} GiB" in text
    assert f"  ranks 2-3, 6-7: no engine: {trainer / GIB:.1f} GiB (rank 2)" in text
    assert "pipeline stage 'all', rank 0 (a GPU of replica 0's engine)" in text
    one = make_plan(recipe(parallel=par, rollout={**SGLANG_2X2, "replicas": 1}), world_size=8, gpu_mem_gib=80)
    assert one.placement.engine_ranks == {0, 1} and one.total == pytest.approx(plan.total)
    assert {ranks: rank for ranks, rank, _ in one.gpus} == {(0, 1): 0, (2, 3, 4, 5, 6, 7): 2}


def test_a_replica_on_the_last_pipeline_stage_carries_its_engine_there():
    """tp 4 x pp 2 on 8 GPUs, sglang tp 4: stage 0 is ranks 0-3, stage 1 ranks 4-7. One replica leaves the
    last stage without an engine; a second (led by rank 4) puts one there, planned with that stage's roles:
    its pool is 0.4 of what the last stage's trainer leaves free."""
    from megappo.plan.planner import _roles_at

    par = {"tp": 4, "pp": 2, "sequence_parallel": True, "use_distributed_optimizer": True}
    rollout = {**SGLANG_2X2, "sglang": {"tp_size": 4, "mem_fraction_static": 0.4}}
    cfg = recipe(parallel=par, rollout=rollout)
    last = _roles_at(cfg, {"actor": QWEN7B, "critic": QWEN7B}, 8, "last", 1)
    static = sum(r.weights + r.grads + r.optimizer for r in last)
    start = sum(r.weights + r.grads + r.master for r in last) + RESERVE_GIB * GIB
    trainer = static + max(r.activations for r in last) + RESERVE_GIB * GIB
    engine = trainer + 0.4 * (80 * GIB - start) + ENGINE_RESERVE_GIB * GIB
    totals = {}
    for replicas in (1, 2):
        plan = make_plan(recipe(parallel=par, rollout={**rollout, "replicas": replicas}), world_size=8, gpu_mem_gib=80)
        totals[replicas] = {rank: total for _, rank, total in plan.gpus}
    assert totals[1][4] == pytest.approx(trainer) and totals[2][4] == pytest.approx(engine)
    assert totals[1][0] == totals[2][0] == max(totals[2].values())  # the first stage's engine GPU stays the worst


def test_hf_engine_replicas_each_hold_the_model_and_their_chunks_kv_cache():
    """rollout.engine=hf, replicas=3 on 3 GPUs: every rank's GPU holds the bf16 model and a KV cache for its
    chunk of whole prompts, ceil(8 / 3) = 3 prompts x n=4 = 12 rows (one engine: 32) of 1536 positions
    x 2 x 28 layers x 4 KV heads x 128 x 2 bytes."""
    rollout = {"engine": "hf", "max_new_tokens": 1024, "n": 4, "hf_decode": "dynamic", "replicas": 3}
    plan = make_plan(recipe(rollout=rollout), world_size=3, gpu_mem_gib=400)
    kv = 12 * 1536 * 2 * 28 * 4 * 128 * 2
    assert plan.gpu_engine == 2 * QWEN7B_PARAMS and plan.gpu_engine_kv == kv
    assert plan.staged == 0  # on a GPU job the staged update is host memory
    assert plan.total == pytest.approx(plan.static + max(plan.peak_activation.activations, kv) + 2 * QWEN7B_PARAMS
                                       + RESERVE_GIB * GIB)
    assert sorted(ranks for ranks, _, _ in plan.gpus) == [(0,), (1, 2)]  # rank 0; the leaders that stage
    one = make_plan(recipe(rollout={**rollout, "replicas": 1}), world_size=3, gpu_mem_gib=400)
    assert one.gpu_engine_kv == 32 * 1536 * 2 * 28 * 4 * 128 * 2
    assert "hf engine on rank 0's GPU" in format_plan(plan)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_staged_update_counts_in_a_cpu_ranks_memory(mode):
    """hardware.device=cpu, the hf engine, replicas=2 on 2 ranks: rank 1 holds its engine's copy of the model
    and stages each update whole (bf16) in the same host memory: one more phase beside the activations
    (sync: the larger counts), on top of them when generation overlaps training."""
    hw = {"device": "cpu", "gpus_per_node": 2, "gpu_memory_gib": 400}
    plan = make_plan(recipe(hardware=hw, rollout={"engine": "hf", "max_new_tokens": 1024, "replicas": 2,
                                                  "mode": mode}))
    staged = 2 * QWEN7B_PARAMS
    assert plan.rank == 1 and plan.staged == staged and plan.host_engine == staged
    act = plan.peak_activation.activations
    phases = max(act, staged) if mode == "sync" else act + staged
    assert plan.total == pytest.approx(plan.static + phases + staged + CPU_RESERVE_GIB * GIB)
    rank0 = {rank: total for _, rank, total in plan.gpus}[0]
    assert rank0 == pytest.approx(plan.total - phases + act)  # no staged update on rank 0
    assert f"staged update {staged / GIB:.1f}" in format_plan(plan)


def test_replica_layout_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"rollout.replicas=16 needs at least as many ranks; the world has 8.*"
                                          r"Fix: set rollout.replicas between 1 and 8"):
        make_plan(recipe(rollout={"engine": "hf", "replicas": 16}), world_size=8)
    # 3 replicas of 4 GPUs on 8: leaders 0, 2, 5 overlap
    with pytest.raises(ConfigError, match=r"rollout.replicas=3 with rollout.sglang.tp_size=4: .*\(0-3, 2-5, 5-8\), "
                                          r"which overlap or cross a node of 8 GPUs. Fix: choose rollout.replicas "
                                          r"from \[1, 2\]"):
        make_plan(recipe(rollout={"engine": "sglang", "replicas": 3, "sglang": {"tp_size": 4}}), world_size=8)
    # 2 nodes of 8: 3 replicas of 4 would start at ranks 0, 5, 10; 5-8 crosses into the second node
    two_nodes = {"nodes": 2, "gpus_per_node": 8}
    with pytest.raises(ConfigError, match=r"cross a node of 8 GPUs. Fix: choose rollout.replicas from \[1, 2, 4\]"):
        make_plan(recipe(hardware=two_nodes, rollout={"engine": "sglang", "replicas": 3, "sglang": {"tp_size": 4}}))
    assert make_plan(recipe(hardware=two_nodes, rollout={"engine": "sglang", "replicas": 4, "sglang": {
        "tp_size": 4}})).placement.engine_ranks == frozenset(range(16))


def test_context_parallelism_splits_activations_and_shards_the_optimizer_over_dp_x_cp():
    """The actor at cp=2 (dp=2 of 4 ranks, layer_spec local as CP needs): its layers' activations are those of
    half the tokens, and the distributed optimizer shards over dp x cp = 4 ranks, as at cp=1 (dp=4)."""
    model = {"path": "/nonexistent/Qwen2.5-7B-Instruct", "dtype": "bfloat16", "layer_spec": "local"}
    par = {"use_distributed_optimizer": True}
    plans = {cp: {r.role: r for r in make_plan(recipe(model=model, parallel=par, actor={
        "ppo_mini_batch_size": 8, "micro_batch_size": 1, "parallel": {"cp": cp}}), world_size=4).roles}
        for cp in (1, 2)}
    one, two = plans[1]["actor"], plans[2]["actor"]
    assert two.adam == pytest.approx(one.adam) and two.params == one.params
    assert two.activations < 0.75 * one.activations
    # activations(cp) = logits + layers / cp + gathered K/V (cp > 1): the K/V out of cp = 1, 2, 4 is each layer's
    # K and V of the whole micro-batch (28 layers, 4 KV heads of 128, 1536 tokens, bf16)
    four = {r.role: r for r in make_plan(recipe(model=model, parallel=par, actor={
        "ppo_mini_batch_size": 8, "micro_batch_size": 1, "parallel": {"cp": 4}}), world_size=4).roles}["actor"]
    kv = 2 * (two.activations - four.activations) - (one.activations - two.activations)
    assert kv == pytest.approx(28 * 2 * 1536 * 4 * 128 * 2)
    assert plans[2]["critic"].activations == pytest.approx(plans[1]["critic"].activations)
    assert "x cp 2 x dp 2" not in format_plan(make_plan(recipe(model=model, parallel={**par, "cp": 1}), world_size=4))
    assert "tp 1 x pp 1 x cp 2 x dp 2" in format_plan(make_plan(recipe(model=model, parallel={**par, "cp": 2}),
                                                                 world_size=4))
