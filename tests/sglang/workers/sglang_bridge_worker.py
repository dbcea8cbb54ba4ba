"""torchrun worker: the real bridge into a real SGLang engine (CPU lane) at a given TP x PP.

usage: torchrun --nproc_per_node N sglang_bridge_worker.py TP PP MODE[,MODE...] MODEL_DIR [DTYPE]

Rank 0 starts one SGLang engine from MODEL_DIR (a tiny Llama with other weights than the
actor's); each sync mode wraps that engine (`SGLangEngine(engine=...)`). For every mode the
Megatron actor is perturbed again, synced with fingerprint verification (as shipped, every
tensor), and the engine's sampled-token log-probs must equal the Megatron actor's within 1e-5
(fp32). Then a bucket corrupted on its way into the engine must be detected on every rank.
With DTYPE=bfloat16 (every GPU recipe's setting) actor and engine are bf16: the fingerprints
compare bf16 tensors, and the log-probs of the two bf16 computations agree on average within
3 x megappo.models.precision.COMPARE_TOL["bfloat16"] and at most within 0.1 (measured: mean
1.0e-2, max 2.9e-2; Megatron alone is within 3.7e-3 of the exact values, so most of it is
SGLang's CPU bf16 path, which was not examined further).
"""

import sys

import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.precision import COMPARE_TOL
from megappo.models.weights import load_hf_weights
from megappo.parallel.state import init_parallel
from megappo.rollout.bridge import WeightBridge, logprob_mismatch
from megappo.rollout.engine import WeightSyncError
from megappo.rollout.sglang_engine import SGLangEngine
from megappo.types import SamplingParams

sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/distributed/workers")
from bridge_worker import corrupt_second_bucket, megatron_log_probs, perturb  # noqa: E402


class CorruptingSGLangEngine(SGLangEngine):
    """The real SGLang engine, with one element of the second bucket's first tensor changed on the way in."""

    def update_weights(self, buckets):
        super().update_weights(corrupt_second_bucket(buckets))


def main():
    tp, pp, modes, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    # (mean, max) |engine - trainer| over the sampled tokens
    tol = (1e-5, 1e-5) if dtype == "float32" else (3 * COMPARE_TOL[dtype], 0.1)
    ps = init_parallel(tp, pp)
    cfg = TINY_CONFIGS["llama"]
    model = build_model(dims_from_hf(cfg), ps, role="actor", dtype=dtype)
    load_hf_weights(model, build_hf_model(cfg, seed=5).state_dict())
    sgl = None
    if ps.rank == 0:
        sgl = SGLangEngine(model_dir, pad_token_id=0, dtype=dtype,
                           engine_args={"max_total_tokens": 2048, "random_seed": 0}).engine
    for mode in modes:
        perturb(model, ps, salt=f"{mode}/")
        engine = SGLangEngine(model_dir, pad_token_id=0, dtype=dtype, sync_mode=mode, engine=sgl) \
            if ps.rank == 0 else None
        for _ in range(2):  # the second sync reuses what the first set up (distributed: the update group)
            stats = WeightBridge(model, engine, bucket_bytes=64 << 10, verify_every=1).sync()
            assert stats.verified and (stats.buckets > 1 or ps.rank != 0)
        box = [None]
        if ps.rank == 0:
            box = [engine.generate([[5, 17, 42, 9], [7, 3], [250, 251, 252, 1, 2]],
                                   SamplingParams(n=2, temperature=1.0, max_new_tokens=8))]
        dist.broadcast_object_list(box, src=0)
        batch = box[0]
        ids, mask = batch.sequences()
        trainer_lp = megatron_log_probs(model, ids, mask, batch.prompt_ids.shape[1])
        lp = logprob_mismatch(batch.rollout_log_probs, trainer_lp * batch.response_mask, batch.response_mask)
        assert lp["rollout/logprob_diff_mean"] <= tol[0] and lp["rollout/logprob_diff_max"] <= tol[1], (mode, lp)
        if ps.rank == 0:
            print(f"OK {mode} tp={tp} pp={pp} {dtype} verified sync x2 tensors={stats.tensors} buckets={stats.buckets} "
                  f"logprob_diff_max={lp['rollout/logprob_diff_max']:.2e}", flush=True)
            if mode == "distributed":
                engine.close_update_group()
    bad = CorruptingSGLangEngine(model_dir, pad_token_id=0, dtype=dtype, engine=sgl) if ps.rank == 0 else None
    try:
        WeightBridge(model, bad, bucket_bytes=64 << 10).sync()
    except WeightSyncError as e:
        assert "verification failed for 1 tensor" in str(e), e
        print(f"OK corrupted bucket detected on rank {ps.rank}", flush=True)
    else:
        raise AssertionError("corrupted bucket not detected")
    dist.barrier()
    if ps.rank == 0:
        SGLangEngine(model_dir, pad_token_id=0, engine=sgl).shutdown()
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    # without the interpreter's teardown (megappo.parallel.launch): tearing down a rank's twenty-odd
    # gloo groups at exit, while rank 0 still stops its engine, now and then aborted rank 1 (SIGABRT,
    # "terminate called without an active exception") after every check had passed
    exit_rank(main())
