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
from typing import Any

from megappo.errors import ConfigError
from megappo.user_code import load_spec
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
    module, where, attr = load_spec(BUILTIN_ENVS.get(spec, spec), who=f"rollout.env='{spec}'", fix=_FIX, malformed=(
        f"rollout.env='{spec}' is neither a built-in environment nor MODULE:CLASS. {_FIX}"))
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
