"""torchrun worker: LoRA adapters in Megatron (megappo.models.lora) equal a plain-torch LoRA.

usage: torchrun --nproc_per_node N lora_worker.py TP PP   (DP = N / (TP*PP))

Tiny Llama and Qwen2 (tied embeddings, qkv bias) actors with rank-4 adapters on all four
linears take 3 AdamW steps (weight decay, global-norm clipping, linear warmup) on a
token-level loss, each DP rank feeding its share in micro-batches of 2; only the adapters
train. Reference: the HF model in one process, frozen, with peft's LoRA written out in plain
torch (y = W x + s B (A x) on q/k/v/o/gate/up/down; q, k, v share one A as Megatron's fused
qkv layer does, gate and up another) and torch.optim.AdamW. Checks, float32 within 2e-5:
- before training: the adapters change nothing (B = 0), and the base view (adapters off)
  gives bit-identical log-probs to a model built without LoRA;
- after the steps: every adapter matrix (peft form, `iter_adapter_tensors`) and every merged
  HF weight (`iter_hf_tensors`) equal the reference's, only adapters have optimizer state,
  the base weights are unchanged, and the base view still gives the untrained log-probs
  bit-exactly while the adapted model's differ.
Then (float32 and bf16) a LoRA trainer checkpoint (save_trainable / load_trainable) resumes
bit-identically: one more step from the loaded model equals one more step of the saved one.
Full recomputation gives the adapters bit-equal gradients.
Adapter-only weight sync (rollout.lora_sync=adapters, float32 and bf16): hf engines started from other
weights, one synced merged and one synced with adapters (base once, then adapters and lm_head), hold
the same model after AdamW steps: the same greedy tokens and log-probs within 1e-5 in float32 (bf16:
the same teacher-forced log-probs within its rounding); the second adapter sync moves exactly the
adapters' and lm_head's bytes, and both bridges' fingerprint verification passes.
Prints "OK <check>" lines; any failure raises.
"""

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megappo.models.builders import build_model
from megappo.models.forward import run_micro_batches
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.checkpoint import load_trainable, save_trainable
from megappo.models.lora import LoRA, _init_a, adapter_parameters, apply_lora, base_view
from megappo.models.recompute import NO_RECOMPUTE, Recompute
from megappo.models.training import OptimSettings, make_trainable, train_step
from megappo.models.weights import iter_adapter_tensors, iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel
from megappo.rollout.bridge import WeightBridge
from megappo.rollout.hf.engine import HFEngine
from megappo.types import SamplingParams
from training_worker import reference_steps, token_weights  # the same loss, weights and AdamW reference

STEPS, LR, WD, CLIP, WARMUP, RANK, ALPHA, SEED = 3, 1e-3, 0.1, 0.05, 1, 4, 8.0, 3
HF_OF = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
MODULE_OF = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}
SCOPE_OF = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


class ReferenceLoRA:
    """peft's LoRA on the HF model in plain torch: A per Megatron layer (shared by the projections
    it fuses), B per HF projection, initialised as megappo initialises the full matrices."""

    def __init__(self, hf, cfg):
        self.hf, self.scale, self.params = hf, ALPHA / RANK, {}
        for p in hf.parameters():
            p.requires_grad_(False)
        for i in range(cfg["num_hidden_layers"]):
            layer = hf.model.layers[i]
            for megatron, projections in HF_OF.items():
                parent = getattr(layer, MODULE_OF[megatron])
                in_features = getattr(parent, projections[0]).in_features
                a = torch.nn.Parameter(_init_a((RANK, in_features), f"decoder.layers.{i}.{SCOPE_OF[megatron]}."
                                                                    f"{megatron}", SEED))
                self.params[f"model.layers.{i}.{MODULE_OF[megatron]}.{projections[0]}.lora_A"] = a
                for proj in projections:
                    linear = getattr(parent, proj)
                    b = torch.nn.Parameter(torch.zeros(linear.out_features, RANK))
                    name = f"model.layers.{i}.{MODULE_OF[megatron]}.{proj}"
                    self.params[f"{name}.lora_B"] = b
                    self.params.setdefault(f"{name}.lora_A", a)
                    linear.register_forward_hook(lambda m, args, out, a=a, b=b: out + self.scale * F.linear(
                        F.linear(args[0], a), b))

    def trainable(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for p in self.params.values()}.values())

    def merged(self) -> dict[str, torch.Tensor]:
        state = dict(self.hf.state_dict())
        for name, b in self.params.items():
            if name.endswith("lora_B"):
                base = name.removesuffix(".lora_B")
                state[f"{base}.weight"] = state[f"{base}.weight"] + self.scale * b @ self.params[f"{base}.lora_A"]
        return state


def reference(cfg, ids, w):
    hf = build_hf_model(cfg, seed=5).train()
    lora = ReferenceLoRA(hf, cfg)
    opt = torch.optim.AdamW(lora.trainable(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    reference_steps(hf, opt, lora.trainable(), ids, w, lr=LR, clip=CLIP, steps=STEPS, warmup=WARMUP)
    return lora


def check(ps, family):
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, dims.vocab_size, (8, 12), generator=gen)
    w = token_weights(ids)
    n_tokens = (w != 0).sum()
    hf_weights = build_hf_model(cfg, seed=5).state_dict()

    plain = build_model(dims, ps, role="actor")
    load_hf_weights(plain, hf_weights)
    model = build_model(dims, ps, role="actor")
    load_hf_weights(model, hf_weights)
    adapted = apply_lora(model, LoRA(rank=RANK, alpha=ALPHA), seed=SEED)
    assert adapted == 4 * dims.num_layers // ps.pp, adapted
    base = base_view(model)
    per_rank = ids.shape[0] // ps.dp
    mine = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
    mbs = [{"input_ids": ids[mine][i:i + 2], "w": w[mine][i:i + 2]} for i in range(0, per_rank, 2)]
    per_tp = model.padded_vocab // ps.tp
    vocab_ids = torch.arange(ps.tp_rank * per_tp, (ps.tp_rank + 1) * per_tp)

    def loss_fn(logits, mb):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.masked_fill(vocab_ids >= dims.vocab_size, float("-inf"))
        labels = mb["input_ids"][:, 1:]
        logp = -vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), labels.contiguous())
        return (logp * mb["w"][:, 1:]).sum() / n_tokens, logp.detach()

    def log_probs(m):
        with torch.no_grad():
            return run_micro_batches(m, mbs, loss_fn, forward_only=True)

    untrained = log_probs(plain)
    for name, m in (("adapted (B = 0)", model), ("base view", base)):
        got = log_probs(m)
        assert all(torch.equal(a, b) for a, b in zip(got, untrained)), f"{family}: {name} log-probs differ"

    trainable = make_trainable(model, OptimSettings(lr=LR, weight_decay=WD, clip_grad=CLIP, warmup_steps=WARMUP,
                                                    total_steps=STEPS))
    with_state = {id(p) for g in trainable.optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for c in model.chunks for p in c.parameters() if getattr(p, "lora_adapter", False)}
    assert with_state == adapters and adapters, "the optimizer must hold the adapters and nothing else"
    for _ in range(STEPS):
        _, metrics = train_step(trainable, mbs, loss_fn)
        assert metrics["skipped"] == 0
    trained = log_probs(model)
    assert all(torch.equal(a, b) for a, b in zip(log_probs(base), untrained)), f"{family}: base view moved"
    if trained:
        moved = max((a - b).abs().max().item() for a, b in zip(trained, untrained))
        assert moved > 1e-3, f"{family}: training did not change the adapted model ({moved})"
    adapters_got = {f"{n}.{which}": t for n, which, t in iter_adapter_tensors(model)}
    merged_got = dict(iter_hf_tensors(model))
    frozen = dict((n, p) for n, _, p in plain.named_parameters())
    assert all(torch.equal(p, frozen[n]) for n, _, p in model.named_parameters()), "a base weight changed"
    if ps.rank == 0:
        ref = reference(cfg, ids, w)
        assert set(adapters_got) == set(ref.params), sorted(set(adapters_got) ^ set(ref.params))[:4]
        worst_adapter = max((adapters_got[k] - ref.params[k].detach()).abs().max().item() for k in ref.params)
        moved_b = max(ref.params[k].abs().max().item() for k in ref.params if k.endswith("lora_B"))
        expected = ref.merged()
        worst_merged = max((merged_got[k] - expected[k]).abs().max().item() for k in merged_got)
        assert moved_b > 1e-3, "the reference did not train"
        assert worst_adapter <= 2e-5 and worst_merged <= 2e-5, (family, worst_adapter, worst_merged)
        print(f"OK {family} lora tp={ps.tp} pp={ps.pp} dp={ps.dp} adapter_diff={worst_adapter:.2e} "
              f"merged_diff={worst_merged:.2e} (B moved {moved_b:.2e})", flush=True)


TINY = TINY_CONFIGS["llama"]


def square_loss(logits, mb):
    """A loss that moves every weight: the checks below need training, not a task."""
    return logits.float().square().mean() * 1e-3, None


def dp_micro_batches(ps, seed: int) -> tuple[torch.Tensor, list[dict]]:
    """8 random rows of 12 tokens, and this data-parallel rank's share in micro-batches of 2."""
    ids = torch.randint(0, dims_from_hf(TINY).vocab_size, (8, 12), generator=torch.Generator().manual_seed(seed))
    per_rank = ids.shape[0] // ps.dp
    return ids, [{"input_ids": ids[ps.dp_rank * per_rank:][i:i + 2]} for i in range(0, per_rank, 2)]


def lora_trainable(ps, lora: LoRA, *, dtype: str = "float32", recompute=NO_RECOMPUTE, total_steps: int = 4):
    """The tiny Llama (HF weights of seed 5) with `lora`, under AdamW at lr 1e-2."""
    m = build_model(dims_from_hf(TINY), ps, role="actor", dtype=dtype, lora=lora, recompute=recompute)
    load_hf_weights(m, build_hf_model(TINY, seed=5).state_dict())
    return make_trainable(m, OptimSettings(lr=1e-2, total_steps=total_steps))


def check_resume(ps, dtype: str):
    """Adapters and their Adam state saved by save_trainable and loaded into a fresh LoRA model
    continue bit-identically (the next step's adapters torch.equal), base weights included."""
    _, mbs = dp_micro_batches(ps, seed=1)

    def build():
        return lora_trainable(ps, LoRA(rank=RANK, alpha=ALPHA), dtype=dtype)

    box = [tempfile.mkdtemp(prefix="lora-resume-") if ps.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    first = build()
    for _ in range(2):
        train_step(first, mbs, square_loss)
    save_trainable(first, path, hf_config=TINY)
    meta = load_trainable(second := build(), path)
    assert meta["lora"]["rank"] == RANK, meta.get("lora")
    for t in (first, second):
        train_step(t, mbs, square_loss)
    pairs = [(a, b) for a, b in zip(first.model.chunks[0].parameters(), second.model.chunks[0].parameters())]
    assert all(torch.equal(a, b) for a, b in pairs), f"{dtype}: resumed LoRA training differs"
    moved = max(p.abs().max().item() for n, p in adapter_parameters(first.model.chunks) if n.endswith("lora_b"))
    assert moved > 0, "the adapters did not train"
    if ps.rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
        print(f"OK lora resume {dtype} tp={ps.tp} pp={ps.pp}: {len(pairs)} tensors bit-identical", flush=True)


def check_recompute(ps):
    """Full recomputation gives the adapters the same gradients (bit-equal): Megatron checkpoints each
    layer with a reentrant autograd Function, which backward skips when no input requires grad, as
    a frozen embedding's output would not without megappo.models.lora's hook."""
    ids = torch.randint(0, dims_from_hf(TINY).vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))
    mbs = [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2])} for i in range(0, 4, 2)]
    grads = []
    for recompute in (NO_RECOMPUTE, Recompute("full")):
        trainable = lora_trainable(ps, LoRA(rank=RANK, alpha=ALPHA), recompute=recompute, total_steps=2)
        train_step(trainable, mbs, square_loss)
        grads.append([p.main_grad.clone() for _, p in adapter_parameters(trainable.model.chunks)])
    assert any(g.abs().max() > 0 for g in grads[0]), "no adapter gradient"
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "full recomputation changed the adapters' gradients"
    if ps.rank == 0:
        print(f"OK lora recompute tp={ps.tp} pp={ps.pp}: {len(grads[0])} adapter gradients bit-equal", flush=True)


def check_adapter_sync(ps, dtype: str):
    """rollout.lora_sync=adapters against merged (module docstring)."""
    ids, mbs = dp_micro_batches(ps, seed=4)
    trainable = lora_trainable(ps, LoRA(rank=RANK, alpha=ALPHA, modules_to_save=("lm_head",)), dtype=dtype)
    model = trainable.model
    engines = {mode: HFEngine(build_hf_model(TINY, seed=7), pad_token_id=0, dtype=dtype) if ps.rank == 0 else None
               for mode in ("merged", "adapters")}  # other weights than the trainer's: the first sync sets them
    bridges = {mode: WeightBridge(model, engine, lora_sync=mode) for mode, engine in engines.items()}
    stats = {}
    for _ in range(2):
        train_step(trainable, mbs, square_loss)
        stats = {mode: bridge.sync() for mode, bridge in bridges.items()}  # raises if verification fails
    moved = sum(t.numel() * t.element_size() for _, _, t in iter_adapter_tensors(model))
    moved += sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(model, only=("output_layer.",)))
    if ps.rank != 0:
        return
    assert all(s.verified for s in stats.values())
    assert stats["adapters"].bytes == moved, (stats["adapters"].bytes, moved)  # the engine's dtype is the trainer's
    assert stats["adapters"].bytes < stats["merged"].bytes / 2, stats
    models = {mode: engine.model for mode, engine in engines.items()}
    with torch.no_grad():
        lp = {mode: m(input_ids=ids).logits.float().log_softmax(-1) for mode, m in models.items()}
    diff = (lp["merged"] - lp["adapters"]).abs().max().item()
    moved_lp = (lp["merged"] - build_hf_model(TINY, seed=5)(input_ids=ids).logits.float().log_softmax(-1)).abs().max()
    assert moved_lp > 1e-3, f"training did not change the synced model ({moved_lp})"
    assert diff <= (1e-5 if dtype == "float32" else 5e-2), (dtype, diff)
    if dtype == "float32":
        params = SamplingParams(temperature=0, max_new_tokens=8)
        prompts = [row[:5].tolist() for row in ids[:4]]
        got, want = (engines[m].generate(prompts, params) for m in ("adapters", "merged"))
        assert torch.equal(got.response_ids, want.response_ids), "adapter sync: other greedy tokens"
        worst = (got.rollout_log_probs - want.rollout_log_probs).abs().max().item()
        assert worst <= 1e-5, worst
    print(f"OK lora adapter sync {dtype} tp={ps.tp} pp={ps.pp}: log-prob diff {diff:.1e}, second sync "
          f"{stats['adapters'].bytes} bytes vs merged {stats['merged'].bytes}", flush=True)


def main():
    tp, pp = int(sys.argv[1]), int(sys.argv[2])
    ps = init_parallel(tp, pp)
    for family in ("llama", "qwen2"):
        check(ps, family)
    for dtype in ("float32", "bfloat16"):
        check_resume(ps, dtype)
    check_recompute(ps)
    for dtype in ("float32", "bfloat16"):
        check_adapter_sync(ps, dtype)
    dist.barrier()
    if ps.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
