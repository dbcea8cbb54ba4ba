"""A fresh run never destroys an earlier run's results: `set_aside_earlier(cfg)`.

`run.output_dir` and `checkpoint.dir` together identify a run. A run that resumes continues the
files it finds there. A run that starts fresh (no checkpoint to resume: a first run, a rerun after
a crash before the first checkpoint, `checkpoint.resume=off`) and finds an earlier run's files in
either directory moves them aside before anything of its own is written, and says where in one
line. Moved, not refused: a rerun after a crash (or a verl script pointed at a used directory) then
just works, and nothing is deleted; a rename on the same filesystem copies nothing.

    RUN/                              run.output_dir
      megappo.lock                    the live run's (never moved)
      metrics.jsonl  config.json ...  the fresh run's
      superseded/
        run_20261128T051500Z/         the earlier run's files, as they were
          metrics.jsonl  samples.jsonl  config.json  curves.png  verl_keys.log ...
          checkpoints/                checkpoint.dir's entries, when it lies inside RUN
            step_00000100/  latest  superseded/ ...
    CKPT/superseded/run_<time>/       checkpoint.dir's entries, when it lies elsewhere

Only what megappo writes is moved (`OUTPUT_ENTRIES`, `is_checkpoint_entry`): a file of yours in
run.output_dir stays where it is. Called by the one process that holds the run's lock
(megappo.trainer.runlock), after `checkpointing.find_resume` said there is nothing to resume.

This module does not know how a run is trained, resumed or launched.
"""

from __future__ import annotations

import os
import re
import time

from megappo.trainer.checkpointing import ERROR_LOG, LATEST, SUPERSEDED
from megappo.config import Config
from megappo.trainer.runlock import LOCK_FILE

#: what a run writes into run.output_dir (its default checkpoint.dir, `checkpoints`, included)
OUTPUT_ENTRIES = ("metrics.jsonl", "samples.jsonl", "config.json", "curves.png", "verl_keys.log",
                  "restarts.jsonl", ERROR_LOG, "wandb_run_id", "wandb", "tensorboard", "mlruns", "val_only", "hf",
                  "engine-init", "checkpoints")
_CHECKPOINT_ENTRY = re.compile(r"^step_\d{8}(\.partial)?$")


def is_checkpoint_entry(name: str) -> bool:
    """A name megappo writes into checkpoint.dir: step directories (finished or not), `latest`,
    errors.log, and superseded/ (the branches a checkpoint.resume_from run moved aside)."""
    return bool(_CHECKPOINT_ENTRY.match(name)) or name in (LATEST, ERROR_LOG, SUPERSEDED)


def earlier_files(cfg: Config) -> tuple[list[str], list[str]]:
    """The earlier run's entries of run.output_dir and of checkpoint.dir (names, sorted)."""
    out, ckpt = os.path.realpath(cfg.run.output_dir), os.path.realpath(cfg.checkpoint_dir)
    holder = os.path.relpath(ckpt, out).split(os.sep)[0] if _inside(ckpt, out) else None  # "." when the same
    outputs = sorted(n for n in _listdir(out) if n in OUTPUT_ENTRIES and n != holder)
    keep = {SUPERSEDED} if holder in (None, ".") else set()  # where the moved entries go: stays
    checkpoints = sorted(n for n in _listdir(ckpt) if is_checkpoint_entry(n) and n not in keep
                         and not (holder == "." and n in outputs))
    return outputs, checkpoints


def set_aside_earlier(cfg: Config) -> str | None:
    """Move an earlier run's files out of the way of a fresh run (see the module docstring); the
    one line saying what moved where, or None when there was nothing to move."""
    outputs, checkpoints = earlier_files(cfg)
    if not outputs and not checkpoints:
        return None
    out, ckpt = os.path.realpath(cfg.run.output_dir), os.path.realpath(cfg.checkpoint_dir)
    aside = _fresh_dir(os.path.join(out, SUPERSEDED), f"run_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    for name in outputs:
        os.rename(os.path.join(out, name), os.path.join(aside, name))
    where = aside
    if checkpoints:
        if _inside(ckpt, out):  # the same layout under `aside` (one filesystem: renames)
            ckpt_aside = os.path.normpath(os.path.join(aside, os.path.relpath(ckpt, out)))
            os.makedirs(ckpt_aside, exist_ok=True)
        else:
            ckpt_aside = _fresh_dir(os.path.join(ckpt, SUPERSEDED), os.path.basename(aside))
            where = f"{aside} and {ckpt_aside}"
        for name in checkpoints:
            os.rename(os.path.join(ckpt, name), os.path.join(ckpt_aside, name))
    what = ", ".join([*outputs, *(os.path.join(cfg.checkpoint_dir, n) for n in _few(checkpoints))])
    why = "checkpoint.resume=off" if cfg.checkpoint.resume == "off" else "no checkpoint to resume"
    return (f"an earlier run's files ({what}) are now in {where}: this run starts fresh ({why}); "
            "nothing was deleted.")


def _few(names: list[str]) -> list[str]:
    """Names for one line: the first two and the last of a long list, with the count between."""
    return names if len(names) <= 4 else [*names[:2], f"... {len(names) - 3} more ...", names[-1]]


def _fresh_dir(parent: str, name: str) -> str:
    """parent/name, or parent/name_2, ... when a run in the same second took it: made, empty."""
    path, n = os.path.join(parent, name), 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = os.path.join(parent, f"{name}_{n}")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _listdir(path: str) -> list[str]:
    return [n for n in os.listdir(path) if n != LOCK_FILE] if os.path.isdir(path) else []
