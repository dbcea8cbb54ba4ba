"""Validation statistics per data source and prompt, under verl 0.9.1's names and with its estimators.

`by_data_source(data_sources, prompts, variables)` takes one entry per validation response: its
row's data source, which prompt it answers (responses of one prompt share it), and the values of
each variable (`reward`: the response's score; the fields reward functions returned, e.g. `acc`,
`pred`). For every data source, variable and prompt with n responses it computes

    mean@n, std@n (population)                         over the prompt's n values
    best@k/mean, best@k/std, worst@k/mean, worst@k/std  max / min of k values drawn with replacement,
                                                        1000 draws (seed 42), for k = 2, 4, 8, ... < n and n
    maj@k/mean, maj@k/std                               the value of the most frequent `pred` among the k
                                                        drawn (ties: the first drawn), when every response
                                                        has a `pred`
    pass@k (k = 1 and the k above)                      where every value is 0 or 1: the chance that k
                                                        responses drawn without replacement hold a 1,
                                                        1 - C(n - c, k) / C(n, k) for c ones (megappo's;
                                                        verl has none: its best@k draws with replacement)

and averages each over the data source's prompts. Names are verl's: `val-core/<source>/<var>/<stat>`
for the core variable (`acc` where the data source has it, else `reward`) at the largest n for
mean / best / maj; everything else `val-aux/<source>/<var>/<stat>`. The draws are verl's exactly (its
`bootstrap_metric` reseeds numpy's legacy generator with 42 for each call, so the indices depend on
n and k only): they are drawn once per (n, k) and applied to every prompt as arrays, which gives
verl's numbers without its per-draw Python loop. String variables other than `pred`, lists and
dicts are left out; None values are dropped as verl drops them.

This module does not know about engines, tokenizers, reward functions or process groups.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

BOOTSTRAP_DRAWS = 1000
BOOTSTRAP_SEED = 42  # verl's process_validation_metrics default
CORE_STATS = ("mean", "maj", "best")


def by_data_source(data_sources: Sequence[str], prompts: Sequence[Any], variables: dict[str, Sequence[Any]]
                   ) -> dict[str, float]:
    """`val-core/...` and `val-aux/...` metrics (module docstring) of one validation pass."""
    grouped: dict[str, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, prompt) in enumerate(zip(data_sources, prompts, strict=True)):
        grouped[str(source) if source else "unknown"][prompt].append(i)  # verl's name for rows without one
    preds = variables.get("pred")
    out = {}
    for source, by_prompt in grouped.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for rows in by_prompt.values():
            pred = [preds[i] for i in rows] if preds is not None else None
            for name, values in variables.items():
                for stat, value in _prompt_stats([values[i] for i in rows], pred).items():
                    per_var[name][stat].append(value)
        core = "acc" if "acc" in per_var else "reward"
        for name, stats in per_var.items():
            n_max = max(int(stat.split("@")[-1].split("/")[0]) for stat in stats)
            for stat, values in stats.items():
                is_core = name == core and stat.startswith(CORE_STATS) and f"@{n_max}" in stat  # verl's test
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{stat}"] = float(np.mean(values))
    return out


def _prompt_stats(values: list, preds: list | None) -> dict[str, float]:
    """One prompt's statistics of one variable ({} for a variable that is not numeric)."""
    values = [v for v in values if v is not None]
    if not values or not all(isinstance(v, (int, float, np.number)) for v in values):
        return {}
    vals = np.asarray(values, dtype=np.float64)
    n = len(vals)
    stats = {f"mean@{n}": float(vals.mean())}
    if n == 1:
        return stats
    stats[f"std@{n}"] = float(vals.std())
    if np.isin(vals, (0.0, 1.0)).all():  # right / wrong: the unbiased pass@k too
        stats.update({f"pass@{k}": _pass_at(n, int(vals.sum()), k) for k in (1, *_subset_sizes(n))})
    votes = _codes(preds) if preds is not None and len(preds) == n and all(p is not None for p in preds) else None
    for k in _subset_sizes(n):
        drawn = _draws(n, k)
        for stat, picked in (("best", vals[drawn].max(1)), ("worst", vals[drawn].min(1))):
            stats[f"{stat}@{k}/mean"], stats[f"{stat}@{k}/std"] = float(picked.mean()), float(picked.std())
        if votes is not None:
            majority = vals[drawn[np.arange(len(drawn)), _majority_position(votes[drawn])]]
            stats[f"maj@{k}/mean"], stats[f"maj@{k}/std"] = float(majority.mean()), float(majority.std())
    return stats


def _pass_at(n: int, correct: int, k: int) -> float:
    """The chance that k of the n responses drawn without replacement hold a correct one:
    1 - C(n - correct, k) / C(n, k) (Chen et al. 2021, the unbiased pass@k), as a product."""
    wrong_only = 1.0
    for i in range(k):
        wrong_only *= max(n - correct - i, 0) / (n - i)
    return 1.0 - wrong_only


def _subset_sizes(n: int) -> list[int]:
    """2, 4, 8, ... below n, then n (verl's gen_ns)."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


@functools.lru_cache(maxsize=64)
def _draws(n: int, k: int) -> np.ndarray:
    """[draws, k] indices into n values: verl's np.random.seed(42); np.random.choice(n, (1000, k))."""
    drawn = np.random.RandomState(BOOTSTRAP_SEED).choice(n, size=(BOOTSTRAP_DRAWS, k), replace=True)
    drawn.setflags(write=False)
    return drawn


def _codes(preds: list) -> np.ndarray:
    """Each prediction as the index of its first occurrence among `preds` (equal predictions, equal codes)."""
    first: dict[Any, int] = {}
    return np.asarray([first.setdefault(p, len(first)) for p in preds])


def _majority_position(votes: np.ndarray) -> np.ndarray:
    """[draws] the position within each row of [draws, k] vote codes of the first occurrence of its most
    frequent code; among codes with equal counts, the one that occurs first (verl's calc_maj_val: a dict
    counted in order of appearance, max() returning the first of the largest)."""
    draws, k = votes.shape
    same = votes[:, :, None] == votes[:, None, :]  # [draws, k, k]
    counts = same.sum(-1)  # how often each position's code occurs in its row
    first = np.argmax(same, axis=-1)  # where each position's code first occurs
    # the largest count wins; among equal counts the earliest first occurrence
    key = counts * (k + 1) - first
    best = np.argmax(key, axis=1)
    return first[np.arange(draws), best]
