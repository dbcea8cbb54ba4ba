"""What `megappo train` checks before any rank starts or any model is built, from files alone.

`check_inputs(cfg, world_size, launcher=None)` first checks that every optional package the run is configured
to use is installed (`check_packages`: the logging sinks, the rollout engine, `--launcher ray`; one table,
PACKAGES, found with importlib's find_spec, nothing imported; peft is not among them: a LoRA export
writes peft's adapter files itself, megappo.trainer.convert), then the world against the layout and the batch sizes
(`Config.validate_world`), that there are prompts and a reward (`Config.require_training_data`),
every model's config.json against its role's tp / pp / vpp (heads, query groups, FFN, layers; the
trained roles' activation recomputation against their layers per pipeline chunk), each role's Megatron
dist checkpoint (a directory with Megatron's metadata.json) and
the roles' vocabularies against the actor's, the dataset files (present, a known format, a row
at least; with data.custom_cls the user's dataset class instead, which reads them), the user's sampler
class (data.sampler), the reward function names, the tokenizer's name or directory, and the episode
environment (`rollout.env` imports, is an Environment and takes `rollout.env_args`). It reads JSON and
file headers only (no torch, no tokenizer, no dataset rows), so the CLI runs it in the launching
process and `create_run` again on every rank, before prompts are tokenized. What needs the
tokenizer or the rows (the vocabulary size, a row without a prompt, prompts over the length
limit) is checked by `create_run` before any model is built.

`load_prompts(cfg, tokenizer)` reads the rows (data.train_files / val_files, through the user's
dataset class with data.custom_cls, or a built-in source), runs the data check on them (megappo.trainer.data_check, per data.bad_row_policy) and tokenizes
the prompts: rank 0 of `create_run` uses its examples; the CLI also runs it, with the tokenizer
check against the model's vocabulary (`check_prompts`), in the process that launches the ranks
(megappo's launcher, Ray), so a bad row, broken JSON or an over-long prompt is refused before any
rank starts and is the only error on the screen.

Every failure is a ConfigError / DataError / ModelConfigError whose message says the fix.

This module does not know about process groups, weights or PPO.
"""

from __future__ import annotations

import os

import contextlib
import dataclasses
import io

from megappo.config import Config
from megappo.data.prompts import (RowOrigin, build_prompts, builtin_rows, builtin_splits, check_files, dataset_class,
                          numbered, read_rows, sampler_class)
from megappo.trainer.data_check import check_data, warn_shared_prompts
from megappo.envs.loading import check_env
from megappo.errors import ConfigError
from megappo.models.hf_config import ModelConfigError, dims_from_hf, load_hf_config
from megappo.models.recompute import Recompute
from megappo.rollout.routes import is_moe_arch
from megappo.rewards import get_reward_fn
from megappo.data.tokenizer import check_tokenizer_spec


#: (setting, value) -> (the module it imports, the pip command that installs it, what else the user can do):
#: every optional package a configured integration needs, checked before any rank starts (check_packages)
PACKAGES: dict[tuple[str, str], tuple[str, str, str]] = {
    ("logging.sinks", "wandb"): ("wandb", "pip install wandb", "remove wandb from logging.sinks / trainer.logger"),
    ("logging.sinks", "tensorboard"): ("tensorboard", "pip install tensorboard",
                                       "remove tensorboard from logging.sinks / trainer.logger"),
    ("logging.sinks", "mlflow"): ("mlflow", "pip install mlflow", "remove mlflow from logging.sinks / trainer.logger"),
    ("rollout.engine", "sglang"): ("sglang", "pip install -e '.[gpu]' on a GPU machine (on CPU: the virtualenv "
                                   "tests/sglang/setup_venv.sh builds, docs/engines.md)", "set rollout.engine=hf"),
    ("--launcher", "ray"): ("ray", "pip install -e '.[ray]' (or pip install ray)", "launch without --launcher ray"),
}


def check_packages(cfg: Config, launcher: str | None = None) -> None:
    """Every package PACKAGES names for what `cfg` (and the launcher, `--launcher`) uses is installed;
    else a ConfigError naming the setting and its pip command. find_spec only: nothing is imported."""
    import importlib.util

    sinks = list(cfg.logging.sinks)
    used = [*(("logging.sinks", s) for s in sinks), ("rollout.engine", cfg.rollout.engine), ("--launcher", launcher)]
    for setting, value in used:
        if (setting, value) not in PACKAGES:
            continue
        module, pip, instead = PACKAGES[setting, value]
        if importlib.util.find_spec(module) is None:
            shown = f"logging.sinks=[{','.join(sinks)}]" if setting == "logging.sinks" else \
                f"--launcher {value}" if setting == "--launcher" else f"{setting}={value}"
            raise ConfigError(f"{shown} needs the {value} package, which is not installed. Fix: {pip} "
                              f"(or {instead}).")


def check_inputs(cfg: Config, world_size: int, launcher: str | None = None) -> None:
    check_packages(cfg, launcher)
    cfg.validate_world(world_size)
    cfg.require_training_data()
    check_models(cfg)
    if cfg.data.sampler.class_path:
        sampler_class(cfg.data.sampler.class_path, cfg.data.sampler.class_name)
    if cfg.data.custom_cls.path:  # the user's class reads the files itself (they may name a hub dataset)
        dataset_class(cfg.data.custom_cls.path, cfg.data.custom_cls.name)
    else:
        check_files(cfg.data.train_files, "data.train_files")
        check_files(cfg.data.val_files, "data.val_files")
    for name in [*cfg.reward.functions, *cfg.reward.metric_functions]:
        get_reward_fn(name)
    check_tokenizer_spec(cfg.model.tokenizer_path)
    check_env(cfg.rollout.env, cfg.rollout.env_args)


def _prepared_hf_config(cfg: Config) -> dict:
    """model.path's config.json; when it is missing and the recipe names the command that writes it
    (model.prepare), the error says to run that command."""
    try:
        return load_hf_config(cfg.model.path)
    except ModelConfigError:
        if cfg.model.prepare and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            raise ModelConfigError(f"model.path={cfg.model.path} does not exist yet: this recipe's model is prepared "
                                   f"once by a command. Fix: run `{cfg.model.prepare}`, then start the run again.")
        raise


def check_models(cfg: Config) -> None:
    """Every model the run builds splits over its role's layout and has the actor's vocabulary."""
    actor = dims_from_hf(cfg.model.hf_config or _prepared_hf_config(cfg), cfg.model.arch)
    if cfg.actor.moe_routing == "replay" and not (actor.is_moe and is_moe_arch(actor.arch)):
        raise ModelConfigError(f"actor.moe_routing=replay needs a Mixture-of-Experts actor; {actor.arch} is dense. "
                               "Fix: set actor.moe_routing=recompute.")
    if cfg.rollout.lora_sync == "adapters" and actor.is_moe:
        raise ModelConfigError(f"rollout.lora_sync=adapters: {actor.arch} is a Mixture-of-Experts model, whose "
                               "experts transformers fuses into tensors with no per-expert linear to adapt. Fix: "
                               "set rollout.lora_sync=merged.")
    sources = {"actor": ("model", actor), "ref": ("model", actor), "critic": ("model", actor)}
    if cfg.use_critic and cfg.critic.path:
        sources["critic"] = ("critic.path", dims_from_hf(load_hf_config(cfg.critic.path)))
    if cfg.reward.model_path:
        sources["reward"] = ("reward.model_path", dims_from_hf(load_hf_config(cfg.reward.model_path)))
    for role in cfg.model_roles:
        where, dims = sources[role]
        try:
            dims.check_layout(*cfg.layout(role), ep=cfg.expert_parallel(role),
                              ep_name=f"{role}.parallel.ep" if getattr(cfg, role).parallel.ep else "parallel.ep")
        except ModelConfigError as e:
            own = " (its own layout: " + role + ".parallel)" if cfg.layout(role) != (
                cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp) else ""
            raise ModelConfigError(f"{where} as the {role}{own}: {e}") from None
        if dims.is_moe and cfg.context_parallel(role) > 1:
            key = f"{role}.parallel.cp" if cfg.context_parallel_own(role) else "parallel.cp"
            raise ModelConfigError(f"{where} as the {role} is a mixture-of-experts model, and {key}="
                                   f"{cfg.context_parallel(role)}: context parallelism with MoE is not supported yet "
                                   f"(routing records and the router's auxiliary loss are not split over the CP group). "
                                   f"Fix: set {key}=1.")
        if role in ("actor", "critic"):  # activation recomputation against this role's layers per pipeline chunk
            _, pp, vpp = cfg.layout(role)
            Recompute.of(getattr(cfg, role).recompute, f"{role}.recompute").check(
                dims, pp=pp, vpp=vpp, cpu=cfg.hardware.device == "cpu")
        if dims.vocab_size != actor.vocab_size:
            raise ModelConfigError(f"{where} has vocab_size {dims.vocab_size}, the actor (model) {actor.vocab_size}: "
                                   "every role scores the same token ids. Fix: use a model with the actor's "
                                   "tokenizer and vocabulary.")
    check_dist_checkpoints(cfg)


def check_dist_checkpoints(cfg: Config) -> None:
    """Each role's Megatron dist checkpoint (`<role>.dist_checkpoint`; the reference's defaults to the actor's) is
    a directory with Megatron's metadata.json; its tensors are checked against the model when it loads."""
    keys = {"actor": "actor.dist_checkpoint", "critic": "critic.dist_checkpoint",
            "ref": "actor.dist_checkpoint" if cfg.ref.dist_checkpoint is None or cfg.ref_is_actor_base
            else "ref.dist_checkpoint"}
    for key in dict.fromkeys(keys[role] for role in cfg.model_roles if role in keys):
        path = getattr(cfg, key.partition(".")[0]).dist_checkpoint
        if path and not os.path.isfile(os.path.join(path, "metadata.json")):
            raise ModelConfigError(
                f"{key}={path} is not a Megatron-Core dist checkpoint ("
                f"{'no metadata.json in it' if os.path.isdir(path) else 'no such directory'}). Fix: point it at a "
                "directory written by dist_checkpointing.save (verl's scripts/converter_hf_to_mcore.py), or unset "
                "it to load model.path's HF weights.")


def _prompt_rows(d) -> tuple[list[dict], list[dict] | None]:
    """(training rows, validation rows or None) from data.*: files, or a built-in source whose
    validation rows (when data.val_files is empty) hold out its training prompts."""
    train, val = _rows_and_origins(d)
    return train[0], val[0] if val else None


def _rows_and_origins(d) -> tuple[tuple[list[dict], list[RowOrigin]], tuple[list[dict], list[RowOrigin]] | None]:
    """`_prompt_rows` with each row's RowOrigin: (rows, origins) of training, of validation or None."""
    builtin = f"data.builtin={d.builtin}"
    # the files, or the rows a dataset class of the user's reads from them (data.custom_cls)
    reader = dict(dataset=(d.custom_cls.path, d.custom_cls.name), config=dataclasses.asdict(d)) if d.custom_cls.path \
        else {}
    if d.builtin and not d.val_files:
        train, val = builtin_splits(d.builtin, d.builtin_size, d.builtin_val_size, d.seed, d.builtin_args)
        return (train, numbered(builtin, len(train), "builtin")), (val, numbered(builtin, len(val), "builtin",
                                                                                   "validation"))
    if d.builtin:
        rows = builtin_rows(d.builtin, d.builtin_size, d.seed, d.builtin_args)
        train = rows, numbered(builtin, len(rows), "builtin")
    else:
        train = read_rows(d.train_files, **reader)
    return train, read_rows(d.val_files, "data.val_files", **reader) if d.val_files else None


def load_prompts(cfg: Config, tokenizer) -> tuple[list, list, dict[str, int]]:
    """(training examples, validation examples, the long-prompt counts): the rows checked per
    data.bad_row_policy (its warnings printed) and tokenized; raises DataError naming the fix.
    Every example keeps its row's RowOrigin (file and line, or built-in source; training or validation)."""
    d = cfg.data
    (rows, origins), val = _rows_and_origins(d)
    source = f"data.builtin={d.builtin}" if d.builtin else f"data.train_files {d.train_files}"
    check = dict(policy=d.bad_row_policy, prompt_key=d.prompt_key, max_new_tokens=cfg.rollout.max_new_tokens,
                 reward_functions=[*cfg.reward.functions, *cfg.reward.metric_functions])
    rows, origins = check_data(rows, tokenizer, source=source, origins=origins, **check)
    kw = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
              long_prompt_policy=d.long_prompt_policy, apply_chat_template=d.apply_chat_template,
              system_prompt=d.system_prompt, few_shot=d.few_shot, template_kwargs=d.apply_chat_template_kwargs)
    train_examples, data_stats = build_prompts(rows, tokenizer, source=str(d.builtin or d.train_files),
                                               origins=origins, **kw)
    val_examples = []
    if val is not None:
        val_rows, val_origins = check_data(val[0], tokenizer, source=f"data.val_files {d.val_files}" if d.val_files
                                           else f"data.builtin={d.builtin} (validation)", origins=val[1], **check)
        if d.val_files:  # a built-in source's own validation rows are held out by construction
            warn_shared_prompts(rows, val_rows, prompt_key=d.prompt_key, train_source=source,
                                val_source=f"data.val_files {d.val_files}", env=cfg.rollout.env)
        val_examples, _ = build_prompts(val_rows, tokenizer, source="validation", origins=val_origins, **kw)
    return train_examples, val_examples, data_stats


def check_prompts(cfg: Config) -> None:
    """What `create_run` refuses on rank 0 before any model is built, checked here without ranks:
    the tokenizer against the model's vocabulary, then every row (`load_prompts`). Prints nothing:
    rank 0 prints the data check's warnings once the run starts."""
    from megappo.data.tokenizer import check_vocab, load_tokenizer

    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    check_vocab(tokenizer, dims_from_hf(cfg.model.hf_config or _prepared_hf_config(cfg), cfg.model.arch).vocab_size)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        load_prompts(cfg, tokenizer)
