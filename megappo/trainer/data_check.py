"""The start-up data check: rows that would train silently wrong, counted, then a policy.

`check_rows(rows, tokenizer, ...)` looks at every row once (rank 0, before prompts are
tokenized) and counts three problems:

- no prompt: the prompt column is missing, empty, whitespace, or chat messages without text;
  or it is neither text nor a list of {"role", "content"} messages;
- unknown characters: characters of a prompt (or of a ground truth) that the tokenizer has no
  token for and encodes as its unknown token (the built-in character tokenizers: <pad>), so the
  model sees padding, or can never write the answer (megappo.data.tokenizer.unknown_characters);
- missing reward fields: a field a configured reward function reads (megappo.rewards.reads,
  e.g. `reward_model.ground_truth`) is absent or null, so every response scores 0; a close
  spelling in the row (`reward_model.groundtruth`) is named;
- answers over the budget: a ground truth whose tokens plus EOS do not fit in
  `rollout.max_new_tokens`, so no response can write it and stop (given `max_new_tokens`).

Each example row is named where the user finds it (megappo.data.prompts.RowOrigin: `train.jsonl:121`, the
file's line as editors show it; `train.parquet row 121`; a built-in source's row, which has no file).

`apply_policy(report, policy)` then, per `data.bad_row_policy`: `error` (the default) raises a
DataError listing each problem with counts, examples and its fix; `warn` prints the same and
trains on the rows as they are (rows without a prompt are dropped: there is nothing to
generate from); `skip` prints it and drops every row with a problem. A clean dataset prints
nothing.

`shared_prompts(train_rows, val_rows, ...)` finds the validation rows whose prompt is exactly a
training prompt (megappo.data.prompts.prompt_identity); with an environment (`env`, rollout.env other than
single_turn) a row counts only when all an episode receives of it is a training row's
(`episode_input`: prompt, ground truth, extra_info, data_source), since the same prompt with other
extra_info is another task. `warn_shared_prompts` prints them as one warning line with the count,
a few examples and the fix (a validation score on them is not held out).

This module does not know about models, engines or process groups.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import json
from typing import Any, Sequence

from megappo.data.prompts import DataError, RowOrigin, numbered, prompt_identity
from megappo.rewards import reads
from megappo.data.tokenizer import unknown_characters, unknown_token

POLICIES = ("error", "warn", "skip")
EXAMPLES = 3  # rows quoted per problem


@dataclasses.dataclass
class Problem:
    """Rows with one kind of problem: what it is, which rows, a few details, and the fix."""

    what: str
    fix: str
    rows: list[int] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)  # per example row, in order
    chars: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # unknown char -> rows

    def add(self, row: int, detail: str, origin: RowOrigin) -> None:
        """Row `row` (its index in the rows checked) has it; `origin` is where the user finds it."""
        self.rows.append(row)
        if len(self.details) < EXAMPLES and detail:
            self.details.append(f"{origin}: {detail}")

    def describe(self, total: int) -> str:
        text = f"{len(self.rows)} of {_rows(total)} {self.what}"
        if self.chars:
            shown = ", ".join(f"{c!r} ({_rows(n)})" for c, n in self.chars.most_common(8))
            more = f" and {len(self.chars) - 8} more" if len(self.chars) > 8 else ""
            text += f": {len(self.chars)} distinct characters, {shown}{more}"
        if self.details:
            text += "; e.g. " + "; ".join(self.details)
        return f"{text}. Fix: {self.fix}."


@dataclasses.dataclass
class DataReport:
    source: str
    total: int
    problems: dict[str, Problem]  # name -> rows with that problem (only those found)

    @property
    def bad_rows(self) -> set[int]:
        return {r for p in self.problems.values() for r in p.rows}

    def describe(self) -> str:
        lines = [f"data check of {self.source} ({self.total} rows):"]
        lines += [f"  {p.describe(self.total)}" for p in self.problems.values()]
        return "\n".join(lines)


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


#: columns that often hold the prompt when data.prompt_key is not 'prompt'
PROMPT_COLUMNS = ("question", "problem", "query", "instruction", "input", "messages", "text")


def prompt_text(prompt: Any) -> str | None:
    """The text of a prompt (a string, or chat messages' contents joined); None if it is neither."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 for m in prompt):
        return "\n".join(m["content"] for m in prompt)
    return None


def _field(row: dict, dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _near_miss(row: dict, dotted: str) -> str:
    """Where `dotted` is probably misspelled in `row`: 'reward_model has ['groundtruth']: did you mean ...'."""
    *parents, leaf = dotted.split(".")
    if parents and leaf in row:
        return f"'{leaf}' is at the top level of the row, not under '{'.'.join(parents)}'"
    parent = _field(row, ".".join(parents)) if parents else row
    if isinstance(parent, dict):
        guess = difflib.get_close_matches(leaf, [str(k) for k in parent], n=1, cutoff=0.6)
        where = ".".join(parents) or "the row"
        if guess:
            return f"{where} has '{guess[0]}', not '{leaf}'"
        return f"{where} has keys {sorted(map(str, parent))}"
    if leaf in row or (parents and parents[0] not in row):
        return f"the row has keys {sorted(map(str, row))}"
    return f"{'.'.join(parents)} is {parent!r}"


def check_rows(rows: Sequence[dict], tokenizer, *, prompt_key: str = "prompt",
               reward_functions: Sequence[str] = (), source: str = "dataset",
               max_new_tokens: int | None = None, origins: Sequence[RowOrigin] | None = None) -> DataReport:
    """Count the rows without a prompt, with unknown characters, without a field a reward reads, or
    with a ground truth that does not fit in `max_new_tokens` (with its EOS). The examples quoted are
    named by their `origins` (file:line, Parquet or built-in row; None: rows 1.. of `source`)."""
    where = list(origins) if origins is not None else numbered(source, len(rows))
    unk = unknown_token(tokenizer)
    problems = {
        "no_prompt": Problem(f"have no prompt in '{prompt_key}'",
                             f"give every row a prompt (text, or chat messages [{{\"role\": \"user\", \"content\": "
                             f"...}}]), or set data.prompt_key to the column that holds it"),
        "unknown_prompt_chars": Problem(f"have prompt characters the tokenizer does not know (encoded as {unk!r}, so "
                                        "the model sees that instead)",
                                        "use a tokenizer that has them (model.tokenizer), or remove them from the "
                                        "data"),
        "unknown_answer_chars": Problem(f"have a ground truth with characters the tokenizer cannot write (encoded as "
                                        f"{unk!r}), so no response can match it",
                                        "use a tokenizer that has them (model.tokenizer), or change the ground truths"),
    }
    fields: dict[str, list[str]] = {}
    for name in reward_functions:
        for f in reads(name):
            fields.setdefault(f, []).append(name)
    for f, names in fields.items():
        problems[f"missing:{f}"] = Problem(
            f"lack {f}, which reward function(s) {names} read (every response would score 0)",
            f"write it in every row (verl layout: " + ('{"reward_model": {"ground_truth": "..."}}'
                                                      if f == "reward_model.ground_truth" else f) + ")")
    texts, answers = [], []
    for i, row in enumerate(rows):
        text = prompt_text(row.get(prompt_key))
        if text is None or not text.strip():
            value = row.get(prompt_key, "<missing>")
            column = next((c for c in PROMPT_COLUMNS if prompt_text(row.get(c))), None)
            guess = f" (data.prompt_key={column}?)" if column and prompt_key not in row else ""
            detail = (f"keys {sorted(map(str, row))}{guess}" if prompt_key not in row
                      else f"{prompt_key}={value!r:.60}" + (" (neither text nor chat messages)" if text is None else ""))
            problems["no_prompt"].add(i, detail, where[i])
        texts.append(text or "")
        for f in fields:
            if _field(row, f) is None:
                problems[f"missing:{f}"].add(i, _near_miss(row, f), where[i])
        answers.append(_answer_text(_field(row, "reward_model.ground_truth")))
    checked = [("unknown_prompt_chars", texts)]
    if "reward_model.ground_truth" in fields:  # a ground truth no response can write
        checked.append(("unknown_answer_chars", answers))
    for kind, column in checked:
        for i, chars in enumerate(unknown_characters(tokenizer, column)):
            if chars:
                problems[kind].add(i, f"{column[i]!r:.60}", where[i])
                problems[kind].chars.update(set(chars))
    if max_new_tokens is not None and "reward_model.ground_truth" in fields:
        over = _answers_over_budget(tokenizer, answers, max_new_tokens)
        if over:
            need = max(n for _, n in over)
            problems["answer_too_long"] = Problem(
                f"have a ground truth that does not fit in rollout.max_new_tokens={max_new_tokens} (its tokens plus "
                f"EOS: up to {need}), so no response can write it and stop",
                f"raise rollout.max_new_tokens to at least {need} (a response that reasons first needs more), or "
                "drop these rows")
            for i, n in over:
                problems["answer_too_long"].add(i, f"{answers[i]!r:.40} = {n} tokens with EOS", where[i])
    return DataReport(source, len(rows), {k: p for k, p in problems.items() if p.rows})


def _answers_over_budget(tokenizer, answers: Sequence[str], budget: int) -> list[tuple[int, int]]:
    """(row, tokens + EOS) of the non-empty answers longer than `budget` tokens with their EOS."""
    rows = [i for i, a in enumerate(answers) if a]
    if not rows:
        return []
    ids = tokenizer([answers[i] for i in rows], add_special_tokens=False)["input_ids"]
    return [(i, len(t) + 1) for i, t in zip(rows, ids) if len(t) + 1 > budget]


def _answer_text(gt: Any) -> str:
    return gt if isinstance(gt, str) else ("" if gt is None else str(gt))


def apply_policy(report: DataReport, policy: str, rows: Sequence[dict]) -> list[int]:
    """The indices of the rows to train on under `data.bad_row_policy=policy`; raises DataError for `error`."""
    assert policy in POLICIES, policy
    if not report.problems:
        return list(range(len(rows)))
    text = report.describe()
    if policy == "error":
        raise DataError(f"{text}\nFix the rows as said, or set data.bad_row_policy=skip (drop these rows) or "
                        "data.bad_row_policy=warn (train on them as they are).")
    drop = report.bad_rows if policy == "skip" else set(report.problems.get("no_prompt", Problem("", "")).rows)
    kept = [i for i in range(len(rows)) if i not in drop]
    action = f"dropped {len(drop)} rows" if drop else "training on the rows as they are"
    if policy == "warn" and drop:
        action += " without a prompt, training on the others as they are"
    print(f"megappo: warning: {text}\nmegappo: data.bad_row_policy={policy}: {action}.", flush=True)
    if not kept:
        raise DataError(f"no row of {report.source} is left to train on after data.bad_row_policy={policy}. Fix: "
                        "correct the rows as said above.")
    return kept


def check_data(rows: Sequence[dict], tokenizer, *, policy: str, prompt_key: str, reward_functions: Sequence[str],
               source: str, max_new_tokens: int | None = None, origins: Sequence[RowOrigin] | None = None
               ) -> tuple[list[dict], list[RowOrigin]]:
    """`check_rows` then `apply_policy`: (the rows to train on, their origins)."""
    origins = list(origins) if origins is not None else numbered(source, len(rows))
    report = check_rows(rows, tokenizer, prompt_key=prompt_key, reward_functions=reward_functions, source=source,
                        max_new_tokens=max_new_tokens, origins=origins)
    kept = apply_policy(report, policy, rows)
    return [rows[i] for i in kept], [origins[i] for i in kept]


def episode_input(row: dict, prompt_key: str = "prompt") -> str:
    """All an environment's episode receives of a row (megappo.envs.base.Episode, built by
    megappo.data.prompts.build_prompts: the prompt, reward_model.ground_truth, extra_info, data_source), as
    one string that is equal for two rows exactly when their episodes start alike."""
    return json.dumps([prompt_identity(row[prompt_key]), (row.get("reward_model") or {}).get("ground_truth"),
                       dict(row.get("extra_info") or {}), row.get("data_source", "unknown")], sort_keys=True,
                      default=str)


def _single_turn(env: str | None) -> bool:
    return env in (None, "single_turn")


def shared_prompts(train_rows: Sequence[dict], val_rows: Sequence[dict], *, prompt_key: str = "prompt",
                   env: str | None = None) -> tuple[list[int], list[str]]:
    """(validation row indices that repeat a training row, the distinct repeats' prompt texts in order).
    A repeat: the same prompt; with an environment (`env` = rollout.env, not single_turn), the same
    `episode_input` (prompt, ground truth, extra_info, data_source)."""
    def key_of(row: dict) -> str:
        return prompt_identity(row[prompt_key]) if _single_turn(env) else episode_input(row, prompt_key)

    seen = {key_of(row) for row in train_rows if row.get(prompt_key) not in (None, "", [])}
    shared, texts, distinct = [], [], set()
    for i, row in enumerate(val_rows):
        prompt = row.get(prompt_key)
        if prompt in (None, "", []):
            continue
        key = key_of(row)
        if key in seen:
            shared.append(i)
            if key not in distinct:
                distinct.add(key)
                texts.append(prompt_text(prompt) or prompt_identity(prompt))
    return shared, texts


def warn_shared_prompts(train_rows: Sequence[dict], val_rows: Sequence[dict], *, prompt_key: str = "prompt",
                        train_source: str = "the training data", val_source: str = "data.val_files",
                        env: str | None = None) -> str | None:
    """Print (and return) one warning line when validation rows repeat training rows (`shared_prompts`);
    None when none do."""
    shared, texts = shared_prompts(train_rows, val_rows, prompt_key=prompt_key, env=env)
    if not shared:
        return None
    examples = ", ".join(f"{t!r:.60}" for t in dict.fromkeys(texts[:EXAMPLES]))
    if _single_turn(env):
        what = (f"({len(texts)} distinct prompt{'s' if len(texts) != 1 else ''}) have a prompt that is also in "
                f"{train_source}")
        fix = f"remove these prompts from {val_source} (or from the training data)"
    else:
        what = (f"({len(texts)} distinct input{'s' if len(texts) != 1 else ''}) start the same episode as a row of "
                f"{train_source} (the same prompt, ground truth, extra_info and data_source: all rollout.env={env} "
                "receives)")
        fix = f"remove these rows from {val_source} (or from the training data)"
    line = (f"megappo: warning: {len(shared)} of {_rows(len(val_rows))} of {val_source} {what}, so val/score is not "
            f"a held-out measure; e.g. {examples}. Fix: {fix}.")
    print(line, flush=True)
    return line
