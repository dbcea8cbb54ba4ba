"""HF config -> ModelDims and layout validation."""

import pytest

from megappo.models.hf_config import ModelConfigError, dims_from_hf, transformer_config
from megappo.models.hf_reference import TINY_CONFIGS, hf_config_object


def test_llama_and_qwen2_dims():
    llama = dims_from_hf(TINY_CONFIGS["llama"])
    assert (llama.num_heads, llama.num_query_groups, llama.head_dim) == (4, 2, 16)
    assert not llama.qkv_bias and not llama.tie_word_embeddings
    qwen = dims_from_hf(TINY_CONFIGS["qwen2"])
    assert qwen.qkv_bias and qwen.tie_word_embeddings and qwen.rope_theta == 1e6
    assert qwen.padded_vocab_size(tp=2) == 512 and qwen.padded_vocab_size(tp=1, divisible_by=64) == 320


def test_qwen3_dims_and_transformer_config():
    qwen3 = dims_from_hf(TINY_CONFIGS["qwen3"])
    assert qwen3.qk_layernorm and not qwen3.qkv_bias and qwen3.head_dim == 32 != 64 // 4
    assert transformer_config(qwen3).qk_layernorm and transformer_config(qwen3).kv_channels == 32
    assert not dims_from_hf(TINY_CONFIGS["llama"]).qk_layernorm
    with pytest.raises(ModelConfigError, match="Qwen3ForCausalLM with attention_bias=True is not supported"):
        dims_from_hf(dict(TINY_CONFIGS["qwen3"], attention_bias=True))


def test_transformers_config_object_and_rope_parameters():
    # transformers >= 5 stores rope_theta under rope_parameters
    cfg = hf_config_object(dict(TINY_CONFIGS["llama"], rope_theta=500000.0))
    assert dims_from_hf(cfg, arch="LlamaForCausalLM").rope_theta == 500000.0


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_config_json_as_transformers_writes_it(family, tmp_path):
    """A config.json saved by transformers >= 5 (rope_parameters; Qwen3-MoE's num_experts as
    num_local_experts) reads as the same dims as the Hub-style dict."""
    hf_config_object(TINY_CONFIGS[family]).save_pretrained(tmp_path)
    assert dims_from_hf(str(tmp_path)) == dims_from_hf(TINY_CONFIGS[family])


def test_llama31_rope_scaling():
    cfg = dict(TINY_CONFIGS["llama"], rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert dims_from_hf(cfg).rope_scaling_factor == 8.0
    cfg["rope_scaling"]["rope_type"] = "yarn"
    with pytest.raises(ModelConfigError, match="rope_type 'yarn' is not supported"):
        dims_from_hf(cfg)


def test_unknown_architecture_names_the_registry():
    with pytest.raises(ModelConfigError, match="not in megappo's registry.*LlamaForCausalLM"):
        dims_from_hf(dict(TINY_CONFIGS["llama"], architectures=["MistralForCausalLM"]))


def test_missing_field():
    cfg = dict(TINY_CONFIGS["llama"])
    del cfg["hidden_size"]
    with pytest.raises(ModelConfigError, match="missing 'hidden_size'"):
        dims_from_hf(cfg)


@pytest.mark.parametrize("tp,pp,needle", [
    (4, 1, "num_key_value_heads=2 is not divisible by tp=4"),
    (3, 1, "num_attention_heads=4 is not divisible by tp=3"),
    (1, 3, "num_hidden_layers=4 is not divisible by pp=3"),
])
def test_layout_that_does_not_divide(tp, pp, needle):
    dims = dims_from_hf(TINY_CONFIGS["llama"])
    with pytest.raises(ModelConfigError) as e:
        dims.check_layout(tp, pp)
    assert needle in str(e.value) and "Fix: choose parallel.tp from [1, 2]" in str(e.value)


def test_world_size_not_multiple_of_tp_pp():
    from megappo.parallel.state import ParallelConfigError, check_layout

    assert check_layout(8, 2, 2) == 2
    with pytest.raises(ParallelConfigError, match="world size 6 is not a multiple of tp\\*pp = 2\\*2"):
        check_layout(6, 2, 2)


def test_moe_dims_per_family():
    q = dims_from_hf(TINY_CONFIGS["qwen3_moe"])
    assert (q.num_experts, q.moe_topk, q.moe_ffn_hidden_size, q.ffn_hidden_size) == (4, 2, 32, 96)
    assert q.moe_layer_pattern == (1, 0, 1, 1) and not q.moe_norm_topk_prob and q.qk_layernorm
    assert q.moe_aux_loss_coef == 0.001
    step2 = dims_from_hf(dict(TINY_CONFIGS["qwen3_moe"], mlp_only_layers=[], decoder_sparse_step=2))
    assert step2.moe_layer_pattern == (0, 1, 0, 1)  # transformers: MoE iff (i + 1) % step == 0
    m = dims_from_hf(TINY_CONFIGS["mixtral"])
    assert m.moe_layer_pattern == (1, 1, 1, 1) and m.moe_norm_topk_prob and not m.qk_layernorm
    assert not dims_from_hf(TINY_CONFIGS["llama"]).is_moe


def test_moe_router_settings():
    # Qwen3-MoE without norm_topk_prob: softmax over all experts, then top-k (pre-softmax)
    qc = transformer_config(dims_from_hf(TINY_CONFIGS["qwen3_moe"]))
    assert qc.moe_router_pre_softmax and qc.moe_router_topk == 2 and qc.moe_layer_freq == [1, 0, 1, 1]
    assert qc.moe_expert_capacity_factor is None and qc.moe_aux_loss_coeff == 0.001
    assert qc.moe_router_load_balancing_type == "aux_loss" and qc.moe_token_dispatcher_type == "alltoall"
    # Mixtral (and norm_topk_prob): softmax over the top-k logits == renormalised top-k
    assert not transformer_config(dims_from_hf(TINY_CONFIGS["mixtral"])).moe_router_pre_softmax
    normed = dims_from_hf(dict(TINY_CONFIGS["qwen3_moe"], norm_topk_prob=True))
    assert not transformer_config(normed).moe_router_pre_softmax
    # routing replay (issue 16 item 3) stays passable
    assert transformer_config(normed, moe_enable_routing_replay=True).moe_enable_routing_replay


def test_moe_layout_errors_name_the_fix():
    q = dims_from_hf(TINY_CONFIGS["qwen3_moe"])
    with pytest.raises(ModelConfigError, match=r"num_experts=4 is not divisible by parallel.ep=3. Fix: choose "
                                               r"parallel.ep from \[1, 2, 4\]"):
        q.check_layout(1, 1, ep=3)
    with pytest.raises(ModelConfigError, match="parallel.ep=2 needs a mixture-of-experts model.*Fix: set parallel.ep=1"):
        dims_from_hf(TINY_CONFIGS["llama"]).check_layout(1, 1, ep=2)
    with pytest.raises(ModelConfigError, match="shared experts are not supported"):
        dims_from_hf(dict(TINY_CONFIGS["qwen3_moe"], shared_expert_intermediate_size=64))
    with pytest.raises(ModelConfigError, match="sliding-window attention is not supported"):
        dims_from_hf(dict(TINY_CONFIGS["mixtral"], sliding_window=128))
