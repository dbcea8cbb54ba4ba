"""torchrun worker: Megatron models vs transformers at a given TP x PP (one launch, many checks).

usage: torchrun --nproc_per_node N model_worker.py TP PP [VPP] [families=llama,qwen2]

For tiny Llama (untied) and Qwen2 (tied, qkv bias), or the families named (Qwen3: q/k norms,
head_dim != hidden/heads), built from config in this process:
  1. logits equal transformers' (fp32, max abs diff <= 1e-4), with and without left padding;
  2. gradients of a fixed linear function of the logits equal transformers' gradients,
     parameter by parameter through the name map (TP shards compared to the HF tensor's shard);
  3. gathering the sharded model back to HF tensors is bit-exact;
  4. a critic (value head) returns [B, T] values equal to HF TokenClassification's.
Prints "OK <check>" lines; any failure raises.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.forward import run_micro_batches
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.name_map import shard_for_tp
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel

TOL = 1e-4


def vocab_slice(ps, padded_vocab):
    per = padded_vocab // ps.tp
    return slice(ps.tp_rank * per, (ps.tp_rank + 1) * per)


def check_lm(ps, family, input_ids, attn):
    cfg = TINY_CONFIGS[family]
    hf = build_hf_model(cfg, seed=7)
    dims = dims_from_hf(cfg)
    model = build_model(dims, ps, role="actor")
    load_hf_weights(model, hf.state_dict())
    vs = vocab_slice(ps, model.padded_vocab)
    V = dims.vocab_size

    # 1. logits, full and left-padded
    with torch.no_grad():
        ref = hf(input_ids=input_ids).logits
        ref_pad = hf(input_ids=input_ids, attention_mask=attn).logits
    for name, batch, expect in (("plain", {"input_ids": input_ids}, ref),
                                ("left-padded", {"input_ids": input_ids, "attention_mask": attn}, ref_pad)):
        mbs = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, input_ids.shape[0], 2)]
        outs = run_micro_batches(model, mbs, lambda out, mb: (out.sum() * 0, out.detach()), forward_only=True)
        if ps.is_last_stage:
            got = torch.cat(outs)
            exp = torch.zeros(got.shape[:2] + (model.padded_vocab,))
            exp[..., :V] = expect
            exp = exp[..., vs]
            valid = attn.bool() if "attention_mask" in batch else torch.ones_like(attn, dtype=torch.bool)
            diff = (got - exp)[valid].abs().max().item()
            assert diff <= TOL, f"{family} {name} logits differ by {diff}"
            print(f"OK {family} logits {name} tp={ps.tp} pp={ps.pp} max_diff={diff:.2e}", flush=True)

    # 2. gradients of sum(logits * W)
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(input_ids.shape + (V,), generator=gen)
    hf.zero_grad()
    (hf(input_ids=input_ids).logits * W).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    if dims.tie_word_embeddings:
        hf_grads.setdefault("lm_head.weight", hf_grads["model.embed_tokens.weight"])
    Wp = torch.zeros(input_ids.shape + (model.padded_vocab,))
    Wp[..., :V] = W
    Wp = Wp[..., vs]
    mbs = [{"input_ids": input_ids[i:i + 2], "w": Wp[i:i + 2]} for i in range(0, input_ids.shape[0], 2)]
    for p in (p for c in model.chunks for p in c.parameters()):
        p.grad = None
    run_micro_batches(model, mbs, lambda out, mb: ((out * mb["w"]).sum(), None), forward_only=False)
    checked = 0
    for name, rule, param in model.named_parameters():
        if dims.tie_word_embeddings and ps.pp > 1 and "word_embeddings" in name or name == "output_layer.weight" and dims.tie_word_embeddings:
            continue  # tied copies on two stages: Megatron sums them in finalize_model_grads (DDP)
        full = rule.from_hf(*(hf_grads[n] for n in rule.hf))
        expect = shard_for_tp(full, rule, ps.tp_rank, ps.tp)
        grad = param.grad
        if ps.tp > 1 and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            # each TP rank holds its heads' part; finalize_model_grads sums them over TP
            grad = grad.clone()
            dist.all_reduce(grad, group=ps.tp_group)
        diff = (grad - expect).abs().max().item()
        scale = expect.abs().max().item() + 1e-6
        assert diff <= 1e-4 * max(1.0, scale), f"{family} grad {name} differs by {diff} (scale {scale})"
        checked += 1
    print(f"OK {family} grads tp={ps.tp} pp={ps.pp} params_checked={checked}", flush=True)

    # 3. gather back to HF: bit-exact
    hf_state = hf.state_dict()
    got = dict(iter_hf_tensors(model))
    if ps.rank == 0:
        expected = {k: v for k, v in hf_state.items() if not (dims.tie_word_embeddings and k == "lm_head.weight")}
        assert set(got) == set(expected), set(got) ^ set(expected)
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"{family} gather {k} not bit-exact"
        print(f"OK {family} gather bit-exact tensors={len(got)}", flush=True)


def check_critic(ps, family, input_ids):
    cfg = TINY_CONFIGS[family]
    hf = build_hf_model(cfg, seed=11, head="token")
    dims = dims_from_hf(cfg)
    model = build_model(dims, ps, role="critic")
    skipped = load_hf_weights(model, hf.state_dict())
    assert skipped == [], skipped
    with torch.no_grad():
        ref = hf(input_ids=input_ids).logits.squeeze(-1)
    mbs = [{"input_ids": input_ids[:2]}, {"input_ids": input_ids[2:]}]
    outs = run_micro_batches(model, mbs, lambda out, mb: (out.sum() * 0, out.detach()), forward_only=True)
    if ps.is_last_stage:
        values = torch.cat(outs)
        assert values.shape == input_ids.shape, values.shape
        diff = (values - ref).abs().max().item()
        assert diff <= TOL, f"critic values differ by {diff}"
        print(f"OK {family} critic values shape={tuple(values.shape)} max_diff={diff:.2e}", flush=True)
    # from an LM checkpoint without a score head: the head stays at its init
    lm = build_hf_model(cfg, seed=11)
    model2 = build_model(dims, ps, role="critic")
    skipped = load_hf_weights(model2, lm.state_dict())
    if ps.is_last_stage:
        assert any(s.startswith("output_layer.") for s in skipped), skipped
    print(f"OK {family} critic from LM checkpoint (value head initialised)", flush=True)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("families=")]
    families = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("families=")),
                    ["llama", "qwen2"])
    tp, pp = int(args[0]), int(args[1])
    vpp = int(args[2]) if len(args) > 2 else None
    ps = init_parallel(tp, pp, vpp)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 300, (4, 12), generator=gen)
    attn = torch.ones_like(input_ids)
    attn[0, :3] = 0
    attn[2, :5] = 0
    for family in families:
        check_lm(ps, family, input_ids, attn)
        check_critic(ps, family, input_ids)
    dist.barrier()
    if ps.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
