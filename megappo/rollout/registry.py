"""Building the rollout engine: `ENGINES` (rollout.engine -> class), `build_engine(name, ...)`,
and `engine_for(cfg, ...)`, the engine a recipe asks for on rank 0 (and on each other replica's rank).

`engine_for` makes every choice the recipe implies: `hf` in this process (with the trainer's
transformers copy of a model built from `model.hf_config`, or one loaded from `model.path`), `hf`
in a child process (`rollout.placement=separate`: the child builds its own copy from an
`HFModelSource`), or `sglang` (which starts from a directory: a model from `model.hf_config` is
first saved under `run.output_dir`/engine-init by `write_engine_init`, once per run), asking the
engine for its expert choices when the trainer replays them.

This is the one module that imports the engine implementations; they import the interface and
the shared helpers from `megappo.rollout.engine`, which imports none of them.

This module does not know about Megatron, PPO or how the bridge gathers weights.
"""

from __future__ import annotations

import os

import torch

from megappo.config import Config
from megappo.rollout.engine import RolloutEngine
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.hf.remote import HFModelSource, RemoteEngine
from megappo.rollout.sglang_engine import SGLangEngine

#: rollout.engine -> engine class (SGLang itself is imported only when an SGLangEngine starts)
ENGINES = {"hf": HFEngine, "sglang": SGLangEngine}


def build_engine(name: str, **kwargs) -> RolloutEngine:
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine '{name}'; choose one of {sorted(ENGINES)} (rollout.engine)")
    return ENGINES[name](**kwargs)


def engine_init_dir(cfg: Config) -> str:
    """Where SGLang's starting copy of a model built from `model.hf_config` is written."""
    return os.path.join(cfg.run.output_dir, "engine-init")


def write_engine_init(cfg: Config, hf_model) -> str:
    """Write that copy (once per run: rank 0, before any replica's SGLang starts from it)."""
    path = engine_init_dir(cfg)
    hf_model.save_pretrained(path)
    return path


def engine_for(cfg: Config, hf_model, tokenizer, *, return_routes: bool, device: torch.device,
               local_rank: int = 0, replica_slot: int = 0) -> RolloutEngine:
    """The engine `cfg.rollout` names, holding the initial weights. `hf_model`: the transformers
    model built from `model.hf_config` (None when the weights come from `model.path`);
    `return_routes`: the trainer replays the engine's expert choices (routing replay); `device`:
    the trainer's (the hf engine runs on a CUDA trainer's GPU in the model dtype); `local_rank`:
    the building rank's on its node (a colocated SGLang replica starts on that rank's GPU); `replica_slot`:
    the engine is its node's replica_slot-th (megappo.rollout.replicas.node_slot; SGLang with
    sync_mode=distributed starts that many engines' GPUs after the trainer's). SGLang with a model from
    `model.hf_config` starts from the copy `write_engine_init` wrote before."""
    if cfg.rollout.engine == "hf" and cfg.rollout.placement == "separate":  # the child builds its own copy
        source = HFModelSource(path=cfg.model.path, hf_config=cfg.model.hf_config, seed=cfg.model.seed_init)
        return RemoteEngine(source, pad_token_id=tokenizer.pad_token_id, cores=cfg.rollout.engine_cores)
    if cfg.rollout.engine == "hf":
        if hf_model is None:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, use_safetensors=True)
        from megappo.rollout.hf.engine import gpu_placement

        return build_engine("hf", model=hf_model, pad_token_id=tokenizer.pad_token_id,
                            decode=cfg.rollout.hf_decode, eos_check_every=cfg.rollout.hf_eos_check_every,
                            max_tokens=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                            **gpu_placement(device, cfg.model.dtype))
    model_path = cfg.model.path or engine_init_dir(cfg)  # a model from model.hf_config: its copy on disk
    colocated = cfg.rollout.sync_mode != "distributed"
    placement = {"base_gpu_id": local_rank} if colocated and local_rank and device.type == "cuda" else {}
    return build_engine("sglang", model_path=model_path, pad_token_id=tokenizer.pad_token_id,
                        dtype=cfg.model.dtype, sync_mode=cfg.rollout.sync_mode, logprob_mode=cfg.rollout.logprob_mode,
                        replica_slot=replica_slot,
                        engine_args={**({"enable_return_routed_experts": True} if return_routes else {}),
                                     **placement, **cfg.rollout.sglang})
