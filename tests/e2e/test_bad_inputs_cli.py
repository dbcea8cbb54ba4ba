"""The bad-input catalogue, second half: the cases that need ranks, the tokenizer or the loop.

`megappo train` on the CPU demo recipe, as a user runs it. Bad dataset rows and a tokenizer
larger than the model are refused before any model is built (by the launching process before
any rank starts when there are several; by rank 0 in a world of one): exit 2, one
`megappo: error:` line that says the fix, no output directory. An error in the user's own reward
function ends the run with one message naming it and the row, last (exit 4). Failures on the way
(tests/e2e/_faults.py injects them into the real CLI) exit 1 with a message and no
traceback: non-finite losses are skipped and counted, then abort past run.max_nan_skips; a
weight-sync fingerprint mismatch stops the run at the first sync; a rank that hangs makes the
waiting rank's collective time out with a message naming that rank, its layout and the stage.
The cases refused before any rank starts are in tests/unit/test_bad_inputs.py.
"""

import json
import os
import sys

import pytest

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(REPO, "tests", "e2e", "_faults.py")
QUIET = ["logging.progress_bar=false", "run.val_before_train=false", "run.val_every=0"]
SMALL = ["data.builtin=null", "data.train_batch_size=8", *(f"{role}.{key}=8" for role in ("actor", "critic")
                                                           for key in ("ppo_mini_batch_size", "micro_batch_size"))]


def megappo(*args: str, fault: str | None = None, pythonpath: str = REPO) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    cmd = [FAULTS, fault] if fault else ["-m", "megappo.cli"]
    proc = prefork.run([sys.executable, *cmd, "train", "recipes/demo-cpu.yaml", *QUIET, *args], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def rows_file(tmp_path, rows) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"data.train_files=[{path}]"


def digit_rows(n, prompt=lambda d: f"{d}>"):
    return [{"prompt": prompt(i % 10), "reward_model": {"ground_truth": str((i + 1) % 10)}} for i in range(n)]


def first_error(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("megappo: error: "))


def test_row_without_prompt_on_two_ranks(tmp_path):
    """Two ranks: the launching process checks every row before it starts them, so the data
    check's error is the only one (no rank starts, none is reported failed or lost)."""
    rows = digit_rows(8)
    rows[3] = {"question": "3>", "reward_model": {"ground_truth": "4"}}
    code, out = megappo(*SMALL, rows_file(tmp_path, rows), f"run.output_dir={tmp_path / 'run'}")
    assert code == 2, out[-4000:]
    assert first_error(out) == f"megappo: error: data check of data.train_files ['{tmp_path}/train.jsonl'] (8 rows):"
    assert (f"  1 of 8 rows have no prompt in 'prompt'; e.g. {tmp_path}/train.jsonl:4: keys ['question', 'reward_model'] "
            "(data.prompt_key=question?). Fix: give every row a prompt") in out
    assert out.rstrip().splitlines()[-1].startswith("Fix the rows as said, or set data.bad_row_policy=skip"), out
    assert "rank" not in out and "Traceback" not in out and not (tmp_path / "run").exists()


REWARD_THAT_RAISES = """
def score(response, ground_truth, extra):
    if ground_truth == "7":
        raise ValueError("no scorer for 7 yet")
    return 0.0
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_the_users_reward_function_is_the_one_message(tmp_path, workers):
    """Two ranks; the user's reward function raises on the row whose answer is 7 (line 7 of the file): its
    own traceback, then one message naming the function, the row (file:line, training) and its prompt, last on the screen; the other
    rank exits quietly with it (no lost connection), the launcher adds nothing and does not
    restart although run.max_restarts allows it. The same when reward workers called it (reward.num_workers)."""
    (tmp_path / "my_reward.py").write_text(REWARD_THAT_RAISES)
    run = tmp_path / "run"
    code, out = megappo(*SMALL, rows_file(tmp_path, digit_rows(8)), f"reward.functions=[{tmp_path}/my_reward.py:score]",
                        "run.max_restarts=1", f"run.output_dir={run}", f"reward.num_workers={workers}")
    assert code == 4, out[-4000:]
    assert out.rstrip().splitlines()[-1] == (
        f"megappo: error: reward function '{tmp_path}/my_reward.py:score' raised ValueError: no scorer for 7 yet on "
        f"{tmp_path}/train.jsonl:7 (training row, prompt '6>'). Fix: correct that code (its traceback is above).")
    traceback = out[out.index("Traceback (most recent call last):"):]
    assert f'File "{tmp_path}/my_reward.py", line 4, in score' in traceback and "megappo/" not in traceback
    assert "lost its connection" not in out and "failed (exited" not in out and "restart" not in out
    assert out.count("megappo: error:") == 1 and not (run / "restarts.jsonl").exists()


REWARD_THAT_RETURNS_NAN = """
def score(response, ground_truth, extra):
    return float("nan") if ground_truth == "4" else 0.0
"""


def test_a_nan_from_the_users_reward_function_is_the_one_message(tmp_path):
    """Two ranks; the user's reward function returns NaN on the row whose answer is 4 (line 4):
    refused at once (reward.bad_value_policy=error) with one message naming it and the row, last,
    exit 4; no step is trained on it."""
    (tmp_path / "my_reward.py").write_text(REWARD_THAT_RETURNS_NAN)
    run = tmp_path / "run"
    code, out = megappo(*SMALL, rows_file(tmp_path, digit_rows(8)), f"reward.functions=[{tmp_path}/my_reward.py:score]",
                        f"run.output_dir={run}")
    assert code == 4, out[-4000:]
    assert out.rstrip().splitlines()[-1] == (
        f"megappo: error: reward function '{tmp_path}/my_reward.py:score' returned nan, not a finite number on "
        f"{tmp_path}/train.jsonl:4 (training row, prompt '3>'). "
        "Fix: return a finite float, or set reward.bad_value_policy=warn to score such responses 0.")
    assert out.count("megappo: error:") == 1 and "Traceback" not in out and "failed (exited" not in out
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()


REFUSED_IN_RANK = {
    "long prompt, policy error": (["data.long_prompt_policy=error", "data.max_prompt_length=3"],
                                  "prompt has 6 tokens > data.max_prompt_length=3. Fix: raise data.max_prompt_length"),
    "every prompt too long, policy skip": (["data.max_prompt_length=3"],
                                           "every prompt of ['{tmp}/train.jsonl'] is longer than data.max_prompt_length"
                                           "=3 (longest: 6 tokens; {{'skipped_long': 8, 'truncated_long': 0}}). Fix:"),
    "tokenizer vocab > model vocab": (["model.hf_config.vocab_size=16"],
                                      "the tokenizer has 19 tokens but the model's vocab_size is 16"),
}


@pytest.mark.one_process  # refused by rank 0 of a world of one (tests/conftest.py)
@pytest.mark.parametrize("case", list(REFUSED_IN_RANK))
def test_refused_before_any_model_is_built(tmp_path, case):
    overrides, needle = REFUSED_IN_RANK[case]
    data = rows_file(tmp_path, digit_rows(8, prompt=lambda d: f"{d}>{d}>{d}>"))
    code, out = megappo("parallel.tp=1", *SMALL, data, *overrides, f"run.output_dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in out, out[-4000:]
    assert needle.format(tmp=tmp_path) in first_error(out)
    assert not (tmp_path / "run").exists()


def test_non_finite_losses_are_skipped_counted_then_abort(tmp_path):
    """Every reward is NaN: each step's updates are skipped (no weight changes) and counted;
    past run.max_nan_skips=1 the run stops, before any checkpoint of it is written. The long
    prompts of the data are truncated and counted on the way in."""
    rows = digit_rows(12) + digit_rows(4, prompt=lambda d: f"{d}>{d}>{d}>")
    run = tmp_path / "run"
    code, out = megappo("parallel.tp=1", *SMALL, rows_file(tmp_path, rows), "data.max_prompt_length=3",
                        "data.long_prompt_policy=truncate", "reward.functions=[nan]", "run.max_nan_skips=1",
                        "checkpoint.save_every=1", f"run.output_dir={run}", fault="nan_reward")
    assert code == 1 and "Traceback" not in out, out[-4000:]
    assert "prompts=16 (4 truncated: longer than data.max_prompt_length=3) |" in out
    assert first_error(out) == ("megappo: error: 2 steps had non-finite losses or gradients (> run.max_nan_skips=1). "
                                "Fix: lower actor.optim.lr / critic.optim.lr, look for NaN or inf in the rewards and "
                                "data, or raise run.max_nan_skips.")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["actor/skipped_steps"], m["critic/skipped_steps"]) for m in metrics] == [(1, 1, 1), (2, 1, 1)]
    assert out.count("SKIPPED updates (actor/skipped_steps, critic/skipped_steps)") == 2
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())  # step 1 (nothing learned yet), not step 2
    assert ckpts == ["latest", "step_00000001"]


def test_weight_sync_mismatch_stops_at_the_first_sync(tmp_path):
    run = tmp_path / "run"
    code, out = megappo("parallel.tp=1", f"run.output_dir={run}", fault="corrupt_sync")
    assert code == 1 and "Traceback" not in out, out[-4000:]
    assert first_error(out).startswith("megappo: error: weight sync verification failed for 1 tensor(s), e.g. "
                                       "['model.embed_tokens.weight']: the engine holds different weights")
    assert "Fix: " in first_error(out) and not (run / "metrics.jsonl").read_text()
    assert not (run / "checkpoints").exists()


@pytest.mark.alone  # the healthy rank's deadline is 9 s (tests/conftest.py)
def test_a_hung_rank_times_out_the_other_with_rank_and_stage(tmp_path):
    """Rank 0 hangs in generation; rank 1, waiting for the batch, gives up after
    parallel.timeout_minutes (9 s here) and says where; the launcher stops rank 0."""
    run = tmp_path / "run"
    code, out = megappo("parallel.timeout_minutes=0.15", f"run.output_dir={run}", fault="stall_rank0")
    assert code == 3, out[-4000:]
    assert first_error(out).startswith(
        "megappo: error: rank 1 (tp_rank 1, pp_rank 0, dp_rank 0) timed out after 9 s in stage 'gen' waiting for "
        "a collective; another rank probably crashed or hangs: check its log. Fix: ")
    assert "megappo: rank 1 failed (exited with code 3); the other ranks were stopped." in out
    assert "Traceback" not in out and not (run / "checkpoints").exists()
