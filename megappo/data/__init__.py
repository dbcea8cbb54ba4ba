"""Data: the prompts a run trains and validates on, and the tokenizer that reads them.

  tokenizer  HF tokenizers, the built-in character tokenizer, chat-template ids
  prompts    prompt datasets (JSONL / Parquet in verl's layout, built-in sources, your dataset
             class), the long-prompt policy, the epoch sampler with its resumable cursor

What a prompt scores is `megappo.rewards`'; the start-up check of the rows against the reward
functions is `megappo.trainer.data_check`'s. `megappo.data.prompts` also names what `prompts` defines
(`from megappo.data.prompts import load_rows`), as it did when it was one module.
"""

from megappo.data.prompts import (  # noqa: F401 - the package's names, as before the split
    NOT_HELD_OUT, VAL_DRAWS_PER_ROW, ClassOrder, DataError, PromptExample, PromptSampler, RowKind, RowOrigin,
    build_prompts, builtin_rows, builtin_splits, check_files, class_rows, code_expression_rows, dataset_class,
    digit_successor_rows, load_rows, lookup_rows, numbered, prompt_identity, random_policy_score, read_rows,
    reasoning_gym_rows, render_prompt, sampler_class,
)
