"""Generation samples: decoded prompt / response / score records, a few per step (`logging.samples`)
or every one (`logging.rollout_dir`, `logging.validation_dir`: verl's rollout_data_dir and
validation_data_dir).

`pick_samples(tokenizer, batch, scores, n)` takes n samples spread over the batch (the first
of every N/n; n < 0: all), decodes the prompt (special tokens kept, so a chat template shows) and the
response as the reward functions saw it (special tokens dropped), and returns plain records:
{"prompt", "response", "score", "ground_truth", "data_source", "finish_reason",
"response_tokens", "group"} (`group`: the batch's number of the prompt; the n samples of one prompt
share it), with "fields" (what the reward functions returned besides the score, e.g. "acc", "pred")
where the batch was scored with them. The metric logger (megappo.metrics.sinks) prints a few, one compact
line each, and appends them to `samples.jsonl`; `write_generations` writes all of a step's to
`<dir>/<step>.jsonl`, replacing the file a run stopped before its checkpoint wrote.

This module does not know about models, engines or process groups.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megappo.types import RolloutBatch


def pick_samples(tokenizer, batch: RolloutBatch, scores, n: int) -> list[dict[str, Any]]:
    """n records spread over the batch (all of it when n >= its size or n < 0); [] when n is 0."""
    total = batch.num_samples
    if n == 0 or total == 0:
        return []
    n = total if n < 0 else min(n, total)
    picked = sorted({i * total // n for i in range(n)})
    records = []
    for i in picked:
        example = batch.examples[i]
        length = int(batch.real_response_mask[i].sum())  # a multi-turn episode: actions and observations
        records.append({
            "prompt": tokenizer.decode(example.prompt_ids, skip_special_tokens=False),
            "response": tokenizer.decode(batch.response_ids[i, :length].tolist(), skip_special_tokens=True),
            "score": float(scores[i]),
            "ground_truth": plain_data(example.ground_truth),
            "data_source": example.data_source,
            "finish_reason": batch.finish_reasons[i],
            "response_tokens": length,
            "group": int(batch.prompt_index[i]),
            **({"fields": plain_data(batch.score_fields[i])} if batch.score_fields is not None else {}),
        })
    return records


def write_generations(directory: str, step: int, records: list[dict[str, Any]]) -> str:
    """`<directory>/<step>.jsonl`, one record a line with its step (verl's file name), written to a
    temporary file and renamed: a kill leaves the old file or the new one. Returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(dict(step=step, **r), ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)
    return path


def plain_data(value: Any) -> Any:
    """Python's own types only (what JSON and torch.load(weights_only=True) read): numbers (numpy scalars
    and 0-d tensors as Python numbers), strings, lists and dicts, anything else as its str."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalars, 0-d tensors
        value = value.item()
    for kind in (bool, int, float, str):  # subclasses (numpy's float64) as the base type
        if isinstance(value, kind):
            return kind(value)
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_data(v) for k, v in value.items()}
    return str(value)
