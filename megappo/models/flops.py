"""Model FLOPs of a pass: the count MFU and the `perf/tflops/...` metrics divide by time.

Counted (matmuls only, 2 FLOPs per multiply-add, forward = 1x, backward = 2x the forward):

  per token          2 N_layers      N_layers: the decoder layers' matrices a token passes through
                                     (QKV, output projection, MLP; a MoE layer's router and its
                                     top-k experts, not all of them); norms, RoPE, softmax and
                                     the input embedding lookup are not counted
  per head position  2 N_head        N_head: the LM head, vocab x hidden (tied or not), or the
                                     value head (hidden); megappo runs the head only on the
                                     positions whose output is used (the response positions,
                                     or each sequence's last token), so it counts those
  per sequence       2 L A s^2       causal attention (QK^T and AV, 4 L A s^2 for the full
                                     s x s score matrix, half of it computed): s the sequence's
                                     tokens, L layers, A = heads x head dim; per token 2 L A s

Forward-only passes (log-probs, values) are those sums; a training pass (forward + backward)
is 3x: 6 N T + 6 N_head K + 6 L A sum(s^2) (6 L A s per token: the 12 L H s of PaLM's count,
halved for causal attention). Activation recomputation is not counted (model FLOPs, not
hardware FLOPs), nor is padding: T is the real tokens of the pass.

Shape legend: T real tokens of a pass, K head positions, s one sequence's tokens.

This module does not know about devices, timing, parallel layouts or PPO.
"""

from __future__ import annotations

from typing import Sequence

from megappo.models.hf_config import ModelDims


def layer_matmul_params(dims: ModelDims) -> float:
    """Weights of one decoder layer a token multiplies by, averaged over dense and MoE layers."""
    h, q, kv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_query_groups * dims.head_dim
    attention = h * (q + 2 * kv) + q * h
    dense_mlp = 3 * h * dims.ffn_hidden_size  # gate, up, down (SwiGLU)
    if not dims.is_moe:
        return attention + dense_mlp
    moe_mlp = dims.moe_topk * 3 * h * dims.moe_ffn_hidden_size + h * dims.num_experts  # top-k experts + router
    share = sum(dims.moe_layer_pattern) / dims.num_layers
    return attention + (1 - share) * dense_mlp + share * moe_mlp


def head_params(dims: ModelDims, *, value_head: bool) -> int:
    return dims.hidden_size if value_head else dims.vocab_size * dims.hidden_size


def pass_flops(dims: ModelDims, seq_lens: Sequence[int], head_positions: int, *, training: bool,
               value_head: bool = False) -> float:
    """FLOPs of one pass over sequences of `seq_lens` real tokens whose head runs on
    `head_positions` positions; `training`: forward + backward (3x the forward)."""
    tokens = sum(seq_lens)
    forward = (2 * dims.num_layers * layer_matmul_params(dims) * tokens
               + 2 * head_params(dims, value_head=value_head) * head_positions
               + 2 * dims.num_layers * dims.num_heads * dims.head_dim * sum(s * s for s in seq_lens))
    return 3 * forward if training else forward
