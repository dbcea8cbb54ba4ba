"""Writes the tiny verl-layout parquet files the GPU recipes' data keys name, for
tests/e2e/test_gpu_recipes.py: data/gsm8k/{train,test}.parquet (rows as verl's
examples/data_preprocess/gsm8k.py writes them: the question with verl's "####" instruction as a
chat message, the answer in reward_model.ground_truth) and data/math/{train,test}.parquet (as
its math_dataset.py writes them: the \\boxed{} instruction, the answer in
reward_model.ground_truth). The questions are one-digit sums, so a tiny model can write an
answer the recipes' reward functions (gsm8k, math_boxed) score.

Run from the repository root to regenerate them: `python tests/data/make_recipe_data.py`. The
output is deterministic (no randomness, fixed row order).

This script does not know about megappo; it needs pyarrow only.
"""

import os

import pyarrow as pa
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.abspath(__file__))
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."  # verl's math_dataset.py
#: (a, b) per row: the training and test questions are different sums
SUMS = {"train": [(1, 2), (3, 4), (2, 5), (6, 1), (4, 4), (0, 3), (5, 2), (1, 7)],
        "test": [(2, 2), (3, 5), (6, 0), (1, 4)]}


def gsm8k_row(split: str, index: int, a: int, b: int) -> dict:
    question = f"Tom has {a} apples and gets {b} more. How many apples does he have?"
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "question": question,
                           "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}}


def math_row(split: str, index: int, a: int, b: int) -> dict:
    question = f"What is ${a} + {b}$?"
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": f"{question} {MATH_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index}}


def main() -> None:
    for name, row in (("gsm8k", gsm8k_row), ("math", math_row)):
        os.makedirs(os.path.join(HERE, name), exist_ok=True)
        for split, sums in SUMS.items():
            rows = [row(split, i, a, b) for i, (a, b) in enumerate(sums)]
            pq.write_table(pa.Table.from_pylist(rows), os.path.join(HERE, name, f"{split}.parquet"))


if __name__ == "__main__":
    main()
