"""Let Megatron-Core 0.16.1 run on a CPU-only torch build (tests, CI, the CPU demo).

Megatron-Core assumes CUDA on a few code paths. This module adapts exactly those, and
nothing else; `enable()` is a no-op when CUDA is available, so none of it is ever active
on a GPU machine. Every patch below names the Megatron-Core functions that need it
(measured facts: ../shared/notes/megatron-core-on-cpu.md in the design repo).

| # | patch | Megatron-Core code that needs it |
|---|-------|----------------------------------|
| 1 | `torch.cuda.current_device()` returns 0, remapped to cpu by #3 | `tensor_parallel.mappings._gather_along_*`, `tensor_parallel.layers`, `pipeline_parallel.p2p_communication._communicate_shapes/_communicate`, `models.common.embeddings.rotary_pos_embedding.RotaryEmbedding` |
| 2 | `torch.cuda.synchronize()` is a no-op | `pipeline_parallel.p2p_communication._communicate`, `parallel_state.initialize_model_parallel` |
| 3 | a process-wide TorchFunctionMode maps `device="cuda"`/`cuda:N`/`N` to cpu and makes `Tensor.cuda()` return the tensor | `pipeline_parallel.schedules.forward_backward_*` (token counters), `optimizer.clip_grads`, `optimizer.grad_scaler`, `dist_checkpointing.exchange_utils`, `models.common.language_module.LanguageModule.setup_embeddings_and_output_layer` (`.cuda()`), `tensor_parallel.data.broadcast_data` |
| 4 | a CPU-generator RNG tracker under Megatron's tracker names | `tensor_parallel.random.get_cuda_rng_tracker`, `model_parallel_cuda_manual_seed`, `CudaRNGStatesTracker.fork` (used by attention dropout and weight init) |
| 5 | `Tensor.type()` reads `torch.cuda.FloatTensor` etc. for CPU tensors, inside the functions that compare it | `optimizer.distrib_optimizer.DistributedOptimizer.__init__` (its `_build_model_and_main_param_groups`), `optimizer.Float16OptimizerWithFloat16Params.__init__`, `optimizer.clip_grads.clip_grad_by_total_norm_fp32` |
| 6 | `torch.cuda.Stream()` / `current_stream()` return one stand-in stream; `torch.cuda.stream(s)` is a null context; its events are already complete | `transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher` (its device-to-host side stream) |
| 7 | `torch.distributed.all_to_all_single` takes split sizes given as CPU tensors (turned into lists); `_AllToAll.backward` runs under #3's mode (autograd does not carry torch-function modes into backward, and it allocates on `torch.cuda.current_device()`) | `tensor_parallel.mappings._AllToAll` called by the MoE all-to-all dispatcher, whose splits stay tensors on CPU (`moe_utils.maybe_move_tensor_to_cpu` turns only CUDA tensors into numpy) |

This module does not know about megappo's models, configs or process groups.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Patch 3: every `device=` that names CUDA becomes cpu; `Tensor.cuda()` is identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Patch 4: Megatron's `CudaRNGStatesTracker` interface over the CPU generator.

    Holds named generator states (model-parallel, data-parallel, expert-parallel) and
    `fork(name)` swaps the global CPU generator to that state for the duration of a block,
    exactly as the CUDA tracker does with the CUDA generator.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists in the CPU RNG tracker")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name} already exists in the CPU RNG tracker")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name} was not added to the CPU RNG tracker")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # initialize_rng_tracker() picks the base class at call time; reset the singleton so
    # the next get_cuda_rng_tracker() builds a CPU tracker.
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def model_parallel_manual_seed(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """CPU counterpart of `megatron.core.tensor_parallel.model_parallel_cuda_manual_seed`.

    Same offsets as Megatron (2718 for model-parallel, 1024 for expert-parallel) so a CPU
    run seeds its tracker states the way a GPU run does.
    """
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


@contextlib.contextmanager
def _cuda_type_names():
    """Inside the block, `Tensor.type()` of a CPU tensor reads 'torch.cuda.FloatTensor' etc."""
    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return real_type(self, *args, **kwargs)
        name = real_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        torch.Tensor.type = real_type


def _patch_tensor_type_strings() -> None:
    """Patch 5: the functions below compare `Tensor.type()` with CUDA type names."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with _cuda_type_names():
                return fn(*args, **kwargs)

        return wrapped

    opt = distrib_optimizer.DistributedOptimizer
    opt.__init__ = wrap(opt.__init__)  # builds its param groups (checks param.type()) here
    optimizer.Float16OptimizerWithFloat16Params.__init__ = wrap(optimizer.Float16OptimizerWithFloat16Params.__init__)
    clip_grads.clip_grad_by_total_norm_fp32 = wrap(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32  # imported by name


def _patch_all_to_all_splits() -> None:
    import torch.distributed as dist

    real = dist.all_to_all_single

    @functools.wraps(real)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if torch.is_tensor(output_split_sizes):
            output_split_sizes = output_split_sizes.tolist()
        if torch.is_tensor(input_split_sizes):
            input_split_sizes = input_split_sizes.tolist()
        return real(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single

    from megatron.core.tensor_parallel import mappings

    backward = mappings._AllToAll.backward

    def backward_on_cpu(ctx, *grad_output):
        with _CudaToCpuMode():
            return backward(ctx, *grad_output)

    mappings._AllToAll.backward = staticmethod(backward_on_cpu)


class _CpuStream:
    """Patch 6: the one 'stream' of a CPU process (a class, so annotations such as
    `torch.cuda.Stream | None` still work); waiting on it does nothing."""

    _instance = None

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self  # an event on a synchronous stream: synchronize() is a no-op


_CPU_STREAM = _CpuStream()


def enable() -> bool:
    """Activate the CPU adaptations once per process. Returns True if they are active.

    Does nothing (and returns False) when CUDA is available.
    """
    global _ENABLED, _MODE
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    torch.cuda.current_device = lambda: 0  # patch 1
    torch.cuda.synchronize = lambda *a, **k: None  # patch 2
    _MODE = _CudaToCpuMode()  # patch 3
    _MODE.__enter__()
    _patch_rng_tracker()  # patch 4
    _patch_tensor_type_strings()  # patch 5
    torch.cuda.Stream = _CpuStream  # patch 6
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    _patch_all_to_all_splits()  # patch 7
    _ENABLED = True
    return True


def is_enabled() -> bool:
    return _ENABLED


@contextlib.contextmanager
def suspended():
    """Patch 3 off inside the block, for code that never names a CUDA device (the CPU rollout
    engine's sampling loop): the mode costs every torch call a Python dispatch, which made a
    tiny model's generation ~1.5x slower. Results are unchanged; the other patches stay.
    Torch-function modes are per thread: on a thread where the mode is not active (a
    background generation, rollout.mode=one_step_off) there is nothing to suspend."""
    if _MODE is None or _MODE not in torch.overrides._get_current_function_mode_stack():
        yield
        return
    _MODE.__exit__(None, None, None)  # megappo pushes no other torch-function mode on top of it
    try:
        yield
    finally:
        _MODE.__enter__()
