"""Recipes: YAML files and dotted command-line overrides, read into a `Config` (megappo.config).

`load_config("recipe.yaml", ["parallel.tp=2", "actor.optim.lr=1e-6"])` reads a recipe, applies its
`variants[variant]` overrides if asked, then the command line's (values parsed as YAML: `2` is an
int, `[a,b]` a list, `null` None; unknown keys are refused with the valid ones), and builds the
Config (`config_from_dict`), whose sections check themselves. `dump_config` writes a Config back
as YAML.

A command line may be verl's, as its scripts write it (`read_overrides`): Hydra's `+key=value` and
`++key=value` are plain overrides, and a verl key is read as megappo's
(`actor_rollout_ref.actor.clip_ratio_high=0.28` -> `actor.clip_ratio_high=0.28`, its value respelled
where megappo's differs), named as unused with why (`trainer.device`), or refused with the fix where
leaving it out would change the training (`custom_reward_function.path`); the tables are
megappo.config.verl_keys. A megappo key set differently in verl's spelling and in megappo's (or by two verl
keys) is an error naming both, its fix the script's own verl key. `VerlReading.start_up_lines()` say what was
read as what, what was not used and which dtype the run computes in (verl computes in bf16); `set_by` names
the override that set a key, for errors about its value. A recipe file written in verl's layout is refused,
with every such key's translation in one error. verl's Hydra flags `--config-path DIR --config-name NAME`
name a recipe (`verl_config_recipe`): DIR/NAME.yaml when it is megappo's, else recipes/verl/NAME.yaml, verl
0.9.1's defaults as a megappo recipe.

Owns: reading and writing recipe files, overrides, the verl-key check. The schema, its defaults
and checks are megappo.config's. Knows nothing about torch, models or processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Optional, Sequence

import yaml

from megappo.config.key_synonyms import synonym_hint, synonym_of
from megappo.config.root import Config
from megappo.config.schema import _build, _hints, _not_here, _options, _type_name, _unknown_key
from megappo.config.verl_keys import (MOOT, MOOT_DEFAULTS, NO_EQUIVALENT, REWARD_FILE, SECTION_DEFAULTS, TIMES_ULYSSES,
                                      VERL_DTYPE, reward_file_reading, spelling, verl_equivalent, verl_hint,
                                      verl_reading)
from megappo.errors import ConfigError


def _is_key(path: str) -> bool:
    """Whether dotted `path` names a field megappo has (any key inside a free-form mapping counts)."""
    tp: Any = Config
    for part in path.split("."):
        if dataclasses.is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                return False
            tp = _options(hints[part])[0]
        elif tp is Any or typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1] if tp is not Any else Any
        else:
            return False
    return True


def _verl_keys(data: Any) -> list[tuple[str, Optional[str], Optional[str]]]:
    """(dotted key, megappo's key, how megappo does it) for each key of the raw recipe `data` that
    megappo lacks and verl has (megappo.config.verl_keys.verl_equivalent; a name from another trainer under a verl
    section, trainer.max_steps, is megappo.config.key_synonyms')."""
    found = [(leaf, *hint) for leaf in _unknown_leaves(data) if (hint := verl_equivalent(leaf, _is_key))]
    return [(leaf, synonym_of(leaf, _is_key), how) if how == NO_EQUIVALENT and synonym_of(leaf, _is_key)
            else (leaf, ours, how) for leaf, ours, how in found]  # another trainer's name under a verl section


def _unknown_leaves(data: Any, cls: type = Config, prefix: str = "") -> list[str]:
    """The dotted keys of the raw recipe `data` (down to their leaves) that megappo does not have."""
    found = []
    if not isinstance(data, dict):
        return found
    hints = _hints(cls)
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key in hints:
            tp = _options(hints[key])[0]
            if dataclasses.is_dataclass(tp):
                found += _unknown_leaves(value, tp, f"{path}.")
        else:
            found += _leaves(value, path)
    return found


def _leaves(value: Any, path: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}.{k}")]
    return [path]


def _verl_error(found: list[tuple[str, Optional[str], Optional[str]]]) -> ConfigError:
    lines = "\n".join(f"  {verl} -> {ours}" if ours else f"  {verl}: {how}" for verl, ours, how in found)
    return ConfigError(f"the recipe uses {len(found)} verl key(s) that megappo names differently or does not have:\n"
                       f"{lines}\nFix: rename (or remove) them as shown; every verl name is mapped in docs/config.md, "
                       "'Coming from verl'.")


def _not_a_mapping(what: str, data: Any) -> ConfigError:
    return ConfigError(f"{what} must be a mapping of sections {[f.name for f in dataclasses.fields(Config)]}, got a "
                       f"{type(data).__name__}. Fix: write 'section:' lines at the top level.")


def config_from_dict(data: dict) -> Config:
    """A Config from plain data (a parsed recipe); raises ConfigError naming the key and the fix."""
    if not isinstance(data, dict):
        raise _not_a_mapping("a recipe", data)
    verl = _verl_keys(data)
    if verl:
        raise _verl_error(verl)
    for leaf in _unknown_leaves(data):  # another trainer's name (learning_rate, max_steps, ...)
        hint = synonym_hint(leaf, None, _is_key)
        if hint:
            raise ConfigError(hint)
    if data.get("model") is None:
        raise ConfigError("the recipe has no 'model' section. Fix: set model.path=/path/to/hf_model "
                          "(or model.hf_config).")
    return _build(Config, data)


#: the two sources of prompts: an override that sets one replaces the recipe's other
_PROMPT_SOURCES = {"data.train_files": ("builtin", None), "data.builtin": ("train_files", [])}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe YAML 1.1, except that a number never holds '_' (YAML 1.2 has no such numbers): verl's
    "lower_upper" thresholds such as `0.5_2` (algorithm.rollout_correction.*_threshold) stay strings
    instead of becoming 0.52, and `1_000` is a string the field's type check refuses."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, re.compile("(?!.*_)" + rx.pattern, rx.flags) if tag.endswith((":int", ":float")) else rx)
            for tag, rx in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _yaml(text) -> Any:
    return yaml.load(text, Loader=_Loader)


def apply_override(data: dict, override: str) -> None:
    """Set `a.b.c=value` in the raw recipe `data`; the value is parsed as YAML. Unknown keys are errors.

    `data.train_files=[...]` on a recipe with `data.builtin` (the demo's) trains on the files
    instead, and `data.builtin=...` replaces the recipe's files: the later source wins."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"override '{override}' is not KEY=VALUE. Fix: write it like parallel.tp=2.")
    if not raw.strip():
        raise ConfigError(f"override '{override}' has no value. Fix: write {key}=null for None or {key}='' for empty.")
    try:
        value = _yaml(raw)
    except yaml.YAMLError:
        value = raw  # e.g. an unbalanced '[': the field's type check reports it
    node, tp = data, Config
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth + 1])
        if dataclasses.is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                hint = verl_hint(key.strip(), raw.strip(), _is_key) or synonym_hint(key.strip(), raw.strip(), _is_key)
                if hint:
                    raise ConfigError(hint)
                raise (_not_here(tp, part) or _unknown_key(part, list(hints))).at(here[:-len(part)])
            tp = _options(hints[part])[0]
        else:  # a free-form mapping (dict[str, X] field or inside one): any key
            tp = typing.get_args(tp)[1] if tp is not Any else Any
        if depth == len(parts) - 1:
            node[part] = value
            other, empty = _PROMPT_SOURCES.get(here, (None, None))
            if other and value and node.get(other):
                node[other] = empty
        else:
            if not (dataclasses.is_dataclass(tp) or tp is Any or typing.get_origin(tp) is dict):
                raise ConfigError(f"override '{override}': '{here}' is a single value ({_type_name(tp)}), not a "
                                  f"section. Fix: write {here}=VALUE.")
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"override '{override}': the recipe sets '{here}' to {node!r}, not a mapping. "
                                  f"Fix: override the whole value instead.")


@dataclasses.dataclass
class VerlReading:
    """What a command line's verl keys were read as: (verl key, megappo override) for each one read,
    (verl key, why) for each one megappo has no use for; the override (as written) that set each megappo key
    (`set_by`, for errors about a value); the dtype the run computes in and what set it, for a command line
    with verl keys (verl computes in bf16 where megappo's default is float32)."""

    read: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    unused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    set_by: dict[str, str] = dataclasses.field(default_factory=dict)
    dtype: Optional[str] = None

    def lines(self) -> list[str]:
        """The lines saying what the verl keys were read as and which are unused (none when the command line has
        no verl key)."""
        out = []
        if self.read:
            out.append("verl keys read as megappo's: " + ", ".join(f"{verl} -> {ours}" for verl, ours in self.read))
        if self.unused:  # keys with the same reason share it: "a, b (why)"
            by_why: dict[str, list[str]] = {}
            for verl, why in self.unused:
                by_why.setdefault(why, []).append(verl)
            out.append("verl keys megappo does not use: " + "; ".join(f"{', '.join(keys)} ({why})"
                                                                       for why, keys in by_why.items()))
        return out

    def start_up_lines(self) -> list[str]:
        """`lines()` and the dtype line: what rank 0 says at start-up (and `megappo plan`)."""
        return self.lines() + ([self.dtype] if self.dtype else [])


def _key_value(override: str) -> tuple[str, str]:
    """(key without Hydra's '+'/'++', raw value) of `key=value`."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    return key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key, (raw if sep else None)


def _parsed(raw: str) -> Any:
    try:
        return _yaml(raw)
    except yaml.YAMLError:
        return raw


def read_overrides(overrides: Sequence[str]) -> tuple[list[str], VerlReading, list[ConfigError]]:
    """A command line as megappo's overrides: Hydra's '+'/'++' stripped, verl keys read as megappo's
    (megappo.config.verl_keys.verl_reading). Also the VerlReading and an error for each refused verl key and each
    megappo key that two spellings set to different values (all of them: a verl script's command line gets
    every fix at once)."""
    out, reading, errors = [], VerlReading(), []
    setters: dict[str, tuple[str, Any]] = {}  # megappo key -> (key as written, value)
    values = {k: _parsed(raw) for k, raw in map(_key_value, overrides) if raw is not None and raw.strip()}
    for override in overrides:
        try:
            _read_one(override, values, out, reading, setters)
        except ConfigError as e:
            errors.append(e)
    return out, reading, errors + _reference_follows_actor(setters)


_VERL_ACTOR_CKPT = "actor_rollout_ref.actor.megatron.dist_checkpointing_path"
_VERL_REF_CKPT = "actor_rollout_ref.ref.megatron"


def _reference_follows_actor(setters: dict[str, tuple[str, Any]]) -> list[ConfigError]:
    """verl starts its reference from model.path unless the reference's own use_dist_checkpointing is on;
    megappo's starts from the actor's weights (ref.dist_checkpoint unset): a verl actor checkpoint without the
    reference's would change the model the KL terms measure against, so it is refused with the fix."""
    actor = setters.get("actor.dist_checkpoint")
    if not actor or actor[0] != _VERL_ACTOR_CKPT or "ref.dist_checkpoint" in setters:
        return []
    return [ConfigError(f"'{_VERL_ACTOR_CKPT}={actor[1]}' starts verl's actor from that Megatron checkpoint but "
                        f"its reference from model.path ({_VERL_REF_CKPT}.use_dist_checkpointing is not on); "
                        f"megappo's reference starts from the actor's weights. Fix: give "
                        f"{_VERL_REF_CKPT}.use_dist_checkpointing=True {_VERL_REF_CKPT}.dist_checkpointing_path="
                        f"{actor[1]} as well (docs/config.md, 'Coming from verl').")]


def _section_defaults(data: dict, overrides: Sequence[str], reading: VerlReading) -> None:
    """verl's defaults that differ from megappo's, set in the raw recipe `data` where the command line gives
    the verl key that brings one and neither it nor the recipe sets the key (megappo.config.verl_keys.SECTION_DEFAULTS)."""
    given = {_key_value(o)[0] for o in overrides}
    for trigger, mine, set_by, why in SECTION_DEFAULTS:
        if _lookup(data, mine.partition("=")[0]) is None and trigger in given and not any(k in given for k in set_by):
            apply_override(data, mine)
            reading.read.append((f"{set_by[0]} (not given)", f"{mine} ({why})"))


def _lookup(data: dict, dotted: str) -> Any:
    """The raw recipe's value at `dotted`, or None."""
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


_REWARD_FILE_OF = {name: file for file, name in REWARD_FILE.items()}  # verl's function-name key -> its file key


def _read_one(override: str, values: dict[str, Any], out: list[str], reading: VerlReading,
              setters: dict[str, tuple[str, Any]]) -> None:
    """read_overrides for one override (`values`: every override's parsed value by key): appended to `out`
    (megappo's spelling) or `reading`."""
    key, raw = _key_value(override)
    if raw is None or not raw.strip() or not key:
        out.append(override)  # apply_override says what is wrong with it
        return
    other, other_value, why = MOOT.get(key, (None, None, None))
    if key in REWARD_FILE:  # verl's reward file and function: read together
        found = reward_file_reading(values[key], values.get(REWARD_FILE[key]))
        if REWARD_FILE[key] in values and found[0] == "read":
            raw = f"{raw.strip()}, {REWARD_FILE[key]}={values[REWARD_FILE[key]]}"
    elif key in _REWARD_FILE_OF:
        if reward_file_reading(values.get(_REWARD_FILE_OF[key]), None)[0] == "read":
            return  # read with its file
        found = ("unused", f"verl reads it with {_REWARD_FILE_OF[key]} only, which is not given")
    elif other and (other in values and ("*" in other_value or spelling(values[other]) in other_value)
                    or other not in values and MOOT_DEFAULTS.get(other) in other_value):
        found = ("unused", why)
    else:
        found = verl_reading(key, raw.strip(), _parsed(raw), _is_key)
    note = ""
    if found and found[0] == "read" and key in TIMES_ULYSSES:  # verl's budget is per GPU of the sp group
        sp = next((values[k] for k in TIMES_ULYSSES[key] if k in values), 1)
        ours, _, value = found[1].partition("=")
        if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 and isinstance(_parsed(value), int):
            found, note = ("read", f"{ours}={_parsed(value) * sp}"), f" (x ulysses_sequence_parallel_size={sp}, " \
                                                                     "as verl counts it)"
    if found is None:
        mine = f"{key}={raw}"
    elif found[0] == "refused":
        hint = synonym_hint(key, raw.strip(), _is_key) if found[1] == NO_EQUIVALENT else None
        if hint:  # another trainer's name under a verl section (trainer.max_steps)
            raise ConfigError(hint)
        raise ConfigError(f"'{key}={raw.strip()}' is a verl key megappo does not read as written. Fix: "
                          f"{found[1]} (docs/config.md, 'Coming from verl').")
    elif found[0] == "unused":
        reading.unused = [(k, w) for k, w in reading.unused if k != key] + [(key, found[1])]
        return
    else:
        mine = found[1]
        ours, _, value = mine.partition("=")
        shown = ours if value == raw.strip() else f"{ours}={value}{note}"
        reading.read = [(k, o) for k, o in reading.read if k.partition("=")[0] != key] + [
            (key if value == raw.strip() else f"{key}={raw.strip()}", shown)]
    ours, _, value = mine.partition("=")
    setters[ours] = _check_same(setters.get(ours), key, _parsed(value), ours)
    reading.set_by[ours] = f"{key}={raw.strip()}"
    out.append(mine)


def _check_same(before: Optional[tuple[str, Any]], key: str, value: Any, ours: str) -> tuple[str, Any]:
    """(key, value) of an override of megappo's `ours`; an error when another spelling set it to another value
    (the same spelling twice: the later one wins, as for any override)."""
    if before and before[0] != key and before[1] != value:
        given = {before[0]: before[1], key: value}
        verl = [k for k in given if k != ours]  # a verl script's own key: the fix changes it there
        fix = (f"give it once: change {verl[0]}={given[verl[0]]} where the script sets it, and drop {ours}="
               f"{given[ours]}" if len(verl) == 1 else
               f"give it once: change {verl[0]} or {verl[1]} where the script sets them, to one value")
        raise ConfigError(f"'{before[0]}={before[1]}' and '{key}={value}' both set {ours} (verl's and megappo's "
                          f"names for one setting), to different values. Fix: {fix}.")
    return key, value


def load_config(path: str | None, overrides: Sequence[str] = (), variant: Optional[str] = None) -> Config:
    """Read a YAML recipe (or start empty when `path` is None), apply `key.sub=value` overrides, build.
    `variant`: first apply the recipe's `variants[variant]` overrides (other hardware), then `overrides`.
    verl's keys in the overrides are read as megappo's (`read_config` also says which)."""
    return read_config(path, overrides, variant)[0]


def read_config(path: str | None, overrides: Sequence[str] = (),
                variant: Optional[str] = None) -> tuple[Config, VerlReading]:
    """`load_config`, and what the command line's verl keys were read as (`VerlReading.lines()`)."""
    data: Any = {}
    if path is not None:
        try:
            with open(path) as f:
                data = _yaml(f)
        except OSError as e:
            raise ConfigError(f"cannot read recipe '{path}': {e.strerror}. Fix: check the path.") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"recipe '{path}' is not valid YAML{where}: {getattr(e, 'problem', None) or e}. "
                              "Fix: correct the YAML there (indentation, brackets, 'key: value').") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise _not_a_mapping(f"recipe '{path}'", data)
    if variant is not None:  # the recipe's own overrides for other hardware go first (checked with the rest)
        variants = data.get("variants") or {}
        if not isinstance(variants, dict) or variant not in variants:
            names = sorted(variants) if isinstance(variants, dict) else []
            raise ConfigError(f"recipe '{path}' has no variant '{variant}'. Fix: choose one of {names} "
                              f"(its variants: section), or leave out --variant.")
        if not isinstance(variants[variant], list):
            raise ConfigError(f"variants.{variant} in '{path}' must be a list of KEY=VALUE overrides. Fix: write "
                              f"{variant}: [hardware.gpu_memory_gib=141, ...].")
        overrides = [*variants[variant], *overrides]
    given = overrides
    recipe_dtype = _lookup(data, "model.dtype")
    overrides, reading, errors = read_overrides(given)
    for override in overrides:
        try:
            apply_override(data, override)
        except ConfigError as e:
            errors.append(e)
    _section_defaults(data, given, reading)
    if errors:
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{len(errors)} overrides megappo cannot read as written (each line names its fix):\n"
            + "\n".join(f"  - {e}" for e in errors))
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        raise _naming_overrides(e, reading.set_by) from None
    if reading.read or reading.unused:
        reading.dtype = _dtype_line(cfg.model.dtype, reading.set_by.get("model.dtype"),
                                    path if recipe_dtype is not None else None)
    return cfg, reading


def _naming_overrides(error: ConfigError, set_by: dict[str, str]) -> ConfigError:
    """`error` (a check of the built config), saying which of the command line's verl keys set the megappo keys
    it names: 'hardware.nodes=16 needs ...' comes from trainer.nnodes=16 when the script wrote that."""
    text = str(error)
    verl = [f"{ours} comes from the command line's {given}" for ours, given in set_by.items()
            if given.partition("=")[0] != ours and re.search(rf"(?<![\w.]){re.escape(ours)}(?![\w])", text)]
    if not verl:
        return error
    before, fix, after = text.partition(" Fix: ")
    return ConfigError(f"{before} {'; '.join(verl)}.{fix}{after}")


def _dtype_line(dtype: str, override: Optional[str], recipe: Optional[str]) -> str:
    """The start-up line saying which dtype a command line with verl keys computes in, and what chose it."""
    source = f"set by {override}" if override else f"{recipe}'s" if recipe else "megappo's default"
    follow = "" if dtype == VERL_DTYPE or override else "; write model.dtype=bfloat16 to follow it"
    return f"this verl command line computes in model.dtype={dtype} ({source}; verl computes in bf16{follow})"


#: verl's trainer configs (Hydra's --config-name) whose verl 0.9.1 defaults megappo has as recipes
VERL_CONFIGS = ("ppo_megatron_trainer", "ppo_trainer")
VERL_RECIPES = "recipes/verl"  # in megappo's repository, beside the package


def verl_config_recipe(config_path: Optional[str], config_name: str) -> tuple[str, str]:
    """The recipe a verl script's Hydra flags `--config-path DIR --config-name NAME` name, and the start-up line
    saying what it is: DIR/NAME.yaml when it is a megappo recipe; megappo's recipe of verl 0.9.1's defaults
    (recipes/verl/NAME.yaml) for verl's own trainer configs, when DIR has no NAME.yaml (the usual case: a verl
    script's config directory is verl's, not on this machine) or DIR is verl's own config directory. A config in
    verl's layout (Hydra's `defaults:` list, verl's keys) is refused: megappo reads verl's keys on the command
    line only."""
    name = config_name[:-len(".yaml")] if config_name.endswith(".yaml") else config_name
    flags = f"--config-name={config_name}" + (f" (--config-path={config_path})" if config_path else "")
    own = os.path.join(config_path, f"{name}.yaml") if config_path else None
    verls_own = own and os.path.exists(os.path.join(config_path, f"_generated_{name}.yaml"))
    if own and os.path.isfile(own) and not verls_own:
        with open(own) as f:
            try:
                data = _yaml(f)
            except yaml.YAMLError:
                data = None
        if not isinstance(data, dict) or "defaults" in data or _verl_keys(data) or set(data) - set(_hints(Config)):
            raise ConfigError(
                f"{flags}: {own} is not a megappo recipe (a config in verl's layout: Hydra's defaults list, verl's "
                f"keys), and megappo reads verl's keys on the command line only. Fix: give its settings as KEY=VALUE "
                f"overrides after --config-name={VERL_CONFIGS[0]} (verl 0.9.1's defaults), or write them as a megappo "
                f"recipe (docs/config.md, 'Coming from verl', names every verl key's megappo key) and give that "
                f"recipe instead of the two flags.")
        return own, f"{flags}: the megappo recipe {own}"
    if name not in VERL_CONFIGS:
        where = f"{config_path} has no {name}.yaml" if config_path else "no --config-path names its directory"
        raise ConfigError(f"{flags}: {where}, and megappo has verl 0.9.1's defaults for {', '.join(VERL_CONFIGS)} "
                          f"only. Fix: write --config-name={VERL_CONFIGS[0]} (or {VERL_CONFIGS[1]}) with the "
                          f"script's overrides, or give a megappo recipe instead of the two flags.")
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above megappo/config/
    recipe = os.path.join(repository, VERL_RECIPES, f"{name}.yaml")
    why = ("is verl's own config directory" if verls_own else f"has no {name}.yaml" if config_path else "")
    return recipe, (f"--config-name={name}: verl 0.9.1's defaults ({VERL_RECIPES}/{name}.yaml) wherever megappo has "
                    f"the key" + (f"; {config_path} {why}" if why else ""))


def dump_config(cfg: Config, path: str) -> None:
    """Write the resolved config as YAML; `load_config(path) == cfg`."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
