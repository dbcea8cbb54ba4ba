"""Metric sinks, resume truncation, progress line and the curves plot."""

import json
import time

import pytest

from megappo.metrics.sinks import BudgetWatch, MetricLogger, Progress, plot_run, read_metrics


def test_jsonl_console_and_resume(tmp_path, capsys):
    log = MetricLogger(str(tmp_path), ["console", "jsonl"], console="full")
    for step in range(1, 5):
        log.log(step, {"critic/score/mean": step / 10, "actor/entropy": 1.0, "timing_s/gen": 0.5})
    log.close()
    assert "step 4: critic/score/mean=0.4 actor/entropy=1\n" in capsys.readouterr().out
    assert [json.loads(line)["actor/entropy"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [1.0] * 4  # the file has what the console does not show
    # resuming from the step-2 checkpoint drops the steps after it, then appends
    log = MetricLogger(str(tmp_path), ["jsonl"], resume_step=2)
    log.log(3, {"critic/score/mean": 0.9})
    log.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    assert read_metrics(str(tmp_path))[-1]["critic/score/mean"] == 0.9


def test_tensorboard_sink_and_resume(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard sink needs the tensorboard package (in .[test])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricLogger(str(tmp_path), ["tensorboard"])
    for step in range(1, 5):
        log.log(step, {"critic/score/mean": step / 10})
    log.close()
    log = MetricLogger(str(tmp_path), ["tensorboard"], resume_step=2)  # resumed from the step-2 checkpoint
    log.log(3, {"critic/score/mean": 0.9})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, round(e.value, 4)) for e in events.Scalars("critic/score/mean")]
    assert got == [(1, 0.1), (2, 0.2), (3, 0.9)]


def test_wandb_sink_keeps_one_run_across_resume(tmp_path, monkeypatch):
    """Offline W&B: the resumed logger reopens the same run id; the records hold the logged values."""
    pytest.importorskip("wandb", reason="the wandb sink needs the wandb package (in .[test])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricLogger(str(tmp_path), ["wandb"], run_name="demo", config={"seed": 7})
    for step in (1, 2, 3):
        log.log(step, {"actor/pg_loss": 0.125 * step})
    log.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    log = MetricLogger(str(tmp_path), ["wandb"], run_name="demo", resume_step=2)  # resumed from step 2
    for step in (3, 4):
        log.log(step, {"actor/pg_loss": 0.125 * step, "critic/vf_loss": 9.5})
    log.close()
    # each wandb.init writes offline-run-<time>-<id>/run-<id>.wandb; a second init in the same second gets
    # the directory name with "-1" appended (wandb 0.31), so the run id is read from the record file's name
    records = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    assert [p.name for p in records] == [f"run-{run_id}.wandb"] * 2, records
    # W&B's service may still be writing a run's records when finish() returns (seen under load): wait for them
    first, second = (_records(p, b"actor/pg_loss") for p in records)
    assert b"actor/pg_loss" in first and b"0.375" in first and b"critic/vf_loss" not in first
    assert b"critic/vf_loss" in second and b"0.5" in second


def _records(path, needle: bytes, timeout_s: float = 60.0) -> bytes:
    """The bytes of a W&B record file once `needle` is in it (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while needle not in (data := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return data


def test_unknown_sink():
    with pytest.raises(ValueError, match="unknown logging sink\\(s\\) \\['swanlab'\\]"):
        MetricLogger("/tmp/x", ["swanlab"])


def test_progress_line():
    line = Progress(total=10, enabled=False).update(4)
    assert line.startswith("[#########---------------] 4/10 steps") and "ETA" in line


def test_plot_writes_png(tmp_path):
    rows = [{"step": s, "critic/score/mean": s / 5, "actor/ppo_kl": 0.01, "actor/entropy": 2 - s / 10,
             "response_length/mean": 3, "timing_s/gen": 0.4} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = plot_run(str(tmp_path))
    assert out.endswith("curves.png") and (tmp_path / "curves.png").stat().st_size > 5000
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plot_run(str(tmp_path / "nope"))


def _steps_in_file(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_restart_before_the_first_checkpoint_logs_each_step_once(tmp_path):
    """A run stopped before its first checkpoint starts again at step 0 (resume_step=0): the
    earlier attempt's records go, instead of steps 0, 1, 2 being appended a second time."""
    log = MetricLogger(str(tmp_path), ["jsonl"])
    for step in range(4):  # validation at step 0, then three steps; killed before a checkpoint
        log.log(step, {"critic/score/mean": 0.1})
    log.close()
    log = MetricLogger(str(tmp_path), ["jsonl"], resume_step=0)
    for step in range(6):
        log.log(step, {"critic/score/mean": 0.5})
    log.close()
    assert _steps_in_file(tmp_path) == list(range(6))
    assert all(r["critic/score/mean"] == 0.5 for r in read_metrics(str(tmp_path)))


def test_resume_keeps_steps_up_to_the_checkpoint_once(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": i}) + "\n"
                                                    for i, s in enumerate([0, 1, 2, 0, 1, 2, 3, 4])))
    log = MetricLogger(str(tmp_path), ["jsonl"], resume_step=2)  # a file with repeats, resumed at step 2
    log.log(3, {"x": 9})
    log.close()
    assert _steps_in_file(tmp_path) == [0, 1, 2, 3]
    assert [r["x"] for r in read_metrics(str(tmp_path))] == [3, 4, 5, 9]  # the later record of a step


def test_plot_tolerates_repeated_steps(tmp_path, monkeypatch):
    """A metrics.jsonl written before the restart rule (steps 1-3 twice): `megappo plot` keeps the
    last record of each step, so the curve runs forward once."""
    rows = [{"step": s, "critic/score/mean": s / 10 + 0.5 * (i >= 3)} for i, s in enumerate([1, 2, 3, 1, 2, 3, 4])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 5, \"cri")
    assert [(r["step"], r["critic/score/mean"]) for r in read_metrics(str(tmp_path))] == [
        (1, 0.6), (2, 0.7), (3, 0.8), (4, 0.9)]  # the line cut short by a kill is skipped
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = []
    real_subplots = plt.subplots

    def spy(*a, **k):
        fig, axes = real_subplots(*a, **k)
        shown.append(axes.ravel()[0])  # the reward panel
        return fig, axes

    monkeypatch.setattr(plt, "subplots", spy)
    plot_run(str(tmp_path))
    assert list(shown[0].lines[0].get_xdata()) == [1, 2, 3, 4]


class _Stream:
    """A stream that says whether it is a terminal and keeps what was written."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_on_a_terminal_is_one_line_rewritten(tmp_path, capsys):
    from megappo.metrics.sinks import console

    stream = _Stream(tty=True)
    bar = Progress(total=4, stream=stream)
    log = MetricLogger(str(tmp_path), ["console"], progress=bar, console="full")
    for step in (1, 2):
        log.log(step, {"critic/score/mean": 0.5})
        bar.update(step)
    console("saved checkpoint x")
    bar.close()
    assert "\n" not in stream.text[:-1] and stream.text.endswith("\n")  # the bar never took a new line
    assert stream.text.count("\r[") >= 2 and "] 2/4 steps" in stream.text
    out = capsys.readouterr().out
    assert out.splitlines() == ["step 1: critic/score/mean=0.5", "step 2: critic/score/mean=0.5",
                                "saved checkpoint x"]  # no progress text in the step lines


def test_progress_in_a_log_file_is_part_of_the_step_line(tmp_path, capsys):
    stream = _Stream(tty=False)
    bar = Progress(total=4, stream=stream)
    log = MetricLogger(str(tmp_path), ["console"], progress=bar, console="full")
    log.log(0, {"val/score/mean": 0.1})  # validation before training: no progress yet
    for step in (1, 2):
        log.log(step, {"critic/score/mean": 0.5})
        bar.update(step)
    bar.close()
    assert stream.text == ""
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 0: val/score/mean=0.1"
    assert [line.split("  | ")[1].split("  ")[0] for line in lines[1:]] == ["1/4 steps", "2/4 steps"]
    alone = _Stream(tty=False)  # without the console sink the bar's text is its own line per step
    Progress(total=4, stream=alone).update(1)
    assert alone.text.startswith("[######------------------] 1/4 steps") and alone.text.endswith("\n")


def test_budget_watch_warns_once_when_every_response_keeps_ending_at_the_budget(capsys):
    watch = BudgetWatch(2, steps=3)
    ratios = [1.0, 1.0, 0.98, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # the demo's worst steps stay below 0.99
    said = [watch.observe(step, {"response_length/clip_ratio": r}) for step, r in enumerate(ratios, start=1)]
    assert [i for i, s in enumerate(said, start=1) if s] == [6]  # steps 4-6, once
    err = capsys.readouterr().err
    assert "steps 4-6: every response ended at the token budget rollout.max_new_tokens=2" in err
    assert "Fix: raise rollout.max_new_tokens" in err and err.count("warning") == 1


#: a PPO step's record: critic, a KL loss against the reference, a KL penalty in the reward
STEP = {"critic/score/mean": 0.41234, "critic/rewards/mean": 0.4, "actor/pg_loss": -0.0123456, "actor/ppo_kl": 0.002,
        "actor/entropy": 2.5, "critic/vf_loss": 0.08341, "actor/kl_loss": 0.00121, "actor/reward_kl_penalty": 0.5,
        "response_length/mean": 2.0, "timing_s/step": 1.5, "perf/throughput": 90.0, "timing_s/gen": 0.5}


@pytest.mark.parametrize("tty", [False, True])
def test_compact_line_has_step_score_losses_rate_and_eta(tmp_path, capsys, tty):
    """logging.console=compact (the default), in a log file and on a terminal (where the live bar is drawn too)."""
    stream = _Stream(tty=tty)
    bar = Progress(total=100, start=10, stream=stream)  # resumed at step 10
    log = MetricLogger(str(tmp_path), ["console"], progress=bar)
    log.log(10, {"val/score/mean": 0.25})  # (a resumed run does not validate first; the line has no rate yet)
    bar.update(11, 2.0)
    log.log(11, STEP)
    bar.update(12, 1.0)
    no_critic = {k: v for k, v in STEP.items() if not k.startswith("critic/vf") and k != "actor/kl_loss"}
    log.log(12, {**no_critic, "val/score/mean": 0.5, "actor/skipped_steps": 1.0})
    bar.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 10/100: val=0.25",
        "step 11/100: score=0.4123 pg_loss=-0.01235 vf_loss=0.08341 kl=0.00121 | 2.0 s/step  ETA 2m58s",
        # no critic: no vf_loss; the KL in the reward when there is no KL loss; validation; a skipped update
        "step 12/100: score=0.4123 val=0.5 pg_loss=-0.01235 kl=0.5 | 1.5 s/step  ETA 2m12s | SKIPPED updates "
        "(actor/skipped_steps): non-finite loss or gradients"]
    assert ("] 12/100 steps  1.5 s/step  ETA 2m12s" in stream.text) == tty  # the bar, on a terminal only
    bare = MetricLogger(str(tmp_path), ["console"])  # without a progress bar: the step alone
    bare.log(3, {"actor/pg_loss": 0.5, "critic/score/mean": 1.0, "actor/ppo_kl": 0.1})
    assert capsys.readouterr().out == "step 3: score=1 pg_loss=0.5\n"


def test_compact_and_full_lines_show_what_they_say(tmp_path, capsys):
    """The compact line is shorter and its values are the full line's metrics; each mode is chosen by name."""
    from megappo.metrics.sinks import COMPACT_FIELDS, CONSOLE_KEYS, compact_line, full_line

    bar = Progress(total=100, enabled=False)
    bar.update(1, 1.0)
    compact, full = compact_line(1, STEP, bar), full_line(1, STEP, bar)
    assert len(compact) < len(full) / 2, (compact, full)
    assert full == "step 1: " + " ".join(f"{k}={STEP[k]:.4g}" for k in CONSOLE_KEYS if k in STEP)
    values = dict(item.split("=") for item in compact.split(": ", 1)[1].split(" | ")[0].split())
    assert values == {label: f"{STEP[keys[0]]:.4g}" for label, keys in COMPACT_FIELDS if keys[0] in STEP}
    with pytest.raises(AssertionError):
        MetricLogger(str(tmp_path), ["console"], console="verbose")


def test_the_done_line_says_the_runs_total_after_a_resume():
    from megappo.cli import done_line

    history = [{"critic/score/mean": 0.5}] * 68 + [{"critic/score/mean": 0.98}]
    assert done_line(history * 2, 0, 138, "runs/x", "runs/x/curves.png") == (  # a run from step 0
        "done: 138 steps, final critic/score/mean=0.980; metrics in runs/x/metrics.jsonl, curves in runs/x/curves.png")
    assert done_line(history, 31, 100, "runs/x", "runs/x/curves.png") == (
        "done: 69 steps this launch (100 of 100 in the run), final critic/score/mean=0.980; metrics in "
        "runs/x/metrics.jsonl, curves in runs/x/curves.png")


def test_a_steps_data_metrics_are_verls_with_max_and_min():
    """verl's compute_data_metrics: scores, rewards, advantages, returns and values with mean / max / min over
    the response tokens, response and prompt lengths with their clip ratios; NaN where there are none;
    resume_step=None (run.val_only's log) keeps every record."""
    import types

    import torch

    from megappo.trainer.step import rollout_metrics, spread
    from megappo.types import RolloutBatch

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = RolloutBatch(prompt_ids=torch.zeros(2, 4, dtype=torch.long), prompt_mask=torch.tensor([[0, 1, 1, 1],
                                                                                                    [1, 1, 1, 1]]),
                         response_ids=torch.zeros(2, 3, dtype=torch.long), response_mask=mask,
                         rollout_log_probs=torch.zeros(2, 3), finish_reasons=["stop", "length"],
                         prompt_index=torch.tensor([0, 1]))
    exp = types.SimpleNamespace(advantages=torch.tensor([[0.5, -1.0, 9.0], [2.0, 9.0, 9.0]]),
                                returns=torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]), values=None)
    m = rollout_metrics(batch, torch.tensor([1.0, 0.0]), exp, None, max_prompt_length=4)
    assert (m["critic/advantages/max"], m["critic/advantages/min"], m["critic/advantages/mean"]) == (2.0, -1.0, 0.5)
    assert (m["critic/returns/max"], m["critic/returns/min"]) == (3.0, 1.0) and "critic/values/max" not in m
    assert (m["response_length/max"], m["response_length/min"], m["response_length/mean"]) == (2.0, 1.0, 1.5)
    assert (m["prompt_length/max"], m["prompt_length/min"], m["prompt_length/clip_ratio"]) == (4.0, 3.0, 0.5)
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, 0.0)
    assert all(v != v for v in spread("critic/values", torch.zeros(0)).values())  # NaN: nothing to describe


def test_a_logger_that_keeps_every_record(tmp_path):
    for step in (4, 2):  # run.val_only at step 4, then at step 2: both rows stay
        log = MetricLogger(str(tmp_path), ["jsonl"], resume_step=None)
        log.log(step, {"val/score/mean": step / 10})
        log.close()
    assert [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [4, 2]


def test_the_reward_curves_show_each_data_source_when_there_are_several():
    from megappo.metrics.sinks import PLOT_PANELS, plot_panels

    one = [{"step": 0, "val-core/openai/gsm8k/acc/mean@4": 0.5, "val-core/openai/gsm8k/acc/best@4/mean": 0.7}]
    assert plot_panels(one) == PLOT_PANELS  # one source: val/score/mean says it
    two = [dict(one[0], **{"val-core/aime/acc/mean@4": 0.1})]
    reward = dict(plot_panels(two))["reward"]
    assert reward == ("critic/score/mean", "val/score/mean", "val-core/aime/acc/mean@4",
                      "val-core/openai/gsm8k/acc/mean@4")


def _dapo_rows(steps=4):
    """Rows as a DAPO run logs them: training steps with filter_groups/* metrics, validations without."""
    rows = [{"step": 0, "val/score/mean": 0.1}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "critic/score/mean": s / 10, "actor/pg_loss": -0.01 * s, "actor/entropy": 1.0,
                     "filter_groups/kept_fraction": 0.5, "filter_groups/hit_limit": float(s % 2),
                     "filter_groups/generated_score_mean": 0.2, "filter_groups/kept_groups": 16.0,
                     "train/num_gen_batches": 2.0})
    return rows


def test_the_default_plot_has_a_dynamic_sampling_panel_when_the_run_sampled_dynamically():
    from megappo.metrics.sinks import DYNAMIC_SAMPLING_PANEL, PLOT_PANELS, plot_panels

    assert plot_panels(_dapo_rows()) == PLOT_PANELS + (DYNAMIC_SAMPLING_PANEL,)
    assert all(k in _dapo_rows()[1] for k in DYNAMIC_SAMPLING_PANEL[1])  # metrics dynamic sampling logs
    plain = [{k: v for k, v in r.items() if not k.startswith("filter_groups/")} for r in _dapo_rows()]
    assert plot_panels(plain) == PLOT_PANELS


def test_plot_metrics_globs_choose_one_panel_per_metric_in_the_order_given():
    from megappo.errors import ConfigError
    from megappo.metrics.sinks import plot_panels

    rows = _dapo_rows()
    assert [t for t, _ in plot_panels(rows, ["filter_groups/*"])] == [
        "filter_groups/generated_score_mean", "filter_groups/hit_limit", "filter_groups/kept_fraction",
        "filter_groups/kept_groups"]
    chosen = plot_panels(rows, ["actor/pg_loss", "filter_groups/kept_*", "actor/*"])  # a metric once
    assert chosen == (("actor/pg_loss", ("actor/pg_loss",)), ("filter_groups/kept_fraction", ("filter_groups/kept_fraction",)),
                      ("filter_groups/kept_groups", ("filter_groups/kept_groups",)), ("actor/entropy", ("actor/entropy",)))
    with pytest.raises(ConfigError, match=r"--metrics 'rollout_corr/\*' matches no metric of this run\. Fix: .*"
                                          r"this run has: actor/\*, critic/\*, filter_groups/\*, train/\*, val/\*"):
        plot_panels(rows, ["rollout_corr/*"])


def test_megappo_plot_metrics_writes_the_chosen_panels(tmp_path, monkeypatch):
    """`megappo plot RUN --metrics A,B --metrics C --out F`: the patterns of both options, one axis each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megappo.cli import main

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _dapo_rows()))
    drawn = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *a, **k):
        drawn.append([(ax.get_title(), [line.get_label() for line in ax.lines]) for ax in fig.axes if ax.get_visible()])
        return real_savefig(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    out = tmp_path / "ds.png"
    assert main(["plot", str(tmp_path), "--metrics", "filter_groups/hit_limit, train/*", "--metrics", "actor/pg_loss",
                 "--out", str(out)]) == 0
    assert out.stat().st_size > 5000 and not (tmp_path / "curves.png").exists()
    assert drawn == [[("filter_groups/hit_limit", ["filter_groups/hit_limit"]),
                      ("train/num_gen_batches", ["train/num_gen_batches"]), ("actor/pg_loss", ["actor/pg_loss"])]]
    assert main(["plot", str(tmp_path)]) == 0  # the default plot: the standard panels and dynamic sampling's
    assert [t for t, _ in drawn[1]][-1] == "dynamic sampling" and len(drawn[1]) == 6
    assert main(["plot", str(tmp_path), "--metrics", "nothing/*"]) == 2
