"""The loop around the PPO step (`megappo train`): steps, logging, progress, checkpoints, validation.

`train(run)` is where a training run goes once `megappo.trainer.setup.create_run` has built it: the first
weight sync, validation before training, then `megappo.trainer.step.ppo_step` once per step with the
step's metrics logged on rank 0, a checkpoint when due (`run.maybe_checkpoint`) and a stop at a step
boundary on Ctrl-C / SIGTERM. `validate` generates on the validation prompts and scores them.

This module does not know how a step computes its metrics, nor how models are built or sharded.
"""

from __future__ import annotations

import sys
import time

from megappo.metrics.sample_log import pick_samples, write_generations
from megappo.metrics.sinks import BudgetWatch, console
from megappo.metrics.validation import by_data_source
from megappo.parallel.comm import broadcast_from_rank0
from megappo.trainer.setup import Run
from megappo.trainer.step import ppo_step, rollout, timed
from megappo.types import SamplingParams


class NonFiniteLossError(RuntimeError):
    """Too many steps had non-finite losses or gradients (run.max_nan_skips)."""


def train(run: Run) -> list[dict[str, float]]:
    """The loop: steps, logging, progress, checkpoints, validation. Returns rank 0's metrics."""
    history = []
    budget = BudgetWatch(run.cfg.rollout.max_new_tokens)
    run.bridge.sync()
    if run.ps.is_rank0:
        run.rollouts.synced(run.start_step)
    if run.cfg.run.val_only:  # verl's trainer.val_only: one validation of these weights, no step, no checkpoint
        val = validate(run, run.start_step)
        if run.ps.is_rank0:
            run.logger.log(run.start_step, val)
        run.close()
        return [val]
    if run.cfg.run.val_before_train and not run.start_step:  # a resumed run validated before its first step
        val = validate(run, run.start_step)
        if run.ps.is_rank0:
            run.logger.log(run.start_step, val)
    for step in range(run.start_step + 1, run.total_steps + 1):
        run.stop_if_interrupted(step - 1)  # Ctrl-C / SIGTERM: every rank stops here, the last step saved
        start = time.perf_counter()
        metrics = ppo_step(run, step)
        if run.ps.is_rank0:
            run.rollouts.synced(step)  # ppo_step ended with the weight sync
        if validates_at(step, run.total_steps, run.cfg.run.val_every):
            with timed(metrics, "validation"):
                metrics.update(validate(run, step))
        if run.ps.is_rank0:
            metrics.update(run.rollouts.metrics())
            metrics["timing_s/step"] = time.perf_counter() - start
            # verl's: prompt + response tokens of the batch per second per rank
            metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / metrics["timing_s/step"] / run.ps.world_size
            skipped = metrics.get("actor/skipped_steps", 0) + metrics.get("critic/skipped_steps", 0)
            run.nan_skips += int(skipped > 0)
            run.progress.update(step, metrics["timing_s/step"])  # the ETA counts step times only
            run.logger.log(step, metrics)
            budget.observe(step, metrics)
            history.append(metrics)
        skips = run.nan_skips = broadcast_from_rank0(run.nan_skips)
        if skips > run.cfg.run.max_nan_skips:
            raise NonFiniteLossError(f"{skips} steps had non-finite losses or gradients (> run.max_nan_skips="
                                     f"{run.cfg.run.max_nan_skips}). Fix: lower actor.optim.lr / critic.optim.lr, "
                                     "look for NaN or inf in the rewards and data, or raise run.max_nan_skips.")
        run.maybe_checkpoint(step)
    run.finish()
    if run.ps.is_rank0 and (said := run.filter_limits.summary(run.cfg.algorithm.filter_groups.max_num_gen_batches)):
        console(said, file=sys.stderr)
    return history


def validates_at(step: int, total_steps: int, val_every: int) -> bool:
    """Whether training step `step` of `total_steps` ends with a validation: every `val_every` steps and at the
    last step (verl's `is_last_step or step % test_freq == 0`); never with val_every=0."""
    return val_every > 0 and (step % val_every == 0 or step == total_steps)


def validation_params(cfg, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Validation's sampling (the rollout section `cfg`): val_n samples at val_temperature, val_top_p and
    val_top_k (None: the training's top_p, top_k), seeded by rollout.seed at every validation."""
    return SamplingParams(n=cfg.val_n, temperature=cfg.val_temperature,
                          top_p=cfg.top_p if cfg.val_top_p is None else cfg.val_top_p,
                          top_k=cfg.top_k if cfg.val_top_k is None else cfg.val_top_k,
                          max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos_ids,
                          stop_token_ids=tuple(cfg.stop_token_ids), seed=cfg.seed)


def validate(run: Run, step: int) -> dict[str, float]:
    """Generation on the validation prompts with the reward functions: `val/...` metrics (and with
    logging.validation_dir every generation in <dir>/<step>.jsonl)."""
    if not run.ps.is_rank0 or not run.val_examples:
        return {}
    with run.rollouts.at_latest():  # async mode: no generation runs, the engine holds the trained weights
        batch = rollout(run, run.val_examples, validation_params(run.cfg.rollout, run.eos_ids))  # one batch
    scored, read = run.scorer.score_validation(batch)
    scores, metrics, fields = scored.scores, scored.metrics, batch.score_fields
    returned = {key: [f.get(key) for f in fields] for key in dict.fromkeys(k for f in fields for k in f)}
    if run.cfg.logging.validation_dir:
        write_generations(run.cfg.logging.validation_dir, step, pick_samples(run.tokenizer, batch, scores, -1))
    return {"val/score/mean": scores.mean().item(), **metrics,
            "val/response_length/mean": batch.real_response_mask.sum(-1).float().mean().item(),
            **{f"val/{k}": v for k, v in (batch.env_metrics or {}).items()},
            **by_data_source(read[3], batch.prompt_index.tolist(), {"reward": scores.tolist(), **returned})}

