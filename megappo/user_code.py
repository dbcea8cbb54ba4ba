"""Loading the user's own code that a recipe names: `path/to/file.py:name` or `pkg.module:name`.

Reward functions, environments and tools are named this way. `load_spec(spec, ...)` splits
the spec, imports the module part (a file is executed once per process; a module is imported
with the working directory on the path) and turns every way that can fail into a ConfigError
that names the spec, says what went wrong and `fix`. Callers check what they take from the
module.

`UserCodeError`: what megappo raises when the user's code fails while a run calls it (a reward
function or an environment's method raises, or returns what megappo cannot use). It names the
code, the dataset row (its file and line, or built-in source; training or validation; its prompt)
and the turn; megappo.cli reports it as the run's one
error (the code's own traceback, then that message last, exit 4) and the other ranks exit quietly
with it (docs/bad-inputs.md).

This module does not know what the loaded names are for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from megappo.errors import ConfigError


class UserCodeError(Exception):
    """The user's own code failed while megappo called it: `code` (e.g. "environment my_env.py:MyEnv.step"),
    `cause` (the exception it raised, or what was wrong with what it returned), the dataset `row`
    (its RowOrigin: file and line, or built-in source, training or validation; None when unknown),
    the `turn` of the episode (None outside one) and the row's `prompt` text when known."""

    def __init__(self, code: str, cause: BaseException | str, *, row: Any = None,
                 turn: int | None = None, prompt: str | None = None, fix: str = "correct that code"):
        self.code, self.cause, self.row, self.turn, self.prompt, self.fix = code, cause, row, turn, prompt, fix
        super().__init__(self._message())

    def _message(self) -> str:
        kind = getattr(self.cause, "remote_type", type(self.cause).__name__)  # raised in a reward worker: its class
        what = f"raised {kind}: {self.cause}" if isinstance(self.cause, BaseException) else self.cause
        row = (self.row.describe(self.prompt) if self.row is not None
               else f"prompt {short_text(self.prompt)}" if self.prompt is not None else "")
        at = ", ".join(w for w in (row, f"turn {self.turn}" if self.turn is not None else "") if w)
        traceback = " (its traceback is above)" if isinstance(self.cause, BaseException) else ""
        return f"{self.code} {what}" + (f" on {at}" if at else "") + f". Fix: {self.fix}{traceback}."

    def at(self, *, row: Any = None, turn: int | None = None, prompt: str | None = None
           ) -> "UserCodeError":
        """This error with the row / turn / prompt it did not know yet (an inner call knew less)."""
        return UserCodeError(self.code, self.cause, row=self.row if self.row is not None else row,
                             turn=self.turn if self.turn is not None else turn,
                             prompt=self.prompt if self.prompt is not None else prompt, fix=self.fix)


def short_text(text: Any, limit: int = 60) -> str:
    """`text` on one line, repr-escaped (newlines as \\n), cut to about `limit` characters."""
    text = repr(text)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


def is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where


@functools.cache  # by absolute path for files: the same file is executed once
def _module(where: str) -> ModuleType:
    if is_file(where):
        spec = importlib.util.spec_from_file_location(f"megappo_user_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    finally:
        sys.path.remove(os.getcwd())


def load_module(where: str, fix: str) -> ModuleType:
    """The module `where` names (a .py file or a dotted module), loaded once per process."""
    if is_file(where) and not os.path.isfile(where):
        raise ConfigError(f"file '{where}' does not exist (relative paths start at {os.getcwd()}). {fix}")
    try:
        return _module(os.path.abspath(where) if is_file(where) else where)
    except ImportError as e:
        raise ConfigError(f"cannot import '{where}' ({e}). {fix}") from None
    except Exception as e:  # the user's module failed while it was imported: show where, keep it short
        raise ConfigError(f"importing '{where}' raised {type(e).__name__}: {e}. Fix: correct that file.") from None


def load_spec(spec: str, *, who: str, malformed: str, fix: str) -> tuple[ModuleType, str, str]:
    """'where:name' -> (module, where, name). Errors start with `who` (e.g. "tool 'x.py:f'");
    `malformed` is the whole message for a spec without both parts."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(malformed)
    try:
        return load_module(where, fix), where, name
    except ConfigError as e:
        raise ConfigError(f"{who}: {e}") from None
