"""Model FLOPs (megappo.models.flops) against counts worked out by hand, and the FLOP-rate / MFU /
peak-memory helpers (megappo.metrics.perf) on CPU."""

import pytest
import torch

from megappo.metrics import perf
from megappo.models.flops import layer_matmul_params, pass_flops
from megappo.models.hf_config import ModelDims
from megappo.plan.planner import layer_params

# L=2 layers, H=8, 2 query heads and 1 query group of head dim 4, ffn 16, vocab 10
DIMS = ModelDims(arch="LlamaForCausalLM", num_layers=2, hidden_size=8, num_heads=2, num_query_groups=1, head_dim=4,
                 ffn_hidden_size=16, vocab_size=10, max_position_embeddings=64, rope_theta=10000.0,
                 rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=False)


def test_layer_params_by_hand():
    # q 8x8, k and v 8x4 each, o 8x8 = 192; gate, up, down 8x16 each = 384
    assert layer_matmul_params(DIMS) == 192 + 384
    # the planner's count is the same plus the two norms (2 x 8)
    assert layer_params(DIMS, 1) == layer_matmul_params(DIMS) + 16


def test_pass_flops_by_hand():
    lens, heads = [3, 5], 4  # 8 tokens; the LM head on 4 response positions
    layers = 2 * 2 * 576 * 8  # 2 FLOPs x L x layer params x T = 18432
    head = 2 * (10 * 8) * 4  # 2 x V H x K = 640
    attention = 2 * 2 * (2 * 4) * (3 * 3 + 5 * 5)  # 2 x L x heads*d x sum s^2 (causal half) = 1088
    assert pass_flops(DIMS, lens, heads, training=False) == layers + head + attention == 20160
    assert pass_flops(DIMS, lens, heads, training=True) == 3 * 20160  # forward + backward (2x)
    # a value head: hidden x 1 instead of the vocabulary
    assert pass_flops(DIMS, lens, heads, training=False, value_head=True) == layers + 2 * 8 * 4 + attention


def test_moe_counts_the_top_k_experts_and_the_router():
    moe = ModelDims(**{**DIMS.__dict__, "num_experts": 4, "moe_topk": 2, "moe_ffn_hidden_size": 6,
                       "moe_layer_pattern": (1, 0)})
    # layer 0: attention 192 + 2 experts x 3 x 8 x 6 (288) + router 8 x 4 (32); layer 1 dense: 192 + 384
    assert layer_matmul_params(moe) == pytest.approx(((192 + 288 + 32) + (192 + 384)) / 2)
    assert layer_params(moe, 1, active=True) == pytest.approx(layer_matmul_params(moe) + 16)


def test_peak_table_and_override():
    assert perf.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert perf.peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert perf.peak_tflops("NVIDIA H200", "bfloat16") == 989.0
    assert perf.peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert perf.peak_tflops("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert perf.device_peak_tflops(torch.device("cpu"), "float32") is None
    assert perf.device_peak_tflops(torch.device("cpu"), "float32", override=123.0) == 123.0


def test_flop_rate_metrics():
    stages = {"actor": (6e12, 2.0), "ref": (1e12, 0.5), "values": (0.0, 1.0)}
    out = perf.flop_rate_metrics(stages, world_size=2, peak=None)  # CPU: no peak, no MFU
    assert out == {"perf/tflops/actor": 1.5, "perf/tflops/ref": 1.0}
    out = perf.flop_rate_metrics(stages, world_size=2, peak=3.0)
    assert out["perf/mfu/actor"] == pytest.approx(0.5) and out["perf/mfu/ref"] == pytest.approx(1 / 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour: no CUDA memory metrics")
def test_peak_memory_records_nothing_on_cpu():
    m = {}
    with perf.peak_memory(m, "gen"):
        torch.zeros(1000)
    assert m == {}


@pytest.mark.gpu
def test_peak_memory_per_stage_and_nested_on_gpu():
    m = {}
    torch.zeros(1, device="cuda")
    with perf.peak_memory(m, "adv"):
        big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB, before the nested stage
        del big
        with perf.peak_memory(m, "reward"):
            small = torch.empty(16 * 2**20, dtype=torch.uint8, device="cuda")
            del small
    assert m["perf/max_memory_allocated_gb/reward"] < 0.2
    assert m["perf/max_memory_allocated_gb/adv"] >= 0.25  # the reset inside did not lose it
    assert m["perf/max_memory_allocated_gb"] == m["perf/max_memory_allocated_gb/adv"]
