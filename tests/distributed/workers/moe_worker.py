"""torchrun worker: MoE models (Qwen3-MoE, Mixtral) vs transformers at a TP x PP x EP layout.

usage: torchrun --nproc_per_node N moe_worker.py TP PP EP [families=qwen3_moe,mixtral]

Each data-parallel rank takes its own rows of a batch (so experts see tokens from every EP
rank); the reference is transformers' model on the whole batch. Built from config in-process:
  1. logits equal transformers' (fp32, max abs diff <= 1e-4), with and without left padding;
  2. (TP=1) gradients of sum(logits * W) over the whole batch, with the aux loss off, equal
     transformers' parameter by parameter: dense grads summed over the data-parallel group,
     expert grads over the expert-data-parallel group (what Megatron's DDP reduces);
  3. gathering back to HF checkpoint names (experts over EP and TP) is bit-exact;
  4. the router metrics (load-balancing loss, per-layer expert load, tokens dropped) reduced
     over all ranks equal those computed from transformers' routers on the whole batch;
  5. full tensors stream to several receiving ranks as to rank 0 (workers/receivers_check.py,
     Qwen3-MoE), and at 4 ranks in two more layouts over the same ranks: TP=1 x EP=2 x DP=4 (two
     EP groups) and a dense Llama at TP=2 x PP=2.
Prints "OK <check>" lines; any failure raises.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.forward import run_micro_batches
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_experts import checkpoint_state
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.moe_metrics import RouterStats
from megappo.models.name_map import shard_for_tp
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import add_layout, init_parallel
from receivers_check import check_receivers

TOL = 1e-4
ROWS = 4  # rows per data-parallel rank


def check(ps, family, input_ids, attn):
    cfg = TINY_CONFIGS[family]
    hf = build_hf_model(cfg, seed=7)
    hf_state = checkpoint_state(hf)
    dims = dims_from_hf(cfg)
    no_aux = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    model = build_model(dims, ps, role="actor", **no_aux)
    load_hf_weights(model, hf_state)
    per = model.padded_vocab // ps.tp
    vs = slice(ps.tp_rank * per, (ps.tp_rank + 1) * per)
    V = dims.vocab_size
    mine = slice(ps.dp_rank * ROWS, (ps.dp_rank + 1) * ROWS)

    # 1. logits on this rank's rows, full and left-padded
    with torch.no_grad():
        ref = hf(input_ids=input_ids).logits[mine]
        ref_pad = hf(input_ids=input_ids, attention_mask=attn).logits[mine]
    for name, batch, expect in (("plain", {"input_ids": input_ids[mine]}, ref),
                                ("left-padded", {"input_ids": input_ids[mine], "attention_mask": attn[mine]}, ref_pad)):
        mbs = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, ROWS, 2)]
        outs = run_micro_batches(model, mbs, lambda out, mb: (out.sum() * 0, out.detach()), forward_only=True)
        if ps.is_last_stage:
            got = torch.cat(outs)
            exp = torch.zeros(got.shape[:2] + (model.padded_vocab,))
            exp[..., :V] = expect
            valid = attn[mine].bool() if "attention_mask" in batch else torch.ones_like(attn[mine], dtype=torch.bool)
            diff = (got - exp[..., vs])[valid].abs().max().item()
            assert diff <= TOL, f"{family} {name} logits differ by {diff}"
            print(f"OK {family} logits {name} tp={ps.tp} pp={ps.pp} ep={ps.ep} max_diff={diff:.2e}", flush=True)

    # 2. gradients (Megatron needs sequence parallelism to train MoE with TP > 1: GPU only)
    if ps.tp == 1:
        gen = torch.Generator().manual_seed(3)
        W = torch.randn(input_ids.shape + (V,), generator=gen)
        hf.zero_grad()
        (hf(input_ids=input_ids).logits * W).sum().backward()
        hf_grads = checkpoint_state_of_grads(hf)
        Wp = torch.zeros(input_ids.shape + (model.padded_vocab,))
        Wp[..., :V] = W
        mbs = [{"input_ids": input_ids[mine][i:i + 2], "w": Wp[mine][i:i + 2]} for i in range(0, ROWS, 2)]
        for p in (p for c in model.chunks for p in c.parameters()):
            p.grad = None
        run_micro_batches(model, mbs, lambda out, mb: ((out * mb["w"]).sum(), None), forward_only=False)
        from megatron.core import parallel_state as mps

        with ps.active():
            expert_dp_group = mps.get_expert_data_parallel_group()
        checked = experts = 0
        for name, rule, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=expert_dp_group if rule.expert else ps.dp_group)
            full = rule.from_hf(*(hf_grads[n] for n in rule.hf))
            expect = shard_for_tp(full, rule, ps.tp_rank, ps.tp)
            diff = (grad - expect).abs().max().item()
            scale = expect.abs().max().item() + 1e-6
            assert diff <= 1e-4 * max(1.0, scale), f"{family} grad {name} differs by {diff} (scale {scale})"
            checked += 1
            experts += rule.expert
        print(f"OK {family} grads tp={ps.tp} pp={ps.pp} ep={ps.ep} params_checked={checked} experts={experts}",
              flush=True)

    # 4. router statistics over all ranks' rows equal those of transformers' routers
    with RouterStats(model) as stats:
        mbs = [{"input_ids": input_ids[mine][i:i + 2]} for i in range(0, ROWS, 2)]
        run_micro_batches(model, mbs, lambda out, mb: (out.sum() * 0, None), forward_only=True)
    got = stats.metrics("actor")
    expect = hf_router_metrics(hf, input_ids, dims)
    assert set(got) == set(expect), set(got) ^ set(expect)
    for key, value in expect.items():
        assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), f"{family} {key}: {got[key]} != {value}"
    assert got["actor/moe_tokens_dropped"] == 0 and got["actor/moe_aux_loss"] > 0
    if ps.rank == 0:
        print(f"OK {family} router metrics {got}", flush=True)

    # 3. gather back to HF checkpoint names: bit-exact
    got = dict(iter_hf_tensors(model))
    if ps.rank == 0:
        assert set(got) == set(hf_state), set(got) ^ set(hf_state)
        for k, v in hf_state.items():
            assert torch.equal(got[k], v), f"{family} gather {k} not bit-exact"
        print(f"OK {family} gather bit-exact tensors={len(got)}", flush=True)


def hf_router_metrics(hf, input_ids, dims):
    """RouterStats' metrics computed from transformers' routers on the whole batch."""
    logits = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0]))
             for i, layer in enumerate(hf.model.layers) if dims.moe_layer_pattern[i]]
    with torch.no_grad():
        hf(input_ids=input_ids)
    for h in hooks:
        h.remove()
    E, k, out, aux = dims.num_experts, dims.moe_topk, {}, []
    for i, lg in sorted(logits.items()):
        probs = lg.float().softmax(-1)  # [T, E]
        routed = torch.zeros(E).index_add_(0, probs.topk(k, -1).indices.flatten(), torch.ones(probs.shape[0] * k))
        aux.append(float(E * ((routed / (probs.shape[0] * k)) * probs.mean(0)).sum()))
        out[f"actor/moe_load_max_over_mean/layer_{i}"] = float(routed.max() / routed.mean())
    out["actor/moe_aux_loss"] = sum(aux) / len(aux)
    out["actor/moe_load_max_over_mean"] = max(v for key, v in out.items() if "/layer_" in key)
    out["actor/moe_tokens_dropped"] = 0.0
    return out


def checkpoint_state_of_grads(hf):
    """The HF model's gradients under checkpoint names (per expert)."""
    from megappo.models.hf_experts import checkpoint_views

    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in hf.named_parameters()}
    return checkpoint_views(grads, hf.config.model_type)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("families=")]
    families = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("families=")),
                    ["qwen3_moe", "mixtral"])
    tp, pp, ep = (int(a) for a in args[:3])
    ps = init_parallel(tp, pp, ep=ep)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 300, (ROWS * ps.dp, 12), generator=gen)
    attn = torch.ones_like(input_ids)
    attn[0, :3] = 0
    attn[ROWS - 1, :5] = 0
    for family in families:
        check(ps, family, input_ids, attn)
    check_receivers(ps, "qwen3_moe")
    if ps.world_size == 4:
        check_receivers(add_layout(ps, 1, 1, ep=2), "qwen3_moe")
        check_receivers(add_layout(ps, 2, 2), "llama")
    dist.barrier()
    if ps.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
