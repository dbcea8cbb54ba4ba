"""Trainer checkpoints: save every N steps and at the end, keep the last K, resume exactly.

Layout under `checkpoint.dir` (default `<run.output_dir>/checkpoints`):

    step_00000010/
      actor/               weights + optimizer + LR scheduler (models.checkpoint.save_trainable)
      critic/              the same, when the algorithm has a critic
      rng/rank_00000.pt    per-rank RNG: python, numpy, torch (CPU and CUDA), Megatron's
                           model-parallel tracker (tensors and numbers only: loaded weights_only)
      trainer_state.json   step, sampler epoch/cursor, KL coefficient, NaN-skip counter, the
                           resolved config; written last inside the directory
      digests/rank_00000.json  size and blake2b digest of every file that rank wrote (rank R: its
                           own `__R_*.distcp` shards and rng file; rank 0: everything else), written
                           before the directory is renamed to its final name
      rollout_buffer.pt    rollout.mode=one_step_off / async: the batches already generated for
                           later steps (waited for at save time), with their steps and policy
                           versions; a resume trains on them
      partial_rollouts.pt  rollout.partial: the samples carried to later steps (tokens, engine
                           log-probs, each token's policy version; prompts by index), plain data
    step_00000020.partial/ a save in progress (or killed): never read, removed by the next save of
                           that step; a resume says that it skips it (and from which step it starts)
    latest                 the name of the newest complete checkpoint
    errors.log             tracebacks of checkpoint errors (the console gets one line)

A save writes into `step_N.partial/`, renames it to `step_N/` when every rank is done, then
replaces `latest` through an atomic rename; only after that are checkpoints beyond
`keep_last` deleted (`_prune`: counted among steps up to the one just saved, and never the newest
checkpoint that preceded steps skipped for non-finite losses). A process killed at any moment
leaves `latest` naming a complete checkpoint. The rollout sampling seed is `rollout.seed + step`,
so it needs no state.

Integrity (`check_files`): before a resume reads a checkpoint, its files are checked against the
digests recorded at save; a damaged one is named in one line and the resume falls back to the
newest intact checkpoint before it (`find_resume`). `check_model_dir` does the same for export.

Resume (`checkpoint.resume`): `auto` continues from `latest` when there is one, `must`
refuses to start without one, `off` starts fresh. A fresh run first moves an earlier run's
checkpoints and logs into `superseded/` (megappo.trainer.earlier_runs), so nothing is overwritten. The checkpoint may be
loaded at another TP/PP/DP layout. What a changed recipe may change is `check_resumable`; run.val_only
validates a checkpoint with its own saved settings and the command line's validation keys (`val_only_config`).

Going back (`checkpoint.resume_from`): a run resumes from the checkpoint it names instead of
`latest` and starts a branch: every checkpoint it saves records `branch: {from: <that
checkpoint's real path>}` in its trainer state, and the same command run again (a requeue, a
restart) continues from the newest intact checkpoint of that branch rather than going back
again. When the branch starts, `set_aside_later` moves checkpoint.dir's checkpoints after the
named step into `superseded/from_step_N_<time>/`, with copies of the run's metrics.jsonl and
samples.jsonl (which the resumed run cuts back to step N): nothing is deleted. A named
checkpoint that fails its check is refused (no fallback to another: it was chosen).

This module does not know the order of a PPO step or how models are built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from megappo.config import Config
from megappo.errors import CheckpointError, CheckpointWarning, ConfigError
from megappo.data.prompts import PromptExample, RowOrigin
from megappo.metrics.sample_log import plain_data
from megappo.rollout import partial as partial_rollouts
from megappo.types import RolloutBatch

LATEST = "latest"
STATE_FILE = "trainer_state.json"
ROLLOUT_BUFFER = "rollout_buffer.pt"
PARTIAL_ROLLOUTS = partial_rollouts.STATE_FILE
FORMAT = "megappo-trainer-v1"
DIGESTS = "digests"
DIGEST_FORMAT = "megappo-digests-v1"
HASH = "blake2b-128"
ERROR_LOG = "errors.log"
SUPERSEDED = "superseded"  # checkpoints (and metric logs) a branch from an earlier step moved aside
NOT_VERIFIED = "not verified (no digests: written by an older megappo)"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")  # Megatron's shards, our rng files

# Changing these on resume would make the checkpoint meaningless or the data stream skip
# or repeat prompts: refused. Other algorithm / optimisation / rollout changes are allowed
# with a warning that lists them; parallel layout, run length, logging and checkpoint
# settings change freely (the layout is resharded on load).
REFUSED_ON_RESUME = ("model", "algorithm.adv_estimator", "data.train_files", "data.builtin", "data.builtin_size",
                     "data.builtin_args", "data.seed", "data.shuffle", "data.train_batch_size", "rollout.n",
                     "critic.path", "reward.model_path",
                     "parallel.use_distributed_optimizer")  # Megatron's two optimizer formats do not convert
WARNED_ON_RESUME = ("algorithm", "actor", "critic", "ref", "rollout", "reward", "data")
# how model.path was made, and how the LM head's passes are computed (the same values within
# tolerance: megappo.parallel.chunked_head), not what the model holds
IGNORED_ON_RESUME = ("model.prepare", "model.lm_head_chunk_tokens")


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


def find_resume(cfg: Config, verify: str = "sizes") -> dict | None:
    """The trainer state to resume from (with its 'path' and 'branch'), per checkpoint.resume and
    checkpoint.resume_from; None to start fresh.

    The checkpoint `latest` names is checked first (`check_files`; `verify`: "sizes" reads no
    shard, "full" also compares digests: collective when a process group is up, each rank hashing
    a share of the files). A damaged one is named in one warning and the newest intact checkpoint
    before it is taken instead, saying so; none left: CheckpointError. Every refusal comes
    before any model is built.
    """
    if cfg.checkpoint.resume_from is not None:
        return _find_branch(cfg, verify)
    root, mode = cfg.checkpoint_dir, cfg.checkpoint.resume
    path = latest_checkpoint(root) if os.path.isdir(root) else None
    if mode == "must" and path is None:
        raise ConfigError(f"checkpoint.resume=must, but {root} has no complete checkpoint. Fix: set checkpoint.dir "
                          "to the run's checkpoint directory, or checkpoint.resume=auto to start fresh when there "
                          "is none.")
    if mode == "off":  # a fresh run: the checkpoints there are moved aside first (megappo.trainer.earlier_runs)
        return None
    state = None
    if path is not None:
        older = [n for n in reversed(_complete_steps(root)) if n < os.path.basename(path)]
        found = _intact_checkpoint([path, *(os.path.join(root, n) for n in older)], full=verify == "full")
        if isinstance(found, list):
            raise CheckpointError(f"no intact checkpoint in {root}: {len(found)} damaged (newest: {found[0]}). "
                                  "Fix: restore the damaged files from a copy, or start a new run (another "
                                  "run.output_dir, or checkpoint.resume=off with a fresh checkpoint.dir).",
                                  every_rank=True)
        path, state = _resumable(found, cfg)
    _warn_unfinished(root, path, state)
    return dict(state, path=path, branch=state.get("branch")) if state else None


def named_checkpoint(cfg: Config) -> str:
    """The step directory checkpoint.resume_from names: a step number (or step_NNNNNNNN) of
    checkpoint.dir, or a path (a step directory; a run or checkpoint directory: its `latest`). It may
    no longer exist: `keep_last` prunes it once its branch saved that many newer checkpoints."""
    name = str(cfg.checkpoint.resume_from).strip()
    number = re.fullmatch(r"(?:step_)?(\d+)", name)
    if number and not os.path.exists(name):
        return os.path.join(cfg.checkpoint_dir, step_dir_name(int(number.group(1))))
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, STATE_FILE)):
        return resolve_checkpoint(name)
    return name


def _find_branch(cfg: Config, verify: str) -> dict:
    """find_resume under checkpoint.resume_from: the newest intact checkpoint of checkpoint.dir that a
    run started from the named checkpoint saved (the branch continues), else the named one itself."""
    root, named = cfg.checkpoint_dir, named_checkpoint(cfg)
    branch = {"from": os.path.realpath(named)}
    later = []  # run.val_only validates the named checkpoint itself, not where its branch got to
    for name in reversed(_complete_steps(root) if not cfg.run.val_only else []):
        path = os.path.join(root, name)
        if os.path.realpath(path) != branch["from"] and _state_or_none(path).get("branch") == branch:
            later.append(path)
    exists = os.path.isfile(os.path.join(named, STATE_FILE))
    if not exists and not later:
        given, step = cfg.checkpoint.resume_from, _STEP_DIR.match(os.path.basename(named))
        if step and os.path.dirname(named) == root:
            have = [int(n[len("step_"):]) for n in _complete_steps(root)]
            raise ConfigError(f"checkpoint.resume_from={given}: {root} has no complete checkpoint of step "
                              f"{int(step.group(1))} (its steps: {have or 'none'}). Fix: name one of those steps, or "
                              "the path of a step_NNNNNNNN directory.")
        raise ConfigError(f"checkpoint.resume_from={given}: no megappo trainer checkpoint there (no {STATE_FILE}). "
                          f"Fix: name a step of {root} (a number) or the path of a step_NNNNNNNN directory.")
    found = _intact_checkpoint([*later, *([named] if exists else [])], full=verify == "full")
    if isinstance(found, list):  # no other checkpoint is taken in place of the one named
        what = f"names {named}, which is damaged" if exists else \
            f"names {named} (pruned), and every checkpoint of its branch is damaged (the oldest"
        raise CheckpointError(f"checkpoint.resume_from {what}: {found[-1]}{'' if exists else ')'}. Fix: restore it "
                              "from a copy, or name another checkpoint.", every_rank=True)
    path, state = _resumable(found, cfg)
    _warn_unfinished(root, path, state)
    return dict(state, path=path, branch=branch)


def _complete_steps(root: str) -> list[str]:
    """The step_NNNNNNNN directories of `root` that hold a trainer state, oldest first ([] without `root`)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(n for n in names if _STEP_DIR.match(n) and os.path.isfile(os.path.join(root, n, STATE_FILE)))


def _state_or_none(path: str) -> dict:
    """A checkpoint's trainer state, or {} when it cannot be read (being moved aside, damaged)."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _resumable(found: tuple[str, dict], cfg: Config) -> tuple[str, dict]:
    path, state = found
    if state.get("format") != FORMAT:
        raise ConfigError(f"'{path}' is not a {FORMAT} checkpoint (format {state.get('format')!r}).")
    if not cfg.run.val_only:  # a validation runs on the checkpoint's own settings (val_only_config)
        check_resumable(state["config"], cfg.to_dict(), path)
    return path, state


def _warn_unfinished(root: str, path: str | None, state: dict | None) -> None:
    unfinished = unfinished_saves(root, state["step"] if state else 0)
    if unfinished:  # a run stopped during a save (a second Ctrl-C, a kill): its step is not there to resume
        starts = f"resuming from {path} (step {state['step']})" if state else "starting from step 0"
        warnings.warn(f"{os.path.join(root, unfinished[-1])} is a save that did not finish (the run was stopped "
                      f"during it), so it cannot be resumed: {starts}.", CheckpointWarning, stacklevel=3)


def set_aside_later(cfg: Config, resume: dict | None) -> str | None:
    """Where a run starts a branch from the checkpoint checkpoint.resume_from names: move checkpoint.dir's
    checkpoints (and unfinished saves) after its step into superseded/from_step_N_<UTC time>/, with copies
    of run.output_dir's metrics.jsonl and samples.jsonl, and point `latest` at the newest checkpoint left
    at or before the step (none: removed), so no later one is resumed or pruned. Run by the one process
    that holds the run's lock, before any rank starts. The directory it made, or None (nothing after)."""
    if not resume or resume.get("branch") is None or os.path.realpath(resume["path"]) != resume["branch"]["from"]:
        return None
    root, step = cfg.checkpoint_dir, resume["step"]
    names = os.listdir(root) if os.path.isdir(root) else []
    later = sorted(n for n in names if _STEP_DIR.match(n) and int(n[len("step_"):]) > step)
    later += unfinished_saves(root, step)
    if not later:
        return None
    aside = os.path.join(root, SUPERSEDED, f"from_{step_dir_name(step)}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.makedirs(aside)
    for log in ("metrics.jsonl", "samples.jsonl"):
        if os.path.isfile(os.path.join(cfg.run.output_dir, log)):
            shutil.copy2(os.path.join(cfg.run.output_dir, log), os.path.join(aside, log))
    left = [n for n in _complete_steps(root) if n not in later]
    if left:
        _write_atomic(os.path.join(root, LATEST), left[-1])
    elif os.path.exists(os.path.join(root, LATEST)):
        os.remove(os.path.join(root, LATEST))
    for name in later:
        os.rename(os.path.join(root, name), os.path.join(aside, name))
    return aside


def _intact_checkpoint(paths: list[str], full: bool) -> tuple[str, dict] | list[str]:
    """(path, trainer state) of the first of `paths` that passes its check, warning about each one that does
    not (and about the fall back); when none does, what is wrong with each."""
    damaged = []
    for path in paths:
        problem = _check_everywhere(path, full)
        if problem is None or problem == NOT_VERIFIED:
            try:
                with open(os.path.join(path, STATE_FILE)) as f:
                    state = json.load(f)
            except (OSError, ValueError) as e:
                problem = f"{os.path.join(path, STATE_FILE)}: cannot be read ({type(e).__name__}: {e})"
            else:
                if problem == NOT_VERIFIED:
                    warnings.warn(f"checkpoint {path} is {NOT_VERIFIED}.", CheckpointWarning, stacklevel=3)
                if damaged:
                    warnings.warn(f"falling back to {path} (step {state['step']}), the newest intact checkpoint.",
                                  CheckpointWarning, stacklevel=3)
                return path, state
        warnings.warn(f"checkpoint {path} is damaged: {problem}; skipping it.", CheckpointWarning, stacklevel=3)
        damaged.append(problem)
    return damaged


def _check_everywhere(path: str, full: bool) -> str | None:
    """`check_files` of `path`; with a process group, every rank hashes a share of the files and
    all take the same answer (the first problem, by rank)."""
    if not (full and dist.is_available() and dist.is_initialized()):
        return check_files(path, full=full)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = check_files(path, full=True, share=(rank, world))
    found = [None] * world
    dist.all_gather_object(found, mine)
    return next((p for p in found if p is not None), None)


def file_digest(path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    """Every file under `step_dir` (relative paths, sorted), the digests and temporaries excluded."""
    out = []
    for here, dirs, names in os.walk(step_dir):
        rel = os.path.relpath(here, step_dir)
        if rel == DIGESTS:
            continue
        out += [os.path.normpath(os.path.join(rel, n)) for n in names if not n.endswith(".tmp")]
    return sorted(out)


def _owner(rel: str, world: int) -> int:
    """The rank that records `rel`'s digest: the one that wrote it (rank 0 for shared files)."""
    m = _RANK_FILE.match(os.path.basename(rel))
    rank = int(m.group(1) or m.group(2)) if m else 0
    return rank if rank < world else 0


def write_digests(step_dir: str, rank: int, world: int) -> None:
    """digests/rank_R.json: size and digest of each file of `step_dir` that rank `rank` wrote."""
    files = {rel: {"size": os.path.getsize(file), "digest": file_digest(file)}
             for rel in _files(step_dir) if _owner(rel, world) == rank for file in [os.path.join(step_dir, rel)]}
    os.makedirs(os.path.join(step_dir, DIGESTS), exist_ok=True)
    _write_atomic(os.path.join(step_dir, DIGESTS, f"rank_{rank:05d}.json"),
                  json.dumps({"format": DIGEST_FORMAT, "hash": HASH, "rank": rank, "files": files}, indent=1))


def check_files(step_dir: str, *, full: bool = True, prefix: str = "", share: tuple[int, int] = (0, 1),
                required: str = STATE_FILE) -> str | None:
    """None when every file recorded in `step_dir`'s digests (under `prefix`) is there with its
    size (and, `full`, its digest); else one line: the file and what is wrong. NOT_VERIFIED when
    the checkpoint has no digests. `share=(i, n)`: digests of every n-th file from the i-th only.
    `required`: the file whose record shows rank 0 finished writing its digests (a trainer
    checkpoint's trainer_state.json; a converted model directory's megappo_model.json)."""
    digests = os.path.join(step_dir, DIGESTS)
    if not os.path.isdir(digests):
        return NOT_VERIFIED
    recorded = {}
    for name in sorted(os.listdir(digests)):
        file = os.path.join(digests, name)
        try:
            with open(file) as f:
                manifest = json.load(f)
            assert manifest["format"] == DIGEST_FORMAT and manifest["hash"] == HASH
            recorded.update(manifest["files"])
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            return f"{file}: the digest record cannot be read ({type(e).__name__})"
    if required not in recorded:
        return f"{os.path.join(digests, 'rank_00000.json')}: missing (the save did not finish writing its digests)"
    names = sorted(rel for rel in recorded if rel.startswith(prefix))
    for i, rel in enumerate(names):
        file, want = os.path.join(step_dir, rel), recorded[rel]
        if not os.path.isfile(file):
            return f"{file}: missing"
        size = os.path.getsize(file)
        if size != want["size"]:
            return f"{file}: {size} bytes, the save wrote {want['size']} (truncated or overwritten)"
        if full and i % share[1] == share[0] and file_digest(file) != want["digest"]:
            return f"{file}: its bytes differ from the {HASH} digest recorded at save (corrupted)"
    return None


def check_model_dir(model_dir: str) -> None:
    """Before export / conversion reads a model directory: a trainer checkpoint's actor/ or
    critic/, or a directory tools/convert_hf_to_megatron.py wrote (its own digests/): its files
    must match their digests (CheckpointError naming the file); one without digests (written by an
    older megappo) is read with a warning."""
    from megappo.models.checkpoint import META_FILE

    step_dir = os.path.dirname(os.path.normpath(model_dir))
    if os.path.isfile(os.path.join(step_dir, STATE_FILE)):
        problem = check_files(step_dir, prefix=os.path.basename(os.path.normpath(model_dir)) + os.sep)
        fix = f"export an earlier step_NNNNNNNN directory of {os.path.dirname(step_dir)}, or restore the file from a copy"
        where = f"checkpoint {step_dir}"
    else:
        problem = check_files(model_dir, required=META_FILE)
        fix = "convert it again from its HF directory (tools/convert_hf_to_megatron.py), or restore the file from a copy"
        where = f"model checkpoint {model_dir}"
    if problem == NOT_VERIFIED:
        warnings.warn(f"{where} is {NOT_VERIFIED}.", CheckpointWarning, stacklevel=2)
    elif problem:
        raise CheckpointError(f"{where} is damaged: {problem}. Fix: {fix}.")


def log_traceback(root: str, e: BaseException) -> str:
    """Append `e`'s traceback to `root`/errors.log; returns " (traceback in FILE)", or "" when it
    cannot be written (a full disk)."""
    import traceback

    log = os.path.join(root, ERROR_LOG)
    try:
        os.makedirs(root, exist_ok=True)
        with open(log, "a") as f:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            f.write(f"--- rank {rank}\n{''.join(traceback.format_exception(e))}")
    except OSError:  # a full disk: the one line still says what happened
        return ""
    return f" (traceback in {log})"


#: loggers of the libraries a save runs through, whose error lines (Megatron's async writer logs
#: "Local process N encountered an error: ..." per rank before raising) belong in errors.log
SAVE_LOGGERS = ("megatron.core.dist_checkpointing", "torch.distributed.checkpoint")


@contextlib.contextmanager
def _library_errors_to(root: str):
    """During a save: those loggers' records go to `root`/errors.log (not Python's last-resort
    stderr handler), so a failed save stays one line on the console. Nothing is opened unless a
    record comes (the disk may be full)."""
    handler = _ErrorLogHandler(os.path.join(root, ERROR_LOG))
    loggers = [logging.getLogger(name) for name in SAVE_LOGGERS]
    saved = [(lg.propagate, lg.handlers[:]) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, (propagate, handlers) in zip(loggers, saved):
            lg.handlers[:], lg.propagate = handlers, propagate


class _ErrorLogHandler(logging.Handler):
    def __init__(self, path: str):
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(f"--- {record.name} {record.levelname}: {self.format(record)}\n")
        except OSError:  # a full disk: the error that follows still says what happened
            pass


def _nearly_full(path: str) -> bool:
    """Whether the file system of `path` has under 1% (or 16 MiB) free: a save that failed there ran
    out of space even when the error does not say so (torch's zip writer: 'unexpected pos')."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return False
    return usage.free < max(16 << 20, usage.total // 100)


def _no_space(e: BaseException) -> bool:
    """Whether `e` (or what it wraps: a cause, torch.distributed.checkpoint's per-rank failures) is ENOSPC."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return True
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [getattr(f, "exc", f) for f in failures.values()]
        todo += [x.__cause__, x.__context__]
    return "[Errno 28]" in str(e)


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


#: the sections of a checkpoint's saved config that run.val_only takes from it: what the model is and how it
#: was trained (the keys a resume compares)
VAL_ONLY_FROM_CHECKPOINT = ("model", "algorithm", "actor", "critic", "ref", "rollout", "reward", "data",
                            "parallel.use_distributed_optimizer")
#: inside them, what a validation takes from its own command line: which prompts and how they are sampled and
#: scored for the report, and how generation and loading run on this machine
VAL_ONLY_OWN_KEYS = ("data.val_files", "data.builtin_val_size", "data.long_prompt_policy", "data.bad_row_policy",
                     "rollout.val_n", "rollout.val_temperature", "rollout.val_top_p", "rollout.val_top_k",
                     "rollout.engine", "rollout.hf_decode", "rollout.hf_eos_check_every", "rollout.sglang",
                     "rollout.placement", "rollout.engine_cores", "rollout.update_bucket_mb", "rollout.verify_every",
                     "rollout.sync_mode", "reward.metric_functions", "reward.timeout_s", "reward.num_workers",
                     "reward.bad_value_policy", "model.layer_spec", "model.lm_head_chunk_tokens",
                     "actor.parallel", "critic.parallel", "ref.parallel", "reward.parallel")


def val_only_config(saved: dict, given: Config) -> tuple[Config, list[str]]:
    """run.val_only on a checkpoint: its saved config `saved` for VAL_ONLY_FROM_CHECKPOINT but VAL_ONLY_OWN_KEYS,
    which come from `given` (the recipe and command line), as do the other sections (run, logging, checkpoint,
    hardware, parallel). Returns the config and `given`'s settings that differ from the checkpoint's and are not
    used ('rollout.n=8 (the checkpoint's: 4)'), for the start-up line."""
    from megappo.config import config_from_dict

    def under(key: str, sections) -> bool:
        return any(key == s or key.startswith(s + ".") for s in sections)

    old, new = _flatten(saved), _flatten(given.to_dict())
    keys = [k for k in dict.fromkeys([*new, *old]) if under(k, VAL_ONLY_FROM_CHECKPOINT) and k not in IGNORED_ON_RESUME]
    merged = given.to_dict()
    ignored = []
    for key in keys:
        if under(key, VAL_ONLY_OWN_KEYS) or old.get(key) == new.get(key):
            continue
        ignored.append(f"{key}={_shown(new, key)} (the checkpoint's: {_shown(old, key)})")
        _set_path(merged, key, old.get(key), present=key in old)
    return config_from_dict(merged), ignored


def _shown(flat: dict, key: str) -> str:
    return json.dumps(flat[key]) if key in flat else "unset"


def _set_path(tree: dict, key: str, value, *, present: bool) -> None:
    """tree[a][b][c] = value for key 'a.b.c' (removed when not `present`)."""
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    if present:
        tree[last] = value
    else:
        tree.pop(last, None)


@dataclasses.dataclass
class TrainerState:
    """What the loop needs besides model and optimizer state (rank 0's view)."""

    step: int
    sampler: dict | None
    kl_coef: float
    nan_skips: int
    branch: dict | None = None  # {"from": the checkpoint checkpoint.resume_from named}: the run's branch


def save(path_root: str, step: int, trainables: dict, trainer: TrainerState, cfg: Config, *, hf_config: dict,
         hf_files: dict | None, critic_hf_config: dict | None, rank: int, keep_last: int,
         rollout_buffer: list | None = None, partial_rollouts: dict | None = None) -> str:
    """Collective: one complete checkpoint of `step`; returns its directory. `rollout_buffer`
    (rank 0): [(step, RolloutBatch)] generated ahead of the training; `partial_rollouts` (rank 0): the
    carried samples' state (megappo.rollout.partial, plain data). A full disk: CheckpointError
    (one line; `latest` still names the previous checkpoint)."""
    try:
        with _library_errors_to(cfg.run.output_dir):
            return _save(path_root, step, trainables, trainer, cfg, hf_config=hf_config, hf_files=hf_files,
                         critic_hf_config=critic_hf_config, rank=rank, keep_last=keep_last,
                         rollout_buffer=rollout_buffer, partial_rollouts=partial_rollouts)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        # a CheckpointException is raised on every rank, with every rank's failure on rank 0 (the
        # coordinator), which reports it; the others end quietly
        if type(e).__name__ == "CheckpointException" and rank != 0:
            log_traceback(path_root, e)
            raise CheckpointError(f"saving step {step} to {path_root} failed (rank 0 says why)", every_rank=True) from None
        if not _no_space(e) and not _nearly_full(path_root):
            raise
        log = log_traceback(cfg.run.output_dir, e)  # not on the full disk, when checkpoint.dir is elsewhere
        previous = latest_checkpoint(path_root)
        resumes = f"it resumes from {previous} ('latest' still names it)" if previous else "it starts from step 0"
        raise CheckpointError(f"no space left on the device of {path_root} while saving step {step}{log}. Fix: "
                              f"free space there (delete {step_dir_name(step)}.partial, lower "
                              f"checkpoint.keep_last, or set checkpoint.dir to a larger disk), then rerun the same "
                              f"command: {resumes}.", every_rank=False) from None


def _save(path_root: str, step: int, trainables: dict, trainer: TrainerState, cfg: Config, *, hf_config: dict,
          hf_files: dict | None, critic_hf_config: dict | None, rank: int, keep_last: int,
          rollout_buffer: list | None, partial_rollouts: dict | None) -> str:
    from megappo.models.checkpoint import save_trainable

    final = os.path.join(path_root, step_dir_name(step))
    partial = final + ".partial"
    world = dist.get_world_size()
    if rank == 0:
        os.makedirs(path_root, exist_ok=True)
        if os.path.isdir(partial):  # this step's save that was killed midway (other saves' are not ours)
            shutil.rmtree(partial)
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
        if partial_rollouts is not None:
            torch.save(partial_rollouts, os.path.join(partial, PARTIAL_ROLLOUTS))
        state = {"format": FORMAT, **dataclasses.asdict(trainer), "roles": sorted(trainables),
                 "world_size": world, "config": cfg.to_dict()}
        _write_atomic(os.path.join(partial, STATE_FILE), json.dumps(state, indent=2))
    write_digests(partial, rank, world)  # every rank, the files it wrote: before the save counts as complete
    dist.barrier()
    if rank == 0:
        if os.path.isdir(final):  # the same step saved before a crash that lost `latest`'s update
            shutil.rmtree(final)
        os.rename(partial, final)
        _write_atomic(os.path.join(path_root, LATEST), step_dir_name(step))
        _prune(path_root, keep_last, upto_step=step)
    dist.barrier()
    return final


def load(path: str, trainables: dict, rank: int) -> None:
    """Collective: model, optimizer and scheduler of each trained role, and this rank's RNG.
    A file that cannot be read: CheckpointError naming the checkpoint (traceback in errors.log)."""
    from megappo.errors import ModelConfigError
    from megappo.models.checkpoint import load_trainable

    try:
        for role, trainable in trainables.items():
            load_trainable(trainable, os.path.join(path, role))
        rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
        rng = torch.load(rng_file, weights_only=True) if os.path.isfile(rng_file) else None
    except (ConfigError, ModelConfigError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a damaged file that no digest covered (a checkpoint of an older megappo)
        from megappo.parallel.stage import as_collective_error

        if as_collective_error(e) is not None:  # a lost peer: megappo.cli reports that
            raise
        log = log_traceback(os.path.dirname(path), e)
        older = "" if os.path.isdir(os.path.join(path, DIGESTS)) else f" (it is {NOT_VERIFIED})"
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"cannot read checkpoint {path}{older}: {type(e).__name__}: {first}{log}. Fix: write "
                              f"an earlier step_NNNNNNNN into {os.path.join(os.path.dirname(path), LATEST)} "
                              f"to resume from it, or restore the files from a copy.",
                              every_rank=type(e).__name__ == "CheckpointException") from None
    if rng is not None:
        _set_rng_state(rng)
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


def load_partial_rollouts(path: str) -> dict | None:
    """The carried samples' state a checkpoint saved (megappo.rollout.partial); None: it has none."""
    file = os.path.join(path, PARTIAL_ROLLOUTS)
    return torch.load(file, weights_only=True) if os.path.isfile(file) else None  # plain data: runs no code


def _plain_batch(batch: RolloutBatch) -> dict:
    """A RolloutBatch as tensors and plain Python data (what torch.load(weights_only=True) reads)."""
    plain = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if plain["examples"] is not None:
        plain["examples"] = [dataclasses.asdict(e) for e in plain["examples"]]
    if plain["score_fields"] is not None:  # what reward functions returned: numpy's numbers too
        plain["score_fields"] = plain_data(plain["score_fields"])
    return plain


def _batch_from_plain(plain: dict) -> RolloutBatch:
    if plain["examples"] is not None:
        plain["examples"] = [PromptExample(**{**e, "origin": RowOrigin(**e["origin"]) if e.get("origin") else None})
                             for e in plain["examples"]]  # a buffer saved before examples kept their origin: None
    return RolloutBatch(**plain)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root: str, keep_last: int, upto_step: int | None = None) -> None:
    """Delete checkpoints beyond the newest `keep_last` among steps <= `upto_step` (the run's own
    history: checkpoints after it, left by a run that a resume fell back from, are neither counted
    nor deleted; they are replaced when the run saves their step again), except the newest one with
    digests that preceded steps skipped for non-finite losses (a later one has more `nan_skips`)."""
    if keep_last <= 0:
        return
    steps = sorted(name for name in os.listdir(root) if _STEP_DIR.match(name)
                   and (upto_step is None or int(name[len("step_"):]) <= upto_step))
    keep = set(steps[-keep_last:]) | {_before_skips(root, steps)}
    for name in steps:
        if name not in keep:
            shutil.rmtree(os.path.join(root, name))


def _before_skips(root: str, steps: list[str]) -> str | None:
    """The newest of `steps` with digests whose NaN-skip count is below a later one's."""
    skips = {}
    for name in steps:
        try:
            with open(os.path.join(root, name, STATE_FILE)) as f:
                skips[name] = int(json.load(f).get("nan_skips", 0))
        except (OSError, ValueError, TypeError):
            continue
    most_after, found = -1, None
    for name in reversed([n for n in steps if n in skips]):
        if skips[name] < most_after and found is None and os.path.isdir(os.path.join(root, name, DIGESTS)):
            found = name
        most_after = max(most_after, skips[name])
    return found


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
