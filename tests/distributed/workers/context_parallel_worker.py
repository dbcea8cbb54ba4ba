"""torchrun worker (4 ranks, gloo): context parallelism (CP=2) against CP=1 on the same packed batch.

usage: torchrun --nproc_per_node 4 context_parallel_worker.py LAYOUT [LAYOUT ...] [--bf16=LAYOUT,...] [--checkpoint=DIR]
LAYOUT: dp2cp2 (tp1 pp1 cp2 dp2), tp2cp2, pp2cp2, vpp2cp2 (pp2 vpp2), cp4 (tp1 cp4 dp1).

In one launch, the reference layout (tp1 pp1 cp1, dp4) and each LAYOUT, over the same ranks, build
the same models from one seeded tiny Llama (packing_worker.py's batch: sequences of 2 to 11 tokens,
shorter than 2 x cp, odd and even lengths; micro-batches of at most 20 tokens) and compare, on
rank 0:
  1. the actor's token_stats: log-probs, entropy, sum of p^2 (temperature 0.7), of the whole batch
     and of a batch of one sequence; the chunked LM head's (lm_head_chunk_tokens=5) too;
  2. bypass mode's IS-weight batch mean (an all-reduce over every rank); a critic's values and a reward
     model's scores;
  3. two PPO updates of the actor (two mini-batches; entropy bonus, KL loss; the distributed
     optimizer at dp2cp2) and of the critic: every loss metric and the gradient norm, then the
     log-probs / values after the updates (the weights the steps made);
  4. at dp2cp2 also a LoRA actor with full recomputation, an actor with selective recomputation of core
     attention, and a Qwen2 actor (tied embeddings) with the chunked LM head, against the same at CP=1.
With --checkpoint=DIR (first, float32, distributed optimizer): weight sync and checkpoints across CP.
  5. the HF tensors the bridge streams (iter_hf_tensors to receivers {0, 1, 3}: at dp2cp2 rank 1 is
     cp rank 1 of replica 0) equal at CP=2 and CP=1 bit for bit, before and after an update at CP=2;
  6. an actor trained at CP=2 and saved (save_trainable) loads at CP=1 with the same weights, and every
     rank the same optimizer shard (fp32 main weights, Adam moments), bit for bit, takes an update there (within TOL of the CP=2 actor's own next update), is saved, and loads
     back at CP=2 bit for bit.
float32 within TOL; bfloat16 (the layouts --bf16 names, against CP=1 in bfloat16) within BF16_TOL, the passes
after an update within BF16_AFTER_UPDATE_TOL (values: absolute; metrics: relative to
max(1, |value|)). Prints "OK <layout> <dtype> <what> <worst difference>" lines.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models import forward
from megappo.models.builders import build_model
from megappo.models.checkpoint import load_trainable, save_trainable
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.lora import NO_LORA, LoRA
from megappo.models.precision import COMPARE_TOL
from megappo.models.recompute import NO_RECOMPUTE, Recompute
from megappo.models.training import OptimSettings, make_trainable
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.packing import MicroBatching
from megappo.parallel.state import add_layout, init_parallel
from megappo.trainer.roles import Experience, PolicyWorker, ValueWorker
from tests.distributed.workers.packing_worker import N, R, TEMP, VANILLA, make_seqs

TOL = 1e-5
BF16_TOL = COMPARE_TOL["bfloat16"]  # a pass, and an update's metrics
#: the passes after an update of bf16 weights: a weight that lands one bf16 step away moves the log-probs by more
BF16_AFTER_UPDATE_TOL = 3 * COMPARE_TOL["bfloat16"]
LAYOUTS = {"dp2cp2": (1, 1, None, 2), "tp2cp2": (2, 1, None, 2), "pp2cp2": (1, 2, None, 2),
           "vpp2cp2": (1, 2, 2, 2), "cp4": (1, 1, None, 4)}


def batching(ps):
    return MicroBatching(packed=True, max_tokens=20, micro_batch_multiple=ps.pp if ps.vpp else 1)


def policy(ps, dims, hf, dtype, *, chunk=0, train=False, lora=NO_LORA, recompute=NO_RECOMPUTE, dist_opt=False):
    model = build_model(dims, ps, role="actor", dtype=dtype, lora=lora, recompute=recompute)
    load_hf_weights(model, hf.state_dict())
    settings = OptimSettings(lr=1e-3, clip_grad=1e6, total_steps=100, use_distributed_optimizer=dist_opt)
    return PolicyWorker(model, batching=batching(ps), temperature=TEMP, lm_head_chunk_tokens=chunk,
                        trainable=make_trainable(model, settings) if train else None)


def value_model(ps, dims, hf, dtype, role, *, train=False, dist_opt=False):
    model = build_model(dims, ps, role=role, dtype=dtype, value_head_seed=7)
    load_hf_weights(model, {k: v for k, v in hf.state_dict().items() if not k.startswith("lm_head")})
    settings = OptimSettings(lr=1e-3, clip_grad=1e6, total_steps=100, use_distributed_optimizer=dist_opt)
    return ValueWorker(model, batching=batching(ps), trainable=make_trainable(model, settings) if train else None)


def experience(seqs, lp):
    mask = seqs.response_mask.float()
    gen = torch.Generator().manual_seed(1)
    return Experience(seqs=seqs, old_log_probs=(lp + 0.05 * torch.randn(N, R, generator=gen)) * mask,
                      advantages=torch.randn(N, R, generator=gen) * mask, ref_log_probs=lp * mask,
                      values=0.1 * torch.randn(N, R, generator=gen) * mask,
                      returns=torch.randn(N, R, generator=gen) * mask)


def run_layout(ps, dims, hf, dtype, seqs, exp, *, with_lora: bool) -> dict:
    """Everything the comparison reads (tensors and metrics on rank 0; None elsewhere)."""
    dist_opt = ps.dp > 1
    out = {}
    actor = policy(ps, dims, hf, dtype, train=True, dist_opt=dist_opt)
    stats = actor.token_stats(seqs, entropy=True, sum_pi_squared=True)
    out["token stats"] = (stats.log_probs, stats.entropy, stats.sum_pi_squared)
    if not ps.vpp:  # (the interleaved schedule needs pp micro-batches, one sequence makes one)
        one = actor.token_stats(seqs.select(torch.tensor([4])), entropy=True)
        out["one sequence"] = (one.log_probs, one.entropy)
    chunked = policy(ps, dims, hf, dtype, chunk=5, train=True, dist_opt=dist_opt)
    cstats = chunked.token_stats(seqs, entropy=True, sum_pi_squared=True)
    out["chunked head token stats"] = (cstats.log_probs, cstats.entropy, cstats.sum_pi_squared)
    # bypass mode's IS-weight batch mean: one all-reduce of every replica's part (once per TP x CP group)
    mean = actor._is_batch_mean(exp, torch.arange(N), {"rollout_is": "token", "rollout_is_threshold": 2.0})
    out["IS weight batch mean"] = (torch.tensor([mean], dtype=torch.float64),)
    kwargs = dict(mini_batch_size=N // 2, epochs=1, loss_mode="vanilla", loss_knobs=VANILLA,
                  loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                  kl_loss_type="low_var_kl", seed=3)
    out["actor update"] = actor.update(exp, **kwargs)
    out["actor after update"] = (actor.log_probs(seqs),)
    out["chunked head update"] = chunked.update(exp, **kwargs)
    out["chunked head after update"] = (chunked.log_probs(seqs),)
    critic = value_model(ps, dims, hf, dtype, "critic", train=True, dist_opt=dist_opt)
    out["values"] = (critic.values(seqs),)
    out["critic update"] = critic.update(exp, mini_batch_size=N // 2, epochs=1, cliprange_value=0.2,
                                         loss_agg_mode="token-mean", seed=3)
    out["critic after update"] = (critic.values(seqs),)
    out["scores"] = (value_model(ps, dims, hf, dtype, "reward").scores(seqs),)
    if with_lora:
        qwen2 = TINY_CONFIGS["qwen2"]  # tied embeddings: the chunked head's weight is the embedding's
        tied = policy(ps, dims_from_hf(qwen2), build_hf_model(qwen2, seed=5), dtype, chunk=5, train=True)
        out["tied chunked head update"] = tied.update(exp, **kwargs)
        out["tied chunked head after update"] = (tied.log_probs(seqs),)
        lora = policy(ps, dims, hf, dtype, train=True, lora=LoRA(rank=4, alpha=8.0, modules_to_save=("lm_head",)),
                      recompute=Recompute(granularity="full", method="uniform", num_layers=1))
        out["lora recompute update"] = lora.update(exp, **kwargs)
        out["lora recompute after update"] = (lora.log_probs(seqs),)
        # selective recomputation of core attention: the K/V all-gather runs again inside the recomputed part
        selective = policy(ps, dims, hf, dtype, train=True, recompute=Recompute(granularity="selective",
                                                                             modules=("core_attn",)))
        out["selective recompute update"] = selective.update(exp, **kwargs)
        out["selective recompute after update"] = (selective.log_probs(seqs),)
    return out


def compare(name: str, got: dict, want: dict, tol: float) -> None:
    for what, ref in want.items():
        if isinstance(ref, dict):  # metrics
            worst = 0.0
            for key, value in ref.items():
                if key.endswith(("/lr", "skipped_steps", "first_micro_batch")):  # the last: DP replica 0's own
                    continue
                diff = abs(got[what][key] - value) / max(1.0, abs(value))
                assert diff <= tol, f"{name} {what} {key}: {got[what][key]} vs CP=1 {value}"
                worst = max(worst, diff)
        else:
            allowed = BF16_AFTER_UPDATE_TOL if tol == BF16_TOL and what.endswith("after update") else tol
            worst = max((g - r).abs().max().item() for g, r in zip(got[what], ref))
            assert worst <= allowed, f"{name} {what}: {worst} > {allowed}"
        print(f"OK {name} {what} {worst:.1e}", flush=True)


def counted(fn, calls):
    def wrapper(model, micro_batches):
        calls.append(model.ps.cp)
        return fn(model, micro_batches)
    return wrapper


def exported(worker) -> dict:
    return {k: v.clone() for k, v in iter_hf_tensors(worker.model, dst={0, 1, 3})}


def adam_state(worker) -> dict:
    """This rank's shard of the distributed optimizer: fp32 main weights, Adam moments (the same shards at
    cp=2 x dp=2 as at dp=4: Megatron shards over data parallel x context parallel)."""
    out = {}
    for i, opt in enumerate(getattr(worker.trainable.optimizer, "chained_optimizers", [worker.trainable.optimizer])):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"{i}.{g}.{j}.main"] = p.detach().clone()
                for k, v in opt.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.numel() > 1:
                        out[f"{i}.{g}.{j}.{k}"] = v.clone()
    return out


def same_bits(a: dict, b: dict, what: str, rank: int) -> None:
    assert a.keys() == b.keys(), what
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {bad}"
    print(f"OK rank {rank} {what} bit for bit ({len(a)} tensors)", flush=True)


def check_checkpoints(ps, cp2, dims, hf, seqs, exp, out_dir: str) -> None:
    kwargs = dict(mini_batch_size=N // 2, epochs=1, loss_mode="vanilla", loss_knobs=VANILLA, loss_agg_mode="token-mean",
                  entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", seed=3)
    a = policy(cp2, dims, hf, "float32", train=True, dist_opt=True)
    b = policy(ps, dims, hf, "float32", train=True, dist_opt=True)
    if ps.rank in (0, 1, 3):
        same_bits(exported(a), exported(b), "export at cp=2 = cp=1 (HF weights)", ps.rank)
    else:
        exported(a), exported(b)
    a.update(exp, **kwargs)

    def crossed(saved, loaded, frm: str, to: str) -> None:
        """`saved`'s checkpoint (cp=`frm`) loaded into `loaded` (cp=`to`): the same weights and optimizer state,
        bit for bit, and the next update of each within TOL."""
        save_trainable(saved.trainable, f"{out_dir}/cp{frm}", TINY_CONFIGS["llama"])
        load_trainable(loaded.trainable, f"{out_dir}/cp{frm}")
        got, want = exported(loaded), exported(saved)
        if ps.rank in (0, 1, 3):
            same_bits(got, want, f"cp={frm} checkpoint loaded at cp={to}", ps.rank)
        same_bits(adam_state(loaded), adam_state(saved), f"cp={frm} optimizer state loaded at cp={to}", ps.rank)
        metrics = {to: loaded.update(exp, **kwargs), frm: saved.update(exp, **kwargs)}
        if ps.rank == 0:
            compare(f"resumed at cp={to}", {"next update": metrics[to]}, {"next update": metrics[frm]}, TOL)

    crossed(a, b, "2", "1")
    crossed(b, policy(cp2, dims, hf, "float32", train=True, dist_opt=True), "1", "2")


def main():
    calls = []  # the CP layouts' passes did split their micro-batches
    forward._split_over_context = counted(forward._split_over_context, calls)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    bf16 = [name for a in sys.argv if a.startswith("--bf16=") for name in a.split("=", 1)[1].split(",")]
    ps = init_parallel(tp=1, pp=1)
    layouts = {name: add_layout(ps, tp, pp, vpp, cp=cp) for name in args for tp, pp, vpp, cp in [LAYOUTS[name]]}
    cfg = TINY_CONFIGS["llama"]
    dims = dims_from_hf(cfg)
    hf = build_hf_model(cfg, seed=5)
    seqs = make_seqs(dims.vocab_size)
    checkpoint = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--checkpoint=")]
    if checkpoint:
        lp = policy(ps, dims, hf, "float32").log_probs(seqs)
        exp = dist_broadcast(experience(seqs, torch.zeros(N, R) if lp is None else lp))
        check_checkpoints(ps, add_layout(ps, 1, 1, cp=2), dims, hf, seqs, exp, checkpoint[0])
    for dtype in ("float32", "bfloat16") if bf16 else ("float32",):
        tol = TOL if dtype == "float32" else BF16_TOL
        with_lora = dtype == "float32" and "dp2cp2" in layouts
        lp = policy(ps, dims, hf, dtype).log_probs(seqs)
        exp = experience(seqs, torch.zeros(N, R) if lp is None else lp)
        exp = dist_broadcast(exp)
        want = run_layout(ps, dims, hf, dtype, seqs, exp, with_lora=with_lora)
        for name, lps in layouts.items():
            if dtype == "bfloat16" and name not in bf16:
                continue
            got = run_layout(lps, dims, hf, dtype, seqs, exp, with_lora=with_lora and name == "dp2cp2")
            if ps.rank == 0:
                compare(f"{name} {dtype}", got, {k: v for k, v in want.items() if k in got}, tol)
    assert calls and set(calls) == {LAYOUTS[name][3] for name in args} | ({2} if checkpoint else set()), calls
    dist.barrier()
    if ps.rank == 0:
        print(f"ALL OK {' '.join(args)}", flush=True)
    dist.destroy_process_group()


def dist_broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
