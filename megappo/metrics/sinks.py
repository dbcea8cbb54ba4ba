"""Metric sinks (console, JSONL, TensorBoard, W&B, MLflow), the progress line, and `megappo plot`.

Metric names follow verl's namespaces (`actor/pg_loss`, `critic/vf_loss`,
`critic/score/mean`, `timing_s/gen`, `perf/throughput`, ...). Only global rank 0 logs. MLflow's
names spell `@` as `_at_` and any other character it does not allow as `_` (`mlflow_key`, as verl's
mlflow logger does).
`MetricLogger(run_dir, sinks, resume_step=N)` writes one JSON object per step to
`run_dir/metrics.jsonl` and to the other sinks; on opening it keeps only the records of steps
<= N (the checkpoint a run resumes from; none for a run that starts at step 0, even when an
earlier attempt stopped before its first checkpoint), so every step is in the file once;
`resume_step=None` keeps every record (run.val_only's log of one validation per start).
`read_metrics` keeps the last record of a step should a file still hold repeats (one written
before that rule). A step's generation samples (`add_samples`, records from
megappo.metrics.sample_log) are printed under its console line (`console="compact"`: those of step 1 and of
every COMPACT_SAMPLES_EVERY-th step) and written to `run_dir/samples.jsonl` (with the jsonl sink),
cut back on resume like metrics.jsonl. The console's step line is `compact_line` (the default: step,
score, the main losses, s/step and ETA) or `full_line` (CONSOLE_KEYS; logging.console=full).
`Progress` is the bar with the ETA; `BudgetWatch` warns once when every response keeps ending at the token budget; `plot_run(run_dir)` draws reward, KL, entropy, response length and timing curves (and dynamic sampling's, when the run has them) from metrics.jsonl into `run_dir/curves.png`; `plot_panels` chooses the panels, those of `megappo plot --metrics GLOB` too.

This module does not know about models, PPO math or process groups.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import sys
import time
import uuid
from typing import Iterable, Mapping, Sequence

from megappo.errors import ConfigError

SINKS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")

#: what the console shows each step with logging.console=full (the JSONL file has everything)
CONSOLE_KEYS = (
    "critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy",
    "critic/vf_loss", "response_length/mean", "timing_s/step", "perf/throughput", "val/score/mean",
)

#: logging.console=compact: (label, the metrics it shows, the first one logged) in the step line
COMPACT_FIELDS = (
    ("score", ("critic/score/mean",)), ("val", ("val/score/mean",)), ("pg_loss", ("actor/pg_loss",)),
    ("vf_loss", ("critic/vf_loss",)), ("kl", ("actor/kl_loss", "actor/reward_kl_penalty")),
)
CONSOLE_MODES = ("compact", "full")
#: logging.console=compact prints the samples of step 1 and of every this-many-th step (full: every step)
COMPACT_SAMPLES_EVERY = 10


class MetricLogger:
    def __init__(self, run_dir: str, sinks: Iterable[str] = ("console", "jsonl"), *, project: str = "megappo",
                 run_name: str | None = None, config: Mapping | None = None, resume_step: int | None = 0,
                 progress: Progress | None = None, console: str = "compact", mlflow_uri: str | None = None):
        sinks = list(sinks)
        unknown = [s for s in sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"unknown logging sink(s) {unknown}; choose from {list(SINKS)} (logging.sinks)")
        assert console in CONSOLE_MODES, console
        self.run_dir, self.sinks, self.progress, self.console = run_dir, sinks, progress, console
        if progress is not None and "console" in sinks:
            progress.in_step_line = True
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = None
        if "jsonl" in sinks:
            path = os.path.join(run_dir, "metrics.jsonl")
            if os.path.exists(path) and resume_step is not None:  # steps after the checkpoint are logged again
                _truncate_after(path, resume_step)  # (all, without one; None: every record is kept)
            self._jsonl = open(path, "a")
        self._samples_jsonl, self._samples = None, []
        samples = os.path.join(run_dir, "samples.jsonl")
        if os.path.exists(samples) and resume_step is not None:
            # a fresh run starts it empty, a resumed one at its checkpoint
            _truncate_after(samples, resume_step, one_per_step=False)
        self._tb = None
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("logging.sinks tensorboard needs the tensorboard package: pip install tensorboard") from e
            # a resumed run drops the events logged after its checkpoint (all, on a fresh start), as
            # metrics.jsonl does
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1 if resume_step
                                     else 0)
        self._wandb = None
        if "wandb" in sinks:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("logging.sinks wandb needs the wandb package: pip install wandb") from e
            # one W&B run per megappo run: its id is kept in the run directory, so a resumed run appends to it.
            # Steps replayed after the checkpoint were logged before the stop; W&B keeps those (a bit-exact
            # resume recomputes the same values) and warns about the repeats.
            self._wandb = wandb.init(project=project, name=run_name, config=dict(config or {}), dir=run_dir,
                                     id=_wandb_run_id(run_dir), resume="allow")
        self._mlflow = _MlflowRun(run_dir, mlflow_uri, project, run_name, config) if "mlflow" in sinks else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items()}
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(clean, step=step)
        if self._mlflow:
            self._mlflow.log(step, clean)
        if "console" in self.sinks:
            console(compact_line(step, clean, self.progress) if self.console == "compact"
                    else full_line(step, clean, self.progress))
        self._log_samples(step)

    def add_samples(self, step: int, records: list[dict]) -> None:
        """Generation samples of `step` (megappo.metrics.sample_log.pick_samples), logged with its metrics."""
        self._samples = [dict(step=step, **r) for r in records]

    def _log_samples(self, step: int) -> None:
        records = [r for r in self._samples if r["step"] == step]
        self._samples = [r for r in self._samples if r["step"] != step]
        if "jsonl" in self.sinks and records:
            if self._samples_jsonl is None:
                self._samples_jsonl = open(os.path.join(self.run_dir, "samples.jsonl"), "a")
            self._samples_jsonl.writelines(json.dumps(r) + "\n" for r in records)
            self._samples_jsonl.flush()
        if "console" in self.sinks and (self.console == "full" or step == 1 or step % COMPACT_SAMPLES_EVERY == 0):
            for r in records:
                console(format_sample(r))

    def close(self) -> None:
        if self._samples_jsonl:
            self._samples_jsonl.close()
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        if self._mlflow:
            self._mlflow.close()


def compact_line(step: int, metrics: Mapping[str, float], progress: Progress | None = None) -> str:
    """logging.console=compact: `step 12/100: score=0.41 pg_loss=-0.0123 vf_loss=0.0834 kl=0.00121 | 1.9 s/step
    ETA 2m47s` (COMPACT_FIELDS that were logged; the rate and ETA of `progress` after its first step)."""
    shown = [f"{label}={metrics[key]:.4g}" for label, keys in COMPACT_FIELDS
             for key in [next((k for k in keys if k in metrics), None)] if key]
    line = f"step {step}{f'/{progress.total}' if progress is not None else ''}: {' '.join(shown)}"
    if progress is not None and step > progress.start:
        line += " | " + progress.timing(step)
    return line + _skipped_note(metrics)


def full_line(step: int, metrics: Mapping[str, float], progress: Progress | None = None) -> str:
    """logging.console=full: `step 12: critic/score/mean=0.41 critic/rewards/mean=... (CONSOLE_KEYS)`, with the
    progress text after it when no live bar shows it."""
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
    line = f"step {step}: {shown}{_skipped_note(metrics)}"
    if progress is not None and progress.enabled and not progress.live and step > progress.start:
        line += "  | " + progress.text(step, bar=False)  # no live bar: the step line has its text
    return line


def _skipped_note(metrics: Mapping[str, float]) -> str:
    skipped = [k for k in ("actor/skipped_steps", "critic/skipped_steps") if metrics.get(k)]
    return f" | SKIPPED updates ({', '.join(skipped)}): non-finite loss or gradients" if skipped else ""


PROMPT_CHARS, RESPONSE_CHARS = 60, 80  # console: the end of a sample's prompt, the start of its response


def _clip(text: str, limit: int, keep_end: bool = False) -> str:
    if len(text) <= limit:
        return repr(text)
    return repr("..." + text[-limit:]) if keep_end else repr(text[:limit] + "...")


def format_sample(record: Mapping) -> str:
    """`  sample: '3>' -> '4' | score 1 | truth '4' | stop`: one line, truncated (the end of the
    prompt, where the question and the template's end are; the start of the response)."""
    truth = "" if record.get("ground_truth") is None else f" | truth {_clip(str(record['ground_truth']), 30)}"
    return (f"  sample: {_clip(record['prompt'], PROMPT_CHARS, keep_end=True)} -> "
            f"{_clip(record['response'], RESPONSE_CHARS)} | score {record['score']:.4g}{truth} | "
            f"{record['finish_reason']}")


def _wandb_run_id(run_dir: str) -> str:
    path = os.path.join(run_dir, "wandb_run_id")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(uuid.uuid4().hex[:16])
    with open(path) as f:
        return f.read().strip()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")  # MLflow's names: letters, digits, '_', '.', '-', ' ', ':', '/'


def mlflow_key(name: str) -> str:
    """A metric or parameter name as MLflow allows it: '@' spelled '_at_', repeated '/' as one, any other
    character it does not allow as '_' (verl's mlflow logger's spelling: `val-core/gsm8k/acc/mean_at_4`)."""
    return _MLFLOW_BAD.sub("_", re.sub("/+", "/", name.replace("@", "_at_")))


def _flat(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys (megappo's override names) -> value text."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple, dict)) else str(v)
    return out


class _MlflowRun:
    """One MLflow run per megappo run, in the experiment named logging.project: its id is kept in
    `run_dir/mlflow_run_id`, so a resumed run appends to it (steps replayed after the checkpoint are logged
    again, as W&B keeps them). The config goes in as parameters under megappo's dotted names. `uri` None:
    MLflow's own choice (its MLFLOW_TRACKING_URI variable, else its default)."""

    PARAM_CHARS = 6000  # MLflow's longest parameter value

    def __init__(self, run_dir: str, uri: str | None, project: str, run_name: str | None,
                 config: Mapping | None):
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError("logging.sinks mlflow needs the mlflow package: pip install mlflow-skinny "
                              "(or mlflow)") from e
        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        path = os.path.join(run_dir, "mlflow_run_id")
        if os.path.exists(path):
            with open(path) as f:
                self.run_id = f.read().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        name = run_name or os.path.basename(os.path.normpath(run_dir))  # logging.run_name's default
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(mlflow_key(k), v[:self.PARAM_CHARS]) for k, v in _flat(config or {}).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        with open(path, "w") as f:
            f.write(self.run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _truncate_after(path: str, step: int, one_per_step: bool = True) -> None:
    """Keep the records of steps <= `step` (none for 0: a run from scratch logs step 0 again),
    each step's last one only with `one_per_step` (metrics; samples keep all of a step's);
    written to a temporary file and renamed, so a kill leaves the old or the new file."""
    upto = step if step else -1
    rows = _read_jsonl(path)
    keep = _last_per_step(rows, upto=upto) if one_per_step else [r for r in rows if r["step"] <= upto]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
    return [r for r in rows if isinstance(r, dict) and "step" in r]


def _last_per_step(rows: list[dict], upto: float = math.inf) -> list[dict]:
    """The last record of each step <= `upto`, by step."""
    last = {r["step"]: r for r in rows if r["step"] <= upto}
    return [last[s] for s in sorted(last)]


class Progress:
    """`[#####-----] 12/40 steps  1.9 s/step  ETA 53s` (rank 0).

    The rate is the mean of the step times given to `update(step, seconds)` (the loop's
    `timing_s/step`), so start-up and the validation before the first step do not count;
    before the first step time it shows `? s/step  ETA ?`.

    On a terminal (the stream is a TTY) the bar is one line redrawn in place (`\\r`) below the
    step lines; `console(text)` prints other lines above it. Elsewhere (a log file, a pipe) the
    bar draws nothing: the step line of the console sink carries its text (`MetricLogger(...,
    progress=)`), or, without that sink, the bar's text is printed as a line per step. Either
    way a step is one line in a log.
    """

    def __init__(self, total: int, start: int = 0, enabled: bool = True, width: int = 24, stream=None):
        self.total, self.done, self.enabled, self.width = total, start, enabled, width
        self.start = start
        self._step_seconds, self._timed_steps = 0.0, 0  # the steps timed so far and their total time
        self.stream = stream or sys.stderr
        self.live = enabled and _isatty(self.stream)
        self.in_step_line = False  # the console sink shows the text in its step lines
        self._drawn: str | None = None

    def text(self, step: int, bar: bool = True) -> str:
        filled = int(self.width * step / max(self.total, 1))
        head = f"[{'#' * filled}{'-' * (self.width - filled)}] " if bar else ""
        return f"{head}{step}/{self.total} steps  {self.timing(step)}"

    def timing(self, step: int) -> str:
        """`1.9 s/step  ETA 53s` after step `step` (`? s/step  ETA ?` before a step time is known)."""
        rate = self._step_seconds / self._timed_steps if self._timed_steps else math.nan
        per_step = f"{rate:.1f}" if math.isfinite(rate) else "?"
        return f"{per_step} s/step  ETA {_fmt_seconds(rate * (self.total - step))}"

    def update(self, step: int, seconds: float | None = None) -> str:
        """Step `step` is done, in `seconds` (its own time: counted in the rate when given)."""
        if seconds is not None:
            self._step_seconds, self._timed_steps = self._step_seconds + seconds, self._timed_steps + 1
        self.done = step
        line = self.text(step)
        if self.live:
            self._draw(line)
        elif self.enabled and not self.in_step_line:
            print(line, file=self.stream, flush=True)
        return line

    def _draw(self, line: str) -> None:
        global _LIVE
        self.stream.write(f"\r{line}\x1b[K")
        self.stream.flush()
        self._drawn, _LIVE = line, self

    def clear(self) -> None:
        """Erase the bar (a line printed next goes where it was)."""
        if self._drawn is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def close(self) -> None:
        """Leave the last bar on its line and end it, so later output starts on a new line."""
        global _LIVE
        if self._drawn is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = None
        if _LIVE is self:
            _LIVE = None


#: the bar drawn on the terminal now, if any (rank 0)
_LIVE: Progress | None = None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def console(text: str, file=None) -> None:
    """Print a line (stdout by default) above the live progress bar, which is redrawn below it."""
    bar = _LIVE
    if bar is not None:
        bar.clear()
    print(text, file=file or sys.stdout, flush=True)
    if bar is not None and bar._drawn is not None:
        bar._draw(bar._drawn)


def end_live_line() -> None:
    """End the live bar's line (before an error message), leaving it as it was."""
    if _LIVE is not None:
        _LIVE.close()


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


class BudgetWatch:
    """Warns once per run when (nearly) every response of `steps` consecutive steps ended at the
    token budget (`response_length/clip_ratio` >= `ratio`): a budget no answer fits in trains silently.
    (The CPU demo, learning, stays below 0.98.)"""

    def __init__(self, max_new_tokens: int, *, ratio: float = 0.99, steps: int = 5):
        self.max_new_tokens, self.ratio, self.steps = max_new_tokens, ratio, steps
        self.run, self.warned = 0, False

    def observe(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """The warning, printed, the first time the condition holds; None otherwise."""
        clipped = metrics.get("response_length/clip_ratio", 0.0) >= self.ratio
        self.run = self.run + 1 if clipped else 0
        if self.warned or self.run < self.steps:
            return None
        self.warned = True
        text = (f"megappo: warning: steps {step - self.steps + 1}-{step}: every response ended at the token budget "
                f"rollout.max_new_tokens={self.max_new_tokens} (response_length/clip_ratio >= {self.ratio}), so no "
                "response stops on its own. Fix: raise rollout.max_new_tokens so that an answer and its EOS fit, or "
                "check that the EOS / stop tokens are the model's.")
        console(text, file=sys.stderr)
        return text


PLOT_COLUMNS = 6  # panels in one row of the plot

PLOT_PANELS = (
    ("reward", ("critic/score/mean", "val/score/mean")),
    ("KL", ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean",)),
    ("timing (s)", ("timing_s/gen", "timing_s/update_actor", "timing_s/update_critic", "timing_s/step")),
)


#: the default plot's panel for a run with dynamic sampling (algorithm.filter_groups; megappo.rollout.dynamic_sampling)
DYNAMIC_SAMPLING_PANEL = ("dynamic sampling", ("filter_groups/kept_fraction", "filter_groups/generated_score_mean",
                                               "filter_groups/hit_limit"))

Panels = tuple[tuple[str, tuple[str, ...]], ...]  # (title, metric names) per panel


def plot_panels(rows: list[dict], patterns: Sequence[str] = ()) -> Panels:
    """The panels of `megappo plot`. Without `patterns`: PLOT_PANELS, the reward panel with each data source's
    core validation metric where the validation set has several (megappo.metrics.validation:
    `val-core/<source>/<var>/mean@N`, ...), and DYNAMIC_SAMPLING_PANEL when the rows have filter_groups/*
    metrics. With `patterns` (shell globs of metric names, `--metrics 'filter_groups/*'`): one panel per metric
    they match, in the order of the patterns, names sorted within one; a pattern that matches none raises
    ConfigError naming the metrics there are."""
    names = sorted({k for r in rows for k in r if k != "step"})
    if patterns:
        chosen: dict[str, None] = {}
        for pattern in patterns:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                groups = sorted({n.split("/")[0] + "/*" if "/" in n else n for n in names})
                raise ConfigError(f"megappo plot --metrics '{pattern}' matches no metric of this run. Fix: give a "
                                  f"metric name or a glob of them (e.g. 'actor/*'); this run has: {', '.join(groups)}.")
            chosen.update(dict.fromkeys(matched))
        return tuple((n, (n,)) for n in chosen)
    panels = PLOT_PANELS
    sources = [k for k in names if k.startswith("val-core/") and "/mean@" in k]
    if len({"/".join(k.split("/")[1:-2]) for k in sources}) >= 2:  # val-core/<source>/<var>/mean@N
        panels = tuple((title, keys + tuple(sources)) if title == "reward" else (title, keys) for title, keys in panels)
    if any(n.startswith("filter_groups/") for n in names):
        panels += (DYNAMIC_SAMPLING_PANEL,)
    return panels


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in '{run_dir}'; is it a megappo run directory (run.output_dir)?")
    return _last_per_step(_read_jsonl(path))  # a restarted run's repeated steps: the last record counts


def plot_run(run_dir: str, out: str | None = None, metrics: Sequence[str] = ()) -> str:
    """Write the curves PNG for a run directory (the panels of `plot_panels(rows, metrics)`, at most
    PLOT_COLUMNS in a row); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    panels = plot_panels(rows, metrics)
    columns = min(len(panels), PLOT_COLUMNS)
    lines = -(-len(panels) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3.2 * lines), squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.ravel(), panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), label=key, marker="." if len(pts) < 30 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
