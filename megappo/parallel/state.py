"""Process groups, set up once: torch.distributed + Megatron-Core model parallelism.

`init_parallel(tp, pp, ...)` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; a single process without them), starts the process group
(NCCL on GPU, gloo on CPU), activates the CPU compatibility layer when there is no CUDA,
calls Megatron-Core's `initialize_model_parallel`, seeds the model-parallel RNG trackers,
and returns a frozen `ParallelState`. Builders, the bridge and the workers take that object
as an argument; nothing below this module calls Megatron's global getters for layout.

Expert parallelism (`ep` > 1, MoE models): each expert-parallel group of `ep` ranks splits
the experts; Megatron's expert tensor parallelism is the model's TP (its default), so an
expert's TP shards live on the same ranks as the attention's, and experts are data-parallel
over `dp // ep` ranks (Megatron's expert-data-parallel group).

Context parallelism (`cp` > 1, megappo.parallel.context): each packed sequence is split over a
context-parallel group of `cp` ranks that share a data-parallel rank; Megatron's rank order
tp-cp-ep-dp-pp puts them next to the TP ranks, and its DDP and distributed optimizer reduce
gradients over the data-parallel group with context parallel (dp x cp ranks). Not with `ep` > 1.

Roles may use different layouts over the same ranks (e.g. actor TP=2, critic PP=2):
`add_layout(ps, tp, pp, ep=..., cp=...)` builds another set of Megatron groups and returns its own
`ParallelState`. Megatron-Core keeps its groups (and RNG tracker) in module globals that
its schedules, DDP, optimizer and checkpointing read; each `ParallelState` holds a
snapshot of those globals, and `with ps.active():` installs it for the block. The model
functions in megappo.models enter their model's layout themselves, so callers never do.

This module does not know about models, configs (beyond their error type) or PPO.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import re
import warnings

import torch
import torch.distributed as dist

from megappo.errors import ConfigError
from megappo.parallel import cpu_compat, stage
from megappo.parallel.listen import LOOPBACK, store_server


class ParallelConfigError(ConfigError):
    """A parallel layout that cannot work; the message says how to fix it (a ConfigError, so the
    CLI reports it as bad input)."""


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """The layout of this process within the world. Built once by `init_parallel`."""

    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str
    device: torch.device
    tp_group: dist.ProcessGroup = dataclasses.field(repr=False)
    pp_group: dist.ProcessGroup = dataclasses.field(repr=False)
    dp_group: dist.ProcessGroup = dataclasses.field(repr=False)
    mp_group: dist.ProcessGroup = dataclasses.field(repr=False)
    #: rank (global) of the first stage in this rank's pipeline, with the same tp/dp rank
    pp_first_rank: int = 0
    #: rank (global) of the last stage in this rank's pipeline, with the same tp/dp rank
    pp_last_rank: int = 0
    #: expert parallelism: experts are split over `ep` ranks of the data-parallel dimension
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = dataclasses.field(default=None, repr=False)
    #: context parallelism: each packed sequence split over `cp` ranks of one data-parallel replica
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = dataclasses.field(default=None, repr=False)
    #: Megatron-Core's module globals for this layout (groups, RNG tracker); see `active()`
    megatron_globals: dict | None = dataclasses.field(default=None, repr=False, compare=False)

    @contextlib.contextmanager
    def active(self):
        """Make this layout Megatron-Core's global one inside the block (nests; restores on exit)."""
        if self.megatron_globals is None:
            yield
            return
        saved = _megatron_globals()
        _install_globals(self.megatron_globals)
        try:
            yield
        finally:
            _install_globals(saved)

    @property
    def layout(self) -> tuple[int, int, int | None]:
        return self.tp, self.pp, self.vpp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (Megatron's expert-data-parallel size)."""
        return self.dp // self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_mp_leader(self) -> bool:
        """tp_rank 0 and cp_rank 0 on the last stage: the rank that holds full per-token results (the
        other CP ranks of the replica hold the same ones)."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.is_last_stage


def check_layout(world_size: int, tp: int, pp: int, vpp: int | None = None, ep: int = 1, cp: int = 1) -> int:
    """Validate a TP x PP (x CP, x EP) layout against the world size; returns the DP size."""
    if tp < 1 or pp < 1 or cp < 1:
        raise ParallelConfigError(f"parallel.tp={tp}, parallel.pp={pp} and parallel.cp={cp} must all be >= 1. "
                                  "Fix: e.g. parallel.tp=1.")
    if world_size % (tp * pp * cp) != 0:
        names, sizes = ("tp*pp*cp", f"{tp}*{pp}*{cp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
        keys = "parallel.tp/parallel.pp" + ("/parallel.cp" if cp > 1 else "")
        raise ParallelConfigError(
            f"world size {world_size} is not a multiple of {names} = {sizes} = {tp * pp * cp}. "
            f"Fix: launch a multiple of {tp * pp * cp} processes (torchrun --nproc_per_node), "
            f"or choose {keys} whose product divides {world_size}."
        )
    if cp > 1 and ep > 1:
        raise ParallelConfigError(f"parallel.cp={cp} with parallel.ep={ep}: context parallelism with expert "
                                  "parallelism is not supported yet. Fix: set parallel.ep=1 or parallel.cp=1.")
    if vpp is not None and (vpp < 1 or pp < 2):
        raise ParallelConfigError(
            f"parallel.vpp={vpp} needs parallel.pp >= 2 and vpp >= 1. Fix: set parallel.vpp=null "
            "to disable virtual pipeline stages."
        )
    dp = world_size // (tp * pp * cp)
    if ep < 1 or dp % ep:
        # Megatron: expert TP = tp, so tp * ep * pp * expert_dp = world, i.e. ep divides dp
        valid = [e for e in range(1, dp + 1) if dp % e == 0]
        raise ParallelConfigError(
            f"parallel.ep={ep} must divide the data-parallel size world/(tp*pp) = {world_size}/({tp}*{pp}) = {dp} "
            f"(experts are split over data-parallel ranks). Fix: choose parallel.ep from {valid}, or launch "
            f"{tp * pp * ep} x k processes."
        )
    return dp


def _torchrun_env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, world, local


#: Upstream warnings that say nothing actionable to a megappo user, on every device:
#: megatron-core 0.16.1's own config default, and torch's deprecations inside
#: megatron-core's dist-checkpointing code.
_UPSTREAM_WARNINGS = (
    "full scope is deprecated",
    "`load_state_dict` is deprecated",
    "Please use DTensor instead",
)
#: Megatron-Core's notes that TE / apex are absent, from several of its modules as they are imported
#: (the same text from two of them): on CPU absent by design (not shown); on a GPU each text is
#: shown once, by rank 0 (every rank has the same installation).
_TE_APEX_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
)
#: On CPU, CUDA stream settings do not apply.
_CPU_WARNINGS = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def _quiet_warnings(cpu: bool, rank: int) -> None:
    for pattern in _UPSTREAM_WARNINGS + (_CPU_WARNINGS if cpu else ()):
        warnings.filterwarnings("ignore", message=f".*{pattern}")
    for pattern in _TE_APEX_WARNINGS:
        warnings.filterwarnings("ignore" if cpu or rank else "once", message=f".*{pattern}")


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    *,
    ep: int = 1,
    cp: int = 1,
    backend: str = "auto",
    seed: int = 1234,
    timeout_minutes: float = 30.0,
) -> ParallelState:
    """Initialise torch.distributed and Megatron-Core model parallelism; return the layout.

    backend: "auto" (nccl when CUDA is available, else gloo), "nccl" or "gloo".
    timeout_minutes: how long a collective may wait before it fails (with a message naming the
    rank and the stage, megappo.parallel.stage); a float, so tests can use seconds.
    Safe to call once per process; call `destroy_parallel()` before calling it again.
    """
    rank, world, local = _torchrun_env()
    check_layout(world, tp, pp, vpp, ep, cp)
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ParallelConfigError("parallel.backend=nccl needs CUDA. Fix: parallel.backend=gloo (or auto) on CPU.")
    _quiet_warnings(cpu=not cuda, rank=rank)
    if not cuda:
        cpu_compat.enable()
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")

    if not dist.is_initialized():
        store = _world_store(rank, world, datetime.timedelta(minutes=timeout_minutes))
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )

    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = _megatron_globals()
    ps = _initialize_layout(tp, pp, vpp, ep, cp, seed=seed, timeout_minutes=timeout_minutes, backend=backend,
                            device=device, env=(rank, world, local))
    stage.set_identity(ps.rank, ps.tp_rank, ps.pp_rank, ps.dp_rank, timeout_minutes)  # the shared layout names ranks
    return ps


def _world_store(rank: int, world: int, timeout: datetime.timedelta):
    """The store the process group starts from, hosted so that it listens on one address only
    (megappo.parallel.listen): a world of one hosts its own on 127.0.0.1; ranks that no torchrun agent
    started (megappo's Ray launcher sets MASTER_ADDR / MASTER_PORT itself) meet at rank 0's store on
    MASTER_ADDR. None under torchrun: its agent hosts the store (on loopback when megappo launched it)."""
    if "MASTER_ADDR" not in os.environ:  # a world of one
        store = store_server(LOOPBACK, 0, 1, timeout=timeout)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = LOOPBACK, str(store.port)
        return store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        return store_server(host, port, world, timeout=timeout)
    return dist.TCPStore(host, port, world, False, timeout=timeout)


def add_layout(base: ParallelState, tp: int, pp: int, vpp: int | None = None, *, ep: int = 1, cp: int = 1,
               seed: int = 1234, timeout_minutes: float = 30.0) -> ParallelState:
    """Collective (every rank, same order): another TP x PP (x CP, x EP) layout over the same ranks.

    The layout that was active before the call stays active; use `with ps.active():`
    (megappo.models does) to run a model built for the new layout.
    """
    assert _PRISTINE is not None, "call init_parallel first"
    check_layout(base.world_size, tp, pp, vpp, ep, cp)
    saved = _megatron_globals()
    _install_globals(_PRISTINE)
    try:
        return _initialize_layout(tp, pp, vpp, ep, cp, seed=seed, timeout_minutes=timeout_minutes, backend=base.backend,
                                  device=base.device, env=(base.rank, base.world_size, base.local_rank))
    finally:
        _install_globals(saved)


def _initialize_layout(tp, pp, vpp, ep=1, cp=1, *, seed, timeout_minutes, backend, device, env) -> ParallelState:
    """Megatron's groups and RNG tracker for one layout (installed as the global ones)."""
    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel

    rank, world, local = env
    mps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout_minutes,
    )
    tp_rank = mps.get_tensor_model_parallel_rank()
    ep_rank = mps.get_expert_model_parallel_rank()
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.model_parallel_manual_seed(seed, tp_rank, ep_rank, mps.get_expert_tensor_parallel_rank())
    pp_ranks = dist.get_process_group_ranks(mps.get_pipeline_model_parallel_group())
    return ParallelState(
        world_size=world,
        rank=rank,
        local_rank=local,
        tp=tp,
        pp=pp,
        dp=world // (tp * pp * cp),
        vpp=vpp,
        tp_rank=tp_rank,
        pp_rank=mps.get_pipeline_model_parallel_rank(),
        dp_rank=mps.get_data_parallel_rank(),
        backend=backend,
        device=device,
        tp_group=mps.get_tensor_model_parallel_group(),
        pp_group=mps.get_pipeline_model_parallel_group(),
        dp_group=mps.get_data_parallel_group(),
        mp_group=mps.get_model_parallel_group(),
        pp_first_rank=pp_ranks[0],
        pp_last_rank=pp_ranks[-1],
        ep=ep,
        ep_rank=ep_rank,
        ep_group=mps.get_expert_model_parallel_group(),
        cp=cp,
        cp_rank=mps.get_context_parallel_rank(),
        cp_group=mps.get_context_parallel_group(),
        megatron_globals=_megatron_globals(),
    )


def in_layout(fn):
    """Decorator for functions whose first argument is a model (`.ps`) or a trainable
    (`.model.ps`): run them inside that model's layout (see `ParallelState.active`)."""

    @functools.wraps(fn)
    def wrapped(obj, *args, **kwargs):
        ps = obj.ps if hasattr(obj, "ps") else obj.model.ps
        with ps.active():
            return fn(obj, *args, **kwargs)

    return wrapped


# Megatron-Core's per-layout module state: every upper-case module global of parallel_state
# (groups, ranks, sizes, cached buffers) and the RNG tracker singleton.
_GLOBAL_NAME = re.compile(r"^_[A-Z0-9_]+$")
_RNG_GLOBALS = ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
_PRISTINE: dict | None = None  # the globals before any layout was initialised


def _megatron_globals() -> dict:
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import random as mrandom

    state = {("ps", k): v for k, v in vars(mps).items() if _GLOBAL_NAME.match(k)}
    state.update({("rng", k): getattr(mrandom, k) for k in _RNG_GLOBALS})
    return state


def _install_globals(state: dict) -> None:
    from megatron.core import parallel_state as mps
    from megatron.core.tensor_parallel import random as mrandom

    modules = {"ps": mps, "rng": mrandom}
    for (module, name), value in state.items():
        setattr(modules[module], name, value)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state as mps

    global _PRISTINE
    mps.destroy_model_parallel()
    _PRISTINE = None
    if dist.is_initialized():
        dist.destroy_process_group()
