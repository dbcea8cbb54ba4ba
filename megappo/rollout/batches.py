"""Joining and picking `RolloutBatch`es: `concat` (batches one after the other: the parts a split
generation call's replicas return, a step's dynamic-sampling rounds) and `take` (samples picked out
of one batch, in a given order), and the table that says how each RolloutBatch field is padded,
joined and picked, checked against the dataclass's fields so a new field cannot be forgotten.

Padding: prompt columns are left-padded (`prompt_ids` with the pad token, `prompt_mask` with 0),
response columns right-padded (`response_ids` with the pad token, masks and log-probs with 0), MoE
routes with -1 (unknown) on both sides; `concat` pads every part to the widest, which is what one
engine call over all the parts' prompts gives (its prompts are left-padded to the longest one, its
responses cut to the longest one). Prompts are renumbered: part i+1's come after part i's.

Shape legend: N samples, P prompt length, R response length (megappo.types).

This module does not know how the batches were generated (engines, replicas, rounds), how they are
scored or filtered, nor Megatron or the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from megappo.rollout.multiturn import merge_episode_metrics
from megappo.types import RolloutBatch

_LEFT = {"prompt_ids": None, "prompt_mask": 0}  # left-padded [N, P]; None: the pad token
_RIGHT = {"response_ids": None, "response_mask": 0, "rollout_log_probs": 0, "response_attention_mask": 0,
          "token_versions": 0}
_ROWS = ("reward_baselines", "env_scores", "clipped", "scores", "score_components")  # [N, ...]
_LISTS = ("finish_reasons", "examples", "score_fields")
_SAME = ("logprob_mode", "policy_version")
_OTHER = ("prompt_index", "routes", "env_metrics", "gen_metrics")


def concat(batches: Sequence[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """The batches one after the other (prompts of batch i+1 numbered after batch i's), padded to the widest."""
    assert {f.name for f in dataclasses.fields(RolloutBatch)} == {*_LEFT, *_RIGHT, *_ROWS, *_LISTS, *_SAME, *_OTHER}
    if len(batches) == 1:
        return batches[0]
    width_p = max(b.prompt_ids.shape[1] for b in batches)
    width_r = max(b.response_ids.shape[1] for b in batches)
    out: dict[str, Any] = {}
    for name, pad in _LEFT.items():
        out[name] = torch.cat([_pad(getattr(b, name), width_p, pad_token_id if pad is None else pad, left=True)
                               for b in batches])
    for name, pad in _RIGHT.items():
        parts = [getattr(b, name) for b in batches]
        if name in ("response_attention_mask", "token_versions") and all(p is None for p in parts):
            out[name] = None
            continue
        assert name != "token_versions" or all(p is not None for p in parts), name
        parts = [b.real_response_mask if name == "response_attention_mask" else p for b, p in zip(batches, parts)]
        out[name] = torch.cat([_pad(p, width_r, pad_token_id if pad is None else pad, left=False) for p in parts])
    for name in _ROWS:
        parts = [getattr(b, name) for b in batches]
        assert all(p is None for p in parts) or all(p is not None for p in parts), name
        out[name] = None if parts[0] is None else torch.cat(parts)
    for name in _LISTS:
        parts = [getattr(b, name) for b in batches]
        out[name] = None if parts[0] is None else [x for p in parts for x in p]
    for name in _SAME:
        assert len({getattr(b, name) for b in batches}) == 1, name
        out[name] = getattr(batches[0], name)
    offset, index = 0, []
    for b in batches:
        index.append(b.prompt_index + offset)
        offset += int(b.prompt_index.max()) + 1
    out["prompt_index"] = torch.cat(index)
    out["routes"] = None if batches[0].routes is None else torch.cat([
        torch.cat([_pad(b.routes[:, :b.prompt_ids.shape[1]], width_p, -1, left=True),
                   _pad(b.routes[:, b.prompt_ids.shape[1]:], width_r, -1, left=False)], dim=1) for b in batches])
    metrics = [b.env_metrics for b in batches]
    out["env_metrics"] = None if metrics[0] is None else merge_episode_metrics(
        [(m, b.num_samples) for m, b in zip(metrics, batches)])
    out["gen_metrics"] = None
    return RolloutBatch(**out)


def take(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """The samples `rows` [M] in that order, prompts renumbered in order of appearance, columns that are
    padding in every row taken dropped; metrics kept."""
    prompt_width = int(batch.prompt_mask[rows].any(0).long().argmax()) if len(rows) else 0  # leading pad columns
    real = batch.real_response_mask[rows].any(0)
    response_width = max(1, int(real.nonzero().max()) + 1 if real.any() else 0)
    new_index = {}
    index = [new_index.setdefault(int(i), len(new_index)) for i in batch.prompt_index[rows].tolist()]
    out = {}
    for name in _LEFT:
        out[name] = getattr(batch, name)[rows, prompt_width:]
    for name in _RIGHT:
        value = getattr(batch, name)
        out[name] = None if value is None else value[rows, :response_width]
    for name in _ROWS:
        value = getattr(batch, name)
        out[name] = None if value is None else value[rows]
    for name in _LISTS:
        value = getattr(batch, name)
        out[name] = None if value is None else [value[i] for i in rows.tolist()]
    routes = batch.routes
    if routes is not None:
        p = batch.prompt_ids.shape[1]
        routes = torch.cat([routes[rows, prompt_width:p], routes[rows, p:p + response_width]], dim=1)
    return dataclasses.replace(batch, **out, prompt_index=torch.tensor(index, dtype=torch.long), routes=routes)


def _pad(x: torch.Tensor, width: int, value, *, left: bool) -> torch.Tensor:
    """[N, W, ...] -> [N, width, ...], `value` added on the left or the right of dim 1."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)
