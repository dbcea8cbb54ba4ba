"""torchrun worker: activation recomputation changes no gradient.

usage: torchrun --nproc_per_node 2 recompute_worker.py TP PP   (DP = 2 / (TP*PP))

A tiny Llama actor (4 layers) and critic take one real PPO update (PolicyWorker.update /
ValueWorker.update: Megatron's pipeline schedule, DDP, the clipped loss with a KL term and an
entropy bonus) on the same experience, packed (token budget 20, the THD path through
megappo.models.packed_attention) and padded (2 rows per micro-batch), once without recomputation
and once with each setting of megappo.models.recompute that runs on CPU: full uniform (1 and 2
layers per checkpoint), full block (1 layer), selective core_attn + mlp. Every parameter's
gradient (the DDP main_grad, after the DP reduction) and the step's metrics must be bit-equal
(torch.equal) to those without recomputation, in float32 and (full uniform, selective; packed) in bf16:
recomputation re-runs the same CPU kernels on the same inputs with the RNG state restored
(Megatron's CheckpointFunction), and the backward consumes the rebuilt tensors in the same order.
Prints "OK <check>" lines; any failure raises.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.recompute import NO_RECOMPUTE, Recompute
from megappo.models.training import OptimSettings, make_trainable
from megappo.models.weights import load_hf_weights
from megappo.parallel.packing import MicroBatching
from megappo.parallel.state import init_parallel
from megappo.trainer.roles import Experience, PolicyWorker, ValueWorker
from packing_worker import N, R, make_seqs  # the same 8 sequences of mixed prompt and response lengths

SETTINGS = {
    "full uniform 1": Recompute("full"),
    "full uniform 2": Recompute("full", num_layers=2),
    "full block 1": Recompute("full", method="block", num_layers=1),
    "selective core_attn+mlp": Recompute("selective", modules=("core_attn", "mlp")),
}
BF16 = ("full uniform 1", "selective core_attn+mlp")


def make_experience(vocab: int) -> Experience:
    seqs = make_seqs(vocab)
    gen = torch.Generator().manual_seed(1)
    mask = seqs.response_mask.float()
    lp = -5.0 + 0.1 * torch.randn(N, R, generator=gen)
    return Experience(seqs=seqs, old_log_probs=lp * mask, advantages=torch.randn(N, R, generator=gen) * mask,
                      ref_log_probs=(lp + 0.05 * torch.randn(N, R, generator=gen)) * mask,
                      values=torch.randn(N, R, generator=gen) * mask, returns=torch.randn(N, R, generator=gen) * mask)


def update(ps, dims, weights, exp, batching, recompute: Recompute, dtype: str):
    """One actor and one critic update; (metrics, every main_grad) of both."""
    settings = OptimSettings(lr=1e-4, clip_grad=1e6, total_steps=10)
    actor = build_model(dims, ps, role="actor", dtype=dtype, recompute=recompute)
    load_hf_weights(actor, weights["actor"])
    critic = build_model(dims, ps, role="critic", dtype=dtype, recompute=recompute)
    load_hf_weights(critic, weights["critic"])
    a = PolicyWorker(actor, batching=batching, temperature=0.7, trainable=make_trainable(actor, settings))
    c = ValueWorker(critic, batching=batching, trainable=make_trainable(critic, settings))
    metrics = a.update(exp, mini_batch_size=N, epochs=1, loss_mode="vanilla",
                       loss_knobs=dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
                       loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                       kl_loss_type="low_var_kl", seed=3)
    metrics.update(c.update(exp, mini_batch_size=N, epochs=1, cliprange_value=0.2, loss_agg_mode="token-mean", seed=3))
    grads = [p.main_grad.detach().clone() for m in (actor, critic) for chunk in m.chunks for p in chunk.parameters()]
    return metrics, grads


def main():
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    ps = init_parallel(tp=tp, pp=pp)
    cfg = TINY_CONFIGS["llama"]
    dims = dims_from_hf(cfg)
    weights = {"actor": build_hf_model(cfg, seed=5).state_dict(),
               "critic": build_hf_model(cfg, seed=11, head="token").state_dict()}
    exp = make_experience(dims.vocab_size)
    batchings = {"packed": MicroBatching(packed=True, max_tokens=20),
                 "padded": MicroBatching(packed=False, micro_batch_size=2)}
    for dtype in ("float32", "bfloat16"):
        for kind, batching in batchings.items():
            if dtype == "bfloat16" and kind == "padded":  # CI time: bf16 packed only (the path every recipe runs)
                continue
            base_metrics, base_grads = update(ps, dims, weights, exp, batching, NO_RECOMPUTE, dtype)
            assert any(g.abs().max() > 0 for g in base_grads), "no gradient"
            for name, recompute in SETTINGS.items():
                if dtype == "bfloat16" and name not in BF16:
                    continue
                metrics, grads = update(ps, dims, weights, exp, batching, recompute, dtype)
                differ = [i for i, (g, b) in enumerate(zip(grads, base_grads)) if not torch.equal(g, b)]
                assert not differ, (f"{dtype} {kind} {name}: gradients {differ} differ from no recomputation by "
                                    f"{max((grads[i] - base_grads[i]).abs().max().item() for i in differ):.2e}")
                bad = {k: (v, base_metrics[k]) for k, v in metrics.items() if v != base_metrics[k]}
                assert not bad, f"{dtype} {kind} {name}: metrics differ {bad}"
                if ps.rank == 0:
                    print(f"OK {dtype} {kind} {name}: {len(grads)} gradients and {len(metrics)} metrics bit-equal "
                          f"to no recomputation", flush=True)
    dist.barrier()
    if ps.rank == 0:
        print(f"ALL OK tp={tp} pp={pp} dp={ps.dp}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
