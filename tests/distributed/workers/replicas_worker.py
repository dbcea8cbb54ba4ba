"""torchrun worker: rollout engine replicas (megappo.rollout.replicas) at a given TP x PP.

usage: torchrun --nproc_per_node N replicas_worker.py TP PP REPLICAS [REPLICAS ...]

For each replica count R: a tiny Llama actor (perturbed, so it differs from the engines' start) and an
hf engine on each of the R leader ranks; after one bridge sync every replica holds the actor's
weights bit for bit (checked on each leader against the tensors the bridge gathered there, and by the
replicas' own fingerprint checks), and the ReplicaSet's generation (prompts split over the R replicas)
gives the tokens rank 0's engine gives alone for the whole call, bitwise (log-probs <= 1e-5), with a
seed, in tempered and greedy sampling; then a replica whose engine corrupts what it loads makes the
sync raise WeightSyncError on every rank.
"""

import sys

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_experts import checkpoint_state
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel
from megappo.rollout import replicas
from megappo.rollout.bridge import WeightBridge
from megappo.rollout.engine import WeightSyncError
from megappo.rollout.hf.engine import HFEngine
from megappo.types import SamplingParams

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bridge_worker import CorruptingEngine, perturb  # noqa: E402

PROMPTS = [[5, 17, 42, 9], [7, 3], [250, 251, 252, 1, 2], [11, 12], [99], [3, 4, 5, 6, 7, 8], [40, 41, 42]]


def with_replicas(ps, model, cfg, count: int, engine_class=HFEngine):
    leader_ranks = replicas.leaders(ps.world_size, count)
    engine = engine_class(build_hf_model(cfg, seed=99), pad_token_id=0) if ps.rank in leader_ranks else None
    held = engine
    engine, server = replicas.connect(ps.rank, leader_ranks, engine, pad_token_id=0, bucket_bytes=64 << 10)
    bridge = WeightBridge(model, engine, bucket_bytes=64 << 10, verify_every=1, receivers=leader_ranks,
                          replica=server)
    return leader_ranks, engine, held, bridge


def check(ps, count: int) -> None:
    cfg = TINY_CONFIGS["llama"]
    model = build_model(dims_from_hf(cfg), ps, role="actor")
    load_hf_weights(model, checkpoint_state(build_hf_model(cfg, seed=5)))
    perturb(model, ps, salt=str(count))
    leader_ranks, engine, held, bridge = with_replicas(ps, model, cfg, count)
    stats = bridge.sync()
    assert stats.verified
    expected = dict(iter_hf_tensors(model, leader_ranks))
    dist.barrier()  # rank 0's sync returned: every replica applied it
    if held is not None:
        state = checkpoint_state(held.model)
        assert expected and all(torch.equal(state[n], t) for n, t in expected.items()), f"replica on rank {ps.rank}"
        print(f"OK R={count} replica on rank {ps.rank} holds the actor's weights", flush=True)
    if ps.rank == 0:
        assert engine.replicas == count, engine
        for params in (SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3),
                       SamplingParams(n=1, temperature=0.0, max_new_tokens=6)):
            split = engine.generate(PROMPTS, params)
            whole = engine.local.generate(PROMPTS, params)
            for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "prompt_index"):
                assert torch.equal(getattr(split, field), getattr(whole, field)), (count, field)
            assert split.finish_reasons == whole.finish_reasons
            diff = (split.rollout_log_probs - whole.rollout_log_probs).abs().max().item()
            assert diff <= 1e-5, diff
            print(f"OK R={count} same tokens as one engine (greedy={params.greedy}, max log-prob diff {diff:.2e})",
                  flush=True)
        engine.shutdown()

    # a replica that loads something else than it was sent: the sync fails on every rank
    bad_rank = leader_ranks[-1]
    _, engine, _, bridge = with_replicas(
        ps, model, cfg, count, engine_class=CorruptingEngine if ps.rank == bad_rank else HFEngine)
    try:
        bridge.sync()
    except WeightSyncError as e:
        assert "verification failed for 1 tensor" in str(e), e
        print(f"OK R={count} corrupted replica detected on rank {ps.rank}", flush=True)
    else:
        raise AssertionError("a corrupted replica was not detected")
    if ps.rank == 0:
        engine.shutdown()
    dist.barrier()


def main():
    tp, pp, *counts = map(int, sys.argv[1:])
    ps = init_parallel(tp, pp)
    for count in counts:
        check(ps, count)
    dist.barrier()
    if ps.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
