"""torchrun worker (1 rank): the sglang engine's `sync_mode=distributed`, over gloo, without SGLang.

usage: torchrun --nproc_per_node 1 update_group_worker.py

SGLang cannot run on CPU, so the engine side is a stand-in for what it does: two
processes (the engine's TP workers, with a default process group of their own) join the
weight-update group the way `sglang.srt.utils.init_custom_process_group` does and receive
what `update_weights_from_distributed` receives (a flattened bucket, or tensor by tensor).
The trainer side is megappo's real code: a Megatron actor, the bridge, and SGLangEngine
holding the stand-in in place of `sglang.Engine`.

Checks: after a sync every engine worker holds the Megatron weights through the name map
bit for bit (both receive formats, and again after a second update on the same group); the
bridge's fingerprint verification reads them back through `get_weights_by_name`; a
corrupted transfer is detected; an engine-side failure raises WeightSyncError.
"""

import datetime
import json
import multiprocessing as mp
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megappo.models.builders import build_model
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.weights import iter_hf_tensors, load_hf_weights
from megappo.parallel.state import init_parallel
from megappo.rollout.bridge import WeightBridge
from megappo.rollout.engine import WeightSyncError
from megappo.rollout.sglang_engine import SGLangEngine
from megappo.rollout.update_group import free_port, outside_torchrun_store

ENGINE_TP = 2


# ---- the engine side: one process per engine TP rank ----

# rows of the tiny Llama's column-parallel weights on SGLang's first rank at engine TP=2 (4 heads
# of 16, 2 KV heads, FFN 128, vocabulary 300 padded to 320); the others are whole there
FIRST_RANK_ROWS = {"q_proj": 32, "k_proj": 16, "v_proj": 16, "gate_proj": 64, "up_proj": 64, "embed_tokens": 160,
                   "lm_head": 160}


def join_group(master_address, master_port, rank, world_size, group_name, backend):
    """As SGLang's init_custom_process_group: TCP rendezvous (rank 0, the trainer, hosts the store),
    keys prefixed by the group name."""
    timeout = datetime.timedelta(seconds=120)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def receive(group, names, dtypes, shapes, load_format):
    """As SGLang's receive_weights_from_distributed (flattened_bucket: byte offsets in order)."""
    dtypes = [getattr(torch, d) for d in dtypes]
    if load_format == "flattened_bucket":
        spans, offset = [], 0
        for dtype, shape in zip(dtypes, shapes):
            assert offset % dtype.itemsize == 0, "unaligned tensor in a flattened bucket"
            size = torch.Size(shape).numel() * dtype.itemsize
            spans.append((offset, size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        return {n: flat[o:o + s].view(d).view(shape).clone()
                for n, d, shape, (o, s) in zip(names, dtypes, shapes, spans)}
    weights = {n: torch.empty(shape, dtype=d) for n, d, shape in zip(names, dtypes, shapes)}
    handles = [dist.broadcast(w, src=0, group=group, async_op=True) for w in weights.values()]
    for h in handles:
        h.wait()
    return weights


def engine_worker(tp_rank, default_port, conn):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=tp_rank,
                            world_size=ENGINE_TP)
    groups, weights, corrupt_next, fail_next = {}, {}, False, False
    while True:
        cmd, kw = conn.recv()
        if cmd == "init":
            groups[kw["group_name"]] = join_group(kw["master_address"], kw["master_port"],
                                                  kw["rank_offset"] + tp_rank, kw["world_size"],
                                                  kw["group_name"], kw["backend"])
            conn.send((True, "ok"))
        elif cmd == "update":
            got = receive(groups[kw["group_name"]], kw["names"], kw["dtypes"], kw["shapes"], kw["load_format"])
            if corrupt_next:
                first = next(iter(got.values()))
                first.view(-1)[0] += 1.0
                corrupt_next = False
            weights.update(got)
            conn.send((False, "injected load failure") if fail_next else (True, "ok"))
            fail_next = False
        elif cmd == "get":
            # as SGLang: the first `truncate_size` rows (elements of a 1-D weight) that its first TP
            # rank holds, as float lists
            w = weights[kw["name"]]
            rows = next((n for part, n in FIRST_RANK_ROWS.items() if part in kw["name"]), w.shape[0])
            conn.send(w.float()[:min(rows, kw["truncate_size"])].tolist())
        elif cmd == "dump":
            conn.send(weights)
        elif cmd == "corrupt":
            corrupt_next = True
            conn.send(True)
        elif cmd == "fail":
            fail_next = True
            conn.send(True)
        elif cmd == "destroy":
            dist.destroy_process_group(groups.pop(kw["group_name"]))
            conn.send((True, "ok"))
        elif cmd == "exit":
            conn.send(True)
            return


class EngineStandIn:
    """The part of sglang.Engine that megappo's distributed sync calls, forwarded to the workers."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(ENGINE_TP):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=engine_worker, args=(r, port, theirs), daemon=True)
            with outside_torchrun_store():  # as SGLangEngine starts sglang.Engine
                proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def _all(self, cmd, **kw):
        for c in self.conns:
            c.send((cmd, kw))
        replies = [c.recv() for c in self.conns]
        bad = [msg for ok, msg in replies if not ok]
        return (False, "; ".join(bad)) if bad else (True, "ok")

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        return self._all("init", master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                         world_size=world_size, group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        return self._all("update", names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                         load_format=load_format)

    def destroy_weights_update_group(self, group_name):
        return self._all("destroy", group_name=group_name)

    def begin_weight_update(self):
        return True, "ok"

    def end_weight_update(self):
        return True, "ok"

    def flush_cache(self):
        return True

    def get_weights_by_name(self, name, truncate_size=100):
        self.conns[0].send(("get", {"name": name, "truncate_size": truncate_size}))
        return self.conns[0].recv()

    def tell(self, cmd, rank=0):
        self.conns[rank].send((cmd, {}))
        return self.conns[rank].recv()

    def dump(self):
        return [self.tell("dump", r) for r in range(ENGINE_TP)]

    def shutdown(self):
        for r in range(ENGINE_TP):
            self.tell("exit", r)
        for p in self.procs:
            p.join(timeout=30)


class PerTensorStandIn(EngineStandIn):
    """An SGLang whose update_weights_from_distributed has no load_format: one broadcast per tensor."""

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True):
        return self._all("update", names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                         load_format=None)


def check_engine_holds(stand_in, model, label):
    expected = dict(iter_hf_tensors(model))
    for rank, held in enumerate(stand_in.dump()):
        assert set(held) == set(expected), f"{label}: engine rank {rank} got {sorted(set(expected) ^ set(held))}"
        for name, tensor in expected.items():
            assert torch.equal(held[name], tensor), f"{label}: engine rank {rank} {name} != Megatron"
    print(f"OK {label} bit-exact on {ENGINE_TP} engine ranks ({len(expected)} tensors)", flush=True)


def main():
    ps = init_parallel(1, 1)
    cfg = TINY_CONFIGS["llama"]
    model = build_model(dims_from_hf(cfg), ps, role="actor")
    load_hf_weights(model, build_hf_model(cfg, seed=5).state_dict())
    model_dir = tempfile.mkdtemp(prefix="megappo-update-group-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)  # the engine's read-back knows the model's dims from it
    for label, cls in (("flattened", EngineStandIn), ("per-tensor", PerTensorStandIn)):
        stand_in = cls()
        engine = SGLangEngine(model_dir, pad_token_id=0, dtype="float32", sync_mode="distributed", engine=stand_in,
                              engine_args={"tp_size": ENGINE_TP}, update_backend="gloo")
        bridge = WeightBridge(model, engine, bucket_bytes=64 << 10, verify_every=1)
        stats = bridge.sync()
        assert stats.verified and stats.buckets > 1, stats
        check_engine_holds(stand_in, model, f"{label} sync")

        with torch.no_grad():
            for _, _, param in model.named_parameters():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.01)
        bridge.sync()  # the same group again
        check_engine_holds(stand_in, model, f"{label} second sync")

        stand_in.tell("corrupt")
        try:
            bridge.sync()
        except WeightSyncError as e:
            assert "verification failed for 1 tensor" in str(e), e
            print(f"OK {label} corrupted transfer detected", flush=True)
        else:
            raise AssertionError("corrupted transfer not detected")

        stand_in.tell("fail", rank=1)
        try:
            bridge.sync()
        except WeightSyncError as e:
            assert "injected load failure" in str(e), e
            print(f"OK {label} engine failure raised", flush=True)
        else:
            raise AssertionError("engine failure not raised")
        engine.shutdown()
    print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
