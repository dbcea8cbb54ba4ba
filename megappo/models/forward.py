"""Micro-batched forward (and backward) through Megatron-Core's pipeline schedules.

`run_micro_batches(model, micro_batches, on_output, forward_only=...)` feeds a list of
micro-batches through `get_forward_backward_func()` (no pipelining, 1F1B, or interleaved
VPP, as the layout decides), so every pass in megappo works at any PP size. A micro-batch
is padded ([b, T] 'input_ids' with an 'attention_mask') or packed ([1, L] 'input_ids' with
'cu_seqlens' and 'position_ids': megappo.parallel.packing); packed sequences attend only
within themselves and start at position 0: Megatron-Core's THD format (PackedSeqParams with
cumulative sequence lengths), read by Transformer Engine's attention on GPUs and by
megappo.models.packed_attention (SDPA per sequence) in the local layer spec. With 'select'
[2, K] ((s, b) positions) only those positions reach the output layer: the LM head runs over
K positions, not b x T. On the last pipeline stage `on_output(output, micro_batch)` receives
the model output, [1, K, V_pad/tp] logits for LM roles or [1, K] values for value-head roles
([b, T, ...] without 'select'), and returns (loss, result): the loss is back-propagated as is (megappo's losses are already normalised by global
counts, so Megatron's own division by the number of micro-batches is switched off with
`calculate_per_token_loss`), the results are returned in micro-batch order on the last
stage and are an empty list elsewhere. With `head_input=True` (the chunked LM head,
megappo.models.lm_head) the output layer returns its input instead: `on_output` receives a
HeadInput of [1, K, H] hidden states and the output weight.

Under context parallelism (the model's layout has cp > 1; packed micro-batches only) each
micro-batch is split over the CP group (megappo.parallel.context: every sequence padded to a
multiple of 2 x cp and cut into load-balanced chunks, one padded length for the whole call): the
model runs on this rank's 1/cp of the tokens, its selected outputs are gathered back over the
group in the order of the whole micro-batch's selection, and `on_output` receives exactly what it
receives at CP=1, on every rank of the group.

Shape legend: b micro-batch size, T sequence length, L packed length (the shape is the same
for every micro-batch of a call; the p2p buffers are sized from it), K selected positions,
V_pad padded vocab, tp tensor-parallel size.

This module does not know about PPO losses or data sources.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from megappo.models.builders import MegatronModel, unwrap
from megappo.models.lm_head import HeadInput, head_inputs
from megappo.models.routing_replay import RouteReplay, replayed_routes
from megappo.parallel import context
from megappo.parallel.state import in_layout


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, T] 1 = token, 0 = padding -> Megatron's [b, 1, T, T] bool mask, True = masked.

    Keys that are padding and keys in the future are masked; a padding query row keeps
    its own diagonal so softmax stays finite (its output is ignored downstream).
    """
    b, t = attention_mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad_keys = ~attention_mask.bool()[:, None, None, :]
    mask = causal[None, None] | pad_keys
    eye = torch.eye(t, dtype=torch.bool, device=attention_mask.device)[None, None]
    return mask & ~eye


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, T] -> [b, T] positions counting real tokens only (HF's convention for left pad)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def gather_vocab_logits(logits: torch.Tensor, model: MegatronModel) -> torch.Tensor:
    """[..., V_pad/tp] last-stage logits -> [..., V] full, unpadded logits on every TP rank.

    Materialises the whole vocabulary: for verification and decoding checks only; training
    and log-probs use megappo.parallel.vocab_parallel instead.
    """
    import torch.distributed as dist

    ps = model.ps
    parts = [torch.empty_like(logits) for _ in range(ps.tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=-1)[..., : model.dims.vocab_size]


@in_layout
def run_micro_batches(
    model: MegatronModel,
    micro_batches: list[dict[str, torch.Tensor]],
    on_output: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, Any]],
    *,
    forward_only: bool,
    routing: RouteReplay | None = None,
    head_input: bool = False,
) -> list[Any]:
    """Run `micro_batches` (each with 'input_ids' [b, T] and optional 'attention_mask'
    [b, T]) through the pipeline schedule; see the module docstring. MoE routing records
    ('routes', 'routes_known') are replayed or compared as `routing` says
    (megappo.models.routing_replay). `head_input`: `on_output` receives the LM head's input, a
    megappo.models.lm_head.HeadInput ([1, K, H] hidden states and the [V_pad/tp, H] weight), not logits."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    b, t = micro_batches[0]["input_ids"].shape
    for mb in micro_batches:
        if tuple(mb["input_ids"].shape) != (b, t):
            raise ValueError("all micro-batches of one call must have the same [b, T] shape; pad them first")
    if model.ps.vpp and len(micro_batches) < model.ps.pp:
        raise ValueError(
            f"the interleaved (VPP) schedule needs at least pp={model.ps.pp} micro-batches per pass, "
            f"got {len(micro_batches)}; lower the micro-batch size or disable parallel.vpp"
        )
    device = model.ps.device
    value_head = model.has_value_head
    if model.ps.cp > 1:  # t: the padded length of the whole pack (Megatron's schedule divides it by cp)
        micro_batches, t = _split_over_context(model, micro_batches)

    def forward_step(data_iterator, chunk):
        # the whole micro-batch moves to the model's device: on_output combines its tensors with the output.
        # non_blocking: a blocking host-to-device copy waits for the GPU's queue to drain (one wait per tensor)
        host = next(data_iterator)
        mb = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        split = mb.get("context")
        if split is None:
            input_ids, inputs, select = mb["input_ids"], _model_inputs(model, mb, b, t, host), mb.get("select")
        else:
            input_ids, inputs, select = _context_inputs(model, mb, split)
        routes, known = _routes_of_this_rank(model, mb)
        with (_selected_outputs(chunk, select) as selected_early, replayed_routes(chunk, routes, known, routing),
              head_inputs(unwrap(chunk), head_input) as head):
            output = chunk(input_ids=input_ids, **inputs)

        def loss_func(output_tensor):
            out = output_tensor.squeeze(-1) if value_head else output_tensor
            if select is not None and not selected_early:
                out = out[select[1], select[0]][None]
            if split is not None:  # this rank's selected outputs -> the micro-batch's, on every CP rank
                out = context.gather_selected(out, split, model.ps.cp_group)
            if head_input:
                out = HeadInput(out, context.shared_use(head["weight"], model.ps.cp))
            loss, result = on_output(out, mb)
            return loss, torch.ones((), dtype=torch.int, device=device), result

        return output, loss_func

    chunks = model.chunks
    n_chunks = len(chunks)
    # Every virtual stage walks the same micro-batches, each with its own iterator.
    iterators = [iter(micro_batches) for _ in range(n_chunks)]
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if n_chunks > 1 else iterators[0],
        model=chunks if n_chunks > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=t,
        micro_batch_size=b,
        forward_only=forward_only,
    )
    return list(results) if model.ps.is_last_stage else []


def _model_inputs(model: MegatronModel, mb: dict[str, torch.Tensor], b: int, t: int,
                  host: dict[str, torch.Tensor]) -> dict[str, Any]:
    """position_ids, attention_mask and packed_seq_params of one micro-batch (`host`: the same micro-batch
    before its move to the device, where the longest sequence is read without a synchronization)."""
    if "cu_seqlens" in mb:  # packed: [1, L]
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, known = mb["cu_seqlens"], host["cu_seqlens"]
        longest = int((known[1:] - known[:-1]).max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return {"position_ids": mb["position_ids"], "attention_mask": None, "packed_seq_params": params}
    attn = mb.get("attention_mask")
    if attn is None:
        return {"position_ids": torch.arange(t, device=model.ps.device).unsqueeze(0).expand(b, t),
                "attention_mask": None}
    return {"position_ids": position_ids_from_mask(attn), "attention_mask": causal_padding_mask(attn)}


def _split_over_context(model: MegatronModel, micro_batches: list[dict]) -> tuple[list[dict], int]:
    """Each packed micro-batch with its ContextSplit ('context'; the caller's dicts are not changed),
    and their padded length Lp, the same for every micro-batch of the call (each rank holds Lp / cp)."""
    ps = model.ps
    if any("cu_seqlens" not in mb or "select" not in mb for mb in micro_batches):
        raise ValueError(f"context parallelism (cp={ps.cp}) splits packed micro-batches only; pack the role's "
                         "passes (<role>.packing=true)")
    assert not any("routes" in mb for mb in micro_batches), "MoE routing records with context parallelism"
    bounds = [mb["cu_seqlens"].tolist() for mb in micro_batches]
    length = context.pass_length(bounds, ps.cp, ps.tp if model.config.sequence_parallel else 1)
    return [{**mb, "context": context.split(b, mb["select"][0], ps.cp, length)}
            for mb, b in zip(micro_batches, bounds)], length


def _context_inputs(model: MegatronModel, mb: dict, split: context.ContextSplit
                    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(this CP rank's [1, Lp/cp] tokens, their model inputs, [2, Kmax] their selected positions)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    ps = model.ps
    ids = split.local_input_ids(mb["input_ids"], ps.cp_rank)
    cu = split.cu_seqlens.to(ps.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=split.longest,
                             max_seqlen_kv=split.longest)
    positions = context.local_positions(cu, ps.cp, ps.cp_rank, ids.shape[1])[None]
    inputs = {"position_ids": positions, "attention_mask": None, "packed_seq_params": params}
    return ids, inputs, split.local_select(ps.cp_rank).to(ps.device)


def _routes_of_this_rank(model: MegatronModel, mb: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The micro-batch's routing record for the tokens this rank's routers see: all of them,
    or this TP rank's share under sequence parallelism."""
    routes, known = mb.get("routes"), mb.get("routes_known")
    if routes is None or not model.config.sequence_parallel:
        return routes, known
    ps = model.ps
    return routes.chunk(ps.tp)[ps.tp_rank], known.chunk(ps.tp)[ps.tp_rank]


@contextlib.contextmanager
def _selected_outputs(chunk: torch.nn.Module, select: torch.Tensor | None):
    """Feed only the `select` [2, K] (s, b) positions of the final hidden states [s, b, h] to the
    last stage's output layer (a forward pre-hook, removed on exit); yields whether it did.
    Not under sequence parallelism (the hidden states are split over TP there): the caller
    selects from the full output instead."""
    module = unwrap(chunk)
    layer = getattr(module, "output_layer", None) if getattr(module, "post_process", False) else None
    if select is None or layer is None or getattr(layer, "sequence_parallel", False):
        yield False
        return

    def only_selected(_, args, kwargs):
        hidden = args[0]
        return (hidden[select[0], select[1]].unsqueeze(1), *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(only_selected, with_kwargs=True)
    try:
        yield True
    finally:
        handle.remove()

