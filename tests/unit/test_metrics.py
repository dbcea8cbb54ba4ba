"""Metric sinks, resume truncation, progress line and the curves plot."""

import json

import pytest

from megappo.metrics import MetricLogger, Progress, plot_run, read_metrics


def test_jsonl_console_and_resume(tmp_path, capsys):
    log = MetricLogger(str(tmp_path), ["console", "jsonl"])
    for step in range(1, 5):
        log.log(step, {"critic/score/mean": step / 10, "actor/entropy": 1.0, "timing_s/gen": 0.5})
    log.close()
    assert "step 4: critic/score/mean=0.4 actor/entropy=1" in capsys.readouterr().out
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


def test_unknown_sink():
    with pytest.raises(ValueError, match="unknown logging sink\\(s\\) \\['mlflow'\\]"):
        MetricLogger("/tmp/x", ["mlflow"])


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
