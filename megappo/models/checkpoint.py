"""Megatron-Core distributed checkpoints of one model, with megappo's model metadata.

A model checkpoint directory holds Megatron's dist-checkpoint files (layout-independent:
it loads at any TP/PP/DP), `megappo_model.json` (architecture, dims, role, vocab padding,
whether optimizer state is inside) and `hf/` (the HF config.json and tokenizer files the
model came from), so a checkpoint can be turned back into an HF directory and a
checkpoint of another model is refused before any tensor is read.

`load_dist_weights`: a role's starting weights from any Megatron-Core dist checkpoint of a GPT
model (verl's `dist_checkpointing_path`; no megappo metadata needed), checked key by key first.
`save_model` / `load_model`: weights only. `save_trainable` / `load_trainable`: weights,
Megatron optimizer state (Adam moments, step; the distributed optimizer's shards in the
'fully_reshardable' format) and the LR scheduler, so training continues exactly. Loading
runs no code from the files: every pickle in them is read restricted (megappo.models.safe_pickle).

This module does not know about trainer state (step, data cursor, RNG: megappo.trainer.checkpointing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from megappo.models.builders import MegatronModel, unwrap
from megappo.models.hf_config import ModelConfigError, ModelDims
from megappo.models.safe_pickle import dist_checkpoint_contents, load_dist_checkpoint
from megappo.parallel.state import in_layout

META_FILE = "megappo_model.json"


def read_metadata(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise ModelConfigError(
            f"'{ckpt_dir}' is not a megappo model checkpoint (no {META_FILE}); "
            "create one with tools/convert_hf_to_megatron.py."
        )
    with open(path) as f:
        return json.load(f)


def check_compatible(model: MegatronModel, meta: dict, ckpt_dir: str) -> None:
    """Refuse a checkpoint whose architecture or dims differ from the model's."""
    saved = ModelDims(**meta["dims"])
    if saved != model.dims:
        diffs = [f"{f.name}: checkpoint {getattr(saved, f.name)!r} vs model {getattr(model.dims, f.name)!r}"
                 for f in dataclasses.fields(ModelDims) if getattr(saved, f.name) != getattr(model.dims, f.name)]
        raise ModelConfigError(
            f"checkpoint '{ckpt_dir}' is from another model ({'; '.join(diffs)}). "
            "Fix: point at a checkpoint of this model, or change the model config."
        )
    value_saved = meta["role"] in ("critic", "reward")
    if value_saved != model.has_value_head:
        raise ModelConfigError(
            f"checkpoint '{ckpt_dir}' holds a {meta['role']} model, which cannot load into the {model.role} model."
        )


def _sharded_state(model: MegatronModel) -> dict:
    # Sharded tensors carry global keys and offsets, so the nesting below (one entry per
    # virtual stage) does not tie the files to this layout.
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model.chunks)}


# The distributed optimizer's default format is rejected by megatron-core 0.16.1's own
# mapping code; 'fully_reshardable' reshards over TP, PP and DP on load.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@in_layout
def save_model(model: MegatronModel, ckpt_dir: str, hf_config: dict, hf_files: dict[str, bytes] | None = None) -> None:
    """Collective: save this model's weights to `ckpt_dir` (which must not exist or be empty)."""
    _save(model, _sharded_state(model), ckpt_dir, hf_config, hf_files, with_optimizer=False)


@in_layout
def save_trainable(trainable, ckpt_dir: str, hf_config: dict, hf_files: dict[str, bytes] | None = None) -> None:
    """Collective: weights + optimizer state + LR scheduler of a `models.training.Trainable`. An
    optimizer that has not stepped yet (the actor during run.critic_warmup) has no state to save:
    the metadata says so, and loading keeps the fresh optimizer, which is what it was."""
    model_state = _sharded_state(trainable.model)
    started = optimizer_started(trainable.optimizer)
    state = dict(model_state, scheduler=trainable.scheduler.state_dict())
    if started:
        state["optimizer"] = trainable.optimizer.sharded_state_dict(model_state, is_loading=False,
                                                                    metadata=OPTIM_METADATA)
    _save(trainable.model, state, ckpt_dir, hf_config, hf_files, with_optimizer=True, optimizer_started=started)


def optimizer_started(optimizer) -> bool:
    """Has the optimizer taken a step (does it hold Adam state)? The same on every rank: a step is
    taken or skipped by all of them."""
    return any(opt.optimizer.state for opt in _inner_optimizers(optimizer))


def _save(model: MegatronModel, state: dict, ckpt_dir: str, hf_config: dict, hf_files, with_optimizer: bool,
          optimizer_started: bool = False) -> None:
    from megatron.core import dist_checkpointing

    if model.ps.rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    _in_process_write_results()
    dist_checkpointing.save(state, ckpt_dir)
    if model.ps.rank == 0:
        meta = {"format": "megappo-model-v1", "role": model.role, "with_optimizer": with_optimizer,
                "optimizer_started": optimizer_started,
                "expert_parallel": model.ps.ep, "dtype": model.precision.name,
                "lora": dataclasses.asdict(model.lora) if model.lora.enabled else None,
                "dims": dataclasses.asdict(model.dims), "hf_config": hf_config}
        with open(os.path.join(ckpt_dir, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        if hf_files:
            os.makedirs(os.path.join(ckpt_dir, "hf"), exist_ok=True)
            for name, data in hf_files.items():
                with open(os.path.join(ckpt_dir, "hf", name), "wb") as f:
                    f.write(data)
    dist.barrier()


def _in_process_write_results() -> None:
    """Megatron's checkpoint writer (filesystem_async) hands its writer processes' results back through a
    queue it makes once per process from a `multiprocessing` Manager: a spawned server process (1-2 s at the
    first save of every launch, measured on the CPU machine, and its shutdown at exit), there for a save that
    runs in a background process. `dist_checkpointing.save` runs the save in this process, which is also the
    one that reads the results, so a plain queue serves: set as that one queue before Megatron makes it."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", ()) is None:  # () : a Megatron without it: nothing to set
        filesystem_async._results_queue = queue.Queue()


@in_layout
def load_model(model: MegatronModel, ckpt_dir: str) -> dict:
    """Collective: load `ckpt_dir` into the model at its current layout; returns metadata."""
    meta = read_metadata(ckpt_dir)
    check_compatible(model, meta, ckpt_dir)
    loaded = load_dist_checkpoint(_sharded_state(model), ckpt_dir)
    _load_chunks(model, loaded)
    return meta


@in_layout
def load_trainable(trainable, ckpt_dir: str) -> dict:
    """Collective: load weights, optimizer state and LR scheduler saved by `save_trainable`
    into `trainable` at its current layout (TP/PP/DP may differ from the saver's)."""
    model = trainable.model
    meta = read_metadata(ckpt_dir)
    check_compatible(model, meta, ckpt_dir)
    if not meta.get("with_optimizer"):
        raise ModelConfigError(f"checkpoint '{ckpt_dir}' holds weights only, no optimizer state to resume from. Fix: "
                               "resume from a trainer checkpoint (<run.output_dir>/checkpoints/step_NNNNNNNN), or load "
                               "these weights as a model with load_model / an HF export.")
    saved_ep = meta.get("expert_parallel", 1)
    if model.dims.is_moe and (saved_ep > 1) != (model.ps.ep > 1):
        # Megatron keeps expert optimizer state apart (a chained optimizer) only when ep > 1
        raise ModelConfigError(
            f"checkpoint '{ckpt_dir}' holds optimizer state saved at parallel.ep={saved_ep}; it resumes at any "
            f"ep {'> 1' if saved_ep > 1 else '= 1'} but not at ep={model.ps.ep} (Megatron keeps expert optimizer "
            f"state apart only when ep > 1). Fix: resume with parallel.ep {'> 1' if saved_ep > 1 else '= 1'}, or "
            "load the weights alone (load_model / an HF export) and start a new optimizer."
        )
    if not meta.get("optimizer_started", True):  # saved before its first step: it stays fresh
        model_state = _sharded_state(model)
        loaded = load_dist_checkpoint(dict(model_state, scheduler=trainable.scheduler.state_dict()), ckpt_dir)
        _load_chunks(model, loaded)
        trainable.optimizer.reload_model_params()  # its main (float32) copy of the weights, from the loaded ones
        trainable.scheduler.load_state_dict(loaded["scheduler"])
        return meta
    for opt in _inner_optimizers(trainable.optimizer):
        # a fresh distributed optimizer has no Adam state to load into yet
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    model_state = _sharded_state(model)
    state = dict(model_state,
                 optimizer=trainable.optimizer.sharded_state_dict(model_state, is_loading=True, metadata=OPTIM_METADATA),
                 scheduler=trainable.scheduler.state_dict())
    loaded = load_dist_checkpoint(state, ckpt_dir)
    _load_chunks(model, loaded)
    with _adam_step_kept_out(trainable.optimizer):
        trainable.optimizer.load_state_dict(loaded["optimizer"])
    trainable.scheduler.load_state_dict(loaded["scheduler"])
    _unshare_adam_steps(trainable.optimizer)
    return meta


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")  # [V_pad, h], split over tp by rows


@in_layout
def load_dist_weights(model: MegatronModel, ckpt_dir: str, named_by: str) -> None:
    """Collective: a role's starting weights from a Megatron-Core dist checkpoint of a GPT model written by
    `dist_checkpointing.save(gpt_model.sharded_state_dict(), dir)` (verl's scripts/converter_hf_to_mcore.py; a
    megappo model checkpoint loads too), saved at any TP/PP and resharded to this model's. As verl's
    `load_mcore_dist_weights`: no key prefix, tensors the model lacks are ignored, a critic or reward model keeps
    its new value head (the checkpoint's output_layer is an LM head). Every other tensor of the model must be
    there at its global shape, else a ModelConfigError on every rank naming `named_by` (the config key) and the
    fix. Extra states (`_extra_state` objects) the checkpoint lacks stay the model's (they carry no weights). The
    vocabulary rows may be padded otherwise (verl pads none, megappo to a multiple of make_vocab_size_divisible_by x
    tp): the embedding and LM head are then read whole by the ranks that hold them, which keep their rows of the
    first vocab_size (padding rows zero)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    try:
        if not os.path.isdir(ckpt_dir):
            raise CheckpointingException("no such directory")
        saved = dist_checkpoint_contents(ckpt_dir)
    except CheckpointingException as e:
        raise ModelConfigError(f"{named_by}={ckpt_dir} is not a Megatron-Core dist checkpoint ({e}). Fix: point it "
                               "at a directory written by dist_checkpointing.save (verl's "
                               "scripts/converter_hf_to_mcore.py), or unset it to load model.path's HF "
                               "weights.") from None
    value_head = ("output_layer.",) if model.has_value_head else ()

    def padded_otherwise(sh) -> bool:  # the vocabulary's rows, padded to another multiple
        shape = tuple(saved[sh.key].global_shape)
        return sh.key in VOCAB_KEYS and shape[1:] == tuple(sh.global_shape[1:]) and shape[0] >= model.dims.vocab_size

    state, problems, kept, whole = {}, [], set(), {}
    for i, chunk in enumerate(model.chunks):
        wanted = {k: v for k, v in unwrap(chunk).sharded_state_dict().items() if not k.startswith(value_head)}
        checked = unwrap(chunk).sharded_state_dict()  # factories built, for the keys and shapes they save under
        apply_factories(checked)
        for sh in nested_values({k: v for k, v in checked.items() if not k.startswith(value_head)}):
            if isinstance(sh, ShardedTensor) and sh.key not in saved:
                problems.append(f"{sh.key} missing")
            elif isinstance(sh, ShardedTensor) and tuple(saved[sh.key].global_shape) != tuple(sh.global_shape) \
                    and not padded_otherwise(sh):
                problems.append(f"{sh.key}: checkpoint {tuple(saved[sh.key].global_shape)} vs model "
                                f"{tuple(sh.global_shape)}")
        for k, v in list(wanted.items()):
            if isinstance(v, ShardedObject) and v.key not in saved:
                del wanted[k]
                kept.add(k)
            elif isinstance(v, ShardedTensor) and v.key in saved and tuple(saved[v.key].global_shape) != \
                    tuple(v.global_shape) and padded_otherwise(v):
                whole[(i, k)] = v  # read whole where it is needed, this rank's rows cut out below
        state[f"model{i}"] = wanted
    everyone = [None] * dist.get_world_size()
    # a layout's stages see different keys; a tensor read whole needs one main replica over the ranks
    dist.all_gather_object(everyone, (sorted(set(problems)), [v.key for v in whole.values()]))
    problems = sorted({p for rank_problems, _ in everyone for p in rank_problems})
    holders = [(rank, n, key) for rank, (_, keys) in enumerate(everyone) for n, key in enumerate(keys)]
    for n, ((i, k), v) in enumerate(whole.items()):
        first = min((r, m) for r, m, key in holders if key == v.key) == (dist.get_rank(), n)
        state[f"model{i}"][k] = ShardedTensor.from_rank_offsets(
            v.key, torch.empty(tuple(saved[v.key].global_shape), dtype=v.data.dtype, device=v.data.device),
            replica_id=0 if first else 1 + dist.get_rank() * len(whole) + n)
    if problems:
        raise ModelConfigError(
            f"{named_by}={ckpt_dir} does not fit the {model.role} model ({len(problems)} tensor(s): "
            f"{'; '.join(problems[:4])}{'; ...' if len(problems) > 4 else ''}). Fix: point it at a checkpoint of "
            "the model that model.path's config.json describes (same layers, sizes and vocabulary), or unset it "
            "to load model.path's HF weights.")
    loaded = load_dist_checkpoint(state, ckpt_dir)
    for (i, k), sh in whole.items():
        rows = torch.zeros(tuple(sh.global_shape), dtype=sh.data.dtype, device=sh.data.device)  # padding rows: 0
        rows[:model.dims.vocab_size] = loaded[f"model{i}"][k][:model.dims.vocab_size]
        loaded[f"model{i}"][k] = rows.narrow(0, sh.global_offset[0], sh.local_shape[0]).clone()
    for i, chunk in enumerate(model.chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        assert not unexpected and all(k.startswith(value_head) or k in kept for k in missing), (missing, unexpected)


def _load_chunks(model: MegatronModel, loaded: dict) -> None:
    for i, chunk in enumerate(model.chunks):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=True)


def _inner_optimizers(optimizer) -> list:
    """The Megatron optimizers inside a (possibly chained) optimizer that wrap a torch one."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if getattr(opt, "optimizer", None) is not None]


@contextlib.contextmanager
def _adam_step_kept_out(optimizer):
    """Let the distributed optimizer load its 'fully_reshardable' state with torch's Adam.

    Without apex/TE, torch Adam keeps a per-parameter 'step' that Megatron restores from the
    param groups; its per-parameter copy loop (0.16.1) also expects 'step' in the saved
    record, which does not carry it. Hide 'step' from that loop; it was restored already.
    """
    patched = []
    for opt in _inner_optimizers(optimizer):
        if not hasattr(opt, "_set_main_param_and_optimizer_states"):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam 'step' tensor.

    Megatron restores one common step; on some load paths every parameter's state then
    holds the SAME tensor object, and torch's foreach Adam increments it once per
    parameter per step (wrong bias correction after resume).
    """
    for opt in _inner_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.detach().clone()
