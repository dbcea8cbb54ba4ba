"""The mlflow sink (logging.sinks mlflow; verl's trainer.logger=[console,mlflow]) against MLflow's local file
store: one run per megappo run across a resume, the config as parameters, every metric at its step under the
name MLflow allows, read back through MLflow's own client."""

import pytest

from megappo.metrics.sinks import MetricLogger, mlflow_key

mlflow = pytest.importorskip("mlflow", reason="the mlflow sink needs the mlflow package (mlflow-skinny, in .[test])")


def test_metric_names_are_spelled_as_mlflow_allows():
    assert mlflow_key("val-core/gsm8k/acc/mean@4") == "val-core/gsm8k/acc/mean_at_4"  # verl's mlflow spelling
    assert mlflow_key("actor/pg_loss") == "actor/pg_loss"
    assert mlflow_key("timing_s//gen (s)+x") == "timing_s/gen _s__x"
    assert mlflow_key("perf/mfu/actor:fwd.bwd-1") == "perf/mfu/actor:fwd.bwd-1"


def test_mlflow_sink_logs_one_run_across_a_resume(tmp_path, monkeypatch):
    # MLflow >= 3.10 keeps its file store for those who opt in (its own variable); a server or sqlite needs no opt-in
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    run_dir = str(tmp_path / "run")
    config = {"actor": {"optim": {"lr": 1e-6}}, "logging": {"sinks": ["console", "mlflow"]}}
    log = MetricLogger(run_dir, ["mlflow"], project="verl_grpo", run_name="demo", config=config, mlflow_uri=uri)
    for step in (1, 2, 3):
        log.log(step, {"actor/pg_loss": -0.1 * step, "val-core/gsm8k/acc/mean@4": 0.25 * step})
    log.close()  # stopped after step 3; its checkpoint is step 2's
    log = MetricLogger(run_dir, ["mlflow"], project="verl_grpo", run_name="demo", config=config, mlflow_uri=uri,
                       resume_step=2)
    log.log(3, {"actor/pg_loss": -0.3, "val-core/gsm8k/acc/mean@4": 0.75})
    log.log(4, {"actor/pg_loss": -0.4, "val-core/gsm8k/acc/mean@4": 1.0})
    log.close()

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("verl_grpo")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == (tmp_path / "run" / "mlflow_run_id").read_text()
    assert (run.info.run_name, run.info.status) == ("demo", "FINISHED")
    assert run.data.params == {"actor.optim.lr": "1e-06", "logging.sinks": '["console", "mlflow"]'}
    history = client.get_metric_history(run.info.run_id, "val-core/gsm8k/acc/mean_at_4")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75), (3, 0.75), (4, 1.0)]
    assert run.data.metrics == {"actor/pg_loss": pytest.approx(-0.4), "val-core/gsm8k/acc/mean_at_4": 1.0}
    MetricLogger(str(tmp_path / "run2"), ["mlflow"], project="verl_grpo", mlflow_uri=uri).close()
    assert {r.info.run_name for r in client.search_runs([experiment.experiment_id])} == {"demo", "run2"}
