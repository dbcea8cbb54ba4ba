"""The Megatron <-> HF name map: pure tensor checks, no processes."""

import pytest
import torch

from megappo.models.hf_config import ModelConfigError, dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS
from megappo.models.name_map import (
    NAME_MAPS, canonical_name, global_layer_name, merge_tp_shards, name_map_for, shard_for_tp,
)


def _random_hf_state(nmap, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = nmap.dims
    shapes = {
        "model.embed_tokens.weight": (d.vocab_size, d.hidden_size),
        "lm_head.weight": (d.vocab_size, d.hidden_size),
        "model.norm.weight": (d.hidden_size,),
        "score.weight": (1, d.hidden_size),
        "score.bias": (1,),
    }
    for i in range(d.num_layers):
        h = f"model.layers.{i}"
        qd, kd = d.num_heads * d.head_dim, d.num_query_groups * d.head_dim
        shapes.update({
            f"{h}.input_layernorm.weight": (d.hidden_size,),
            f"{h}.post_attention_layernorm.weight": (d.hidden_size,),
            f"{h}.self_attn.q_proj.weight": (qd, d.hidden_size),
            f"{h}.self_attn.k_proj.weight": (kd, d.hidden_size),
            f"{h}.self_attn.v_proj.weight": (kd, d.hidden_size),
            f"{h}.self_attn.q_proj.bias": (qd,), f"{h}.self_attn.k_proj.bias": (kd,),
            f"{h}.self_attn.v_proj.bias": (kd,),
            f"{h}.self_attn.o_proj.weight": (d.hidden_size, qd),
            f"{h}.self_attn.q_norm.weight": (d.head_dim,), f"{h}.self_attn.k_norm.weight": (d.head_dim,),
            f"{h}.mlp.gate_proj.weight": (d.ffn_hidden_size, d.hidden_size),
            f"{h}.mlp.up_proj.weight": (d.ffn_hidden_size, d.hidden_size),
            f"{h}.mlp.down_proj.weight": (d.hidden_size, d.ffn_hidden_size),
        })
    needed = {n for r in nmap.rules() for n in r.hf}
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items() if n in needed}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("value_head", [False, True])
def test_round_trip_is_bit_exact(family, value_head):
    dims = dims_from_hf(TINY_CONFIGS[family])
    nmap = name_map_for(dims, padded_vocab=dims.padded_vocab_size(2), value_head=value_head, value_head_bias=True)
    hf = _random_hf_state(nmap)
    meg = nmap.hf_to_megatron(hf)
    assert meg["embedding.word_embeddings.weight"].shape[0] == 512  # 300 padded to 128 * tp
    assert torch.all(meg["embedding.word_embeddings.weight"][300:] == 0)
    back = nmap.megatron_to_hf(meg)
    assert set(back) == set(nmap.hf_names())
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name


def test_qkv_interleaving_per_query_group():
    # 4 heads in 2 query groups, head_dim 1, hidden 1: rows are labelled by value.
    cfg = dict(TINY_CONFIGS["llama"], hidden_size=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=1, intermediate_size=4, num_hidden_layers=1)
    dims = dims_from_hf(cfg)
    nmap = name_map_for(dims, padded_vocab=384)
    rule = nmap.rule("decoder.layers.0.self_attention.linear_qkv.weight")
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = rule.from_hf(q, k, v)
    # Megatron: for each group g, its query heads, then k_g, then v_g
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert [t.flatten().tolist() for t in rule.to_hf(fused)] == [[10, 11, 12, 13], [20, 21], [30, 31]]


def test_fc1_tp_shards_hold_gate_and_up_halves():
    dims = dims_from_hf(TINY_CONFIGS["llama"])
    nmap = name_map_for(dims, padded_vocab=384)
    rule = nmap.rule("decoder.layers.1.mlp.linear_fc1.weight")
    gate = torch.arange(8.0).reshape(8, 1)
    up = 100 + torch.arange(8.0).reshape(8, 1)
    full = rule.from_hf(gate, up)
    shards = [shard_for_tp(full, rule, r, 2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert torch.equal(merge_tp_shards(shards, rule), full)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_merge_round_trip_every_rule(tp):
    dims = dims_from_hf(TINY_CONFIGS["qwen2"])
    nmap = name_map_for(dims, padded_vocab=dims.padded_vocab_size(tp))
    meg = nmap.hf_to_megatron(_random_hf_state(nmap, seed=tp))
    for name, full in meg.items():
        rule = nmap.rule(name)
        shards = [shard_for_tp(full, rule, r, tp) for r in range(tp)]
        assert torch.equal(merge_tp_shards(shards, rule), full), name


def test_tied_output_layer_is_not_exported_twice():
    dims = dims_from_hf(TINY_CONFIGS["qwen2"])  # tie_word_embeddings=True
    nmap = name_map_for(dims, padded_vocab=384)
    assert "lm_head.weight" not in nmap.hf_names()
    assert nmap.rule("output_layer.weight").hf == ("model.embed_tokens.weight",)
    assert nmap.hf_names().count("model.embed_tokens.weight") == 1


def test_names_from_te_spec_and_wrappers_and_pipeline_offsets():
    assert canonical_name("module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.input_layernorm.weight"
    assert canonical_name("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.3.pre_mlp_layernorm.weight"
    assert global_layer_name("decoder.layers.1.mlp.linear_fc2.weight", 2) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert global_layer_name("decoder.final_layernorm.weight", 2) == "decoder.final_layernorm.weight"


def test_unknown_names_and_missing_tensors_are_clear():
    dims = dims_from_hf(TINY_CONFIGS["llama"])
    nmap = name_map_for(dims, padded_vocab=384)
    with pytest.raises(KeyError, match="no LlamaForCausalLM name-map rule"):
        nmap.rule("decoder.layers.0.self_attention.q_layernorm.weight")
    hf = _random_hf_state(nmap)
    del hf["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ModelConfigError, match="missing 1 tensor.*another model"):
        nmap.hf_to_megatron(hf)
    hf = _random_hf_state(nmap)
    hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"][:-1]
    with pytest.raises(ModelConfigError, match="299 rows but the config's vocab_size is 300"):
        nmap.hf_to_megatron(hf)


def test_registry_is_explicit():
    assert set(NAME_MAPS) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                              "MixtralForCausalLM"}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_round_trip_is_bit_exact_with_checkpoint_names(family):
    # the HF side is what save_pretrained writes: per-expert tensors (megappo.models.hf_experts)
    from megappo.models.hf_experts import checkpoint_state
    from megappo.models.hf_reference import build_hf_model

    dims = dims_from_hf(TINY_CONFIGS[family])
    nmap = name_map_for(dims, padded_vocab=dims.padded_vocab_size(1))
    hf = checkpoint_state(build_hf_model(TINY_CONFIGS[family], seed=1))
    assert set(nmap.hf_names()) == set(hf)
    meg = nmap.hf_to_megatron(hf)
    expert_rules = [r for r in nmap.rules() if r.expert]
    assert len(expert_rules) == 2 * dims.num_experts * sum(dims.moe_layer_pattern)
    back = nmap.megatron_to_hf(meg)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_moe_names_per_family_and_global_expert_index():
    q = name_map_for(dims_from_hf(TINY_CONFIGS["qwen3_moe"]), padded_vocab=384)
    rule = q.rule("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    assert rule.hf == ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight")
    assert rule.expert and rule.glu and rule.tp_dim == 0
    assert q.rule("decoder.layers.0.mlp.router.weight").hf == ("model.layers.0.mlp.gate.weight",)
    assert q.rule("decoder.layers.1.mlp.linear_fc1.weight").hf[0] == "model.layers.1.mlp.gate_proj.weight"  # dense
    m = name_map_for(dims_from_hf(TINY_CONFIGS["mixtral"]), padded_vocab=384)
    assert m.rule("decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight").hf == (
        "model.layers.2.block_sparse_moe.experts.1.w2.weight",)
    assert m.rule("decoder.layers.2.mlp.router.weight").hf == ("model.layers.2.block_sparse_moe.gate.weight",)
    # local expert 1 of EP rank 1 of 2 (4 experts) is global expert 3, on pipeline stage offset 2
    from megappo.models.name_map import global_param_name

    assert global_param_name("module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2, 2) == \
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
