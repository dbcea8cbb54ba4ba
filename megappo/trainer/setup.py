"""Everything a training run holds, built once from a Config: `create_run(cfg)`.

Process groups, the tokenizer, the actor / reference / critic / reward models (HF weights,
or a Megatron dist checkpoint's, loaded into the shards, Megatron optimizers for the trained
ones), the rollout engine and the bridge on rank 0, prompts and sampler, the KL controller, the metric logger, and the
step bookkeeping the loop needs; when a checkpoint is there to resume from (megappo.trainer.checkpointing),
the models, optimizers, data cursor, KL coefficient and RNG continue from it.

`create_run` calls one named phase after another, each taking what the earlier ones built:
`model_source` (HF config, weights, tokenizer), `load_prompts`, `role_layouts` (process groups
per role), `build_roles` (the models and workers a `RoleBuild` asks for: the decisions made once
from the config, such as routing replay and recomputation), `build_rollout_side` (engine,
schedule, bridge), `resume_state`, `announce` (config.json, logger, start-up lines). A new
capability enters as a phase's argument (a field of the `RoleBuild`), not as a branch inside one.
`write_initial_model` writes `model_source`'s weights as an HF directory (`megappo export --init`).

This module does not know the order of a PPO step (see megappo.trainer.step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import warnings
from typing import Any

import torch

from megappo.trainer import checkpointing

from megappo.parallel import interrupts
from megappo.config import Config, lora_saved_modules, lora_targets
from megappo.data.prompts import ClassOrder, PromptSampler
from megappo.rollout.dynamic_sampling import LimitCount
from megappo.metrics.sinks import MetricLogger, Progress, console
from megappo.trainer.convert import read_aux_files
from megappo.models.builders import MegatronModel, build_model
from megappo.models.checkpoint import load_dist_weights
from megappo.models.hf_config import ModelConfigError, ModelDims, dims_from_hf, load_hf_config
from megappo.models.lora import NO_LORA, LoRA, base_view
from megappo.models.recompute import NO_RECOMPUTE, Recompute
from megappo.models.routing_replay import RouteReplay
from megappo.models.training import OptimSettings, make_trainable
from megappo.models.weights import load_hf_weights
from megappo.parallel.comm import broadcast_from_rank0
from megappo.parallel.state import ParallelState, add_layout, init_parallel
from megappo.trainer.preflight import check_inputs
from megappo.trainer.preflight import load_prompts as read_prompts
from megappo.ppo.kl import make_kl_controller
from megappo.rewards.scoring import Scorer
from megappo.envs.loading import env_class
from megappo.envs.tools import runs_python
from megappo.rollout.bridge import WeightBridge
from megappo.rollout.registry import engine_for, write_engine_init
from megappo.rollout.replicas import connect as connect_replicas, leaders as replica_leaders, node_slot
from megappo.rollout.multiturn import observation_encoder
from megappo.rollout.partial import PartialRollouts
from megappo.rollout.partial_episodes import Episodes
from megappo.rollout.schedule import SCHEDULES
from megappo.data.tokenizer import builtin_tokenizer_files, check_vocab, load_tokenizer, special_token_ids
from megappo.parallel.packing import MicroBatching
from megappo.metrics.perf import device_peak_tflops
from megappo.trainer.roles import PolicyWorker, ValueWorker


@dataclasses.dataclass
class Run:
    cfg: Config
    ps: ParallelState
    build: RoleBuild  # what was built, decided once (routing replay, recomputation, roles)
    tokenizer: Any
    actor: PolicyWorker
    ref: PolicyWorker | None
    critic: ValueWorker | None
    reward_model: ValueWorker | None
    engine: Any  # RolloutEngine on rank 0, None elsewhere
    bridge: WeightBridge
    train_examples: list
    val_examples: list
    sampler: PromptSampler | None
    kl_ctrl: Any
    logger: MetricLogger | None
    progress: Progress | None
    total_steps: int
    hf_config: dict
    critic_hf_config: dict | None = None
    start_step: int = 0  # the step a resumed run continues after
    nan_skips: int = 0  # steps skipped for non-finite losses so far (carried across resumes)
    last_saved_step: int | None = None
    branch: dict | None = None  # the branch a checkpoint.resume_from run continues (megappo.trainer.checkpointing)
    rollouts: Any = None  # rank 0: when batches are generated (megappo.rollout.schedule), None elsewhere
    scorer: Scorer | None = None  # rank 0: the rewards' scoring of batches, with its checks and reward workers
    # rank 0, algorithm.filter_groups: the steps that hit max_num_gen_batches (warned once, counted at the end)
    filter_limits: LimitCount = dataclasses.field(default_factory=LimitCount)
    partial: PartialRollouts | None = None  # rank 0, rollout.partial: the samples carried between steps

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())

    def actor_update_args(self, step: int) -> dict:
        a = self.cfg.actor
        return dict(mini_batch_size=a.ppo_mini_batch_size * self.cfg.rollout.n, epochs=a.ppo_epochs,
                    loss_mode=self.cfg.policy_loss_mode, loss_knobs=policy_loss_knobs(self.cfg),
                    loss_agg_mode=a.loss_agg_mode, loss_scale_factor=a.loss_scale_factor, entropy_coeff=a.entropy_coeff,
                    use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                    seed=self.cfg.run.seed * 7919 + step)

    def critic_update_args(self, step: int) -> dict:
        c = self.cfg.critic
        return dict(mini_batch_size=c.ppo_mini_batch_size * self.cfg.rollout.n, epochs=c.ppo_epochs,
                    cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                    loss_scale_factor=c.loss_scale_factor, seed=self.cfg.run.seed * 7919 + step)

    @property
    def peak_tflops(self) -> float | None:
        """Dense peak TFLOP/s of one GPU in the model dtype (MFU's denominator; None: unknown, CPU)."""
        return device_peak_tflops(self.ps.device, self.cfg.model.dtype, self.cfg.hardware.peak_tflops)

    @property
    def trainables(self) -> dict:
        return _trained(self.actor, self.critic)

    def maybe_checkpoint(self, step: int) -> None:
        every = self.cfg.checkpoint.save_every
        if every > 0 and step % every == 0:  # 0: at the end only (finish); -1: never
            self.save_checkpoint(step)

    def save_checkpoint(self, step: int) -> str:
        """Collective: a trainer checkpoint of `step` (megappo.trainer.checkpointing)."""
        trainer = buffered = carried = None
        if self.ps.is_rank0:
            buffered = self.rollouts.settle()  # the batches generated ahead, waited for
            carried = self.partial.state_dict() if self.partial else None  # after settle: no generation runs
            trainer = checkpointing.TrainerState(step=step, sampler=self.sampler.state_dict(),
                                                 kl_coef=float(self.kl_ctrl.value), nan_skips=self.nan_skips,
                                                 branch=self.branch)
        path = checkpointing.save(self.cfg.checkpoint_dir, step, self.trainables, trainer, self.cfg,
                                  hf_config=self.hf_config, hf_files=self._hf_files(),
                                  critic_hf_config=self.critic_hf_config, rank=self.ps.rank,
                                  keep_last=self.cfg.checkpoint.keep_last, rollout_buffer=buffered,
                                  partial_rollouts=carried)
        self.last_saved_step = step
        if self.ps.is_rank0:
            console(f"saved checkpoint {path}")  # above the progress bar
        return path

    def stop_if_interrupted(self, step: int) -> None:
        """Collective, at a step boundary: when a rank got SIGINT / SIGTERM (megappo.parallel.interrupts),
        every rank saves a checkpoint of `step`, the last completed step (unless it is saved
        already), closes the logger and raises Interrupted, whose message says how to resume."""
        signum = interrupts.agree(self.ps.device)
        if not signum:
            return
        if step == 0:
            message = "interrupted before step 1 ended: nothing to save; rerun the same command to start again"
        else:
            rerun = "rerun the same command"
            if self.cfg.checkpoint.resume == "off":  # which would set its checkpoints aside and start over
                rerun += " with checkpoint.resume=auto"
            saved = (os.path.join(self.cfg.checkpoint_dir, checkpointing.step_dir_name(step))
                     if step == self.last_saved_step else self.save_checkpoint(step))
            message = f"interrupted at step {step}: checkpoint saved to {saved}; {rerun} to resume"
        if self.logger:
            self.logger.close()
        raise interrupts.Interrupted(signum, message)

    def finish(self) -> None:
        """Collective: the final checkpoint (unless this step was just saved, or checkpoint.save_every=-1
        asks for none), the HF export if asked for, and close the reward workers and the logger."""
        self._stop_generation()
        if self.last_saved_step != self.total_steps and self.cfg.checkpoint.save_every >= 0:
            self.save_checkpoint(self.total_steps)
        if self.cfg.checkpoint.save_hf_at_end:
            self.export_hf(os.path.join(self.cfg.run.output_dir, "hf"))
        self._release()

    def close(self) -> None:
        """The end of a run that saves nothing (run.val_only): `finish` without its checkpoint and export."""
        self._stop_generation()
        self._release()

    def _stop_generation(self) -> None:
        if self.rollouts:
            self.rollouts.close()
        if self.progress:
            self.progress.close()  # the last bar stays; what follows starts on a new line

    def _release(self) -> None:
        if self.scorer:
            self.scorer.close()
        if self.logger:
            self.logger.close()

    def export_hf(self, path: str) -> None:
        """Collective: the trained actor (and critic) as HF directories `path`/actor, `path`/critic."""
        from megappo.trainer.convert import export_hf

        hf_files = self._hf_files()
        base = adapter_base(self.cfg.to_dict()["model"]) if self.actor.model.lora.enabled else None
        export_hf(self.actor.model, os.path.join(path, "actor"), self.hf_config, hf_files, overwrite=True, base=base)
        if self.critic:
            export_hf(self.critic.model, os.path.join(path, "critic"), self.critic_hf_config, hf_files,
                      overwrite=True)
        if self.ps.is_rank0:
            print(f"exported HF model directories to {path}", flush=True)

    def _hf_files(self) -> dict:
        return export_files(self.cfg.model, self.tokenizer)


def export_files(model_cfg, tokenizer) -> dict[str, bytes]:
    """Tokenizer and generation files an exported model carries: the model directory's, then
    those of `model.tokenizer` when it names another source (a directory's tokenizer files, or
    the built-in tokenizer's as HF files), which win."""
    files = read_aux_files(model_cfg.path) if model_cfg.path else {}
    source = model_cfg.tokenizer
    if source and source.startswith("builtin:"):
        files.update(builtin_tokenizer_files(tokenizer))
    elif source and source != model_cfg.path and os.path.isdir(source):
        own = read_aux_files(source)
        if "generation_config.json" in files:  # generation settings belong to the model
            own.pop("generation_config.json", None)
        files.update(own)
    return files


def adapter_base(model_section: dict):
    """Where a LoRA actor's exported peft adapter finds its base model (megappo.trainer.convert.AdapterBase),
    from the run's `model` section as plain data (a trainer checkpoint's saved config): model.path,
    by its absolute path when it is a directory from here (a relative path is the training's working
    directory's: export from there); a model built from model.hf_config is written next to the
    adapter, its fully trained modules (modules_to_save) at the random init the run started from
    (the same build as _hf_source's)."""
    from megappo.config import SAVED_MODULES, ModelConfig
    from megappo.trainer.convert import AdapterBase

    path = model_section.get("path")
    if path:
        return AdapterBase(path=os.path.abspath(path) if os.path.isdir(path) else path)
    from megappo.models.hf_reference import build_hf_model

    hf = build_hf_model(model_section["hf_config"], seed=model_section.get("seed_init", ModelConfig.seed_init))
    return AdapterBase(start={name: t for name, t in hf.state_dict().items()
                              if name.rsplit(".", 2)[-2] in SAVED_MODULES})


def policy_loss_knobs(cfg: Config) -> dict:
    """Every knob a policy loss may take (megappo.ppo.policy_losses; each loss reads those it uses): the
    clip ratios, actor.policy_loss.*, SAPO's temperatures and, in bypass mode, the rollout correction's."""
    a, rc = cfg.actor, cfg.rollout_correction
    knobs = dict(clip_ratio_low=a.clip_low, clip_ratio_high=a.clip_high, clip_ratio_c=a.clip_ratio_c,
                 tau_pos=a.tau_pos, tau_neg=a.tau_neg,
                 **{k: v for k, v in dataclasses.asdict(a.policy_loss).items() if k != "loss_mode"})
    if rc.bypass_mode:
        knobs.update({k: v for k, v in dataclasses.asdict(rc).items() if k != "bypass_mode"})
    return knobs


def _trained(actor: PolicyWorker, critic: ValueWorker | None) -> dict:
    """The Trainables of the trained roles by role name: what a trainer checkpoint holds."""
    return {"actor": actor.trainable, **({"critic": critic.trainable} if critic else {})}


def recompute_of(cfg: Config, role: str) -> Recompute:
    """A role's activation recomputation: `actor.recompute` / `critic.recompute`; none for the
    forward-only roles (ref, reward)."""
    if role not in ("actor", "critic"):
        return NO_RECOMPUTE
    return Recompute.of(getattr(cfg, role).recompute, f"{role}.recompute")


def lora_of(cfg: Config, role: str) -> LoRA:
    """A role's LoRA adapters: `actor.lora` / `critic.lora`; none for the forward-only roles."""
    if role not in ("actor", "critic") or not getattr(cfg, role).lora.enabled:
        return NO_LORA
    section = getattr(cfg, role).lora
    return LoRA(rank=section.rank, alpha=section.alpha, dropout=section.dropout,
                targets=lora_targets(section.target_modules, f"{role}.lora.target_modules"),
                modules_to_save=lora_saved_modules(section.modules_to_save, f"{role}.lora.modules_to_save"))


def _hf_source(cfg: Config):
    """(HF config dict, weights: a directory or an in-memory state dict, the HF model or None)."""
    if cfg.model.path:
        return load_hf_config(cfg.model.path), cfg.model.path, None
    from megappo.models.hf_experts import checkpoint_state
    from megappo.models.hf_reference import build_hf_model

    hf = build_hf_model(cfg.model.hf_config, seed=cfg.model.seed_init)
    return cfg.model.hf_config, checkpoint_state(hf), hf  # MoE: per-expert checkpoint names


def _optim(section, total_steps: int, use_dist_opt: bool) -> OptimSettings:
    """A role's optimizer settings; its LR schedule advances once per training step (megappo.trainer.roles)."""
    o = section.optim
    return OptimSettings(lr=o.lr, min_lr=o.lr * o.min_lr_ratio, weight_decay=o.weight_decay, betas=tuple(o.betas),
                         eps=o.eps, clip_grad=section.grad_clip, warmup_steps=o.warmup_for(total_steps),
                         total_steps=total_steps, decay_style=o.lr_decay_style,
                         use_distributed_optimizer=use_dist_opt)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The actor's starting point, read once: what every role's weights and the engine start from."""

    hf_config: dict  # with the tokenizer's special token ids when the model is built from model.hf_config
    weights: Any  # an HF directory, or the in-memory state dict of `hf_model`
    hf_model: Any  # the transformers model built from model.hf_config; None for model.path
    dims: ModelDims
    tokenizer: Any


@dataclasses.dataclass
class Prompts:
    """Rank 0's prompts and sampler (empty / None on other ranks) and the run's length (every rank)."""

    train: list
    val: list
    sampler: PromptSampler | None
    stats: dict  # build_prompts' counts of long prompts skipped / truncated
    total_steps: int


@dataclasses.dataclass(frozen=True)
class RoleBuild:
    """What the roles phase builds, decided once from the config and handed down: the models, the
    engine and the step read these decisions here, never from the config again."""

    roles: tuple[str, ...]  # the Megatron models this run builds: actor, and critic / ref / reward as needed
    routing_replay: bool  # MoE: the actor's and reference's routers replay the engine's expert choices
    recompute: dict[str, Recompute]  # activation recomputation per role
    lora: dict[str, LoRA]  # LoRA adapters per trained role (megappo.models.lora); absent: none
    ref_is_actor_base: bool  # the reference is the actor with its adapters off, not a model of its own

    @classmethod
    def of(cls, cfg: Config) -> RoleBuild:
        return cls(roles=cfg.model_roles, routing_replay=cfg.routing_replay,
                   recompute={role: recompute_of(cfg, role) for role in cfg.model_roles},
                   lora={role: lora_of(cfg, role) for role in cfg.lora_roles},
                   ref_is_actor_base=cfg.ref_is_actor_base)


@dataclasses.dataclass
class Roles:
    """The role workers the build asked for (None: not in this run)."""

    actor: PolicyWorker
    ref: PolicyWorker | None
    critic: ValueWorker | None
    reward_model: ValueWorker | None


def create_run(cfg: Config) -> Run:
    """Collective: every phase in turn, each taking what the earlier ones built."""
    p = cfg.parallel
    ps = init_parallel(p.tp, p.pp, p.vpp, ep=p.ep, cp=p.cp, backend=p.backend, seed=cfg.run.seed, timeout_minutes=p.timeout_minutes)
    check_inputs(cfg, ps.world_size)  # layout vs model, data files, rewards: before any data or model work
    with contextlib.nullcontext() if ps.is_rank0 else warnings.catch_warnings(action="ignore"):
        resume = checkpointing.find_resume(cfg, verify="full")  # refusals, damaged files: before any model is built
    torch.manual_seed(cfg.run.seed)
    source = model_source(cfg)
    prompts = load_prompts(cfg, ps, source.tokenizer)
    layouts = role_layouts(cfg, ps)
    build = RoleBuild.of(cfg)
    roles = build_roles(cfg, layouts, source, build, prompts.total_steps)
    engine, rollouts, bridge = build_rollout_side(cfg, ps, source, roles.actor.model, prompts.total_steps,
                                                  routing_replay=build.routing_replay)
    kl = cfg.algorithm.kl_ctrl
    kl_ctrl = make_kl_controller(kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
    partial = partial_rollouts(cfg, source.tokenizer) if ps.is_rank0 else None
    start_step, nan_skips = resume_state(resume, ps, roles, kl_ctrl, prompts, rollouts, partial)
    logger, progress = announce(cfg, ps, prompts, roles, layouts, resume=resume, start_step=start_step)
    critic_hf_config = load_hf_config(cfg.critic.path) if cfg.critic.path else source.hf_config
    return Run(cfg=cfg, ps=ps, build=build, tokenizer=source.tokenizer, actor=roles.actor, ref=roles.ref,
               critic=roles.critic, reward_model=roles.reward_model, hf_config=source.hf_config,
               critic_hf_config=critic_hf_config, engine=engine, bridge=bridge, train_examples=prompts.train,
               val_examples=prompts.val, sampler=prompts.sampler, kl_ctrl=kl_ctrl, logger=logger, progress=progress,
               total_steps=prompts.total_steps, start_step=start_step, nan_skips=nan_skips,
               last_saved_step=start_step if resume else None, rollouts=rollouts, partial=partial,
               branch=resume["branch"] if resume else None,
               scorer=Scorer(cfg.reward, source.tokenizer, cfg.rollout.max_new_tokens,
                             python_tool=runs_python(cfg.rollout.env, cfg.rollout.env_args)) if ps.is_rank0 else None)


def model_source(cfg: Config) -> ModelSource:
    """The actor's HF config and weights, its dims and the tokenizer (checked against its vocab)."""
    hf_config, weights, hf_model = _hf_source(cfg)
    dims = dims_from_hf(hf_config, cfg.model.arch)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    check_vocab(tokenizer, dims.vocab_size)
    if not cfg.model.path:  # a model from config: exports and SGLang's copy name the tokenizer's special tokens
        hf_config = {**special_token_ids(tokenizer), **hf_config}
        for key in special_token_ids(tokenizer):  # (SGLang also stops at the config's eos_token_id)
            setattr(hf_model.config, key, hf_config[key])
            setattr(hf_model.generation_config, key, hf_config[key])
    return ModelSource(hf_config=hf_config, weights=weights, hf_model=hf_model, dims=dims, tokenizer=tokenizer)


def write_initial_model(cfg: Config, out_dir: str, overwrite: bool = False) -> ModelSource:
    """`megappo export --init`: the actor's starting weights of a recipe that builds its model from
    model.hf_config (the same tensors `model_source` gives a run, seeded by model.seed_init) as an HF directory
    with the tokenizer's files, for another trainer's model path (verl's actor_rollout_ref.model.path)."""
    from megappo.trainer.convert import check_output_dir
    from megappo.models.hf_reference import save_hf_dir

    if cfg.model.path:
        raise ModelConfigError(f"the recipe's model is an HF directory already (model.path={cfg.model.path}); "
                               "--init writes a model built from model.hf_config. Fix: use that directory itself "
                               f"(e.g. actor_rollout_ref.model.path={cfg.model.path}).")
    if cfg.actor.dist_checkpoint:
        raise ModelConfigError(f"the recipe's actor starts from actor.dist_checkpoint={cfg.actor.dist_checkpoint}, "
                               "not from the model --init writes (model.hf_config's). Fix: give the run that "
                               "checkpoint (actor.dist_checkpoint, or verl's use_dist_checkpointing with "
                               "dist_checkpointing_path), or drop actor.dist_checkpoint to export the built model.")
    check_output_dir(out_dir, overwrite)
    source = model_source(cfg)
    staged = f"{os.path.abspath(out_dir)}.tmp-{os.getpid()}"  # renamed into place once complete
    os.makedirs(staged)
    save_hf_dir(staged, source.weights, source.hf_config)
    for name, data in export_files(cfg.model, source.tokenizer).items():
        with open(os.path.join(staged, name), "wb") as f:
            f.write(data)
    if os.path.exists(out_dir):  # empty, or --overwrite
        shutil.rmtree(out_dir)
    os.replace(staged, out_dir)
    return source


def load_prompts(cfg: Config, ps: ParallelState, tokenizer) -> Prompts:
    """Collective: rank 0 reads, checks and tokenizes the training and validation prompts (data.*);
    every rank learns the number of steps."""
    train_examples, val_examples, sampler, data_stats = [], [], None, {}
    if ps.is_rank0:
        d = cfg.data
        train_examples, val_examples, data_stats = read_prompts(cfg, tokenizer)  # checked, tokenized
        order = ClassOrder(d.sampler.class_path, d.sampler.class_name, train_examples, dataclasses.asdict(d)) \
            if d.sampler.class_path else None  # the user's sampler class (data.sampler), else data.shuffle's
        sampler = PromptSampler(len(train_examples), cfg.prompts_per_draw, seed=d.seed, shuffle=d.shuffle,
                                key=cfg.prompts_per_draw_key, order=order)
    # with algorithm.filter_groups an epoch counts generation batches (verl's), a step takes one or more
    steps_per_epoch = broadcast_from_rank0(sampler.batches_per_epoch if sampler else None)
    total_steps = cfg.run.total_steps or steps_per_epoch * cfg.run.total_epochs
    return Prompts(train=train_examples, val=val_examples, sampler=sampler, stats=data_stats, total_steps=total_steps)


def role_layouts(cfg: Config, ps: ParallelState) -> dict[str, ParallelState]:
    """Collective: each model role's ParallelState. A role with its own TP / PP / EP / CP gets its own
    Megatron groups over the same ranks (built in the same order on every rank); the others share `ps`."""
    def layout_of(role: str) -> tuple:
        return cfg.layout(role) + (cfg.expert_parallel(role), cfg.context_parallel(role))

    states = {ps.layout + (ps.ep, ps.cp): ps}
    for role in cfg.model_roles:
        if layout_of(role) not in states:
            states[layout_of(role)] = add_layout(ps, *cfg.layout(role), ep=cfg.expert_parallel(role),
                                                 cp=cfg.context_parallel(role),
                                                 seed=cfg.run.seed, timeout_minutes=cfg.parallel.timeout_minutes)
    return {role: states[layout_of(role)] for role in cfg.model_roles}


def build_roles(cfg: Config, layouts: dict[str, ParallelState], source: ModelSource, build: RoleBuild,
                total_steps: int) -> Roles:
    """Collective: the role models `build` asks for, loaded with their HF weights (a critic or reward
    model from its own directory) or from a Megatron dist checkpoint (`<role>.dist_checkpoint`; the
    reference follows the actor's), wrapped in their workers, with optimizers for the trained ones."""
    def model(role: str, weights=source.weights, dist_checkpoint: str | None = None) -> MegatronModel:
        # a critic or reward model from its own directory may have another size than the actor
        role_dims = dims_from_hf(load_hf_config(weights)) if isinstance(weights, str) else source.dims
        if role_dims.vocab_size != source.dims.vocab_size:
            raise ModelConfigError(f"the {role} model's vocab_size {role_dims.vocab_size} differs from the actor's "
                                   f"{source.dims.vocab_size}; all roles must share the tokenizer.")
        m = build_model(role_dims, layouts[role], role=role, dtype=cfg.model.dtype,
                        layer_spec=cfg.model.layer_spec,
                        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                        sequence_parallel=cfg.parallel.sequence_parallel, value_head_seed=cfg.model.seed_init,
                        recompute=build.recompute[role], lora=build.lora.get(role, NO_LORA),
                        **({"moe_enable_routing_replay": True} if replays(role) else {}))
        if dist_checkpoint:  # verl's dist_checkpointing_path: the HF config still comes from `weights`
            load_dist_weights(m, dist_checkpoint, named_by=f"{role}.dist_checkpoint")
        else:
            load_hf_weights(m, weights)
        return m

    def replays(role: str) -> bool:
        return build.routing_replay and role in ("actor", "ref")

    def trainable(role: str, m: MegatronModel):
        return make_trainable(m, _optim(getattr(cfg, role), total_steps, cfg.parallel.use_distributed_optimizer))

    temperature = cfg.rollout.temperature or 1.0
    actor_model = model("actor", dist_checkpoint=cfg.actor.dist_checkpoint)
    head_chunk = cfg.model.lm_head_chunk_tokens  # the chunked LM head: one setting for both policy models
    actor = PolicyWorker(actor_model, batching=_batching(cfg, "actor"), temperature=temperature,
                         routing=RouteReplay() if replays("actor") else None, lm_head_chunk_tokens=head_chunk,
                         trainable=trainable("actor", actor_model))
    ref = critic = reward_model = None
    if "ref" in build.roles:
        # with actor.lora: the actor's own weights with the adapters off, no second copy
        ref_model = base_view(actor.model) if build.ref_is_actor_base else \
            model("ref", dist_checkpoint=cfg.ref.dist_checkpoint or cfg.actor.dist_checkpoint)
        ref = PolicyWorker(ref_model, batching=_batching(cfg, "ref"), temperature=temperature,
                           routing=RouteReplay() if replays("ref") else None, lm_head_chunk_tokens=head_chunk)
    if "critic" in build.roles:
        critic_model = model("critic", cfg.critic.path or source.weights, cfg.critic.dist_checkpoint)
        critic = ValueWorker(critic_model, batching=_batching(cfg, "critic"),
                             trainable=trainable("critic", critic_model))
    if "reward" in build.roles:
        reward_model = ValueWorker(model("reward", cfg.reward.model_path), batching=_batching(cfg, "reward"))
    return Roles(actor=actor, ref=ref, critic=critic, reward_model=reward_model)


def _batching(cfg: Config, role: str) -> MicroBatching:
    """A role's micro-batching: packed to its token budget, or `micro_batch_size` sequences."""
    tp, pp, vpp = cfg.layout(role)
    micro = cfg.ref_micro_batch_size if role == "ref" else getattr(cfg, role).micro_batch_size
    return MicroBatching(packed=cfg.packs(role), max_tokens=cfg.max_tokens_per_micro_batch(role),
                         micro_batch_size=micro, micro_batch_multiple=pp if vpp else 1,
                         multiple=tp if cfg.parallel.sequence_parallel else 1)


def build_rollout_side(cfg: Config, ps: ParallelState, source: ModelSource, actor_model: MegatronModel,
                       total_steps: int, *, routing_replay: bool) -> tuple[Any, Any, WeightBridge]:
    """Collective: (engine, rollout schedule, bridge). Every replica's leader (megappo.rollout.replicas: rank 0
    alone with rollout.replicas=1) builds an engine (megappo.rollout.registry); rank 0 holds them all as one (a
    ReplicaSet when there are several) behind the schedule of rollout.mode, the other leaders serve theirs to it,
    and every rank sends through the bridge; ranks other than 0 hold None for engine and schedule."""
    leader_ranks = replica_leaders(ps.world_size, cfg.rollout.replicas)
    if cfg.rollout.engine == "sglang" and not cfg.model.path:  # SGLang starts from a copy on disk, written once
        if ps.is_rank0:
            write_engine_init(cfg, source.hf_model)
        if len(leader_ranks) > 1:
            torch.distributed.barrier()
    engine = None
    if ps.rank in leader_ranks:  # with several replicas, every engine starts at the same time
        engine = engine_for(cfg, source.hf_model, source.tokenizer, return_routes=routing_replay, device=ps.device,
                            local_rank=ps.local_rank, replica_slot=node_slot(ps.rank, ps.local_rank, leader_ranks))
    engine, replica = connect_replicas(ps.rank, leader_ranks, engine, pad_token_id=source.tokenizer.pad_token_id,
                                       bucket_bytes=cfg.rollout.update_bucket_mb << 20)
    rollouts = SCHEDULES[cfg.rollout.mode](total_steps, cfg.rollout.staleness_limit) if ps.is_rank0 else None
    bridge = WeightBridge(actor_model, rollouts.gated(engine) if rollouts else None,
                          bucket_bytes=cfg.rollout.update_bucket_mb << 20, verify_every=cfg.rollout.verify_every,
                          lora_sync=cfg.rollout.lora_sync, receivers=leader_ranks, replica=replica)
    return engine, rollouts, bridge


def partial_rollouts(cfg: Config, tokenizer) -> PartialRollouts | None:
    """rollout.partial's carried samples and their rule (megappo.rollout.partial), with rollout.env's
    environments for multi-turn episodes; None when off."""
    part, r = cfg.rollout.partial, cfg.rollout
    if not part.enable:
        return None
    episodes = None
    if r.env != "single_turn":
        env = env_class(r.env)
        episodes = Episodes(env, r.env_args, tokenizer=tokenizer, max_turns=r.max_turns,
                            max_turn_tokens=r.max_turn_tokens, max_new_tokens=r.max_new_tokens,
                            encode_observation=observation_encoder(
                                tokenizer, env.observation_role, cfg.data.apply_chat_template,
                                r.bad_observation_policy, cfg.data.apply_chat_template_kwargs))
    return PartialRollouts(batch_size=cfg.data.train_batch_size, n=r.n, over_sample=part.over_sample,
                           chunk_tokens=r.partial_chunk_tokens, max_new_tokens=r.max_new_tokens,
                           max_token_staleness=part.max_token_staleness, on_stale=part.on_stale,
                           pad_token_id=tokenizer.pad_token_id, episodes=episodes)


def resume_state(resume: dict | None, ps: ParallelState, roles: Roles, kl_ctrl, prompts: Prompts, rollouts,
                 partial: PartialRollouts | None) -> tuple[int, int]:
    """Collective: when resuming, load the trained roles' models and optimizers, and on rank 0 the KL
    coefficient, the data cursor, the rollout buffer and the carried partial samples from the checkpoint.
    (start step, NaN skips)."""
    if not resume:
        return 0, 0
    checkpointing.load(resume["path"], _trained(roles.actor, roles.critic), ps.rank)
    kl_ctrl.value = resume["kl_coef"]
    if prompts.sampler:
        prompts.sampler.load_state_dict(resume["sampler"])
        rollouts.restore(checkpointing.load_rollout_buffer(resume["path"]))
        carried = checkpointing.load_partial_rollouts(resume["path"])
        if partial and carried:
            partial.load_state_dict(carried, prompts.train)
        elif carried and carried.get("groups"):
            print(f"megappo: the checkpoint carries {len(carried['groups'])} unfinished groups of rollout.partial; "
                  f"this run has rollout.partial.enable=false, so they are dropped (their prompts are not trained on "
                  f"until the next epoch)", flush=True)
    return resume["step"], resume["nan_skips"]


def val_only_dir(cfg: Config) -> str:
    """Where run.val_only logs its validations."""
    return os.path.join(cfg.run.output_dir, "val_only")


def announce(cfg: Config, ps: ParallelState, prompts: Prompts, roles: Roles, layouts: dict[str, ParallelState],
             *, resume: dict | None, start_step: int) -> tuple[MetricLogger | None, Progress | None]:
    """Rank 0: config.json in run.output_dir, the progress bar and the metric logger, and the start-up
    lines (resumed from where; world, prompts, steps, roles; per-role layouts). (None, None) elsewhere."""
    if not ps.is_rank0:
        return None, None
    log_dir = val_only_dir(cfg) if cfg.run.val_only else cfg.run.output_dir  # a validation leaves the run's own
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    progress = Progress(prompts.total_steps, start=start_step, enabled=cfg.logging.progress_bar and not cfg.run.val_only)
    # run.val_only: its own log, every validation kept (the run's metrics.jsonl is not cut back or added to)
    logger = MetricLogger(log_dir, cfg.logging.sinks,
                          project=cfg.logging.project, run_name=cfg.logging.run_name, config=cfg.to_dict(),
                          resume_step=None if cfg.run.val_only else start_step, progress=progress,
                          console=cfg.logging.console, mlflow_uri=cfg.logging.mlflow_tracking_uri)
    if cfg.run.val_only:
        weights = f"{resume['path']} (step {start_step})" if resume else f"model.path {cfg.model.path or '(built)'}"
        print(f"megappo: run.val_only: validating {weights} once, no training; metrics in "
              f"{os.path.join(val_only_dir(cfg), 'metrics.jsonl')}", flush=True)
    if resume:
        branch = resume["branch"]["from"] if resume["branch"] else None
        since = f", the branch from {branch}" if branch and branch != os.path.realpath(resume["path"]) else ""
        print(f"megappo: resumed from {resume['path']} (step {start_step}{since})", flush=True)
    print(f"megappo: world={ps.world_size} tp={ps.tp} pp={ps.pp}{f' cp={ps.cp}' if ps.cp > 1 else ''} dp={ps.dp} | prompts={len(prompts.train)}"
          f"{_long_prompts_note(prompts.stats, cfg.data.max_prompt_length)} | steps={prompts.total_steps} | "
          f"critic={'on' if roles.critic else 'off'} ref={_ref_note(cfg) if roles.ref else 'off'}"
          f"{_lora_note(cfg)} | "
          f"estimator={cfg.algorithm.adv_estimator} env={cfg.rollout.env}"
          f"{f' reward_workers={cfg.reward.num_workers}' if cfg.reward.num_workers else ''}"
          f"{_replicas_note(cfg, ps.world_size)}", flush=True)
    if any(state is not ps for state in layouts.values()):
        print("megappo: per-role layouts: " + ", ".join(
            f"{role} tp={tp} pp={pp}{f' vpp={vpp}' if vpp else ''}{f' cp={cp}' if cp > 1 else ''} "
            f"dp={ps.world_size // (tp * pp * cp)}"
            for role in cfg.model_roles for tp, pp, vpp in [cfg.layout(role)] for cp in [cfg.context_parallel(role)]),
            flush=True)
    return logger, progress


def _replicas_note(cfg: Config, world_size: int) -> str:
    """' rollout_replicas=2 (ranks 0, 1)' with several engine replicas (megappo.rollout.replicas), else ''."""
    if cfg.rollout.replicas == 1:
        return ""
    ranks = ", ".join(map(str, replica_leaders(world_size, cfg.rollout.replicas)))
    return f" rollout_replicas={cfg.rollout.replicas} (ranks {ranks})"


def _ref_note(cfg: Config) -> str:
    return "actor's base (adapters off)" if cfg.ref_is_actor_base else "on"


def _lora_note(cfg: Config) -> str:
    """' | lora: actor r=8 alpha=16' for the roles with adapters, or ''."""
    roles = [f"{role} r={lora.rank} alpha={lora.alpha:g}" for role in ("actor", "critic")
             for lora in [lora_of(cfg, role)] if lora.enabled]
    return f" | lora: {', '.join(roles)}" if roles else ""


def _long_prompts_note(stats: dict[str, int], limit: int) -> str:
    """' (4 truncated to data.max_prompt_length=512)', or '' when no prompt was too long."""
    done = [f"{n} {what}" for what, n in (("skipped", stats.get("skipped_long", 0)),
                                          ("truncated", stats.get("truncated_long", 0))) if n]
    return f" ({', '.join(done)}: longer than data.max_prompt_length={limit})" if done else ""

