"""Trainer checkpoints: save every N steps and at the end, keep the last K, resume exactly.

Layout under `checkpoint.dir` (default `<run.output_dir>/checkpoints`):

    step_00000010/
      actor/               weights + optimizer + LR scheduler (models.checkpoint.save_trainable)
      critic/              the same, when the algorithm has a critic
      rng/rank_00000.pt    per-rank RNG: python, numpy, torch (CPU and CUDA), Megatron's
                           model-parallel tracker (tensors and numbers only: loaded weights_only)
      trainer_state.json   step, sampler epoch/cursor, KL coefficient, NaN-skip counter, the
                           resolved config; written last inside the directory
      rollout_buffer.pt    rollout.mode=one_step_off / async: the batches already generated for
                           later steps (waited for at save time), with their steps and policy
                           versions; a resume trains on them
    step_00000020.partial/ a save in progress (or killed): never read, removed by the next save;
                           a resume says that it skips it (and from which step it starts instead)
    latest                 the name of the newest complete checkpoint

A save writes into `step_N.partial/`, renames it to `step_N/` when every rank is done, then
replaces `latest` through an atomic rename; only after that are checkpoints beyond
`keep_last` deleted. A process killed at any moment leaves `latest` naming a complete
checkpoint. The rollout sampling seed is `rollout.seed + step`, so it needs no state.

Resume (`checkpoint.resume`): `auto` continues from `latest` when there is one, `must`
refuses to start without one, `off` starts fresh (and refuses to write into a checkpoint
directory that has one, so nothing is overwritten by accident). The checkpoint may be
loaded at another TP/PP/DP layout. What a changed recipe may change is `check_resumable`.

This module does not know the order of a PPO step or how models are built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist

from megappo.config import Config
from megappo.errors import ConfigError
from megappo.data import PromptExample
from megappo.types import RolloutBatch

LATEST = "latest"
STATE_FILE = "trainer_state.json"
ROLLOUT_BUFFER = "rollout_buffer.pt"
FORMAT = "megappo-trainer-v1"
_STEP_DIR = re.compile(r"^step_(\d{8})$")

# Changing these on resume would make the checkpoint meaningless or the data stream skip
# or repeat prompts: refused. Other algorithm / optimisation / rollout changes are allowed
# with a warning that lists them; parallel layout, run length, logging and checkpoint
# settings change freely (the layout is resharded on load).
REFUSED_ON_RESUME = ("model", "algorithm.adv_estimator", "data.train_files", "data.builtin", "data.builtin_size",
                     "data.builtin_args", "data.seed", "data.shuffle", "data.train_batch_size", "rollout.n",
                     "critic.path", "reward.model_path",
                     "parallel.use_distributed_optimizer")  # Megatron's two optimizer formats do not convert
WARNED_ON_RESUME = ("algorithm", "actor", "critic", "ref", "rollout", "reward", "data")
IGNORED_ON_RESUME = ("model.prepare",)  # how model.path was made, not what it holds


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_root: str) -> str | None:
    """The directory `latest` names, or None when there is no complete checkpoint."""
    pointer = os.path.join(ckpt_root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(ckpt_root, name)
    if not _STEP_DIR.match(name) or not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise ConfigError(f"'{pointer}' names '{name}', which is not a complete checkpoint. Fix: point it at a "
                          f"step_NNNNNNNN directory in {ckpt_root} that has {STATE_FILE}, or resume with "
                          "checkpoint.resume=off and another checkpoint.dir.")
    return path


def resolve_checkpoint(path: str) -> str:
    """A step directory from a step directory, a checkpoint root, or a run directory."""
    for candidate in (path, os.path.join(path, "checkpoints")):
        if os.path.isfile(os.path.join(candidate, STATE_FILE)):
            return candidate
        found = latest_checkpoint(candidate) if os.path.isdir(candidate) else None
        if found:
            return found
    raise ConfigError(f"no megappo trainer checkpoint at '{path}' (looked for {STATE_FILE} and a '{LATEST}' "
                      "pointer). Fix: pass a run directory, its checkpoints/ directory, or a step_NNNNNNNN directory.")


def find_resume(cfg: Config) -> dict | None:
    """The trainer state to resume from (with its 'path'), per checkpoint.resume; None to start fresh.

    Reads only small JSON files, so every refusal comes before any model is built.
    """
    root, mode = cfg.checkpoint_dir, cfg.checkpoint.resume
    path = latest_checkpoint(root) if os.path.isdir(root) else None
    if mode == "must" and path is None:
        raise ConfigError(f"checkpoint.resume=must, but {root} has no complete checkpoint. Fix: set checkpoint.dir "
                          "to the run's checkpoint directory, or checkpoint.resume=auto to start fresh when there "
                          "is none.")
    if mode == "off":
        if path is not None:
            raise ConfigError(f"checkpoint.resume=off, but {root} already holds checkpoints (latest: "
                              f"{os.path.basename(path)}) that a fresh run would mix with its own. Fix: resume with "
                              "checkpoint.resume=auto, or choose another run.output_dir / checkpoint.dir.")
        return None
    state = None
    if path is not None:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        if state.get("format") != FORMAT:
            raise ConfigError(f"'{path}' is not a {FORMAT} checkpoint (format {state.get('format')!r}).")
        check_resumable(state["config"], cfg.to_dict(), path)
    unfinished = unfinished_saves(root, state["step"] if state else 0)
    if unfinished:  # a run stopped during a save (a second Ctrl-C, a kill): its step is not there to resume
        starts = f"resuming from {path} (step {state['step']})" if state else "starting from step 0"
        warnings.warn(f"{os.path.join(root, unfinished[-1])} is a save that did not finish (the run was stopped "
                      f"during it), so it cannot be resumed: {starts}.", stacklevel=2)
    return dict(state, path=path) if state else None


def unfinished_saves(root: str, after_step: int) -> list[str]:
    """The `step_N.partial` directories in `root` with N > `after_step`, oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(n for n in names if n.endswith(".partial") and _STEP_DIR.match(n[:-len(".partial")])
                  and int(n[len("step_"):-len(".partial")]) > after_step)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("hf_config", "builtin_args", "sglang"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resumable(saved: dict, current: dict, path: str) -> None:
    """Refuse a resume whose recipe changed what the checkpoint depends on; warn about other changes."""
    old, new = _flatten(saved), _flatten(current)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in IGNORED_ON_RESUME)

    def under(key: str, sections) -> bool:
        return any(key == s or key.startswith(s + ".") for s in sections)

    refused = [k for k in changed if under(k, REFUSED_ON_RESUME)]
    if refused:
        diffs = "; ".join(f"{k}: checkpoint {old.get(k)!r} vs now {new.get(k)!r}" for k in refused[:6])
        raise ConfigError(f"cannot resume from {path}: the recipe changed {diffs}. Fix: restore those settings, or "
                          "start a new run (another run.output_dir, or checkpoint.resume=off with a fresh "
                          "checkpoint.dir).")
    warned = [k for k in changed if under(k, WARNED_ON_RESUME)]
    if warned:
        diffs = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in warned)
        warnings.warn(f"resuming from {path} with changed settings: {diffs}", stacklevel=2)


@dataclasses.dataclass
class TrainerState:
    """What the loop needs besides model and optimizer state (rank 0's view)."""

    step: int
    sampler: dict | None
    kl_coef: float
    nan_skips: int


def save(path_root: str, step: int, trainables: dict, trainer: TrainerState, cfg: Config, *, hf_config: dict,
         hf_files: dict | None, critic_hf_config: dict | None, rank: int, keep_last: int,
         rollout_buffer: list | None = None) -> str:
    """Collective: one complete checkpoint of `step`; returns its directory. `rollout_buffer`
    (rank 0): [(step, RolloutBatch)] generated ahead of the training."""
    from megappo.models.checkpoint import save_trainable

    final = os.path.join(path_root, step_dir_name(step))
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(path_root, exist_ok=True)
        for name in os.listdir(path_root):  # saves that were killed midway
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(path_root, name))
        os.makedirs(os.path.join(partial, "rng"))
    dist.barrier()
    for role, trainable in trainables.items():
        save_trainable(trainable, os.path.join(partial, role), critic_hf_config if role == "critic" else hf_config,
                       hf_files)
    torch.save(_rng_state(), os.path.join(partial, "rng", f"rank_{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        if rollout_buffer:
            torch.save({"batches": [{"step": buffered_step, "batch": _plain_batch(batch)}
                                    for buffered_step, batch in rollout_buffer]}, os.path.join(partial, ROLLOUT_BUFFER))
        state = {"format": FORMAT, **dataclasses.asdict(trainer), "roles": sorted(trainables),
                 "world_size": dist.get_world_size(), "config": cfg.to_dict()}
        _write_atomic(os.path.join(partial, STATE_FILE), json.dumps(state, indent=2))
        if os.path.isdir(final):  # the same step saved before a crash that lost `latest`'s update
            shutil.rmtree(final)
        os.rename(partial, final)
        _write_atomic(os.path.join(path_root, LATEST), step_dir_name(step))
        _prune(path_root, keep_last)
    dist.barrier()
    return final


def load(path: str, trainables: dict, rank: int) -> None:
    """Collective: model, optimizer and scheduler of each trained role, and this rank's RNG."""
    from megappo.models.checkpoint import load_trainable

    for role, trainable in trainables.items():
        load_trainable(trainable, os.path.join(path, role))
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    elif rank == 0:
        warnings.warn(f"{path} has no RNG state for some ranks (saved with another world size); "
                      "those ranks keep their seeded RNG.", stacklevel=2)


def load_rollout_buffer(path: str) -> list[tuple[int, RolloutBatch]]:
    """[(step, RolloutBatch)] a checkpoint buffered for the steps after it ([]: none)."""
    file = os.path.join(path, ROLLOUT_BUFFER)
    if not os.path.isfile(file):
        return []
    saved = torch.load(file, weights_only=True)  # tensors and plain data only: a file cannot run code
    entries = saved["batches"] if "batches" in saved else [saved]  # one batch: saved by megappo before async mode
    return [(entry["step"], _batch_from_plain(entry["batch"])) for entry in entries]


def _plain_batch(batch: RolloutBatch) -> dict:
    """A RolloutBatch as tensors and plain Python data (what torch.load(weights_only=True) reads)."""
    plain = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if plain["examples"] is not None:
        plain["examples"] = [dataclasses.asdict(e) for e in plain["examples"]]
    return plain


def _batch_from_plain(plain: dict) -> RolloutBatch:
    if plain["examples"] is not None:
        plain["examples"] = [PromptExample(**e) for e in plain["examples"]]
    return RolloutBatch(**plain)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: str, keep_last: int) -> None:
    if keep_last <= 0:
        return
    steps = sorted(name for name in os.listdir(root) if _STEP_DIR.match(name))
    for name in steps[:-keep_last]:
        shutil.rmtree(os.path.join(root, name))


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import random as mrandom

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {"python": [version, list(py_state), py_gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "torch": torch.get_rng_state(),
             "tracker": mrandom.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
