"""The machinery every config section shares: `_Section` (convert and type-check each field on
construction, then run the section's own `check()`), the converter from plain data to typed fields
(`_convert`, `_build`) and back (`_plain`), and the error helpers (`_require`, `_at_least`,
`_unknown_key`).

Errors are `ConfigError`s (megappo.errors) written with `{P}key`: the prefix of the section's
dotted path is filled in as the error leaves each enclosing section, so a message names
`actor.optim.lr`, not `lr`. A section may refuse keys a reader would expect there, with why, in
its `REFUSED_KEYS` (key -> reason and fix); `_build` reports those before the unknown-key error.

Owns: the section base, the type conversion and its messages. Knows no section and no field: the
sections are in the other modules of megappo.config. Imports nothing from megappo but its errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Any, Literal, Optional, Union

from megappo.errors import P, ConfigError


def _require(ok: bool, template: str) -> None:
    """Section checks: write keys as f'{P}key' so the error shows the full dotted path."""
    if not ok:
        raise ConfigError(template)


#: the words YAML 1.1 reads as False / True (megappo.config.loading parses recipes and overrides as YAML 1.1)
_YAML_BOOLS = {False: ("off", "no", "false", "n"), True: ("on", "yes", "true", "y")}


def _at_least(section: Any, **minimums: int) -> None:
    for name, low in minimums.items():
        value = getattr(section, name)
        _require(value is None or value >= low,
                 f"{P}{name}={value} must be >= {low}. Fix: set {P}{name}={low} or more.")


def _default(section: type) -> Any:
    """A section field whose default is that section's defaults."""
    return dataclasses.field(default_factory=section)


class _Section:
    """Base of every section: converts and type-checks each field, then runs `check()`."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _convert(f.name, getattr(self, f.name), hints[f.name]))
        self.check()

    def check(self) -> None:
        """Consistency of this section's own fields."""


# -- conversion of plain data to typed fields -----------------------------------------------

_YAML11_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")  # PyYAML reads `1e-6` (no dot) as a str
_SCALARS = (bool, int, float, str)
_EXAMPLES = {bool: "true", int: "2", float: "0.5", str: "text", list: "[a,b]", tuple: "[0.9,0.999]", dict: "{k: v}"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(tp: Any) -> list[Any]:
    """The non-None members of a Union (`Optional[X]` -> [X]); [tp] for anything else."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is Literal:
        return f"one of {list(args)}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _type_error(key: str, value: Any, tp: Any) -> ConfigError:
    base = _options(tp)[0]
    if base is str and not isinstance(value, str):
        fix = f"quote it: {P}{key}='{value}'"
    else:
        fix = f"write e.g. {P}{key}={_EXAMPLES.get(typing.get_origin(base) or base, '{k: v}')}"
    return ConfigError(f"{P}{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__}). Fix: {fix}.")


def _convert(key: str, value: Any, tp: Any) -> Any:
    """`value` checked against annotation `tp`, containers and sections converted. `key` is section-relative."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = _options(tp)
        if float in options and isinstance(value, float) and not math.isfinite(value):
            return _convert(key, value, float)  # the finiteness error, not "expected float or null"
        if len(options) == 1 and options[0] not in _SCALARS:
            return _convert(key, value, options[0])  # its error is the more specific one
        for option in options:
            with contextlib.suppress(ConfigError):
                return _convert(key, value, option)
        raise _type_error(key, value, tp)
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:  # True == 1, but not a choice of 1
            return value
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on/no/yes as a bool: the choice of that spelling
            spelled = [a for a in args if isinstance(a, str) and a.lower() in _YAML_BOOLS[value]]
            if len(spelled) == 1:
                return spelled[0]
        guess = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" Did you mean '{guess[0]}'?" if guess else ""
        raise ConfigError(f"{P}{key}: {value!r} is not one of {list(args)}.{hint} Fix: set {P}{key} to one of them.")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _type_error(key, value, tp)
        try:
            return _build(tp, value)
        except ConfigError as e:
            raise e.under(key) from None
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.match(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _type_error(key, value, tp)
        if not math.isfinite(value):  # YAML's .nan / .inf: no field means anything by them
            raise ConfigError(f"{P}{key}={value} is not a finite number. Fix: set {P}{key} to a finite value.")
        return float(value)
    if tp in _SCALARS:
        if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
            return value
        raise _type_error(key, value, tp)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, value, tp)
        return [_convert(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or (Ellipsis not in args and len(value) != len(args)):
            raise _type_error(key, value, tp)
        items = [args[0]] * len(value) if Ellipsis in args else args
        return tuple(_convert(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, items)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _type_error(key, value, tp)
        return {k: _convert(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    raise TypeError(f"config annotation {tp!r} of '{key}' is not supported")  # a bug in this module


def _unknown_key(key: Any, valid: list[str]) -> ConfigError:
    guess = difflib.get_close_matches(str(key), valid, n=1)
    hint = (f" Did you mean '{P}{guess[0]}'? Fix: rename it." if guess
            else " Fix: remove it or use one of the valid keys.")
    return ConfigError(f"unknown config key '{P}{key}'.{hint} Valid keys: {valid}.")


def _not_here(cls: type, key: Any) -> Optional[ConfigError]:
    """The error for a key section `cls` refuses with a reason (its `REFUSED_KEYS`), else None."""
    why = getattr(cls, "REFUSED_KEYS", {}).get(key)
    return ConfigError(f"{P}{key}: {why}") if why else None


def _build(cls: type, data: dict) -> Any:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in valid:
            raise _not_here(cls, key) or _unknown_key(key, valid)
    return cls(**data)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj
