"""Which environment class `rollout.env` names, and the start-up check of `rollout.env_args`.

`env_class(spec)` resolves a built-in short name (`BUILTIN_ENVS`: single_turn, tools,
lookup; imported lazily) or the user's own class, `pkg.module:Class` (imported from the
working directory and sys.path) or `path/to/file.py:Class`. `check_env(spec, args)` resolves
it and builds one instance with the arguments, so that a bad path, a class that is not an
`Environment` or arguments its `__init__` refuses fail before any model is built, each with
a ConfigError that names the fix. An environment's `__init__` should therefore be cheap (open
sandboxes and connections in `reset`).

This module does not know about engines, tokenizers or PPO.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Any

from megappo.config import ConfigError
from megappo.envs.base import Environment

#: rollout.env short names -> "module:Class" (imported only when named)
BUILTIN_ENVS = {
    "single_turn": "megappo.envs.base:SingleTurn",
    "tools": "megappo.envs.tools:ToolEnv",
    "lookup": "megappo.envs.lookup:LookupEnv",
}

_FIX = ("Fix: set rollout.env to one of " + ", ".join(BUILTIN_ENVS)
        + ", or to your own class as pkg.module:Class or path/to/file.py:Class.")


@functools.cache
def env_class(spec: str) -> type[Environment]:
    """The Environment subclass `rollout.env` names (loaded once per process)."""
    where, _, attr = BUILTIN_ENVS.get(spec, spec).rpartition(":")
    if not where or not attr:
        raise ConfigError(f"rollout.env='{spec}' is neither a built-in environment nor MODULE:CLASS. {_FIX}")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ConfigError(f"rollout.env='{spec}': file '{where}' does not exist (relative paths start at "
                              f"{os.getcwd()}). {_FIX}")
        module_spec = importlib.util.spec_from_file_location(f"megappo_env_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(module_spec)
        load = lambda: module_spec.loader.exec_module(module)  # noqa: E731
    else:
        module = None

        def load():
            nonlocal module
            sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(where)
            finally:
                sys.path.remove(os.getcwd())
    try:
        load()
    except ImportError as e:
        raise ConfigError(f"rollout.env='{spec}': cannot import '{where}' ({e}). {_FIX}") from None
    except Exception as e:  # the user's module failed while it was imported: show where, keep it short
        raise ConfigError(f"rollout.env='{spec}': importing '{where}' raised {type(e).__name__}: {e}. "
                          "Fix: correct that file.") from None
    cls = getattr(module, attr, None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Environment)
                       and v.__module__ == module.__name__)
        raise ConfigError(f"rollout.env='{spec}': '{where}' has no '{attr}' (its Environment classes: {found}). {_FIX}")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"rollout.env='{spec}': {attr} is not a subclass of megappo.envs.base.Environment. Fix: "
                          "write `class " + attr + "(Environment)` with `async def step(self, action)` "
                          "(docs/environments.md).")
    return cls


def check_env(spec: str, args: dict[str, Any]) -> type[Environment]:
    """Resolve `rollout.env` and build one instance with `rollout.env_args`; returns the class."""
    cls = env_class(spec)
    try:
        cls(**args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rollout.env={spec} with rollout.env_args={dict(args)}: {e}. Fix: pass the arguments "
                          f"{cls.__name__}.__init__ accepts, with valid values.") from None
    return cls
