"""Every optional package a configured integration needs is checked before any rank starts
(megappo.trainer.preflight.check_packages): `megappo train` in this process returns 2 after one
`megappo: error:` line naming the setting and its pip command, and writes nothing (no output
directory, no lock). A package that is installed here is made "missing" by pointing its PACKAGES
entry at a module that does not exist; the check itself (find_spec) is the real one."""

import importlib.util
import pathlib

import pytest

from megappo import cli

from megappo.trainer import preflight

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes" / "demo-cpu.yaml")
ABSENT = "megappo_test_no_such_package"


def missing(monkeypatch, setting, value):
    module, pip, instead = preflight.PACKAGES[setting, value]
    monkeypatch.setitem(preflight.PACKAGES, (setting, value), (ABSENT, pip, instead))
    assert importlib.util.find_spec(ABSENT) is None


def refused(tmp_path, capsys, *args) -> str:
    out = tmp_path / "run"
    code = cli.main(["train", DEMO, f"run.output_dir={out}", f"checkpoint.dir={tmp_path / 'ckpt'}", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not out.exists() and not (tmp_path / "ckpt").exists(), f"written before the error: {err}"
    assert err.count("\n") == 1 and err.startswith("megappo: error: "), err
    return err.strip()


@pytest.mark.parametrize("spelling, sinks", [("logging.sinks=[console,wandb]", "console,wandb"),
                                             ('trainer.logger=["console","wandb"]', "console,wandb,jsonl")])
def test_a_missing_sink_package_is_one_line_with_its_pip_command(tmp_path, capsys, monkeypatch, spelling, sinks):
    """verl's trainer.logger (read as logging.sinks, with megappo's metrics.jsonl kept) too."""
    missing(monkeypatch, "logging.sinks", "wandb")
    assert refused(tmp_path, capsys, spelling) == (
        f"megappo: error: logging.sinks=[{sinks}] needs the wandb package, which is not installed. "
        "Fix: pip install wandb (or remove wandb from logging.sinks / trainer.logger).")


def test_tensorboard_sink(tmp_path, capsys, monkeypatch):
    missing(monkeypatch, "logging.sinks", "tensorboard")
    assert "Fix: pip install tensorboard (or remove tensorboard from logging.sinks" in refused(
        tmp_path, capsys, "logging.sinks=[console,jsonl,tensorboard]")


def test_ray_launcher(tmp_path, capsys, monkeypatch):
    missing(monkeypatch, "--launcher", "ray")
    assert refused(tmp_path, capsys, "--launcher", "ray").endswith(
        "--launcher ray needs the ray package, which is not installed. "
        "Fix: pip install -e '.[ray]' (or pip install ray) (or launch without --launcher ray).")


def test_sglang_engine(tmp_path, capsys, monkeypatch):
    missing(monkeypatch, "rollout.engine", "sglang")
    assert "rollout.engine=sglang needs the sglang package, which is not installed. Fix: " \
        "pip install -e '.[gpu]' on a GPU machine" in refused(tmp_path, capsys, "rollout.engine=sglang")


def test_installed_packages_pass_and_unused_ones_are_not_asked_for(monkeypatch):
    """A sink that is not configured is not checked; one whose package is installed passes."""
    from megappo.config import load_config

    cfg = load_config(DEMO, ["logging.sinks=[console,jsonl]"])
    for key in list(preflight.PACKAGES):
        missing(monkeypatch, *key)
    preflight.check_packages(cfg)  # nothing configured needs a package
    monkeypatch.setitem(preflight.PACKAGES, ("logging.sinks", "jsonl"), ("json", "pip install json", "-"))
    preflight.check_packages(cfg)  # json is installed
    monkeypatch.setitem(preflight.PACKAGES, ("logging.sinks", "jsonl"), (ABSENT, "pip install x", "-"))
    with pytest.raises(preflight.ConfigError, match="logging.sinks=\\[console,jsonl\\] needs the"):
        preflight.check_packages(cfg)

