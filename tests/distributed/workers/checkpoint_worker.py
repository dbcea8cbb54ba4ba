"""torchrun worker (2 ranks): model + optimizer + LR-scheduler checkpoints resume exactly.

usage: torchrun --nproc_per_node 2 checkpoint_worker.py OUT_DIR [moe]

For the plain and the distributed optimizer: a tiny Llama trains 2 steps at TP=2 (linear
warmup and decay, so the scheduler state matters), is saved with `save_trainable`, and
trains 2 more steps (the reference). A freshly built model (other initial weights) loads
the checkpoint and trains the same 2 steps: its weights must equal the reference bit for
bit. Then the same checkpoint loads at another layout (PP=2, or DP=2 for the distributed
optimizer: resharding on load) and the 2 steps must agree with the reference to 1e-5.
With `moe`: a tiny Qwen3-MoE trained at EP=2 (each rank holds half the experts) resumes exactly
at EP=2; its weights load at EP=1 (DP=2, every rank all experts) bit for bit; its optimizer
state at EP=1 is refused with the fix named (plain optimizer only).
"""

import os
import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.checkpoint import load_model, load_trainable, save_model, save_trainable
from megappo.models.hf_config import ModelConfigError, dims_from_hf
from megappo.models.hf_experts import checkpoint_state
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.training import OptimSettings, make_trainable, train_step
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel
from training_worker import token_weights

CFG = TINY_CONFIGS["llama"]
DIMS = dims_from_hf(CFG)


def trainable_at(ps, dist_opt: bool, init_seed: int):
    model = build_model(DIMS, ps, role="actor")
    load_hf_weights(model, checkpoint_state(build_hf_model(CFG, seed=init_seed)))
    return make_trainable(model, OptimSettings(lr=1e-3, min_lr=1e-4, weight_decay=0.1, clip_grad=0.5, warmup_steps=1,
                                               total_steps=6, decay_style="linear", use_distributed_optimizer=dist_opt))


def train(ps, trainable, steps: int) -> None:
    ids = torch.randint(0, DIMS.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0))
    w = token_weights(ids)
    n_tokens = (w != 0).sum()
    per_rank = ids.shape[0] // ps.dp
    mine = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
    mbs = [{"input_ids": ids[mine][i:i + 2], "w": w[mine][i:i + 2]} for i in range(0, per_rank, 2)]
    model = trainable.model
    per_tp = model.padded_vocab // ps.tp
    vocab_ids = torch.arange(ps.tp_rank * per_tp, (ps.tp_rank + 1) * per_tp)

    def loss_fn(logits, mb):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.masked_fill(vocab_ids >= DIMS.vocab_size, float("-inf"))
        logp = -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), mb["input_ids"][:, 1:].contiguous())
        return (logp * mb["w"][:, 1:]).sum() / n_tokens, None

    for _ in range(steps):
        _, metrics = train_step(trainable, mbs, loss_fn)
        assert metrics["skipped"] == 0


def relayout(tp: int, pp: int, ep: int = 1):
    from megatron.core import parallel_state as mps

    mps.destroy_model_parallel()
    return init_parallel(tp, pp, ep=ep)


def check(out: str, dist_opt: bool, moe: bool = False) -> None:
    ps = relayout(1, 1, ep=2) if moe else relayout(2, 1)
    ckpt = os.path.join(out, f"dist_opt{int(dist_opt)}")
    original = trainable_at(ps, dist_opt, init_seed=5)
    train(ps, original, 2)
    save_trainable(original, ckpt, CFG)
    train(ps, original, 2)
    reference = {k: v.clone() for k, v in iter_hf_tensors(original.model)}
    lr = original.optimizer.param_groups[0]["lr"]

    resumed = trainable_at(ps, dist_opt, init_seed=9)
    load_trainable(resumed, ckpt)
    train(ps, resumed, 2)
    got = dict(iter_hf_tensors(resumed.model))
    if ps.rank == 0:
        unequal = [k for k in reference if not torch.equal(reference[k], got[k])]
        assert not unequal, f"dist_opt={dist_opt}: resumed weights differ from the straight run: {unequal[:3]}"
        assert resumed.optimizer.param_groups[0]["lr"] == lr, "the LR scheduler did not resume"
    if moe:  # weights saved at EP=2 load at EP=1 (DP=2, every rank all experts); optimizer state does not
        weights = os.path.join(out, "moe_weights")
        save_model(original.model, weights, CFG)
        ps = relayout(1, 1, ep=1)
        other = trainable_at(ps, dist_opt, init_seed=9)
        load_model(other.model, weights)
        got = dict(iter_hf_tensors(other.model))
        if ps.rank == 0:
            unequal = [k for k in reference if not torch.equal(reference[k], got[k])]
            assert not unequal, f"moe: weights saved at ep=2 differ at ep=1: {unequal[:3]}"
        try:
            load_trainable(other, ckpt)
        except ModelConfigError as e:
            assert "saved at parallel.ep=2" in str(e) and "Fix:" in str(e), e
        else:
            raise AssertionError("optimizer state saved at ep=2 loaded at ep=1")
        if ps.rank == 0:
            print("OK moe: exact resume at ep=2; weights resharded to ep=1 bit-exact; optimizer ep change refused",
                  flush=True)
        return

    tp, pp = (1, 1) if dist_opt else (1, 2)  # DP=2 for the distributed optimizer, PP=2 otherwise
    ps = relayout(tp, pp)
    other = trainable_at(ps, dist_opt, init_seed=9)
    load_trainable(other, ckpt)
    train(ps, other, 2)
    got = dict(iter_hf_tensors(other.model))
    if ps.rank == 0:
        worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
        assert worst <= 1e-5, f"dist_opt={dist_opt}: resumed at tp={tp} pp={pp} dp={ps.dp} differs by {worst}"
        print(f"OK dist_opt={dist_opt}: exact resume at tp=2; resharded resume at tp={tp} pp={pp} dp={ps.dp} "
              f"max diff {worst:.1e}", flush=True)


def main():
    global CFG, DIMS
    out = sys.argv[1]
    if sys.argv[2:] == ["moe"]:
        CFG = TINY_CONFIGS["qwen3_moe"]
        DIMS = dims_from_hf(CFG)
        check(out, dist_opt=False, moe=True)
    else:
        for dist_opt in (False, True):
            check(out, dist_opt)
    dist.barrier()
    if dist.get_rank() == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
