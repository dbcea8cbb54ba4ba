"""What to change when `megappo plan` says a recipe does not fit: changes found by planning them.

`find_fixes(cfg, plan, ...) -> Fixes` tries changes that leave the training itself alone (its
batches, sequence lengths, model and algorithm) and can lower one GPU's memory, each written as the
`key=value` overrides a user would type (`_knobs`):

  layout          parallel.tp / parallel.pp with more model parallelism, dividing the world (tp within
                  a node; sequence parallelism on with tp > 1)
  context par.    parallel.cp, doubled and more, dividing the data-parallel size (dense models; long
                  sequences: each rank holds 1/cp of every sequence's activations)
  optimizer       parallel.use_distributed_optimizer=true
  sequence par.   parallel.sequence_parallel=true
  interleaving    parallel.vpp=null
  experts         parallel.ep (MoE)
  recomputation   actor/critic.recompute.granularity=full
  micro-batches   <role>.micro_batch_size (padded) or <role>.max_tokens_per_micro_batch (packed),
                  halved down to one sequence
  LM head         model.lm_head_chunk_tokens=1024 (no full-vocabulary logits)
  SGLang          rollout.sglang.tp_size (within a node; rollout.replicas lowered to as many as then fit
                  beside each other), rollout.sglang.mem_fraction_static (solved: the middle of the range
                  where the KV cache holds a sequence and the trainer still fits, `_solve_fraction`)
  replicas        rollout.replicas, fewer (engines on fewer GPUs)
  hf engine       rollout.hf_decode=dynamic, rollout.placement=separate (generation on the host)

Every change is applied to the config and planned again by `megappo.plan.planner.make_plan` at the same world
size and GPU memory; one that the config or layout checks refuse (a tp that does not divide the
heads, a value already at its limit) is never offered, nor one alone that does not fit (so none
that saves nothing). The answer (`Fixes`):

- `alone`: the changes that fit by themselves, largest saving first; of a knob with several values
  (a micro-batch size, a layout) the mildest that fits.
- `together`, when none fits alone: the fewest changes that fit together (every combination of up
  to MAX_COMBINATION of them, else all of them at once, then dropped one by one while it still fits),
  the lowest total among those of that size, then each setting as mild as still fits. `closest`,
  when nothing fits: all of them at once.
- `variant`: the recipe's `variants:` (other hardware), each planned at the same GPU memory; of those
  that fit, one that trains the same first (`_training_changes`), then one on as many GPUs, else on
  the fewest; with the command that plans it.
- `more_gpus`, when nothing fits on this world size: the same search on 1, 2, ... MAX_MORE_NODES
  more nodes of the same GPUs (or 2, 3, ... times a --world-size); the first that fits, with its layout.

It does not count memory (megappo.plan.planner does) and ranks by GiB saved and number of changes, not by
what a change costs in speed (docs/planner.md says that per knob).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from typing import Optional, Sequence

from megappo.config import Config, apply_override, config_from_dict, read_config
from megappo.errors import ConfigError
from megappo.models.hf_config import ModelConfigError
from megappo.plan.planner import GIB, Plan, make_plan, replica_counts

MIN_SAVING_GIB = 0.05  # a layout that saves less takes no part in the combinations
MAX_COMBINATION = 3  # changes per combination searched exhaustively
MAX_SHOWN = 3  # fixes printed alone
MAX_MORE_NODES = 32  # node counts tried beyond the current one
LAYOUTS_IN_COMBINATIONS = 4  # the layouts that save most take part in the combination search
LM_HEAD_CHUNK_TOKENS = 1024  # the chunk size measured in benchmarks/RESULTS.md


@dataclasses.dataclass(frozen=True)
class Fix:
    """A set of overrides and the plan with them applied."""

    overrides: tuple[str, ...]
    plan: Plan
    saved: float  # bytes, against the plan being fixed

    @property
    def text(self) -> str:
        return " ".join(self.overrides)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    plan: Plan
    command: str  # `megappo plan ... --variant NAME`
    hardware: str  # e.g. '2 nodes x 8 GPUs of 40 GiB'
    changes: tuple[str, ...] = ()  # what it trains differently (algorithm, roles, lengths, batches, LoRA)


@dataclasses.dataclass(frozen=True)
class Fixes:
    world: str  # the GPUs searched, e.g. '1 node x 8 GPUs of 40 GiB'
    alone: tuple[Fix, ...] = ()  # each fits by itself; largest saving first
    together: Optional[Fix] = None  # none fits alone: the fewest that fit together
    closest: Optional[Fix] = None  # nothing fits on this world: every change at once
    variant: Optional[Variant] = None  # a variant of the recipe that fits at this GPU memory
    more_gpus: Optional[Fix] = None  # nothing fits on this world: the fewest GPUs that fit
    more_gpus_world: str = ""  # their description
    searched_up_to: int = 0  # the largest world size searched for more_gpus


@dataclasses.dataclass(frozen=True)
class _Knob:
    """One setting: its candidate values (each a dict of overrides), mildest first."""

    name: str
    values: tuple[dict[str, str], ...]


@dataclasses.dataclass(frozen=True)
class _Item:
    knob: str
    value: dict[str, str]
    plan: Plan
    saved: float
    rank: int  # position among its knob's values, 0 the mildest


def _overrides(value: dict[str, str]) -> tuple[str, ...]:
    return tuple(f"{k}={v}" for k, v in value.items())


class _Planner:
    """Plans a config with overrides at a world size and this search's GPU memory (cached)."""

    def __init__(self, cfg: Config, gpu_mem_gib: float, hf_config: Optional[str]):
        self.data, self.gpu_mem_gib, self.hf_config = cfg.to_dict(), gpu_mem_gib, hf_config
        self.cache: dict = {}

    def config(self, value: dict[str, str]) -> Config:
        data = copy.deepcopy(self.data)
        for override in _overrides(value):
            apply_override(data, override)
        return config_from_dict(data)

    def plan(self, value: dict[str, str], world: int) -> Optional[Plan]:
        """The plan, or None when the config or layout checks refuse it."""
        key = (tuple(sorted(value.items())), world)
        if key not in self.cache:
            try:
                self.cache[key] = make_plan(self.config(value), world, gpu_mem_gib=self.gpu_mem_gib,
                                            hf_config=self.hf_config)
            except (ConfigError, ModelConfigError):
                self.cache[key] = None
        return self.cache[key]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _halved(now: int, least: int) -> list[int]:
    """now/2, now/4, ... down to `least` (included), mildest first."""
    out, v = [], now // 2
    while v > least:
        out.append(v)
        v //= 2
    return out + ([least] if now > least else [])


def _knobs(cfg: Config, plan: Plan, world: int, per_node: int) -> list[_Knob]:
    """The settings to try on `cfg` at `world` ranks (`per_node` of them share a node)."""
    p, d, knobs = cfg.parallel, plan.dims, []
    layouts = []
    for t in _divisors(world):
        for q in _divisors(world // t):
            if t > per_node or q > d.num_layers or t * q < p.tp * p.pp or (t, q) == (p.tp, p.pp):
                continue
            value = {}
            if t != p.tp:
                value["parallel.tp"] = str(t)
            if q != p.pp:
                value["parallel.pp"] = str(q)
            if t > 1 and not p.sequence_parallel:
                value["parallel.sequence_parallel"] = "true"
            if t == 1 and p.sequence_parallel:
                value["parallel.sequence_parallel"] = "false"
            if p.vpp and q == 1:
                value["parallel.vpp"] = "null"
            layouts.append(((t * q, -t, 0), value))
            if p.vpp and q > 1:  # the interleaving may not divide the new pipeline's layers
                layouts.append(((t * q, -t, 1), {**value, "parallel.vpp": "null"}))
    if layouts:
        knobs.append(_Knob("layout", tuple(v for _, v in sorted(layouts, key=lambda x: x[0]))))
    if not d.is_moe:  # context parallelism: every sequence's activations split over cp ranks (dense models)
        dp = world // (p.tp * p.pp * p.cp)
        values = tuple({"parallel.cp": str(p.cp * c)} for c in _divisors(dp) if c > 1)
        if values:
            knobs.append(_Knob("context parallelism", values))
    if not p.use_distributed_optimizer:
        knobs.append(_Knob("distributed optimizer", ({"parallel.use_distributed_optimizer": "true"},)))
    if p.tp > 1 and not p.sequence_parallel:
        knobs.append(_Knob("sequence parallel", ({"parallel.sequence_parallel": "true"},)))
    if p.vpp:
        knobs.append(_Knob("interleaving", ({"parallel.vpp": "null"},)))
    if d.is_moe:
        ep = [e for e in _divisors(d.num_experts) if e > p.ep and e <= world // (p.tp * p.pp)]
        if ep:
            knobs.append(_Knob("experts", tuple({"parallel.ep": str(e)} for e in ep)))
    for role in ("actor", "critic") if cfg.use_critic else ("actor",):
        rc = getattr(cfg, role).recompute
        if rc.granularity != "full":
            value = {f"{role}.recompute.granularity": "full"}
            if rc.modules is not None:
                value[f"{role}.recompute.modules"] = "null"
            knobs.append(_Knob(f"{role} recomputation", (value,)))
    seq = cfg.max_sequence_length
    for role in cfg.model_roles:
        if cfg.packs(role):
            values = _halved(cfg.max_tokens_per_micro_batch(role), seq)
            key = f"{role}.max_tokens_per_micro_batch"
        else:
            micro = cfg.ref_micro_batch_size if role == "ref" else getattr(cfg, role).micro_batch_size
            values, key = _halved(micro, 1), f"{role}.micro_batch_size"
        if values:
            knobs.append(_Knob(f"{role} micro-batches", tuple({key: str(v)} for v in values)))
    if cfg.model.lm_head_chunk_tokens == 0:
        knobs.append(_Knob("LM head", ({"model.lm_head_chunk_tokens": str(LM_HEAD_CHUNK_TOKENS)},)))
    r = cfg.rollout
    if plan.engine is not None or (r.engine == "sglang" and r.sync_mode != "distributed"):
        now = int(r.sglang.get("tp_size", 1))
        g = d.num_query_groups
        sizes = [t for t in range(now + 1, min(world, per_node) + 1)
                 if d.num_heads % t == 0 and (g % t == 0 if t <= g else t % g == 0)]
        values = []
        for t in sizes:  # wider replicas: as many as still fit beside each other (megappo.plan.planner.Placement)
            fewer = max(replica_counts(world, per_node, t, most=r.replicas))
            values.append({"rollout.sglang.tp_size": str(t), **({"rollout.replicas": str(fewer)}
                                                                 if fewer != r.replicas else {})})
        if values:
            knobs.append(_Knob("SGLang tp", tuple(values)))
    if r.replicas > 1 and plan.placement is not None:
        counts = replica_counts(world, per_node, plan.placement.width, most=r.replicas - 1)
        knobs.append(_Knob("rollout replicas", tuple({"rollout.replicas": str(c)} for c in reversed(counts))))
    if r.engine == "hf" and cfg.hardware.device == "gpu" and r.placement == "colocated":
        if r.hf_decode in ("auto", "graphs") and plan.gen_overlaps and r.mode == "sync":
            knobs.append(_Knob("hf decode", ({"rollout.hf_decode": "dynamic"},)))
        value = {"rollout.placement": "separate"}
        if r.hf_decode not in ("auto", "dynamic"):
            value["rollout.hf_decode"] = "auto"
        if r.lora_sync != "merged":
            value["rollout.lora_sync"] = "merged"
        knobs.append(_Knob("hf engine on the host", (value,)))
    return knobs


def _solve_fraction(planner: _Planner, value: dict[str, str], plan: Plan, world: int) -> Optional[Fix]:
    """`value` plus the rollout.sglang.mem_fraction_static in the middle of the range where SGLang's KV
    cache holds one sequence and the trainer still fits (None when there is none). The pool is the
    fraction of the memory free when SGLang starts: total = start + fraction x free + the rest."""
    e = plan.engine
    if e is None or e.pool <= 0:
        return None
    free = e.pool / e.mem_fraction
    start = plan.gpu_mem - free
    rest = plan.total - start - e.pool
    low = (e.weights + e.kv_token_bytes * plan.seq) / free
    high = 1 - rest / free
    low, high = math.ceil(low * 100) / 100, math.floor(high * 100) / 100
    if low > high or high <= 0 or low >= 1:
        return None
    frac = max(low, min(high, round((low + high) / 2, 2), 0.99))
    solved = {**value, "rollout.sglang.mem_fraction_static": f"{frac:g}"}
    new = planner.plan(solved, world)
    return Fix(_overrides(solved), new, 0.0) if new is not None and new.fits else None


@dataclasses.dataclass(frozen=True)
class _Found:
    as_is: Optional[Plan] = None
    alone: tuple[Fix, ...] = ()
    together: Optional[Fix] = None
    closest: Optional[Fix] = None


def _search(planner: _Planner, base_value: dict[str, str], world: int, per_node: int) -> _Found:
    """What fits at `world` ranks (the config with `base_value`): as it is, changes alone, or together."""
    base = planner.plan(base_value, world)
    if base is None:
        return _Found()
    if base.fits:
        return _Found(as_is=base)

    def tried(members: Sequence[_Item], fraction: bool = False) -> tuple[Optional[Plan], dict[str, str]]:
        """The plan with the members' overrides (`fraction`: and the memory fraction solved for them)."""
        value = dict(base_value)
        for m in members:
            value.update(m.value)
        plan = planner.plan(value, world)
        if fraction and plan is not None:
            solved = _solve_fraction(planner, value, plan, world)
            if solved is None:
                return None, value
            return solved.plan, dict(o.split("=", 1) for o in solved.overrides)
        return plan, value

    def fix(value: dict[str, str], plan: Plan) -> Fix:
        changed = {k: v for k, v in value.items() if base_value.get(k) != v}
        return Fix(_overrides(changed), plan, base.total - plan.total)

    items: list[_Item] = []  # every value the checks accept (one may save only with another: actor and critic)
    for knob in _knobs(planner.config(base_value), base, world, per_node):
        for rank, value in enumerate(knob.values):
            plan = planner.plan({**base_value, **value}, world)
            if plan is not None:
                items.append(_Item(knob.name, value, plan, base.total - plan.total, rank))
    alone: dict[str, _Item] = {}
    for item in items:  # of each knob the mildest value that fits
        if item.plan.fits and (item.knob not in alone or item.rank < alone[item.knob].rank):
            alone[item.knob] = item
    fixes = [fix(i.value, i.plan) for i in alone.values()]
    plan, value = tried([], fraction=True)
    if plan is not None:
        fixes.append(fix(value, plan))
    if fixes:
        return _Found(alone=tuple(sorted(fixes, key=lambda f: -f.saved)))

    # together: each knob's strongest value (of the layouts, those that save most)
    strongest: dict[str, _Item] = {}
    for item in items:
        if item.knob != "layout" and (item.knob not in strongest or (item.saved, item.rank) > (
                strongest[item.knob].saved, strongest[item.knob].rank)):
            strongest[item.knob] = item
    layouts = sorted((i for i in items if i.knob == "layout" and i.saved >= MIN_SAVING_GIB * GIB),
                     key=lambda i: -i.saved)[:LAYOUTS_IN_COMBINATIONS]
    pool = [*strongest.values(), *layouts]
    fraction = base.engine is not None or any(i.plan.engine is not None for i in items)

    def fitting(members: Sequence[_Item], frac: bool) -> Optional[tuple[list[_Item], bool, Plan, dict]]:
        plan, value = tried(members, frac)
        return (list(members), frac, plan, value) if plan is not None and plan.fits else None

    everything = [[*strongest.values(), *([layout] if layout else [])] for layout in [None, *layouts]]
    at_once = [f for members in everything for f in [fitting(members, False) or (fitting(members, True) if fraction
                                                                                   else None)] if f]
    if not at_once:
        plans = [(p, v) for p, v in (tried(members) for members in everything) if p is not None]
        if not plans:
            return _Found()
        plan, value = min(plans, key=lambda pv: pv[0].total)
        return _Found(closest=fix(value, plan))
    found = None
    for size in range(2, MAX_COMBINATION + 1):  # the fewest changes (a solved memory fraction is one)
        candidates = [f for members in itertools.combinations(pool, size)
                      if len({m.knob for m in members}) == size for f in [fitting(members, False)] if f]
        if fraction:
            candidates += [f for members in itertools.combinations(pool, size - 1)
                           if len({m.knob for m in members}) == size - 1 for f in [fitting(members, True)] if f]
        if candidates:
            found = min(candidates, key=lambda f: f[2].total)
            break
    if found is None:  # all at once, then drop changes one by one (the smallest savings first) while it fits
        members, frac, _, _ = min(at_once, key=lambda f: f[2].total)
        for item in sorted(members, key=lambda i: i.saved):
            rest = [m for m in members if m is not item]
            for solve in (False, True) if fraction else (False,):
                if rest and len(rest) + solve < len(members) + frac and fitting(rest, solve):
                    members, frac = rest, solve
                    break
        if frac and fitting(members, False):
            frac = False
        found = fitting(members, frac)
    members, frac, _, _ = found
    for n, member in enumerate(members):  # each knob as mild as still fits
        for milder in sorted((i for i in items if i.knob == member.knob and i.rank < member.rank),
                             key=lambda i: i.rank):
            trial = fitting([*members[:n], milder, *members[n + 1:]], frac)
            if trial:
                members = trial[0]
                break
    _, _, plan, value = fitting(members, frac)
    return _Found(together=fix(value, plan))


def _hardware_nodes(cfg: Config, plan: Plan) -> Optional[tuple[int, int]]:
    """(nodes, GPUs per node) when the plan's world is the recipe's hardware section's, else None."""
    hw = cfg.hardware
    if hw.gpus_per_node and plan.world_size == hw.nodes * hw.gpus_per_node:
        return hw.nodes, hw.gpus_per_node
    return None


def find_fixes(cfg: Config, plan: Plan, *, hf_config: Optional[str] = None, recipe: Optional[str] = None,
               overrides: Sequence[str] = (), variant: Optional[str] = None) -> Fixes:
    """What makes `plan` (make_plan of `cfg`) fit, each change planned. `recipe`, `overrides`, `variant`:
    how `cfg` was read (megappo.config.loading.read_config), to plan the recipe's other variants with the same
    overrides and name the command; without `recipe` the variants are `cfg.variants` applied to `cfg`."""
    gpu_mem_gib = plan.gpu_mem / GIB
    world = cfg.hardware.describe(plan.world_size, gpu_mem_gib)
    if plan.fits:
        return Fixes(world=world)
    planner = _Planner(cfg, gpu_mem_gib, hf_config)
    nodes = _hardware_nodes(cfg, plan)
    per_node = nodes[1] if nodes else plan.world_size
    found = _search(planner, {}, plan.world_size, per_node)
    out = Fixes(world=world, alone=found.alone, together=found.together, closest=found.closest,
                variant=_variant(cfg, plan, hf_config, recipe, overrides, variant))
    if found.alone or found.together:
        return out
    for m in range(1, MAX_MORE_NODES + 1):
        if nodes:
            value, more = {"hardware.nodes": str(nodes[0] + m)}, (nodes[0] + m) * per_node
            where = planner.config(value).hardware.describe(more, gpu_mem_gib)
        else:  # --world-size: multiples of it
            value, more = {}, (m + 1) * plan.world_size
            where = ""
        out = dataclasses.replace(out, searched_up_to=more)
        more_found = _search(planner, value, more, per_node)
        fit = more_found.alone[0] if more_found.alone else more_found.together
        if more_found.as_is is not None:
            fit = Fix(_overrides(value), more_found.as_is, plan.total - more_found.as_is.total)
        if fit is not None:
            overrides_ = tuple(dict.fromkeys([*_overrides(value), *fit.overrides]))
            return dataclasses.replace(out, more_gpus=Fix(overrides_, fit.plan, plan.total - fit.plan.total),
                                       more_gpus_world=where)
    return out


def _variant(cfg: Config, plan: Plan, hf_config: Optional[str], recipe: Optional[str], overrides: Sequence[str],
             current: Optional[str]) -> Optional[Variant]:
    """The recipe's variant that fits GPUs of this plan's memory: on as many GPUs as the plan, else on the
    fewest (the lowest total among them)."""
    gpu_mem_gib = plan.gpu_mem / GIB
    fits = []
    for name, variant_overrides in cfg.variants.items():
        if name == current:
            continue
        try:
            if recipe:
                vcfg = read_config(recipe, overrides, name)[0]
            else:
                data = cfg.to_dict()
                for o in variant_overrides:
                    apply_override(data, o)
                vcfg = config_from_dict(data)
            vplan = make_plan(vcfg, gpu_mem_gib=gpu_mem_gib, hf_config=hf_config, variant=name)
        except (ConfigError, ModelConfigError):
            continue
        if vplan.fits:
            fits.append((bool(_training_changes(cfg, vcfg)), vplan.world_size != plan.world_size, vplan.world_size,
                         vplan.total, name, vplan, vcfg))
    if not fits:
        return None
    # one that trains the same first; then on as many GPUs, else on the fewest
    *_, name, vplan, vcfg = min(fits, key=lambda x: x[:5])
    command = None
    if recipe:
        mem = "" if vcfg.hardware.gpu_memory_gib == gpu_mem_gib else f" --gpu-mem {gpu_mem_gib:g}"
        command = " ".join(["megappo plan", recipe, *overrides, "--variant", name]) + mem
    return Variant(name, vplan, command or f"--variant {name}", vcfg.hardware.describe(vplan.world_size, gpu_mem_gib),
                   _training_changes(cfg, vcfg))


def _training_changes(cfg: Config, other: Config) -> tuple[str, ...]:
    """What `other` trains differently from `cfg` (a variant may change more than the hardware)."""
    same = {"algorithm": lambda c: c.algorithm, "roles": lambda c: c.roles, "rollout.n": lambda c: c.rollout.n,
            "data.max_prompt_length": lambda c: c.data.max_prompt_length,
            "rollout.max_new_tokens": lambda c: c.rollout.max_new_tokens,
            "data.train_batch_size": lambda c: c.data.train_batch_size,
            "actor.ppo_mini_batch_size": lambda c: c.actor.ppo_mini_batch_size,
            "actor.lora": lambda c: c.actor.lora}
    return tuple(key for key, of in same.items() if of(cfg) != of(other))


def format_fixes(fixes: Fixes, plan: Plan) -> str:
    """A few lines after format_plan's verdict: the fixes, each with its planned total."""
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    lines = []
    if fixes.alone:
        lines.append("fixes, each planned with it applied (largest saving first):")
        lines += [f"  - {f.text}: {g(f.plan.total)} GiB" for f in fixes.alone[:MAX_SHOWN]]
    elif fixes.together:
        lines.append("no single change fits; the fewest that fit together, planned:")
        lines.append(f"  - {fixes.together.text}: {g(fixes.together.plan.total)} GiB")
    else:
        closest = f" (all changes of layout, batching and engine memory at once: {g(fixes.closest.plan.total)} GiB)" \
            if fixes.closest else ""
        more = "" if fixes.more_gpus or not fixes.searched_up_to else \
            f"; nor on up to {fixes.searched_up_to} {'GPUs' if plan.device == 'gpu' else 'ranks'}"
        lines.append(f"nothing fits on {fixes.world}{closest}{more}")
    if fixes.variant:
        v = fixes.variant
        also = f"; it also changes {', '.join(v.changes)}" if v.changes else ""
        lines.append(f"  - the recipe's variant {v.name} fits ({v.hardware}{also}): "
                     f"{g(v.plan.total)} GiB: {v.command}")
    if fixes.more_gpus:
        p, unit = fixes.more_gpus.plan, "GPUs" if plan.device == "gpu" else "ranks"
        flag = "" if any(o.startswith("hardware.nodes=") for o in fixes.more_gpus.overrides) else \
            f"--world-size {p.world_size} "
        where = f"{fixes.more_gpus_world}; " if fixes.more_gpus_world else ""
        lines.append(f"  - {p.world_size} {unit} fit ({where}tp {p.tp} x pp {p.pp} x dp {p.dp}): "
                     f"{flag}{fixes.more_gpus.text}: {g(p.total)} GiB")
    return "\n".join(lines)
