"""The settings of rollout correction (verl's `algorithm.rollout_correction`): option names, the
grammar of the threshold strings and the checks of one setting, in plain Python.

Owns: `IS_LEVELS`, `RS_OPTIONS`, `LOSS_TYPES`, `RsBounds`, `parse_is_threshold`, `parse_rs_options`,
`parse_rs_thresholds`, `validate` (errors name the `algorithm.rollout_correction.*` key and the fix).
Does not know about tensors or the trainer: the config checks a recipe with it (no torch), and
megappo.ppo.rollout_correction reads the parsed bounds from it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")

_KEY = "algorithm.rollout_correction."
_IS_FIX = ('Fix: give a positive number (TIS, e.g. 2.0) or "lower_upper" with 0 < lower <= upper '
           '(IcePop, e.g. "0.5_5.0").')
_RS_FIX = ('Fix: give one threshold for all options or one per option, comma separated; k1 options take '
           '"lower_upper" (e.g. "0.999_1.001") or an upper u (lower 1/u), k2/k3 options a positive upper '
           'bound (e.g. 0.01).')


# -- thresholds ----------------------------------------------------------------------------------

class RsBounds(NamedTuple):
    """Bounds of one RS option: `lower` is set for k1 options only (bounds on exp(k1))."""
    lower: float | None
    upper: float


def _number(text: str, key: str, spec, fix: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{_KEY}{key}={spec!r}: '{text}' is not a number. {fix}") from None
    if math.isnan(value):
        raise ValueError(f"{_KEY}{key}={spec!r} is NaN. {fix}")
    return value


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """`rollout_is_threshold` -> (upper, lower): a number (or number string) u gives (u, None),
    truncated IS; "l_u" gives (u, l), IcePop. Raises TypeError / ValueError naming the key."""
    key = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{_KEY}{key} must be a number or a string, got {spec!r}. {_IS_FIX}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"{_KEY}{key} is an empty string. {_IS_FIX}")
        head, sep, tail = text.partition("_")
        if sep:
            lower, upper = _number(head, key, spec, _IS_FIX), _number(tail, key, spec, _IS_FIX)
        else:
            upper = _number(text, key, spec, _IS_FIX)
    else:
        upper = _number(str(spec), key, spec, _IS_FIX)
    if upper <= 0:
        raise ValueError(f"{_KEY}{key}={spec!r}: the upper bound must be positive. {_IS_FIX}")
    if lower is not None and lower <= 0:
        raise ValueError(f"{_KEY}{key}={spec!r}: the lower bound must be positive. {_IS_FIX}")
    if lower is not None and lower > upper:
        raise ValueError(f"{_KEY}{key}={spec!r}: the lower bound exceeds the upper bound. {_IS_FIX}")
    return upper, lower


def parse_rs_options(rollout_rs: str) -> list[str]:
    """`rollout_rs` ("seq_mean_k1,token_k3") -> its options in order, duplicates dropped."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"{_KEY}rollout_rs must be a string of comma separated options, got {rollout_rs!r}. "
                         f"Fix: choose from {list(RS_OPTIONS)}, or null to disable rejection sampling.")
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    if not options:
        raise ValueError(f"{_KEY}rollout_rs={rollout_rs!r} names no option. "
                         f"Fix: choose from {list(RS_OPTIONS)}, or null to disable rejection sampling.")
    for option in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"{_KEY}rollout_rs: unknown option '{option}'. Fix: choose from {list(RS_OPTIONS)}.")
    return options


def parse_rs_thresholds(options: list[str], spec: float | str | None) -> dict[str, RsBounds]:
    """`rollout_rs_threshold` for the parsed `options` -> {option: RsBounds}. One spec is shared by
    all options; otherwise give one per option, comma separated, in the options' order."""
    key = "rollout_rs_threshold"
    if spec is None:
        raise ValueError(f"{_KEY}{key} is required when {_KEY}rollout_rs is set. {_RS_FIX}")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{_KEY}{key} must be a number or a string, got {spec!r}. {_RS_FIX}")
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if not specs:
        raise ValueError(f"{_KEY}{key}={spec!r} holds no threshold. {_RS_FIX}")
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{_KEY}{key}={spec!r} gives {len(specs)} thresholds for the {len(options)} options "
                         f"{options}. {_RS_FIX}")
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = {}
    for option, text in zip(options, specs):
        where = f"{_KEY}{key}={spec!r} for option '{option}'"
        if option.endswith("k1"):
            head, sep, tail = text.partition("_")
            upper = _number(tail if sep else head, key, spec, _RS_FIX)
            if upper <= 0:
                raise ValueError(f"{where}: thresholds must be positive. {_RS_FIX}")
            lower = _number(head, key, spec, _RS_FIX) if sep else 1.0 / upper
            if lower <= 0:
                raise ValueError(f"{where}: thresholds must be positive. {_RS_FIX}")
            if lower > upper:
                raise ValueError(f"{where}: lower > upper. {_RS_FIX}")
            bounds[option] = RsBounds(lower, upper)
        else:
            if "_" in text:
                raise ValueError(f"{where}: '{text}' has a lower bound; k2/k3 options take one upper bound. {_RS_FIX}")
            upper = _number(text, key, spec, _RS_FIX)
            if upper <= 0:
                raise ValueError(f"{where}: the threshold must be positive. {_RS_FIX}")
            bounds[option] = RsBounds(None, upper)
    return bounds


def validate(*, rollout_is: str | None = None, rollout_is_threshold: float | str | None = 2.0,
             rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
             rollout_rs_threshold: float | str | None = None, bypass_mode: bool = False,
             loss_type: str = "ppo_clip") -> None:
    """Check one `algorithm.rollout_correction` setting (the keys of a `PRESETS` entry);
    raises ValueError / TypeError naming the key and the fix."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"{_KEY}rollout_is={rollout_is!r} is unknown. Fix: choose from {list(IS_LEVELS)}, "
                         "or null for no IS weights.")
    if rollout_is is not None and rollout_is_threshold is None:
        raise ValueError(f"{_KEY}rollout_is={rollout_is!r} needs {_KEY}rollout_is_threshold. {_IS_FIX}")
    if rollout_is_threshold is not None:
        parse_is_threshold(rollout_is_threshold)
    if rollout_rs is not None:
        parse_rs_thresholds(parse_rs_options(rollout_rs), rollout_rs_threshold)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{_KEY}loss_type={loss_type!r} is unknown. Fix: choose from {list(LOSS_TYPES)}.")
