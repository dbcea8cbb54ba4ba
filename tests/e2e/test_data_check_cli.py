"""The start-up data check and the generation samples through `megappo train`, as a user meets them.

Rows with characters the built-in tokenizer does not know, a misspelled ground-truth key and an
empty prompt: by default (data.bad_row_policy=error) the run stops before any model is built
with the counts, examples and fixes; with `skip` it drops them, says so, and trains, showing
logging.samples examples per step under the step line (logging.console=full: every step's) and in
samples.jsonl.
"""

import json

from megappo.rewards import digit_successor
from tests.e2e.test_bad_inputs_cli import QUIET, SMALL, digit_rows, first_error, megappo, rows_file  # noqa: F401

BAD = [{"prompt": "What is 3+4?", "reward_model": {"ground_truth": "7"}},
       {"prompt": "2>", "reward_model": {"groundtruth": "3"}},
       {"prompt": "", "reward_model": {"ground_truth": "1"}}]


def test_bad_rows_are_refused_with_counts_before_any_model_is_built(tmp_path):
    code, out = megappo("parallel.tp=1", *SMALL, rows_file(tmp_path, digit_rows(8) + BAD),
                        f"run.output_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in out, out[-4000:]
    assert first_error(out) == f"megappo: error: data check of data.train_files ['{tmp_path}/train.jsonl'] (11 rows):"
    at = f"{tmp_path}/train.jsonl"  # the file's lines, as an editor shows them
    assert f"  1 of 11 rows have no prompt in 'prompt'; e.g. {at}:11: prompt=''. Fix: give every row a prompt" in out
    assert ("  1 of 11 rows have prompt characters the tokenizer does not know (encoded as '<pad>', so the model sees "
            "that instead): 6 distinct characters") in out
    assert f"e.g. {at}:9: 'What is 3+4?'. Fix: use a tokenizer that has them (model.tokenizer)" in out
    assert ("  1 of 11 rows lack reward_model.ground_truth, which reward function(s) ['digit_successor'] read (every "
            f"response would score 0); e.g. {at}:10: reward_model has 'groundtruth', not 'ground_truth'. Fix:") in out
    assert "or set data.bad_row_policy=skip (drop these rows) or data.bad_row_policy=warn" in out
    assert not (tmp_path / "run").exists()


def test_skip_drops_them_and_samples_show_each_step(tmp_path):
    run = tmp_path / "run"
    code, out = megappo("parallel.tp=1", *SMALL, rows_file(tmp_path, digit_rows(16) + BAD), "data.bad_row_policy=skip",
                        "logging.samples=2", "logging.console=full", "run.total_steps=2", f"run.output_dir={run}")
    assert code == 0, out[-4000:]
    assert f"megappo: warning: data check of data.train_files ['{tmp_path}/train.jsonl'] (19 rows):" in out
    assert "megappo: data.bad_row_policy=skip: dropped 3 rows." in out and "prompts=16 " in out
    lines = out.splitlines()
    for step in (1, 2):  # two samples under each step line
        at = next(i for i, line in enumerate(lines) if line.startswith(f"step {step}: "))
        assert all(line.startswith("  sample: '") and " | score " in line for line in lines[at + 1:at + 3]), lines[at:]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    for s in samples:  # each score is the reward of the response it is shown with
        assert s["prompt"][0].isdigit() and s["prompt"][1:] == ">" and s["data_source"] == "unknown"
        assert s["score"] == digit_successor(s["response"], s["ground_truth"], {})
        assert s["finish_reason"] in ("stop", "length") and 1 <= s["response_tokens"] <= 2
