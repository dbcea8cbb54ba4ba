"""torchrun worker (2 ranks, gloo): the chunked LM head against today's path at TP=2.

Today's path: Megatron's ColumnParallelLinear (the GPT output layer: vocabulary split over TP, no
bias, gather_output=False; with sequence parallelism its [S/tp, B, H] input is all-gathered) builds
the [S, B, V_pad/tp] logits, PolicyWorker._scaled's temperature and padding mask, then
megappo.parallel.vocab_parallel. Chunked: megappo.models.lm_head.tp_mapped_input (Megatron's
mappings, as the layer applies them) and megappo.parallel.chunked_head over token chunks that do
not divide the S x B tokens. Both start from the same weights and the same hidden states (every
rank holds the full [S, B, H]; under SP each rank feeds its S/tp slice).

Compared, on every rank: log-probs and entropy, the gradient of a weighted sum of both wrt the
layer's input (the rank's slice under SP) and wrt the rank's weight shard; float32 within 1e-5
(gradients relative to the largest of the tensor, at least 1), bfloat16 within
COMPARE_TOL["bfloat16"] the same way. The vocabulary has padding rows (37 ids in 40 rows, rank 1's
last 3 rows are padding) whose gradient must be 0. Prints "OK ..." lines.
"""

import contextlib

import torch
import torch.distributed as dist

from megappo.models.lm_head import tp_mapped_input
from megappo.models.precision import COMPARE_TOL
from megappo.parallel.chunked_head import chunked_head_log_probs_and_entropy
from megappo.parallel.state import destroy_parallel, init_parallel
from megappo.parallel.vocab_parallel import vocab_parallel_log_probs_and_entropy

S, B, H, V_PAD, V = 10, 3, 16, 40, 37  # 30 tokens


def output_layer(dt, sp, w_full, group, tp, rank):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=dt,
                                 use_cpu_initialization=True, perform_initialization=False)
    layer = ColumnParallelLinear(H, V_PAD, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                 gather_output=False, skip_bias_add=False, tp_group=group)
    per = V_PAD // tp
    layer.weight.data.copy_(w_full[rank * per:(rank + 1) * per])
    return layer


def today(layer, x, labels, temperature, rank):
    logits, _ = layer(x)  # [S, B, V_pad/tp]
    logits = logits.transpose(0, 1)  # [B, S, V_pad/tp], as GPTModel returns them
    if temperature != 1.0:
        logits = logits.float() / temperature
    per = layer.weight.shape[0]
    pad = torch.arange(rank * per, (rank + 1) * per) >= V
    if pad.any():
        logits = logits.masked_fill(pad, float("-inf"))
    return vocab_parallel_log_probs_and_entropy(logits, labels, layer.tp_group)


def chunked(layer, x, labels, temperature, chunk):
    hidden = tp_mapped_input(x, sequence_parallel=layer.sequence_parallel, tp_group=layer.tp_group)  # [S, B, H]
    flat = hidden.transpose(0, 1).reshape(B * S, H)
    lp, ent = chunked_head_log_probs_and_entropy(flat, layer.weight, labels.reshape(-1), layer.tp_group,
                                                 temperature=temperature, vocab_size=V, chunk_tokens=chunk)
    return lp.view(B, S), ent.view(B, S)


@contextlib.contextmanager
def cpu_device_in_backward():
    """ColumnParallelLinear's sequence-parallel backward allocates on torch.cuda.current_device(),
    which megappo.parallel.cpu_compat maps to the CPU only inside its torch-function mode, and autograd
    does not carry that mode into backward (its patch 7): for the reference's backward here, the
    current device is the CPU itself."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def main():
    ps = init_parallel(tp=2, pp=1)
    group, rank = ps.tp_group, ps.tp_rank
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(S, B, H, generator=gen) * 2
    w_full = torch.randn(V_PAD, H, generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    w_lp, w_ent = torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)
    for dtype, tol in (("float32", 1e-5), ("bfloat16", COMPARE_TOL["bfloat16"])):
        dt = getattr(torch, dtype)
        for sp in (False, True):
            for temperature in (1.0, 0.7):
                for chunk in (7, 4, 1000):
                    outs = []
                    for fn in (lambda l, x: today(l, x, labels, temperature, rank),
                               lambda l, x: chunked(l, x, labels, temperature, chunk)):
                        layer = output_layer(dt, sp, w_full.to(dt), group, ps.tp, rank)
                        x = (full.chunk(ps.tp)[rank] if sp else full).to(dt).clone().requires_grad_()
                        lp, ent = fn(layer, x)
                        with cpu_device_in_backward():
                            ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
                        outs.append((lp.detach(), ent.detach(), x.grad, layer.weight.grad))
                    (lp0, ent0, gx0, gw0), (lp1, ent1, gx1, gw1) = outs
                    case = f"{dtype} sp={sp} T={temperature} chunk={chunk}"
                    diffs = {"lp": (lp1 - lp0).abs().max().item(), "ent": (ent1 - ent0).abs().max().item()}
                    for name, a, b in (("grad x", gx1, gx0), ("grad W", gw1, gw0)):
                        assert a.dtype == b.dtype == dt and a.shape == b.shape, (case, name, a.dtype, a.shape, b.shape)
                        diffs[name] = (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())
                    bad = {k: v for k, v in diffs.items() if not v <= tol}
                    assert not bad, f"{case}: {bad} > {tol}"
                    if rank == 1:
                        assert gw1[-(V_PAD - V):].abs().max() == 0 and gw0[-(V_PAD - V):].abs().max() == 0
                    print(f"OK rank {ps.rank} {case} {({k: float('%.1e' % v) for k, v in diffs.items()})}", flush=True)
    dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
