"""Prompt datasets (JSONL / Parquet in verl's layout, built-in sources) and the sampler.

A row in verl's layout:
  {"data_source": "openai/gsm8k",
   "prompt": [{"role": "user", "content": "..."}],       # chat messages (or a plain string)
   "reward_model": {"style": "rule", "ground_truth": "72"},
   "extra_info": {...}}
`load_rows(paths)` reads .jsonl/.json and .parquet files (pyarrow, imported lazily);
`read_rows` also returns each row's `RowOrigin` (file and 1-based line or row, training or validation;
`numbered` for built-in sources and rows given in code), which the data check, `build_prompts` and,
through `PromptExample.origin`, the reward functions' and environments' errors name;
`class_rows(path, name, files, ...)` reads rows from a dataset class of the user's (verl's
`data.custom_cls.path` / `.name`: `Class(data_files, config)`, read with len() and [i] or by iterating it,
each row a dict in verl's layout), instead of from the files themselves;
`build_prompts(rows, tokenizer, ...)` renders the chat template, tokenizes, and applies the
long-prompt policy (skip / truncate from the left / error), counting what it did.
Built-in sources need no files: `reasoning_gym:<task>` (procedural tasks from the
reasoning-gym package with their own scorers), `digit_successor` (the CPU demo task), `lookup` (the
multi-turn demo's) and `code_expression` (the code demo's);
`builtin_splits` draws their training and validation rows, no validation prompt in training.

`PromptSampler` yields global batches of example indices, reshuffled every epoch from
(seed, epoch), with a cursor that checkpoints and resumes exactly; with the user's sampler class
(verl's `data.sampler.class_path` / `.class_name`; `ClassOrder`) each epoch's order is what the class
yields, iterated once more per epoch, and a resumed run replays its epochs to the one it stopped in.

This module does not know about models, engines or process groups.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
from typing import Any, Iterable, Iterator, Literal, Sequence

from megappo.errors import ConfigError
from megappo.data.tokenizer import chat_template_ids
from megappo.user_code import load_spec, short_text


#: how a row's place is counted: a JSONL file's line, a Parquet file's row, a built-in source's row
#: (no file), or a row of a list given in code
RowKind = Literal["jsonl", "parquet", "builtin", "list"]


@dataclasses.dataclass(frozen=True)
class RowOrigin:
    """Where a prompt row came from, as the user finds it again: every number is 1-based, a JSONL
    row's the file's line as editors show it (`train.jsonl:121`), a Parquet row's its row number
    (`train.parquet row 121`), a built-in source's its row in that source, which has no file
    (`data.builtin=digit_successor row 5 (built-in, no file)`). It travels with the row's
    PromptExample to the reward functions and environments, whose errors name it."""

    source: str  # the file as data.train_files / val_files name it, or "data.builtin=<spec>"
    number: int  # 1-based line (jsonl) or row (the other kinds)
    kind: RowKind = "jsonl"
    split: Literal["training", "validation"] = "training"

    def __str__(self) -> str:
        if self.kind == "jsonl":
            return f"{self.source}:{self.number}"
        if self.kind == "list":
            return f"row {self.number} of {self.source}"
        return f"{self.source} row {self.number}" + (" (built-in, no file)" if self.kind == "builtin" else "")

    def describe(self, prompt: str | None = None) -> str:
        """'train.jsonl:121 (training row, prompt '2+1=')': where, which split, and the prompt on one line."""
        where = str(self).removesuffix(" (built-in, no file)")
        notes = [f"{self.split} row"] + (["built-in, no file"] if self.kind == "builtin" else [])
        return f"{where} ({', '.join(notes + ([f'prompt {short_text(prompt)}'] if prompt is not None else []))})"


class DataError(ValueError):
    """A dataset megappo cannot use; the message names the file/row and the fix."""


@dataclasses.dataclass
class PromptExample:
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra: dict
    index: int  # its position among the prompts (0-based; what an environment's Episode.index is)
    origin: RowOrigin | None = None  # where the row came from (None: a checkpoint saved before megappo kept it)


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading .parquet needs pyarrow. Fix: pip install pyarrow.") from None
    return pq


def check_files(paths: Sequence[str], key: str = "data.train_files") -> None:
    """Cheap checks before any rank starts: every file exists, has a known format and a row."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"dataset file '{path}' ({key}) does not exist. Fix: correct the path in {key}.")
        if path.endswith((".jsonl", ".json")):
            with open(path) as f:
                empty = not any(line.strip() for line in f)
        elif path.endswith(".parquet"):
            empty = _pyarrow_parquet().read_metadata(path).num_rows == 0
        else:
            raise DataError(f"dataset file '{path}' ({key}) has an unsupported format. Fix: convert it to .jsonl "
                            "(one JSON object per line) or .parquet.")
        if empty:
            raise DataError(f"dataset file '{path}' ({key}) is empty (no rows). Fix: write at least one prompt row "
                            f"into it or remove it from {key}.")


def load_rows(paths: Sequence[str], key: str = "data.train_files") -> list[dict]:
    return read_rows(paths, key)[0]


def read_rows(paths: Sequence[str], key: str = "data.train_files", *, dataset: tuple[str, str] | None = None,
              config: dict | None = None) -> tuple[list[dict], list[RowOrigin]]:
    """(the rows of every file, in order, each row's RowOrigin: its JSONL line or Parquet row, 1-based;
    validation rows when `key` is data.val_files). `dataset`: (path, class name) of the user's dataset class,
    which reads the files instead (`class_rows`, given the data section `config`)."""
    if dataset:
        return class_rows(*dataset, paths, config or {}, key)
    check_files(paths, key)
    split = "validation" if key == "data.val_files" else "training"
    rows: list[dict] = []
    origins: list[RowOrigin] = []
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            with open(path) as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{line_no} is not valid JSON ({e.msg}). Fix: one JSON object "
                                            "per line.") from None
                        if not isinstance(rows[-1], dict):
                            raise DataError(f"{path}:{line_no} is a {type(rows[-1]).__name__}, not a JSON object. "
                                            'Fix: write each row as {"prompt": ..., ...}.')
                        origins.append(RowOrigin(path, line_no, "jsonl", split))
        else:
            table = _pyarrow_parquet().read_table(path).to_pylist()
            rows.extend(table)
            origins += [RowOrigin(path, i + 1, "parquet", split) for i in range(len(table))]
    return rows, origins


def dataset_class(path: str, name: str) -> type:
    """The user's dataset class `name` in `path` (a .py file or a module), loaded as reward files are; a
    ConfigError naming the fix when it is not there."""
    return _user_class(path, name, "data.custom_cls", "path", "name")


def _user_class(path: str, name: str, section: str, path_key: str, name_key: str) -> type:
    """Class `name` of the .py file or module `path` that `section`.`path_key` / `name_key` name, loaded as
    reward files are (megappo.user_code); a ConfigError naming the fix when it is not there."""
    spec = f"{path}:{name}"
    fix = (f"Fix: set {section}.{path_key} to a .py file or an importable module, and {section}.{name_key} to a "
           "class in it.")
    module, _, _ = load_spec(spec, who=f"{section} {spec}", malformed=f"{section} {spec}: {fix}", fix=fix)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{section} {spec}: {path} has no class {name!r}. {fix}")
    return cls


def class_rows(path: str, name: str, files: Sequence[str], config: dict, key: str = "data.train_files"
               ) -> tuple[list[dict], list[RowOrigin]]:
    """The rows of the user's dataset class `name` in `path` (a .py file or a module; verl's data.custom_cls):
    megappo calls `name(files, config)` (`files`: data.train_files or data.val_files as given, which the class
    reads itself; `config`: the data section as a dict) and reads its rows with len() and [i], or by
    iterating it. Each row is a dict in verl's layout, checked and tokenized as a file's rows are."""
    split = "validation" if key == "data.val_files" else "training"
    spec = f"{path}:{name}"
    cls = dataset_class(path, name)
    try:
        dataset = cls(list(files), dict(config))
        if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            rows = [dataset[i] for i in range(len(dataset))]
        elif hasattr(dataset, "__iter__"):
            rows = list(dataset)
        else:
            raise DataError(f"data.custom_cls {spec}: an instance has neither len() and [i] nor iteration, so megappo "
                            f"cannot read its rows. Fix: give {name} __len__ and __getitem__ (as a torch Dataset has) "
                            "or __iter__, each row a dict in verl's layout.")
    except DataError:
        raise
    except Exception as e:  # the user's class failed: what it raised, where, and the fix
        raise DataError(f"data.custom_cls {spec}({list(files)}, config) raised {type(e).__name__}: {e}. Fix: correct "
                        f"that class (megappo calls {name}(data_files, config), then len() and [i]).") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"data.custom_cls {spec}: row {i + 1} ({key}) is a {type(row).__name__}, not a dict. "
                            "Fix: return each row as a dict in verl's layout ({\"prompt\": [...], \"data_source\": ..., "
                            "\"reward_model\": {\"ground_truth\": ...}}); verl's RLHFDataset returns tokenized tensors, "
                            "which megappo does not read.")
    return rows, numbered(spec, len(rows), "list", split)


def numbered(source: str, n: int, kind: RowKind = "list", split: str = "training") -> list[RowOrigin]:
    """The origins of `n` rows of `source` numbered 1..n (a built-in source's rows, or rows given in code)."""
    return [RowOrigin(source, i + 1, kind, split) for i in range(n)]


def render_prompt(prompt: Any, tokenizer, apply_chat_template: bool, system_prompt: str | None = None,
                  few_shot: Sequence[dict] = (), template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one prompt. `system_prompt` becomes the first message unless the row has its own;
    the `few_shot` turns come right after the system message (the row's, this one, or none);
    `template_kwargs`: more arguments of the chat template (data.apply_chat_template_kwargs)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    has_system = bool(messages) and isinstance(messages[0], dict) and messages[0].get("role") == "system"
    system = messages[:1] if has_system else [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages = [*system, *few_shot, *messages[has_system:]]
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return chat_template_ids(tokenizer, messages, generation_prompt=True, template_kwargs=template_kwargs)
    text = "\n".join(m["content"] for m in messages)  # a text prompt is one message: the text as it is
    return tokenizer.encode(text, add_special_tokens=False)


def build_prompts(rows: Iterable[dict], tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int = 512,
                  long_prompt_policy: str = "skip", apply_chat_template: bool = True, source: str = "dataset",
                  system_prompt: str | None = None, few_shot: Sequence[dict] = (), template_kwargs: dict | None = None,
                  origins: Sequence[RowOrigin] | None = None) -> tuple[list[PromptExample], dict[str, int]]:
    """Tokenize rows; returns (examples, {"skipped_long": k, "truncated_long": k}). `origins`: each
    row's RowOrigin (None: the rows are numbered 1.. of `source`), kept in its example and named in errors."""
    rows = list(rows)
    origins = list(origins) if origins is not None else numbered(source, len(rows))
    examples, stats, longest = [], {"skipped_long": 0, "truncated_long": 0}, 0
    for i, (row, origin) in enumerate(zip(rows, origins, strict=True)):
        if prompt_key not in row or row[prompt_key] in (None, "", []):
            raise DataError(
                f"{origin} has no '{prompt_key}' (keys: {sorted(row)}). Fix: add a '{prompt_key}' to the "
                "row, or set data.prompt_key to the column that holds the prompt."
            )
        ids = render_prompt(row[prompt_key], tokenizer, apply_chat_template, system_prompt, few_shot, template_kwargs)
        longest = max(longest, len(ids))
        if len(ids) > max_prompt_length:
            if long_prompt_policy == "error":
                raise DataError(
                    f"{origin}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}. "
                    "Fix: raise data.max_prompt_length, or set data.long_prompt_policy=skip (drop such prompts, "
                    "counted) or truncate (keep their last tokens, counted)."
                )
            if long_prompt_policy == "skip":
                stats["skipped_long"] += 1
                continue
            ids = ids[-max_prompt_length:]  # keep the end, where the question and template are
            stats["truncated_long"] += 1
        reward_info = row.get("reward_model") or {}
        examples.append(PromptExample(prompt_ids=ids, data_source=row.get("data_source", "unknown"),
                                      ground_truth=reward_info.get("ground_truth"),
                                      extra=dict(row.get("extra_info") or {}), index=i, origin=origin))
    if not examples:
        raise DataError(f"every prompt of {source} is longer than data.max_prompt_length={max_prompt_length} "
                        f"(longest: {longest} tokens; {stats}). Fix: raise data.max_prompt_length, or set "
                        "data.long_prompt_policy=truncate.")
    return examples, stats


# -- built-in sources -----------------------------------------------------------------------

def digit_successor_rows(size: int, seed: int) -> list[dict]:
    """The CPU demo task: after '3>' the answer is '4' (after '9>': '0'). What a random policy
    scores on it is `random_policy_score`'s to say, not a number written here."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        d = rng.randrange(10)
        rows.append({"data_source": "digit_successor", "prompt": f"{d}>",
                     "reward_model": {"style": "rule", "ground_truth": str((d + 1) % 10)}})
    return rows


def lookup_rows(size: int, seed: int) -> list[dict]:
    """The multi-turn CPU demo task (`megappo.envs.lookup`): the prompt '3?' names a key; the value
    stored under it (a digit drawn per row, the ground truth) is only told by the environment."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        key, value = rng.randrange(10), rng.randrange(10)
        rows.append({"data_source": "lookup", "prompt": f"{key}?", "extra_info": {"key": key},
                     "reward_model": {"style": "env", "ground_truth": str(value)}})
    return rows


def code_expression_rows(size: int, seed: int) -> list[dict]:
    """The code demo's task (reward `code_expression`): after '7=' the answer is a Python expression worth 7
    ('7', '3+4', '9-2'), which the sandboxed executor evaluates; the ground truth is the value's text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        value = rng.randrange(10)
        rows.append({"data_source": "code_expression", "prompt": f"{value}=",
                     "reward_model": {"style": "rule", "ground_truth": str(value)}})
    return rows


def random_policy_score(rows: Sequence[dict], reward_fn, tokenizer, max_new_tokens: int,
                        vocab_size: int | None = None) -> float:
    """The exact mean score of a policy that draws every response token uniformly from the
    vocabulary (`vocab_size`, default the tokenizer's), stopping at EOS or after
    `max_new_tokens`, scored like the trainer scores: `reward_fn(text, ground_truth, extra)` on
    the response decoded without special tokens, with its finish reason in `extra`. Enumerates every response, so only for tiny
    vocabularies and lengths (the demo: 19 tokens, 2 new tokens, 361 responses per prompt).
    The demo docs quote this number; a unit test keeps them equal."""
    vocab = vocab_size or len(tokenizer)
    eos = tokenizer.eos_token_id
    if vocab ** max_new_tokens > 1_000_000:
        raise ValueError(f"{vocab}^{max_new_tokens} responses are too many to enumerate")
    responses: list[tuple[list[int], float]] = []  # (token ids, probability)
    frontier: list[list[int]] = [[]]
    while frontier:
        ids = frontier.pop()
        if ids and (ids[-1] == eos or len(ids) == max_new_tokens):
            responses.append((ids, float(vocab) ** -len(ids)))
        else:
            frontier.extend(ids + [t] for t in range(vocab))
    texts = [(tokenizer.decode(ids, skip_special_tokens=True), "stop" if ids[-1] == eos else "length", p)
             for ids, p in responses]
    def key(row):
        return json.dumps([row["prompt"], (row.get("reward_model") or {}).get("ground_truth")], sort_keys=True)

    distinct = {key(r): r for r in rows}
    counts = collections.Counter(key(r) for r in rows)
    total = 0.0
    for k, row in distinct.items():  # each distinct prompt once, weighed by how often it occurs
        gt, extra = (row.get("reward_model") or {}).get("ground_truth"), dict(row.get("extra_info") or {})
        total += counts[k] * sum(p * reward_fn(text, gt, dict(extra, finish_reason=reason)) for text, reason, p in texts)
    return total / len(rows)


def reasoning_gym_rows(task: str, size: int, seed: int, **task_args) -> list[dict]:
    return list(_reasoning_gym_stream(task, size, seed, task_args))


def _reasoning_gym_stream(task: str, size: int, seed: int, task_args: dict) -> Iterator[dict]:
    """The task's rows 0..size-1, made one at a time (row i depends on (seed, i) only)."""
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("data.builtin=reasoning_gym:... needs the reasoning-gym package. Fix: pip install "
                        "reasoning-gym.") from None
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_args)
    except (TypeError, ValueError, KeyError, AssertionError) as e:
        raise DataError(f"reasoning-gym task '{task}' with data.builtin_args={task_args}: {e}. Fix: check the task "
                        "name and data.builtin_args against reasoning-gym's task list.") from None
    for entry in dataset:
        yield {
            "data_source": f"reasoning_gym/{task}",
            "prompt": [{"role": "user", "content": entry["question"] + " Give only the final answer."}],
            "reward_model": {"style": "rule", "ground_truth": entry["answer"]},
            "extra_info": {"task": task, "entry": entry},
        }


def builtin_rows(spec: str, size: int, seed: int, args: dict | None = None) -> list[dict]:
    """data.builtin: 'digit_successor', 'lookup', 'code_expression' or 'reasoning_gym:<task>' (options in
    data.builtin_args)."""
    return list(_builtin_stream(spec, size, seed, args))


def _builtin_stream(spec: str, size: int, seed: int, args: dict | None) -> Iterator[dict]:
    if spec == "digit_successor":
        return iter(digit_successor_rows(size, seed))
    if spec == "lookup":
        return iter(lookup_rows(size, seed))
    if spec == "code_expression":
        return iter(code_expression_rows(size, seed))
    if spec.startswith("reasoning_gym:"):
        return _reasoning_gym_stream(spec.split(":", 1)[1], size, seed, dict(args or {}))
    raise DataError(f"unknown data.builtin '{spec}'. Fix: set data.builtin=digit_successor, lookup, code_expression or "
                    "data.builtin=reasoning_gym:<task>.")


def prompt_identity(prompt: Any) -> str:
    """A prompt's exact identity for duplicate checks: text, and chat messages that hold the
    same text as one user message, compare equal; any other difference counts."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return json.dumps(messages, sort_keys=True, default=str)


#: built-in sources with no prompt to hold out: every one of them is in a training set of any
#: useful size, so their validation set is drawn like the training set and measures the fit
NOT_HELD_OUT = {"digit_successor": "its 10 prompts ('0>' to '9>') are all in the training set",
                "lookup": "its 10 prompts ('0?' to '9?') are all in the training set (the values are drawn per row)",
                "code_expression": "its 10 prompts ('0=' to '9=') are all in the training set"}

#: candidates drawn for a held-out validation set, per validation row asked for
VAL_DRAWS_PER_ROW = 64


def builtin_splits(spec: str, train_size: int, val_size: int, seed: int, args: dict | None = None
                   ) -> tuple[list[dict], list[dict]]:
    """(training rows, validation rows) of a built-in source; no validation prompt is a training prompt.

    The training rows are `builtin_rows(spec, train_size, seed)`. The validation rows are the
    first `val_size` rows of the stream seeded `seed + 1` whose prompt (`prompt_identity`) is not
    in the training set, so both depend on (spec, sizes, seed, args) only and a resumed run
    rebuilds them exactly. A task with too few distinct prompts to fill the validation set after
    `VAL_DRAWS_PER_ROW * val_size + train_size` draws is a DataError. Sources in `NOT_HELD_OUT`
    have no prompt to hold out: their validation rows are `builtin_rows(spec, val_size, seed + 1)`.
    """
    train = builtin_rows(spec, train_size, seed, args)
    if spec in NOT_HELD_OUT:
        return train, builtin_rows(spec, val_size, seed + 1, args)
    seen = {prompt_identity(r["prompt"]) for r in train}
    draws = VAL_DRAWS_PER_ROW * val_size + train_size
    val = []
    for row in _builtin_stream(spec, draws, seed + 1, args):
        if prompt_identity(row["prompt"]) not in seen:
            val.append(row)
            if len(val) == val_size:
                return train, val
    raise DataError(
        f"data.builtin={spec} (data.builtin_args={dict(args or {})}): only {len(val)} of {draws} prompts drawn for "
        f"validation are not in the training set ({train_size} rows), fewer than data.builtin_val_size={val_size}: "
        "the task has few distinct prompts. Fix: lower data.builtin_size or data.builtin_val_size, or widen "
        "data.builtin_args (more digits or terms).")


# -- sampling ------------------------------------------------------------------------------

class PromptSampler:
    """Global batches of example indices; shuffled per epoch from (seed, epoch); resumable.

    Incomplete final batches are dropped (every step has the configured batch size).
    """

    def __init__(self, num_examples: int, batch_size: int, *, seed: int = 1, shuffle: bool = True,
                 key: str = "data.train_batch_size", order: "ClassOrder | None" = None):
        if batch_size > num_examples:
            raise DataError(
                f"{key}={batch_size} is larger than the dataset ({num_examples} usable prompts). "
                f"Fix: lower {key} or add prompts."
            )
        self.n, self.batch_size, self.seed, self.shuffle = num_examples, batch_size, seed, shuffle
        self.epoch, self.cursor, self.order = 0, 0, order

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    def _order(self) -> list[int]:
        if self.order is not None:
            return self.order(self.epoch)
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.cursor >= self.batches_per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        start = self.cursor * self.batch_size
        self.cursor += 1
        return self._order()[start:start + self.batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise DataError("the checkpoint's sampler was built for another dataset or seed. Fix: resume with the "
                            "same data and data.seed.")
        self.epoch, self.cursor = state["epoch"], state["cursor"]


class ClassOrder:
    """Each epoch's order of the prompts from the user's sampler class (verl's data.sampler.class_path /
    class_name): megappo calls `Class(data_source, data_config)` once (`data_source`: the training prompts,
    megappo's PromptExample each, with len() and [i]; `data_config`: the data section as a dict) and iterates
    the instance once per epoch; every epoch must yield each index in [0, N) as many times as N indices in all
    (a permutation, or a draw with repeats of N). verl's curriculum samplers (an `update(batch)` method, called
    with verl's batch after each step) are refused: megappo has no such batch to give them."""

    def __init__(self, path: str, name: str, examples: Sequence, config: dict):
        spec = f"{path}:{name}"
        cls = sampler_class(path, name)
        self.spec, self.n = spec, len(examples)
        try:
            self.sampler = cls(examples, config)
        except Exception as e:
            raise DataError(f"data.sampler {spec}(data_source, data_config) raised {type(e).__name__}: {e}. Fix: "
                            f"correct that class (megappo calls {name}(data_source, data_config)).") from None
        self.epoch, self.current = -1, []

    def __call__(self, epoch: int) -> list[int]:
        """The order of `epoch` (the instance iterated again up to it: epochs come in order, and a resumed run
        replays the ones before its own)."""
        assert epoch >= self.epoch, (epoch, self.epoch)
        while self.epoch < epoch:
            self.current, self.epoch = self._next(), self.epoch + 1
        return self.current

    def _next(self) -> list[int]:
        try:
            order = [int(i) for i in self.sampler]
        except Exception as e:
            raise DataError(f"data.sampler {self.spec}: iterating it raised {type(e).__name__}: {e}. Fix: make "
                            f"__iter__ yield prompt indices.") from None
        bad = [i for i in order if not 0 <= i < self.n]
        if len(order) != self.n or bad:
            raise DataError(f"data.sampler {self.spec} yielded {len(order)} indices"
                            + (f", {bad[:3]} outside [0, {self.n})" if bad else "")
                            + f" for {self.n} prompts. Fix: yield {self.n} indices in [0, {self.n}) per epoch (each "
                              f"prompt once, or a draw with repeats).")
        return order


def sampler_class(path: str, name: str) -> type:
    """The user's sampler class `name` in `path`, loaded as reward files are; a ConfigError naming the fix when
    it is not there or is a curriculum sampler (ClassOrder says why)."""
    spec = f"{path}:{name}"
    cls = _user_class(path, name, "data.sampler", "class_path", "class_name")
    if callable(getattr(cls, "update", None)):
        raise ConfigError(f"data.sampler {spec} has an update(batch) method: a curriculum sampler that verl calls "
                          "with its batch after each step, which megappo does not have. Fix: order the prompts "
                          "without update (each epoch from __iter__), or order the rows of data.train_files and "
                          "set data.shuffle=false.")
    return cls
