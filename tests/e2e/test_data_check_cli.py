"""The start-up data check and the generation samples through `megappo train`, as a user meets them.

Rows with characters the built-in tokenizer does not know, a misspelled ground-truth key and an
empty prompt: by default (data.bad_row_policy=error) the run stops before any model is built
with the counts, examples and fixes.
"""

from tests.e2e.test_bad_inputs_cli import QUIET, SMALL, digit_rows, first_error, megappo, rows_file  # noqa: F401

BAD = [{"prompt": "What is 3+4?", "reward_model": {"ground_truth": "7"}},
       {"prompt": "2>", "reward_model": {"groundtruth": "3"}},
       {"prompt": "", "reward_model": {"ground_truth": "1"}}]


def test_bad_rows_are_refused_with_counts_before_any_model_is_built(tmp_path):
    code, out = megappo("parallel.tp=1", *SMALL, rows_file(tmp_path, digit_rows(8) + BAD),
                        f"run.output_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in out, out[-4000:]
    assert first_error(out) == f"megappo: error: data check of data.train_files ['{tmp_path}/train.jsonl'] (11 rows):"
    assert "  1 of 11 rows have no prompt in 'prompt'; e.g. row 10: prompt=''. Fix: give every row a prompt" in out
    assert ("  1 of 11 rows have prompt characters the tokenizer does not know (encoded as '<pad>', so the model sees "
            "that instead): 6 distinct characters") in out
    assert "e.g. row 8: 'What is 3+4?'. Fix: use a tokenizer that has them (model.tokenizer)" in out
    assert ("  1 of 11 rows lack reward_model.ground_truth, which reward function(s) ['digit_successor'] read (every "
            "response would score 0); e.g. row 9: reward_model has 'groundtruth', not 'ground_truth'. Fix:") in out
    assert "or set data.bad_row_policy=skip (drop these rows) or data.bad_row_policy=warn" in out
    assert not (tmp_path / "run").exists()
