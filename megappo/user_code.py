"""Loading the user's own code that a recipe names: `path/to/file.py:name` or `pkg.module:name`.

Reward functions, environments and tools are named this way. `load_spec(spec, ...)` splits
the spec, imports the module part (a file is executed once per process; a module is imported
with the working directory on the path) and turns every way that can fail into a ConfigError
that names the spec, says what went wrong and `fix`. Callers check what they take from the
module.

This module does not know what the loaded names are for.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType

from megappo.errors import ConfigError


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
