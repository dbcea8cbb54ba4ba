"""torchrun worker: the weight-sync bridge at a given TP x PP.

usage: torchrun --nproc_per_node N bridge_worker.py TP PP [EP] [families=llama,qwen2]

For tiny Llama and Qwen2 (or the families named; MoE ones at expert parallelism EP, whose
engine holds transformers' fused experts and takes per-expert checkpoint names): the engine (rank 0) starts from other weights; the Megatron actor
is randomly perturbed; after a sync the engine's tensors equal the Megatron weights mapped
to HF names bit for bit and the fingerprints agree; a corrupted bucket raises
WeightSyncError on every rank; the engine's sampled-token log-probs equal the Megatron
actor's recomputed log-probs (fp32, max abs diff <= 1e-4).
"""

import sys
import zlib

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.forward import gather_vocab_logits, run_micro_batches
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_experts import checkpoint_state
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel
from megappo.rollout.bridge import WeightBridge, logprob_mismatch
from megappo.rollout.engine import WeightSyncError
from megappo.rollout.hf.engine import HFEngine
from megappo.types import SamplingParams


def corrupt_second_bucket(buckets):
    """The buckets, with one element of the second bucket's first tensor changed."""
    for i, bucket in enumerate(buckets):
        if i == 1:
            name, t = bucket[0]
            t = t.clone()
            t.view(-1)[0] += 1.0
            bucket = [(name, t)] + bucket[1:]
        yield bucket


def perturb(model, ps, salt: str = "") -> None:
    """Random noise on every Megatron weight, keyed by HF name: replicated tensors get the same
    noise on every TP rank, and a tied output layer (last stage) the same as the embedding."""
    with torch.no_grad():
        for _name, rule, param in model.named_parameters():
            shard = ps.tp_rank if rule.tp_dim is not None else 0
            gen = torch.Generator().manual_seed(zlib.crc32(f"{salt}{rule.hf[0]}/{shard}".encode()))
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


class CorruptingEngine(HFEngine):
    """The real hf engine, with one element of one tensor flipped on the way in."""

    def update_weights(self, buckets):
        super().update_weights(corrupt_second_bucket(buckets))


def megatron_log_probs(model, ids, mask, prompt_len):
    """[N, R] log-probs of ids[:, P:] under the Megatron actor, on every rank."""
    ps = model.ps
    outs = run_micro_batches(model, [{"input_ids": ids, "attention_mask": mask}],
                             lambda out, mb: (out.sum() * 0, out.detach()), forward_only=True)
    n, r = ids.shape[0], ids.shape[1] - prompt_len
    lp = torch.zeros(n, r)
    if ps.is_last_stage:
        logits = gather_vocab_logits(outs[0], model)[:, prompt_len - 1:-1]
        lp = logits.log_softmax(-1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
    if ps.pp > 1:
        dist.broadcast(lp, src=ps.pp_last_rank, group=ps.pp_group)
    return lp


def check(ps, family):
    cfg = TINY_CONFIGS[family]
    dims = dims_from_hf(cfg)
    model = build_model(dims, ps, role="actor")
    load_hf_weights(model, checkpoint_state(build_hf_model(cfg, seed=5)))
    perturb(model, ps)
    engine = HFEngine(build_hf_model(cfg, seed=99), pad_token_id=0) if ps.rank == 0 else None
    bridge = WeightBridge(model, engine, bucket_bytes=64 << 10, verify_every=1)
    stats = bridge.sync()
    assert stats.verified
    expected = dict(iter_hf_tensors(model))
    if ps.rank == 0:
        state = checkpoint_state(engine.model)  # fused experts read back per expert
        assert stats.buckets > 1 and stats.tensors == len(expected)
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), f"{family}: engine {name} != Megatron through the name map"
        print(f"OK {family} sync bit-exact tensors={stats.tensors} buckets={stats.buckets} "
              f"bytes={stats.bytes}", flush=True)

    # log-prob agreement after the sync
    box = [None]
    if ps.rank == 0:
        batch = engine.generate([[5, 17, 42, 9], [7, 3], [250, 251, 252, 1, 2]],
                                SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0,
                                               logprob_mode="untempered"))
        box = [batch]
    dist.broadcast_object_list(box, src=0)
    batch = box[0]
    ids, mask = batch.sequences()
    trainer_lp = megatron_log_probs(model, ids, mask, batch.prompt_ids.shape[1])
    stats = logprob_mismatch(batch.rollout_log_probs, trainer_lp * batch.response_mask, batch.response_mask)
    assert stats["rollout/logprob_diff_max"] <= 1e-4, stats
    if ps.rank == 0:
        print(f"OK {family} logprob agreement {stats}", flush=True)

    # a corrupted bucket is detected on every rank
    bad_engine = CorruptingEngine(build_hf_model(cfg, seed=99), pad_token_id=0) if ps.rank == 0 else None
    try:
        WeightBridge(model, bad_engine, bucket_bytes=64 << 10).sync()
    except WeightSyncError as e:
        assert "verification failed for 1 tensor" in str(e), e
        print(f"OK {family} corrupted bucket detected on rank {ps.rank}", flush=True)
    else:
        raise AssertionError("corrupted bucket not detected")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("families=")]
    families = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("families=")),
                    ["llama", "qwen2"])
    tp, pp = int(args[0]), int(args[1])
    ps = init_parallel(tp, pp, ep=int(args[2]) if len(args) > 2 else 1)
    for family in families:
        check(ps, family)
    dist.barrier()
    if ps.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
