"""A check for torchrun workers: full tensors streamed to several receiving ranks at once.

`check_receivers(ps, family)` builds a tiny LoRA actor of `family` at the layout `ps` (rank-4
adapters on every linear, B random, so the merged weights differ from the base ones) and, for
each receiver set (every rank, and sets without rank 0 taking tp, dp and pp ranks > 0), checks:
- each receiver yields the same (name, tensor) list as rank 0 does with dst=0, in the same
  order and bit for bit (dtype included), from `iter_hf_tensors` and `iter_adapter_tensors`;
  the other ranks yield nothing;
- a rank whose EP group's pipelines hold no receiver makes no torch.distributed call (which
  ranks share an EP group is read from the groups here, not from the rank order weights.py reads).
Prints "OK receivers <family> tp=.. pp=.. dp=.. ep=.." on rank 0; any failure raises.
"""

import contextlib
import functools
import zlib

import torch
import torch.distributed as dist

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_experts import checkpoint_state
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.lora import LoRA
from megappo.models.weights import iter_adapter_tensors, iter_hf_tensors, load_hf_weights

#: the torch.distributed calls megappo.models.weights makes
_CALLS = ("all_gather", "send", "recv", "broadcast_object_list")


def receiver_sets(world: int) -> list[frozenset[int]]:
    """Every rank; rank 1 alone; at 4 ranks also rank 2 alone and ranks 1 and 3."""
    sets = [frozenset(range(world)), frozenset({1})]
    if world == 4:
        sets += [frozenset({2}), frozenset({1, 3})]
    return sets


def lora_actor(ps, family):
    cfg = TINY_CONFIGS[family]
    model = build_model(dims_from_hf(cfg), ps, role="actor", lora=LoRA(rank=4, alpha=8.0))
    load_hf_weights(model, checkpoint_state(build_hf_model(cfg, seed=7)))
    with torch.no_grad():
        for name, _, param in model.named_parameters():
            layer = getattr(param, "lora_layer", None)
            if layer is not None:  # the same B on every replica of this shard (a row layer's B is whole)
                shard = ps.tp_rank if layer.lora_kind == "column" else 0
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + shard)
                layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen))
    return model


@contextlib.contextmanager
def counted_calls():
    """Count this rank's torch.distributed calls of `_CALLS` inside the block."""
    calls = []
    saved = {name: getattr(dist, name) for name in _CALLS}

    def counted(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def streams(model, dst):
    """(iter_hf_tensors' list, iter_adapter_tensors' list) on this rank."""
    return list(iter_hf_tensors(model, dst)), list(iter_adapter_tensors(model, dst))


def assert_same(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} tensors, rank 0 has {len(want)}"
    for g, w in zip(got, want):
        assert g[:-1] == w[:-1], f"{what}: {g[:-1]} where rank 0 has {w[:-1]}"
        assert g[-1].dtype == w[-1].dtype and torch.equal(g[-1], w[-1]), f"{what}: {w[:-1]} differs"


def check_receivers(ps, family):
    model = lora_actor(ps, family)
    reference = streams(model, 0)  # a collective: every rank runs it
    box = [reference if ps.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    want = box[0]
    assert want[0] and want[1], "nothing streamed to rank 0"
    dp_of = [None] * ps.world_size
    dist.all_gather_object(dp_of, ps.dp_rank)
    ep_group_dp = {dp_of[r] for r in dist.get_process_group_ranks(ps.ep_group)}
    for receivers in receiver_sets(ps.world_size):
        with counted_calls() as calls:
            got = streams(model, tuple(receivers))
        what = f"{family} tp={ps.tp} pp={ps.pp} dp={ps.dp} ep={ps.ep} rank {ps.rank} of receivers {sorted(receivers)}"
        if ps.rank in receivers:
            for g, w, stream in zip(got, want, ("hf tensors", "adapter tensors")):
                assert_same(g, w, f"{what}, {stream}")
        else:
            assert got == ([], []), f"{what}: a non-receiver yielded tensors"
        if not any(dp_of[r] in ep_group_dp for r in receivers):
            assert not calls, f"{what}: no receiver in this rank's EP group, yet it called {sorted(set(calls))}"
    dist.barrier()
    if ps.rank == 0:
        print(f"OK receivers {family} tp={ps.tp} pp={ps.pp} dp={ps.dp} ep={ps.ep} "
              f"sets={[sorted(s) for s in receiver_sets(ps.world_size)]} tensors={len(want[0])}", flush=True)
