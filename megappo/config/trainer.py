"""The run around the steps, what verl calls `trainer.*`: `run` (output directory, seeds, length,
validation cadence, restarts), `checkpoint` (saving and resuming), `logging` (metric sinks, the
console) and `hardware` (the machines a recipe is sized for; its `variants` are other machines).

Cross-section rules beside these sections: `check_variants` (each variant a list of overrides),
`check_restarts` (restarts need checkpoints) and `check_critic_warmup` (a warmup needs a critic).
They read the root `Config` (megappo.config.root, which imports this module).

Owns: these sections, their defaults and checks. Does not write checkpoints or metrics
(megappo.trainer.checkpointing, megappo.metrics.sinks) or start ranks (megappo.parallel.launch).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from megappo.config.schema import _at_least, _require, _Section
from megappo.errors import P


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
    """Trainer checkpoints (models, optimizers, schedulers, data cursor, RNG): megappo.trainer.checkpointing."""

    dir: Optional[str] = None
    """`null`: `<run.output_dir>/checkpoints`."""
    save_every: int = 0
    """Steps between checkpoints; 0: only at the end of training (the last step is always saved); -1: none, not even
    at the end (Ctrl-C and SIGTERM still save the step they stop at)."""
    keep_last: int = 2
    """Newest checkpoints kept; 0: all."""
    resume: Literal["auto", "must", "off"] = "auto"
    """`auto`: from `latest` if there is one; `must`: refuse to start without one; `off`: start fresh. A fresh run
    first moves an earlier run's files and checkpoints into `run.output_dir/superseded/`
    ([checkpoints.md](checkpoints.md))."""
    resume_from: Union[int, str, None] = None
    """Go back to an earlier checkpoint instead of `latest`: a step number (or `step_NNNNNNNN`) of `checkpoint.dir`,
    or a step directory's path (any run's). The later checkpoints move to `checkpoint.dir/superseded/` (nothing is
    deleted); the same command run again continues the new branch
    ([checkpoints.md](checkpoints.md#going-back-to-an-earlier-checkpoint))."""
    save_hf_at_end: bool = False
    """Also export the final actor (and critic) as HF directories under `<run.output_dir>/hf/`."""

    def check(self) -> None:
        _at_least(self, save_every=-1, keep_last=0)
        _require(not (self.resume_from is not None and self.resume == "off"),
                 f"checkpoint.resume_from={self.resume_from} names a checkpoint to resume from, but "
                 "checkpoint.resume=off starts fresh. Fix: drop one of them (checkpoint.resume=auto or must "
                 "resumes from the named checkpoint).")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(_Section):
    sinks: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = dataclasses.field(
        default_factory=lambda: ["console", "jsonl"])
    """Any of `console`, `jsonl` (`metrics.jsonl` in `run.output_dir`), `tensorboard`, `wandb`, `mlflow`
    ([metrics.md](metrics.md#mlflow))."""
    project: str = "megappo"
    """W&B project, MLflow experiment."""
    mlflow_tracking_uri: Optional[str] = None
    """The `mlflow` sink's server or store (`http://host:5000`, `sqlite:///mlflow.db`, `databricks`, ...); `null`:
    MLflow's own choice (its `MLFLOW_TRACKING_URI`, else its default)."""
    run_name: Optional[str] = None
    """`null`: the name of `run.output_dir`."""
    progress_bar: bool = True
    """A live progress line on the console."""
    console: Literal["compact", "full"] = "compact"
    """The console's step line. `compact`: `step 12/100: score=0.41 pg_loss=-0.0123 vf_loss=0.0834 kl=0.00121 | 1.9
    s/step  ETA 2m47s` (`score` is `critic/score/mean`, `val` is `val/score/mean` on validation steps, `vf_loss`
    with a critic, `kl` is `actor/kl_loss` or `actor/reward_kl_penalty` when a KL term is on), and the `samples`
    lines of step 1 and every 10th step. `full`: `step 12: critic/score/mean=... critic/rewards/mean=...
    actor/pg_loss=... actor/ppo_kl=... actor/entropy=... critic/vf_loss=... response_length/mean=...
    timing_s/step=... perf/throughput=...` and the `samples` lines of every step. `metrics.jsonl`, TensorBoard, W&B
    and `samples.jsonl` get everything either way."""
    samples: int = 1
    """Samples per step shown under the step's console line (step 1 and every 10th step with `console=compact`,
    every step with `full`) and written in full to `samples.jsonl` (with the `jsonl` sink); 0: none."""
    rollout_dir: Optional[str] = None
    """Every generation of every step, one JSON record a line in `<dir>/<step>.jsonl` (verl's
    `trainer.rollout_data_dir`): `prompt`, `response`, `score`, `ground_truth`, `data_source`, `finish_reason`,
    `response_tokens`, `group` (the samples of one prompt share it), `fields` (what your reward function returned
    besides the score), `step`. A resumed run rewrites the steps it replays."""
    validation_dir: Optional[str] = None
    """The same for every validation's generations, `<dir>/<step>.jsonl` (step 0: before training; verl's
    `trainer.validation_data_dir`)."""

    def check(self) -> None:
        _at_least(self, samples=0)


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    output_dir: str = "runs/default"
    """Metrics, the resolved config, checkpoints."""
    seed: int = 42
    """Global seed (init, mini-batch shuffling)."""
    total_steps: Optional[int] = None
    """PPO steps; `null`: `total_epochs` passes over the prompts."""
    total_epochs: int = 1
    """Used when `total_steps` is `null`."""
    val_every: int = 0
    """Steps between validations, and one after the last step (as verl's `trainer.test_freq`: a 30-step run with
    `val_every=20` validates after steps 20 and 30; once when the last step is a multiple); 0: none during
    training."""
    val_before_train: bool = False
    """Validate once before the first step."""
    max_nan_skips: int = 3
    """Abort after this many steps skipped for a non-finite loss or gradient."""
    max_restarts: int = 0
    """A dead rank (kill -9, a crash, the OOM killer) or a timed-out collective restarts every rank from the latest
    checkpoint, at most this often (logged in `restarts.jsonl`), when `megappo train` starts the ranks (not under an
    outside torchrun); bad input, failed runs and SIGINT/SIGTERM never restart
    ([launchers.md](launchers.md#when-a-rank-dies))."""
    critic_warmup: int = 0
    """The first N steps train the critic alone, the actor stays frozen (verl's `trainer.critic_warmup`)."""
    val_only: bool = False
    """Validate once and stop (verl's `trainer.val_only`): the weights of `model.path`, or of the checkpoint the run
    resumes from (`checkpoint.resume_from=PATH` for any run's step directory, exactly that one); no training step,
    no checkpoint, nothing in the run's directory moved or cut back; metrics (with the [per-data-source
    statistics](metrics.md#validation-by-data-source)) in `run.output_dir/val_only/metrics.jsonl`, every validation
    kept; every generation with `logging.validation_dir`. A checkpoint is validated with its own saved settings; the
    command line gives only the validation keys, and other settings it changes are named as unused
    ([checkpoints.md](checkpoints.md#going-back-to-an-earlier-checkpoint))."""

    def check(self) -> None:
        _at_least(self, total_steps=1, total_epochs=1, val_every=0, max_nan_skips=0, max_restarts=0, critic_warmup=0)


@dataclasses.dataclass(frozen=True)
class HardwareConfig(_Section):
    """The machines a recipe is sized for. `megappo plan RECIPE` plans this world size and memory per
    GPU, the launchers in tools/launch/ start this many ranks by default, and `megappo train` warns
    when a GPU run is launched on another world size. With device=cpu a 'GPU' is one gloo rank and
    its share of the host's memory. Other machines are `variants` of the recipe (docs/planner.md)."""

    device: Literal["gpu", "cpu"] = "gpu"
    """`gpu`: one rank per GPU; `cpu`: gloo ranks, a "GPU" is one rank's share of host memory."""
    nodes: int = 1
    """Machines."""
    gpus_per_node: Optional[int] = None
    """Ranks per machine, one per GPU; `null`: `parallel.tp * parallel.pp` (one replica)."""
    gpu_memory_gib: float = 80.0
    """GiB per GPU (`cpu`: host memory per rank)."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one GPU in `model.dtype`, for `perf/mfu/*`; `null`: from the CUDA device's name (H100,
    H200, A100; no MFU on other GPUs and on CPU) ([metrics.md](metrics.md#flop-rates-and-mfu))."""

    def check(self) -> None:
        _at_least(self, nodes=1, gpus_per_node=1)
        _require(self.gpu_memory_gib > 0, f"{P}gpu_memory_gib={self.gpu_memory_gib} must be > 0 (GiB per GPU). "
                                          f"Fix: e.g. {P}gpu_memory_gib=80.")
        _require(self.peak_tflops is None or self.peak_tflops > 0,
                 f"{P}peak_tflops={self.peak_tflops} must be > 0 (TFLOP/s of one GPU). Fix: e.g. {P}peak_tflops=989 "
                 f"(H100 SXM, bf16), or leave it unset to read the GPU's name.")
        _require(self.nodes == 1 or self.gpus_per_node is not None,
                 f"{P}nodes={self.nodes} needs {P}gpus_per_node (the ranks of each node). Fix: set "
                 f"{P}gpus_per_node=8 (or your GPUs per node).")

    def describe(self, world_size: int, memory_gib: Optional[float] = None) -> str:
        """'1 node x 8 GPUs of 80 GiB' (cpu: ranks and host memory) for `world_size` ranks in all; a world
        that is not nodes x ranks is '6 GPUs of 80 GiB'."""
        unit = "GPU" if self.device == "gpu" else "rank"
        memory = f"{self.gpu_memory_gib if memory_gib is None else memory_gib:g} GiB" + (
            "" if self.device == "gpu" else " of host memory")
        per_node, split = divmod(world_size, self.nodes)
        if split or self.nodes == 1 and world_size == 1:
            return f"{world_size} {unit}{'s' if world_size > 1 else ''} of {memory}"
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {per_node} {unit}{'s' if per_node > 1 else ''} "
                f"of {memory}")


# -- rules across sections ----------------------------------------------------------------------

def check_variants(cfg: "Config") -> None:
    """Each variant is a list of KEY=VALUE overrides of the recipe."""
    for name, overrides in cfg.variants.items():
        for override in overrides:
            key = override.partition("=")[0].strip()
            _require("=" in override and bool(key) and not key.startswith("variants"),
                     f"variants.{name}: '{override}' is not a KEY=VALUE override of this recipe. Fix: write "
                     f"it like hardware.gpus_per_node=4 or parallel.tp=2.")


def check_restarts(cfg: "Config") -> None:
    """Restarting from the latest checkpoint needs checkpoints."""
    _require(cfg.run.max_restarts == 0 or cfg.checkpoint.save_every >= 0,
             f"run.max_restarts={cfg.run.max_restarts} restarts a run from its latest checkpoint, but "
             "checkpoint.save_every=-1 saves none. Fix: set checkpoint.save_every=N (every N steps) or "
             "run.max_restarts=0.")


def check_critic_warmup(cfg: "Config") -> None:
    """Training the critic alone first needs a critic."""
    est = cfg.algorithm.adv_estimator
    _require(not cfg.run.critic_warmup or cfg.use_critic,
             f"run.critic_warmup={cfg.run.critic_warmup} trains the critic alone first, but this run has no critic "
             f"(algorithm.adv_estimator={est}). Fix: set run.critic_warmup=0, or use algorithm.adv_estimator=gae.")
