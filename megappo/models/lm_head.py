"""The chunked LM head's model side: the output layer's input instead of its logits.

With `model.lm_head_chunk_tokens` > 0 the policy passes (log-probs, entropy, the actor's loss)
do not let Megatron's output layer (a ColumnParallelLinear over the vocabulary) build the
[K, V_pad/tp] logits. Inside `head_inputs(chunk)` the last stage's output layer returns, in place
of its logits, the hidden states it would have multiplied, after the same tensor-parallel mapping
ColumnParallelLinear applies to its input (Megatron's own functions):
  sequence parallel: gather_from_sequence_parallel_region (all-gather of the [S/tp, B, H] split;
                     backward: reduce-scatter of the partial input gradients)
  tp > 1 otherwise:  copy_to_tensor_model_parallel_region (backward: all-reduce over TP)
  tp = 1:            the input itself
(with a guard that hands Megatron's mappings a contiguous gradient: `_ContiguousGrad`)
and GPTModel returns them as [B, S, H] (or [1, K, H] with megappo.models.forward's selection).
The weight the layer would have used (its own, or the tied embedding's that GPTModel passes as
`weight=`) is kept beside them: `HeadInput(hidden, weight)` is what `on_output` receives.
megappo.parallel.chunked_head then computes the log-probs and entropy chunk by chunk from them.

Megatron's GPT output layer has no bias (GPTModel builds it with bias=False); a layer with one
is refused. This module does not know about PPO, losses or data.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch


@dataclasses.dataclass
class HeadInput:
    """What the output layer would have computed logits from: hidden [.., H] and its weight [V_pad/tp, H]."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def __getitem__(self, index) -> "HeadInput":
        return HeadInput(self.hidden[index], self.weight)


def tp_mapped_input(hidden: torch.Tensor, *, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """The output layer's input after ColumnParallelLinear's input mapping (see the module docstring)."""
    from megatron.core.tensor_parallel import mappings

    if tp_group is None or torch.distributed.get_world_size(tp_group) == 1:
        return hidden
    if sequence_parallel:
        mapped = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                               group=tp_group)
    else:
        mapped = mappings.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    return _ContiguousGrad.apply(mapped)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. Megatron's `_reduce` (the backward of
    copy_to_tensor_model_parallel_region) all-reduces `grad.contiguous()` and returns `grad`: a
    non-contiguous gradient (e.g. through GPTModel's [S, B] -> [B, S] transpose with B > 1) would
    silently not be summed over TP. ColumnParallelLinear does not meet this: its all-reduce runs on
    the gradient its own matmul makes."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@contextlib.contextmanager
def head_inputs(module: torch.nn.Module, on: bool):
    """Within: `module`'s (an unwrapped GPTModel on the last stage) output layer returns its mapped
    input, not logits, and `taken` (yielded) holds the weight it was given. Off, or on a stage
    without an output layer: nothing changes."""
    layer = getattr(module, "output_layer", None) if getattr(module, "post_process", False) else None
    taken: dict[str, torch.Tensor] = {}
    if not on or layer is None:
        yield taken
        return
    if getattr(layer, "bias", None) is not None:
        raise NotImplementedError("the chunked LM head does not apply an output-layer bias (GPT's has none)")

    def mapped_input(hidden, weight=None, runtime_gather_output=None):
        taken["weight"] = layer.weight if weight is None else weight
        return tp_mapped_input(hidden, sequence_parallel=layer.sequence_parallel, tp_group=layer.tp_group), None

    layer.forward = mapped_input  # an instance attribute: nn.Module.__call__ (and its pre-hooks) call it
    try:
        yield taken
    finally:
        del layer.forward
