"""Moving experience between the orchestrator (global rank 0) and the DP replicas.

`broadcast_from_rank0(obj)` sends a Python object (tensors inside are fine) from rank 0 to
every rank; `dp_shard(n, ps)` is the slice of a global batch that this rank's DP replica
owns; `gather_to_rank0(ps, payload)` collects one payload per DP replica (from its
last-stage, tp-rank-0 rank, which holds full per-sample results) on rank 0, in DP order.

Objects are pickled by torch.distributed's object collectives: only megappo's own
in-process data goes through here, never files or anything a user supplies.

This module does not know about models or PPO.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megappo.parallel.state import ParallelState


def broadcast_from_rank0(obj: Any) -> Any:
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def dp_shard(n: int, ps: ParallelState) -> slice:
    """Rows [start, stop) of an n-row global batch for this DP replica (n % dp == 0)."""
    if n % ps.dp:
        raise ValueError(f"a batch of {n} samples does not split over dp={ps.dp} replicas")
    per = n // ps.dp
    return slice(ps.dp_rank * per, (ps.dp_rank + 1) * per)


def gather_to_rank0(ps: ParallelState, payload: Any) -> list[Any] | None:
    """On rank 0: the payloads of the DP replicas' leaders (is_mp_leader), in DP order."""
    mine = (ps.dp_rank, payload) if ps.is_mp_leader else None
    out = [None] * ps.world_size if ps.rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    if ps.rank != 0:
        return None
    found = sorted((x for x in out if x is not None), key=lambda x: x[0])
    return [p for _, p in found]
