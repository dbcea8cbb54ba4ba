"""A process group between the trainer's rank 0 and an inference engine's ranks, for weight updates.

SGLang's `update_weights_from_distributed` receives weights over a process group of its
own, separate from both the trainer's world and the engine's TP world: rank 0 is the
trainer (the sender), ranks 1..tp are the engine's TP workers. Each side joins with
`init_custom_process_group` semantics: a TCP rendezvous at `master_address:master_port`
(the trainer side hosts the store, listening on that address only: megappo.parallel.listen;
127.0.0.1 by default, megappo.rollout.sglang_engine's `update_address`), keys prefixed with the group name, then torch's own
process-group constructor. `open_update_group` does the trainer's half the same way, so the
two halves meet in the same store namespace.

A bucket travels as one flat uint8 buffer: each tensor's bytes in order, no padding
(SGLang's `load_format="flattened_bucket"`, which rebuilds the tensors from the names,
dtypes and shapes sent with the request; all tensors of a bucket share the engine's dtype,
so every tensor starts aligned).

Weights never pass through the trainer's default process group, so other ranks need not
take part, and the engine may run on GPUs the trainer does not use.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megappo.parallel.listen import store_server
from megappo.rollout.engine import Bucket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_update_group(*, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
                      backend: str = "nccl", timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group; every member calls this with the same address and name."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # not c10d.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE) it would only connect, and no one would host
    if rank == 0:  # listens on master_address only (torch's own TCPStore would listen on every interface)
        store = store_server(master_address, master_port, world_size, timeout=timeout, multi_tenant=True)
    else:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=timeout)
    # members' group ranks are their ranks in this group, whatever their default-group ranks are
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@contextlib.contextmanager
def outside_torchrun_store():
    """Start the engine's processes inside this: under torchrun, TORCHELASTIC_USE_AGENT_STORE
    tells every rendezvous to connect to the launcher's store instead of hosting one, and
    the engine's workers (which inherit the environment) set up process groups of their own."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten_bucket(bucket: Bucket, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, dict]:
    """One uint8 buffer holding the bucket's tensors (cast to `dtype`) back to back, and the metadata to rebuild it."""
    parts = [t.to(device=device, dtype=dtype).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    meta = {"names": [name for name, _ in bucket], "dtypes": [dtype_name(dtype)] * len(bucket),
            "shapes": [list(t.shape) for _, t in bucket]}
    return torch.cat(parts), meta
