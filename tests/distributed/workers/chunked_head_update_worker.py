"""torchrun worker (2 ranks, gloo): the actor with the chunked LM head on against off.

usage: torchrun --nproc_per_node 2 chunked_head_update_worker.py TP PP [bf16]

On the tiny Llama (untied output layer) and Qwen2 (tied embeddings: the head's weight is the
embedding's, whose gradient adds both uses) test models of packing_worker.py (vocabulary 300,
padded to 512 at TP2: rank 1's shard is mostly padding), two actors from the same weights, one
with PolicyWorker(lm_head_chunk_tokens=5) (chunks that do not divide the micro-batches' tokens),
one without:
  1. token_stats: log-probs, entropy and sum of p^2 (temperature 0.7, packed micro-batches);
  2. two PPO updates (two mini-batches, entropy bonus and KL loss): every loss metric and the
     gradient norm, every parameter's main_grad after the last step (Megatron's DDP buffer: the
     weight gradient reached it), and every weight after the steps;
  3. both again for a LoRA actor (llama, float32) whose LM head trains fully (modules_to_save).
float32 within TOL (values: absolute; gradients and weights: relative to the tensor's largest,
at least 1); bfloat16 within COMPARE_TOL["bfloat16"] the same way. Prints "OK ..." lines.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.lora import NO_LORA, LoRA
from megappo.models.precision import COMPARE_TOL
from megappo.models.training import OptimSettings, make_trainable
from megappo.models.weights import load_hf_weights
from megappo.parallel.packing import MicroBatching
from megappo.parallel.state import init_parallel
from megappo.trainer import roles as workers_module
from megappo.trainer.roles import Experience, PolicyWorker
from tests.distributed.workers.packing_worker import N, R, TEMP, VANILLA, make_seqs, reference_log_probs

TOL = 1e-5
CHUNK = 5


def actor_pair(ps, dims, hf, dtype, settings, lora=NO_LORA):
    out = {}
    for chunk in (0, CHUNK):
        model = build_model(dims, ps, role="actor", dtype=dtype, lora=lora)
        load_hf_weights(model, hf.state_dict())
        batching = MicroBatching(packed=True, max_tokens=20, micro_batch_multiple=ps.pp)
        out[chunk] = PolicyWorker(model, batching=batching, temperature=TEMP, lm_head_chunk_tokens=chunk,
                                  trainable=make_trainable(model, settings) if settings else None)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())


def check(ps, family: str, dtype: str, lora=NO_LORA) -> None:
    tol = TOL if dtype == "float32" else COMPARE_TOL["bfloat16"]
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    seqs = make_seqs(dims.vocab_size)
    hf = build_hf_model(cfg, seed=5)

    name = f"{family} {dtype}" + (" lora" if lora.enabled else "")
    stats = {c: w.token_stats(seqs, entropy=True, sum_pi_squared=True)
             for c, w in actor_pair(ps, dims, hf, dtype, None, lora).items()}
    if ps.rank == 0:
        d = {k: (getattr(stats[CHUNK], k) - getattr(stats[0], k)).abs().max().item()
             for k in ("log_probs", "entropy", "sum_pi_squared")}
        assert all(v <= tol for v in d.values()), f"{name} token stats: {d} > {tol}"
        print(f"OK {name} token stats chunked = full logits {({k: float('%.1e' % v) for k, v in d.items()})}",
              flush=True)

    ref_lp, _, _ = reference_log_probs(hf, seqs)
    mask = seqs.response_mask.float()
    gen = torch.Generator().manual_seed(1)
    exp = Experience(seqs=seqs, old_log_probs=(ref_lp + 0.05 * torch.randn(N, R, generator=gen)) * mask,
                     advantages=torch.randn(N, R, generator=gen) * mask, ref_log_probs=ref_lp * mask)
    workers = actor_pair(ps, dims, hf, dtype, OptimSettings(lr=1e-4, clip_grad=1e6, total_steps=100), lora)
    metrics = {c: w.update(exp, mini_batch_size=N // 2, epochs=1, loss_mode="vanilla", loss_knobs=VANILLA,
                           loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                           kl_loss_type="low_var_kl", seed=3) for c, w in workers.items()}
    if ps.rank == 0:
        for key, want in metrics[0].items():
            if key.endswith(("/lr", "skipped_steps")):
                continue
            diff = abs(metrics[CHUNK][key] - want)
            assert diff <= tol * max(1.0, abs(want)), f"{name} {key}: chunked {metrics[CHUNK][key]} vs {want}"
    worst = {"main_grad": 0.0, "weights": 0.0}
    params = {c: [(n, p) for chunk in w.model.chunks for n, p in chunk.named_parameters()] for c, w in workers.items()}
    assert len(params[0]) == len(params[CHUNK])
    for (pname, a), (_, b) in zip(params[CHUNK], params[0]):
        if not a.requires_grad:  # LoRA's frozen base
            assert torch.equal(a, b), pname
            continue
        for kind, x, y in (("main_grad", a.main_grad, b.main_grad), ("weights", a.detach(), b.detach())):
            diff = rel(x, y)
            assert diff <= tol, f"{name} {kind} of {pname}: {diff} > {tol}"
            worst[kind] = max(worst[kind], diff)
    head = [n for n, p in params[0] if "output_layer" in n or "word_embeddings" in n]
    if ps.rank == 0:
        print(f"OK {name} updates chunked = full logits (grad_norm {metrics[CHUNK]['actor/grad_norm']:.6g} "
              f"vs {metrics[0]['actor/grad_norm']:.6g}; worst relative {({k: float('%.1e' % v) for k, v in worst.items()})}; "
              f"head weights here: {head})", flush=True)


def counted(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapper


def main():
    calls = []  # the chunked passes did run on the last stage
    workers_module.chunked_head_log_probs_and_entropy = counted(workers_module.chunked_head_log_probs_and_entropy, calls)
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    dtypes = ("float32", "bfloat16") if sys.argv[-1] == "bf16" else ("float32",)
    ps = init_parallel(tp=tp, pp=pp)
    for family in ("llama", "qwen2"):
        for dtype in dtypes:
            check(ps, family, dtype)
    # LoRA with the LM head trained fully next to the adapters (modules_to_save): its main_grad
    check(ps, "llama", "float32", LoRA(rank=4, alpha=8.0, modules_to_save=("lm_head",)))
    assert calls or ps.pp_rank != ps.pp - 1, "the chunked LM head never ran"
    dist.barrier()
    if ps.rank == 0:
        print(f"ALL OK tp={tp} pp={pp}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
