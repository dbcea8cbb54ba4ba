"""torchrun worker: routing replay makes the trainer score the engine's tokens with the engine's experts.

usage: torchrun --nproc_per_node N replay_worker.py TP PP EP

A tiny Qwen3-MoE (4 experts, top-2, renormalised) whose router rows 0 and 1 differ by a small
delta: the engine (the hf engine, transformers) holds it as is, the trainer (Megatron, at the
given layout) with rows 0 and 1 swapped. The pair's logits then nearly tie and their order
flips between engine and trainer, so wherever the pair straddles the top-2 boundary the
trainer routes the token to another expert, while the gate weights of replayed routes change
by O(delta) only. With the engine's routes replayed, the trainer's log-probs of the engine's
sampled tokens equal the engine's within 1e-5 (packed and padded micro-batches); recomputing
the routes instead, they differ by far more and the count of differing routes is > 0. An
actor update with replay runs and its first micro-batch's ppo_kl is that small too.
Prints "OK <check>" lines; any failure raises.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import build_hf_model
from megappo.models.routing_replay import RouteReplay
from megappo.models.training import OptimSettings, make_trainable
from megappo.models.weights import load_hf_weights
from megappo.parallel.comm import broadcast_from_rank0
from megappo.parallel.packing import MicroBatching
from megappo.parallel.state import init_parallel
from megappo.rollout.hf.engine import HFEngine
from megappo.types import SamplingParams
from megappo.trainer.roles import Experience, PolicyWorker, SeqBatch, pass_metrics

TOL = 1e-5
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 96,
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu", "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.0,
}
DELTA = 3e-6


def save(model, path: str) -> str:
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    return path


def main():
    tp, pp, ep = (int(a) for a in sys.argv[1:4])
    ps = init_parallel(tp=tp, pp=pp, ep=ep)
    torch.manual_seed(0)
    hf = build_hf_model(CONFIG, seed=3)
    with torch.no_grad():  # rows 0 and 1 of every router: a near tie, +-DELTA apart
        for layer in hf.model.layers:
            w = layer.mlp.gate.weight
            delta = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(7)) * DELTA
            w[1] = w[0] - delta
            w[0] = w[0] + delta
    tmp = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    tmp = broadcast_from_rank0(tmp)
    engine_dir = save(hf, os.path.join(tmp, "engine"))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight[[0, 1]] = layer.mlp.gate.weight[[1, 0]].clone()
    trainer_dir = save(hf, os.path.join(tmp, "trainer"))

    batch = None
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        engine = HFEngine(AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32), pad_token_id=0)
        prompts = [[int(t) for t in torch.randint(1, 96, (2 + i % 5,), generator=torch.Generator().manual_seed(i))]
                   for i in range(4)]
        batch = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=5, return_routes=True))
    batch = broadcast_from_rank0(batch)
    ids, mask = batch.sequences()
    seqs = SeqBatch(input_ids=ids, attention_mask=mask, response_mask=batch.response_mask,
                    prompt_len=batch.prompt_ids.shape[1], routes=batch.routes)
    action = batch.response_mask.bool()

    dims = dims_from_hf(CONFIG)
    model = build_model(dims, ps, role="actor", moe_enable_routing_replay=True)
    load_hf_weights(model, trainer_dir)
    batchings = {"packed": MicroBatching(packed=True, max_tokens=24),
                 "padded": MicroBatching(packed=False, micro_batch_size=2)}
    for kind, batching in batchings.items():
        replayed = PolicyWorker(model, batching=batching, routing=RouteReplay(replay=True))
        lp = replayed.log_probs(seqs)
        differ = pass_metrics([replayed]).get("rollout/moe_routes_differ_frac")
        recomputed = PolicyWorker(model, batching=batching, routing=RouteReplay(replay=False))
        lp_own = recomputed.log_probs(seqs)
        differ_own = pass_metrics([recomputed]).get("rollout/moe_routes_differ_frac")
        plain = PolicyWorker(model, batching=batching).log_probs(seqs)
        if dist.get_rank() == 0:
            err = (lp - batch.rollout_log_probs)[action].abs().max().item()
            err_own = (lp_own - batch.rollout_log_probs)[action].abs().max().item()
            assert err <= TOL, f"{kind}: replayed log-probs differ from the engine's by {err}"
            assert err_own > 100 * TOL, f"{kind}: the perturbation changed no log-prob ({err_own})"
            assert differ is not None and differ > 0 and differ == differ_own, (differ, differ_own)
            assert torch.equal(lp_own, plain), "counting without replay changed the computation"
            print(f"OK {kind} replayed log-probs = engine's (max diff {err:.2e}); recomputed routes differ "
                  f"({differ:.3f} of routes, max log-prob diff {err_own:.2e})", flush=True)

    settings = OptimSettings(lr=1e-3, weight_decay=0.0)
    trainable = PolicyWorker(model, batching=batchings["packed"], routing=RouteReplay(),
                             trainable=make_trainable(model, settings))
    exp = Experience(seqs=seqs, old_log_probs=batch.rollout_log_probs, advantages=torch.randn(ids.shape[0],
                     batch.response_mask.shape[1], generator=torch.Generator().manual_seed(1)) * batch.response_mask)
    m = trainable.update(exp, mini_batch_size=ids.shape[0], epochs=1,
                         loss_mode="vanilla", loss_knobs=dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0),
                         loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False,
                         kl_loss_coef=0.0, kl_loss_type="low_var_kl", seed=0)
    if dist.get_rank() == 0:
        kl = abs(m["actor/ppo_kl_first_micro_batch"])
        assert kl <= TOL and m["actor/grad_norm"] > 0, m
        print(f"OK update with replay: first micro-batch ppo_kl {kl:.2e}, grad norm {m['actor/grad_norm']:.3e}")
        print("ALL OK", flush=True)
    dist.barrier()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
