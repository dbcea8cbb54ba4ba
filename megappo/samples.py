"""Generation samples: a few decoded prompt / response / score records per step (`logging.samples`).

`pick_samples(tokenizer, batch, scores, n)` takes n samples spread over the batch (the first
of every N/n), decodes the prompt (special tokens kept, so a chat template shows) and the
response as the reward functions saw it (special tokens dropped), and returns plain records:
{"prompt", "response", "score", "ground_truth", "data_source", "finish_reason",
"response_tokens"}. The metric logger (megappo.metrics) prints them, one compact line each,
and appends them to `samples.jsonl`.

This module does not know about models, engines or process groups.
"""

from __future__ import annotations

from typing import Any

from megappo.types import RolloutBatch

def pick_samples(tokenizer, batch: RolloutBatch, scores, n: int) -> list[dict[str, Any]]:
    """n records spread over the batch (all of it when n >= its size); [] when n is 0."""
    total = batch.num_samples
    if n <= 0 or total == 0:
        return []
    picked = sorted({i * total // min(n, total) for i in range(min(n, total))})
    records = []
    for i in picked:
        example = batch.examples[i]
        length = int(batch.real_response_mask[i].sum())  # a multi-turn episode: actions and observations
        records.append({
            "prompt": tokenizer.decode(example.prompt_ids, skip_special_tokens=False),
            "response": tokenizer.decode(batch.response_ids[i, :length].tolist(), skip_special_tokens=True),
            "score": float(scores[i]),
            "ground_truth": _plain(example.ground_truth),
            "data_source": example.data_source,
            "finish_reason": batch.finish_reasons[i],
            "response_tokens": length,
        })
    return records


def _plain(value: Any) -> Any:
    """JSON-safe: numbers, strings, lists and dicts as they are, anything else as its str."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
