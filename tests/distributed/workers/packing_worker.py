"""torchrun worker: packed passes equal padded ones and a per-sequence transformers reference.

usage: torchrun --nproc_per_node N packing_worker.py TP PP [VPP] [bf16]   (DP = N / (TP*PP))

For tiny Llama (untied) and Qwen2 (tied, qkv bias), on a batch of 8 sequences with prompts
of 1-6 tokens (left-padded to 6) and responses of 1-7 tokens (right-padded to 7):
  1. actor log-probs and entropy (temperature 0.7): packed (token budget 20, so several
     sequences share a micro-batch and several micro-batches run) = padded (2 rows per
     micro-batch) = transformers run on each sequence alone, without padding (<= 1e-5);
  2. critic values and reward-model scores: packed = padded = transformers' token
     classification head on each sequence alone (<= 1e-5);
  3. actor and critic updates, every loss_agg_mode in turn on the same two models (packed and
     padded): the losses, entropy and gradient norm, and every parameter's gradient agree
     (<= 1e-5, relative to the largest gradient of the tensor).
  4. every policy loss of megappo.ppo.policy_losses through the packed trainer (llama; with `bf16` in
     bf16 too): the update's loss and metrics equal the loss function on the whole batch (check_policy_losses).
  5. with `bf16`: the same forward passes of bf16 models, packed and padded, equal the exact
     values of those bf16 weights (transformers in float32 on each sequence alone, weights rounded
     to bf16) within megappo.models.precision.COMPARE_TOL["bfloat16"]; transformers' own bf16
     pass is measured against the same reference and printed beside it.
Prints "OK <check>" lines; any failure raises.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.precision import COMPARE_TOL
from megappo.models.training import OptimSettings, make_trainable
from megappo.models.weights import load_hf_weights
from megappo.parallel.packing import MicroBatching
from megappo.parallel.state import init_parallel
from megappo.ppo.losses import AGG_MODES, LossInputs, global_counts
from megappo.ppo.policy_losses import compute_policy_loss
from megappo.trainer.roles import Experience, PolicyWorker, SeqBatch, ValueWorker

TOL = 1e-5
VANILLA = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
N, P, R, TEMP = 8, 6, 7, 0.7


def make_seqs(vocab: int) -> SeqBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (N, P + R), generator=gen)
    attn = torch.zeros(N, P + R, dtype=torch.long)
    resp = torch.zeros(N, R, dtype=torch.long)
    for i in range(N):
        p, r = 1 + i % 6, 1 + (3 * i) % 7
        attn[i, P - p:P + r] = 1
        resp[i, :r] = 1
    ids = ids * attn  # padding id 0
    return SeqBatch(input_ids=ids, attention_mask=attn, response_mask=resp, prompt_len=P)


def alone(seqs: SeqBatch, i: int) -> tuple[torch.Tensor, int, int]:
    """Sequence i without padding, its prompt and response lengths."""
    mask = seqs.attention_mask[i].bool()
    return seqs.input_ids[i][mask], int(seqs.attention_mask[i, :P].sum()), int(seqs.response_mask[i].sum())


def reference_log_probs(hf, seqs: SeqBatch):
    """([N, R] log-probs, entropy, sum of p^2) of the tempered softmax, each sequence alone, in float64."""
    lp, ent, sps = torch.zeros(N, R), torch.zeros(N, R), torch.zeros(N, R)
    with torch.no_grad():
        for i in range(N):
            ids, p, r = alone(seqs, i)
            logits = hf(input_ids=ids[None]).logits[0, p - 1:p - 1 + r].double() / TEMP
            logp = logits.log_softmax(-1)
            lp[i, :r] = logp.gather(-1, ids[p:p + r, None]).squeeze(-1).float()
            ent[i, :r] = -(logp.exp() * logp).sum(-1).float()
            sps[i, :r] = logp.exp().square().sum(-1).float()
    return lp, ent, sps


def reference_values(hf_tok, seqs: SeqBatch):
    values, scores = torch.zeros(N, R), torch.zeros(N)
    with torch.no_grad():
        for i in range(N):
            ids, p, r = alone(seqs, i)
            v = hf_tok(input_ids=ids[None]).logits[0, :, 0]
            values[i, :r] = v[p - 1:p - 1 + r]
            scores[i] = v[p + r - 1]
    return values, scores


def batchings(ps, vpp):
    least = ps.pp if vpp else 1
    return {"packed": MicroBatching(packed=True, max_tokens=20, micro_batch_multiple=least),
            "padded": MicroBatching(packed=False, micro_batch_size=2)}


def forward_passes(ps, dims, hf, hf_tok, seqs: SeqBatch, vpp, dtype: str):
    """(kind, log-probs, entropy, values, scores, sum of p^2) of an actor loaded from `hf` and a critic from
    `hf_tok` in `dtype`, packed and padded."""
    actor = build_model(dims, ps, role="actor", dtype=dtype)
    load_hf_weights(actor, hf.state_dict())
    critic = build_model(dims, ps, role="critic", dtype=dtype)
    load_hf_weights(critic, hf_tok.state_dict())
    for kind, batching in batchings(ps, vpp).items():
        stats = PolicyWorker(actor, batching=batching, temperature=TEMP).token_stats(seqs, entropy=True,
                                                                                     sum_pi_squared=True)
        lp, ent, sps = stats.log_probs, stats.entropy, stats.sum_pi_squared
        values = ValueWorker(critic, batching=batching).values(seqs)
        yield kind, lp, ent, values, ValueWorker(critic, batching=batching).scores(seqs), sps


def close(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{name}: max abs diff {diff} > {TOL}"
    return diff


def grads(model) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for chunk in model.chunks for p in chunk.parameters()]


def compare_updates(family: str, role: str, ps, results: dict, grad_lists: dict, mode: str) -> None:
    a, b = results["packed"], results["padded"]
    if ps.rank == 0:
        for key in a:
            if key.endswith(("/lr", "skipped_steps", "first_micro_batch")):  # the last: which rows, by design
                continue
            diff = abs(a[key] - b[key])
            assert diff <= TOL * max(1.0, abs(b[key])), f"{family} {role} {mode} {key}: {a[key]} vs {b[key]}"
    for i, (ga, gb) in enumerate(zip(grad_lists["packed"], grad_lists["padded"])):
        diff = (ga - gb).abs().max().item()
        assert diff <= TOL * max(1.0, gb.abs().max().item()), f"{family} {role} {mode} grad {i} differs by {diff}"


def check(ps, family: str, vpp) -> None:
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    seqs = make_seqs(dims.vocab_size)
    hf = build_hf_model(cfg, seed=5)
    hf_tok = build_hf_model(cfg, seed=11, head="token")
    ref_lp, ref_ent, ref_sps = reference_log_probs(hf, seqs)
    ref_values, ref_scores = reference_values(hf_tok, seqs)
    mask = seqs.response_mask.float()

    # 1 + 2: forward passes
    for kind, lp, ent, values, scores, sps in forward_passes(ps, dims, hf, hf_tok, seqs, vpp, "float32"):
        if ps.rank == 0:
            d = [close(f"{family} {kind} log-probs", lp, ref_lp * mask), close(f"{family} {kind} entropy", ent, ref_ent * mask),
                 close(f"{family} {kind} values", values, ref_values * mask), close(f"{family} {kind} scores", scores, ref_scores),
                 close(f"{family} {kind} sum of p^2", sps, ref_sps * mask)]
            print(f"OK {family} {kind} forward = transformers per sequence, max diffs {['%.1e' % x for x in d]}", flush=True)

    # 3: updates, packed and padded models side by side
    gen = torch.Generator().manual_seed(1)
    exp = Experience(seqs=seqs, old_log_probs=(ref_lp + 0.05 * torch.randn(N, R, generator=gen)) * mask,
                     advantages=torch.randn(N, R, generator=gen) * mask, ref_log_probs=ref_lp * mask,
                     values=ref_values * mask, returns=torch.randn(N, R, generator=gen) * mask)
    settings = OptimSettings(lr=1e-4, clip_grad=1e6, total_steps=100)
    workers = {}
    for kind, batching in batchings(ps, vpp).items():
        a = build_model(dims, ps, role="actor")
        load_hf_weights(a, hf.state_dict())
        c = build_model(dims, ps, role="critic")
        load_hf_weights(c, hf_tok.state_dict())
        workers[kind] = (PolicyWorker(a, batching=batching, temperature=TEMP, trainable=make_trainable(a, settings)),
                         ValueWorker(c, batching=batching, trainable=make_trainable(c, settings)))
    for mode in AGG_MODES:
        actor_m = {k: w[0].update(exp, mini_batch_size=N, epochs=1, loss_mode="vanilla", loss_knobs=VANILLA,
                                  loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True,
                                  kl_loss_coef=0.1, kl_loss_type="low_var_kl", seed=3) for k, w in workers.items()}
        compare_updates(family, "actor", ps, actor_m, {k: grads(w[0].model) for k, w in workers.items()}, mode)
        critic_m = {k: w[1].update(exp, mini_batch_size=N, epochs=1, cliprange_value=0.2, loss_agg_mode=mode, seed=3)
                    for k, w in workers.items()}
        compare_updates(family, "critic", ps, critic_m, {k: grads(w[1].model) for k, w in workers.items()}, mode)
    print(f"OK {family} updates packed = padded, every loss_agg_mode ({len(AGG_MODES)})", flush=True)


def check_bf16(ps, family: str, vpp) -> None:
    """Forward passes of bf16 models against the exact values of their (bf16) weights."""
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    seqs = make_seqs(dims.vocab_size)
    hf = build_hf_model(cfg, seed=5).to(torch.bfloat16).float()  # the bf16 weights, computed in float32
    hf_tok = build_hf_model(cfg, seed=11, head="token").to(torch.bfloat16).float()
    ref_lp, ref_ent, _ = reference_log_probs(hf, seqs)
    ref_values, ref_scores = reference_values(hf_tok, seqs)
    hf_lp, _, _ = reference_log_probs(hf.to(torch.bfloat16), seqs)  # transformers computing in bf16
    mask = seqs.response_mask.float()
    tol = COMPARE_TOL["bfloat16"]
    for kind, lp, ent, values, scores, _ in forward_passes(ps, dims, hf, hf_tok, seqs, vpp, "bfloat16"):
        if ps.rank == 0:
            d = {"log-probs": (lp - ref_lp * mask).abs().max().item(), "entropy": (ent - ref_ent * mask).abs().max().item(),
                 "values": (values - ref_values * mask).abs().max().item(),
                 "scores": (scores - ref_scores).abs().max().item()}
            bad = {k: v for k, v in d.items() if not v <= tol}
            assert not bad, f"{family} bf16 {kind}: differs from the exact values by {bad} (> {tol})"
            hf_diff = ((hf_lp - ref_lp) * mask).abs().max().item()
            print(f"OK {family} bf16 {kind} forward = exact values within {tol}: max diffs "
                  f"{ {k: float('%.1e' % v) for k, v in d.items()} }; transformers bf16 log-probs {hf_diff:.1e}", flush=True)


#: (loss mode, loss_agg_mode, knobs) run through the trainer: every registered loss, tight clip ratios so
#: that clipping happens. clip_cov's bounds take no token (its choice is per part and tested in
#: tests/unit/test_policy_losses.py); kl_cov, which always takes some, is left to the unit tests.
CLIP = dict(clip_ratio_low=0.04, clip_ratio_high=0.05, clip_ratio_c=3.0)
THROUGH_TRAINER = [
    ("vanilla", "seq-mean-token-sum-norm", {}),  # divided by R = 7, the batch's response width, in every part
    ("vanilla", "seq-mean-token-sum-norm", dict(loss_scale_factor=3.0)),  # the role's constant instead
    ("gspo", "seq-mean-token-mean", {}), ("gspo", "token-mean", {}),
    ("cispo", "token-mean", {}), ("sapo", "token-mean", dict(tau_pos=1.0, tau_neg=1.05)), ("gpg", "token-sum", {}),
    ("dppo_tv", "token-mean", {}), ("dppo_kl", "seq-mean-token-sum", {}), ("geo_mean", "token-mean", {}),
    ("dro", "token-mean", dict(dro_beta=0.1)), ("clip_cov", "token-mean", dict(clip_cov_lb=1e3, clip_cov_ub=1e4)),
    ("bypass_mode", "token-mean", dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0,
                                       rollout_rs="token_k1", rollout_rs_threshold="0.96_1.04")),
    ("bypass_mode", "seq-mean-token-mean", dict(loss_type="ppo_clip", rollout_rs="seq_mean_k3",
                                                 rollout_rs_threshold=5e-4)),
    # batch-normalised weights: the trainer's pre-pass gives every part the mini-batch's mean
    ("bypass_mode", "token-mean", dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.02,
                                       rollout_is_batch_normalize=True)),
]


def check_policy_losses(ps, family: str, vpp, dtype: str) -> None:
    """Each policy loss through the trainer (packed, every layout this worker runs, IS weights given):
    the update's actor/pg_loss and token-mean metrics (sums of the parts' shares: micro-batches x DP
    replicas) equal the loss function on the whole batch at the transformers log-probs of the same
    weights, single rank, unpacked. float32 within TOL; bfloat16 within 3 x COMPARE_TOL (the log-probs'
    tolerance times |A| ~ 1)."""
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    seqs = make_seqs(dims.vocab_size)
    hf = build_hf_model(cfg, seed=5)
    if dtype == "bfloat16":
        hf = hf.to(torch.bfloat16).float()  # the bf16 weights, computed in float32: the exact values
    ref_lp, _, _ = reference_log_probs(hf, seqs)
    mask = seqs.response_mask.float()
    gen = torch.Generator().manual_seed(2)
    old = (ref_lp + 0.05 * torch.randn(N, R, generator=gen)) * mask
    adv = torch.randn(N, R, generator=gen) * mask
    isw = (0.5 + torch.rand(N, R, generator=gen)) * mask
    tol = TOL if dtype == "float32" else 3 * COMPARE_TOL["bfloat16"]
    actor = build_model(dims, ps, role="actor", dtype=dtype)
    worker = PolicyWorker(actor, batching=batchings(ps, vpp)["packed"], temperature=TEMP,
                          trainable=make_trainable(actor, OptimSettings(lr=1e-4, clip_grad=1e6, total_steps=100)))
    worst = 0.0
    for mode, agg, knobs in THROUGH_TRAINER:
        load_hf_weights(actor, hf.state_dict())  # every loss starts from the same weights
        weights = None if mode == "bypass_mode" else isw  # bypass forms its own
        exp = Experience(seqs=seqs, old_log_probs=old, advantages=adv, rollout_is_weights=weights)
        loss_knobs = {k: v for k, v in knobs.items() if k != "loss_scale_factor"}  # the role's, not the loss's
        got = worker.update(exp, mini_batch_size=N, epochs=1, loss_mode=mode, loss_knobs={**CLIP, **loss_knobs},
                            loss_agg_mode=agg, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                            kl_loss_type="low_var_kl", seed=3, loss_scale_factor=knobs.get("loss_scale_factor"))
        if ps.rank == 0:
            inputs = LossInputs(old, ref_lp * mask, adv, mask, loss_agg_mode=agg, rollout_is_weights=weights,
                                loss_scale_factor=knobs.get("loss_scale_factor"),
                                **global_counts(mask))  # bypass: counts before rejection
            loss, want = compute_policy_loss(mode, inputs, **CLIP, **loss_knobs)
            for key, value in {"actor/pg_loss": loss, **want}.items():
                if key.startswith("rollout_corr/"):  # each part's own statistic, averaged over parts
                    continue
                diff = abs(got[key] - float(value))
                assert diff <= tol * max(1.0, abs(float(value))), f"{family} {dtype} {mode} {agg} {key}: " \
                    f"trainer {got[key]} vs whole batch {float(value)}"
                worst = max(worst, diff)
    if ps.rank == 0:
        print(f"OK {family} {dtype} policy losses through the trainer = whole batch, single rank "
              f"({len(THROUGH_TRAINER)} cases, max diff {worst:.1e})", flush=True)


def main():
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    vpp = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "bf16" else None
    bf16 = sys.argv[-1] == "bf16"
    ps = init_parallel(tp=tp, pp=pp, vpp=vpp)
    for family in ("llama", "qwen2"):
        check(ps, family, vpp)
        if bf16:
            check_bf16(ps, family, vpp)
    for dtype in ("float32", "bfloat16") if bf16 else ("float32",):
        check_policy_losses(ps, "llama", vpp, dtype)
    dist.barrier()
    if ps.rank == 0:
        print(f"ALL OK tp={tp} pp={pp} vpp={vpp} dp={ps.dp}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
