"""torchrun worker: Megatron DDP + optimizer steps equal a plain-torch reference.

usage: torchrun --nproc_per_node N training_worker.py TP PP [dist_opt]   (DP = N / (TP*PP))

Tiny Llama and Qwen2 actors take 3 AdamW steps (weight decay, global-norm clipping, linear
warmup) on a token-level loss normalised by the global token count, each DP rank feeding
its share of the batch in micro-batches of 2. Reference: the HF model with
torch.optim.AdamW on the whole batch in one process. Weights after the steps must agree.
Then a step whose gradient is NaN on one rank only is skipped on every rank, weights unchanged.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.training import OptimSettings, make_trainable, train_step
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel

STEPS, LR, WD, CLIP, WARMUP = 3, 1e-3, 0.1, 0.5, 1


def token_weights(ids):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(ids.shape, generator=gen)
    w[:, :3] = 0.0  # some tokens do not count, as with a response mask
    return w


def reference(cfg, ids, w):
    hf = build_hf_model(cfg, seed=5).train()
    decay = [p for n, p in hf.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in hf.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    reference_steps(hf, opt, list(hf.parameters()), ids, w, lr=LR, clip=CLIP)
    return hf.state_dict()


def reference_steps(hf, opt, params, ids, w, *, lr: float, clip: float, steps: int = STEPS, warmup: int = WARMUP):
    """`steps` AdamW steps of the HF model in one process on the token-weighted log-prob loss, the
    gradient of `params` clipped to a global norm of `clip` (the reference of training_worker and
    lora_worker)."""
    n_tokens = (w != 0).sum()
    for step in range(steps):
        for g in opt.param_groups:  # linear warmup as Megatron and HF schedulers: lr * step / warmup
            g["lr"] = lr * step / warmup if step < warmup else lr
        opt.zero_grad()
        logp = hf(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = (logp * w[:, 1:]).sum() / n_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()


def check(ps, family, dist_opt):
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dims.vocab_size, (8, 12), generator=gen)
    w = token_weights(ids)
    n_tokens = (w != 0).sum()

    model = build_model(dims, ps, role="actor")
    load_hf_weights(model, build_hf_model(cfg, seed=5).state_dict())
    trainable = make_trainable(model, OptimSettings(lr=LR, weight_decay=WD, clip_grad=CLIP, warmup_steps=WARMUP,
                                                    total_steps=STEPS, use_distributed_optimizer=dist_opt))
    per_rank = ids.shape[0] // ps.dp
    mine = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
    mbs = [{"input_ids": ids[mine][i:i + 2], "w": w[mine][i:i + 2]} for i in range(0, per_rank, 2)]
    per_tp = model.padded_vocab // ps.tp
    vocab_ids = torch.arange(ps.tp_rank * per_tp, (ps.tp_rank + 1) * per_tp)

    def loss_fn(logits, mb):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.masked_fill(vocab_ids >= dims.vocab_size, float("-inf"))  # padded vocab rows
        labels = mb["input_ids"][:, 1:]
        logp = -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), labels.contiguous())
        return (logp * mb["w"][:, 1:]).sum() / n_tokens, None

    for _ in range(STEPS):
        _, metrics = train_step(trainable, mbs, loss_fn)
        assert metrics["skipped"] == 0
    got = dict(iter_hf_tensors(model))
    if ps.rank == 0:
        expected = reference(cfg, ids, w)
        worst = max((got[k] - expected[k]).abs().max().item() for k in got)
        moved = max((expected[k] - build_hf_model(cfg, seed=5).state_dict()[k]).abs().max().item() for k in got)
        assert moved > 1e-3, "the reference did not train"
        assert worst <= 2e-5, f"{family}: weights differ from the reference by {worst}"
        print(f"OK {family} training tp={ps.tp} pp={ps.pp} dp={ps.dp} dist_opt={dist_opt} "
              f"max_weight_diff={worst:.2e} (moved {moved:.2e})", flush=True)

    def nan_on_last_rank(logits, mb):  # a non-finite gradient on one rank: every rank skips the step
        loss, _ = loss_fn(logits, mb)
        return loss * (float("nan") if ps.rank == ps.world_size - 1 else 1.0), None

    _, metrics = train_step(trainable, mbs, nan_on_last_rank)
    assert metrics["skipped"] == 1, metrics
    after = dict(iter_hf_tensors(model))
    if ps.rank == 0:
        assert all(torch.equal(got[k], after[k]) for k in got), "a skipped step changed the weights"


def main():
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    dist_opt = len(sys.argv) > 3 and sys.argv[3] == "dist_opt"
    ps = init_parallel(tp, pp)
    for family in ("llama", "qwen2"):
        check(ps, family, dist_opt)
    dist.barrier()
    if ps.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
