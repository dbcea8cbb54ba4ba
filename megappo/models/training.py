"""Make a MegatronModel trainable: Megatron DDP, Megatron's optimizer, LR schedule, steps.

`make_trainable(model, OptimSettings(...))` wraps the chunks in Megatron-Core's
DistributedDataParallel, builds `get_megatron_optimizer` (Adam with decoupled weight
decay, global-norm gradient clipping, optionally the distributed optimizer) and an
`OptimizerParamScheduler` (linear warmup, then constant / linear / cosine decay).
`train_step(trainable, micro_batches, on_output)` zeroes the grad buffers, runs forward and
backward through the pipeline schedule, finalises gradients (DP reduction, tied-embedding
and layernorm all-reduces), and steps the optimizer and (unless the caller steps it itself,
as the PPO trainer does once per training step) the scheduler.

Gradient reduction across DP is a SUM (the model's TransformerConfig sets
`calculate_per_token_loss`): each rank's loss must already be normalised by the global
(all DP ranks, all micro-batches) token or sequence count, which megappo.ppo's loss
aggregation does when given those counts. Then the summed gradient is the gradient of
the whole mini-batch's loss, whatever the DP size and micro-batch split.

This module does not know about PPO losses or data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from megappo.models.builders import MegatronModel
from megappo.models.forward import run_micro_batches
from megappo.models.routing_replay import RouteReplay
from megappo.parallel.state import in_layout


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 1  # scheduler steps over the run (for decay): the PPO trainer's training steps
    decay_style: str = "constant"  # constant | linear | cosine
    use_distributed_optimizer: bool = False


@dataclasses.dataclass
class Trainable:
    model: MegatronModel
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    settings: OptimSettings


@in_layout
def make_trainable(model: MegatronModel, settings: OptimSettings) -> Trainable:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = model.config
    model.precision.check_trainable()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,  # megappo.parallel.chunked_head adds into main_grad itself, outside the hooks
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    model.chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in model.chunks]
    for chunk in model.chunks:
        chunk.broadcast_params()
    # DP reduction and the tied-embedding / layernorm all-reduces, no division by a token
    # count: megappo's losses are normalised by global counts already.
    config.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        **model.precision.optimizer_kwargs(),
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model.chunks)
    total = max(settings.total_steps, settings.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr if settings.decay_style != "constant" else settings.lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=total,
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    return Trainable(model=model, optimizer=optimizer, scheduler=scheduler, settings=settings)


@in_layout
def train_step(
    trainable: Trainable,
    micro_batches: list[dict[str, torch.Tensor]],
    on_output: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, Any]],
    *,
    routing: RouteReplay | None = None,
    head_input: bool = False,
    step_scheduler: bool = True,
) -> tuple[list[Any], dict[str, float]]:
    """One optimizer step over `micro_batches`; returns (last-stage results, step metrics).
    `routing`: how MoE routing records in the micro-batches are used (routing replay); `head_input`:
    `on_output` gets the LM head's input (megappo.models.forward.run_micro_batches);
    `step_scheduler`: advance the LR schedule after a successful step (False: the caller does).

    A step whose gradient norm is not finite is skipped (no update) and reported with
    `skipped=1`; the caller counts and decides when to abort.
    """
    model = trainable.model
    for chunk in model.chunks:
        chunk.zero_grad_buffer()
    trainable.optimizer.zero_grad()
    results = run_micro_batches(model, micro_batches, on_output, forward_only=False, routing=routing,
                                head_input=head_input)
    grads_finite = _grads_finite(trainable)
    if grads_finite:
        success, grad_norm, _ = trainable.optimizer.step()
    else:
        success, grad_norm = False, float("nan")
    if success and step_scheduler:
        trainable.scheduler.step(increment=1)
    metrics = {
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "lr": trainable.optimizer.param_groups[0]["lr"],
        "skipped": 0.0 if success else 1.0,
    }
    return results, metrics


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every element of `t` is finite. Equals `torch.isfinite(t).all()` in one
    pass with no temporary: min and max are both finite exactly when every element is
    (aminmax propagates NaN)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _grads_finite(trainable: Trainable) -> bool:
    """All ranks agree whether every gradient is finite (one all-reduce). The gradients are
    the DDP chunks' contiguous grad buffers (every `main_grad` is a view into one): one
    check per buffer, one host sync."""
    import torch.distributed as dist

    flags = [all_finite(buffer.grad_data) for chunk in trainable.model.chunks
             for buffer in chunk.buffers + chunk.expert_parallel_buffers]
    bad = (~torch.stack(flags)).sum(dtype=torch.float32).reshape(1) if flags else torch.zeros(1)
    bad = bad.to(trainable.model.ps.device)
    dist.all_reduce(bad)
    return bad.item() == 0
