"""HF <-> Megatron checkpoint conversion, with verification (used by tools/ and the CLI).

`hf_to_megatron`: HF directory -> megappo model checkpoint (Megatron dist-checkpoint +
metadata + HF config/tokenizer files) written at the current TP/PP layout.
`megatron_to_hf`: back to an HF directory (config, tokenizer files, safetensors shards).
Both are collectives over all ranks of the layout; both write into a temporary directory
next to the output and rename it into place only when everything (including --verify)
succeeded, so a failure never leaves a half-written output.

A LoRA actor's export also writes a peft adapter (PEFT_DIR) and names its base model in
adapter_config.json (`AdapterBase`): the HF directory the run started from, or the base written
next to the adapter (BASE_DIR) from the model's frozen weights.

Verification: (1) round trip bit-exact: the loaded Megatron shards, gathered and mapped
back, equal the HF tensors bit for bit; (2) logits: Megatron's logits (or values, for a
value-head model) on sample inputs equal transformers' within `tol` (the model dtype's).

This module does not know about PPO or the trainer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Mapping

import torch
import torch.distributed as dist

from megappo.config import SAVED_MODULES
from megappo.models.builders import MegatronModel, build_model
from megappo.models.checkpoint import load_model, read_metadata, save_model
from megappo.models.forward import gather_vocab_logits, run_micro_batches
from megappo.models.hf_config import ModelConfigError, ModelDims, dims_from_hf, load_hf_config
from megappo.models.hf_reference import ShardedSafetensorsWriter
from megappo.models.precision import LOGIT_TOL
from megappo.models.lora import LoRA
from megappo.models.weights import HFWeights, iter_adapter_tensors, iter_hf_tensors, load_hf_weights
from megappo.parallel.state import ParallelState

#: Files besides weights that an HF model directory carries along (tokenizer, templates).
HF_AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "generation_config.json",
)


def read_aux_files(hf_dir: str, everything: bool = False) -> dict[str, bytes]:
    """The tokenizer / generation files of an HF directory (every file with everything=True)."""
    out = {}
    names = sorted(os.listdir(hf_dir)) if everything and os.path.isdir(hf_dir) else HF_AUX_FILES
    for name in names:
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"output '{out_dir}' exists and is not empty; pass --overwrite or choose another path.")


class _StagedOutput:
    """A temp directory beside `out_dir`, renamed into place on success, removed on failure.
    `digests`: each rank records the size and digest of the files it wrote (digests/rank_R.json,
    megappo.trainer.checkpointing) before the rename, so readers can check them (check_model_dir)."""

    def __init__(self, out_dir: str, ps: ParallelState, overwrite: bool, *, digests: bool = False):
        self.out_dir, self.ps, self.overwrite, self.digests = os.path.abspath(out_dir), ps, overwrite, digests
        box = [f"{self.out_dir}.tmp-{os.getpid()}" if ps.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.tmp = box[0]

    def __enter__(self) -> str:
        if self.ps.rank == 0:
            os.makedirs(os.path.dirname(self.tmp) or ".", exist_ok=True)
        dist.barrier()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.digests:
            from megappo.trainer.checkpointing import write_digests

            dist.barrier()  # every rank's files are written
            write_digests(self.tmp, dist.get_rank(), dist.get_world_size())
            dist.barrier()
        if self.ps.rank == 0:
            if exc_type is None:
                if os.path.exists(self.out_dir):
                    shutil.rmtree(self.out_dir)  # only reachable with --overwrite
                os.replace(self.tmp, self.out_dir)
            elif os.path.exists(self.tmp):
                shutil.rmtree(self.tmp)
        if exc_type is None:
            dist.barrier()  # nobody reads out_dir before rank 0 has renamed it into place
        return False


def hf_to_megatron(hf_dir: str, out_dir: str, ps: ParallelState, *, role: str = "actor",
                   verify: bool = False, overwrite: bool = False, arch: str | None = None) -> dict:
    """Collective. Returns verification results (empty when verify=False)."""
    check_output_dir(out_dir, overwrite)
    hf_config = load_hf_config(hf_dir)
    dims = dims_from_hf(hf_config, arch)
    model = build_model(dims, ps, role=role)
    load_hf_weights(model, hf_dir)
    results = {}
    with _StagedOutput(out_dir, ps, overwrite, digests=True) as tmp:
        save_model(model, tmp, hf_config, read_aux_files(hf_dir))
        if verify:
            fresh = build_model(dims, ps, role=role)
            load_model(fresh, tmp)
            results = verify_model(fresh, hf_dir)
    return results


def megatron_to_hf(ckpt_dir: str, out_dir: str, ps: ParallelState, *, verify: bool = False,
                   overwrite: bool = False, max_shard_bytes: int = 2 << 30, base: AdapterBase | None = None) -> dict:
    """Collective. Writes the HF directory from global rank 0 (`base`: see export_hf)."""
    check_output_dir(out_dir, overwrite)
    meta = read_metadata(ckpt_dir)
    dims = ModelDims(**meta["dims"])
    # the dtype it was saved in (checkpoints before megappo recorded it were float32)
    saved = meta.get("lora")
    lora = LoRA(**{**saved, "targets": tuple(saved["targets"]), "modules_to_save": tuple(saved["modules_to_save"])}
                ) if saved else LoRA()
    model = build_model(dims, ps, role=meta["role"], dtype=meta.get("dtype", "float32"), lora=lora)
    load_model(model, ckpt_dir)  # a LoRA model's adapters too: its export is merged (and peft's adapter)
    return export_hf(model, out_dir, meta["hf_config"], read_aux_files(os.path.join(ckpt_dir, "hf"), everything=True),
                     verify=verify, overwrite=overwrite, max_shard_bytes=max_shard_bytes, base=base)


def export_hf(model: MegatronModel, out_dir: str, hf_config: dict, hf_files: dict[str, bytes], *,
              verify: bool = False, overwrite: bool = False, max_shard_bytes: int = 2 << 30,
              base: AdapterBase | None = None) -> dict:
    """Collective: the live (sharded) model as an HF directory written by global rank 0:
    safetensors shards in the model's dtype, `hf_config` (saying that dtype) as config.json,
    and `hf_files` (tokenizer files). A LoRA actor's also holds its peft adapter (PEFT_DIR) and,
    unless `base` names the directory the run started from, the base model (BASE_DIR)."""
    ps = model.ps
    check_output_dir(out_dir, overwrite)
    results = {}
    with _StagedOutput(out_dir, ps, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes) if ps.rank == 0 else None
        for name, tensor in iter_hf_tensors(model):
            writer.add(name, tensor)
        if ps.rank == 0:
            writer.close()
            _write_config_and_files(tmp, model, hf_config, hf_files)
        if model.lora.enabled and not model.has_value_head:
            base = base or AdapterBase()
            base_path = base.path or os.path.join(os.path.abspath(out_dir), BASE_DIR)  # where it will be
            write_peft_adapter(model, os.path.join(tmp, PEFT_DIR), hf_config, base_path, hf_files)
            if not base.path:
                write_base(model, os.path.join(tmp, BASE_DIR), hf_config, hf_files, base.start, max_shard_bytes)
        dist.barrier()
        if verify:
            results = verify_model(model, tmp)
    return results


#: where export_hf writes a LoRA actor's adapters in peft's format, next to the merged weights
PEFT_DIR = "adapter"
#: where export_hf writes a LoRA actor's base model (the weights its adapters apply to), when written
BASE_DIR = "base"
#: the tokenizer files the adapter directory carries (AutoTokenizer loads from it; peft's AutoPeftModel
#: then finds them locally instead of asking the Hub)
_TOKENIZER_FILES = tuple(n for n in HF_AUX_FILES if n != "generation_config.json")


@dataclasses.dataclass(frozen=True)
class AdapterBase:
    """The base model a LoRA export's peft adapter names (adapter_config.json's base_model_name_or_path).

    `path`: the HF directory the run started from (model.path), named as given, nothing copied.
    None: the base is written next to the adapter (BASE_DIR) and named by its absolute path: the
    model's frozen weights, except the modules trained fully (modules_to_save), whose starting values
    a checkpoint no longer holds: `start` gives them (HF name -> tensor, e.g. a random init rebuilt
    from its seed); a module missing from `start` is written as trained."""

    path: str | None = None
    start: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def _saved_modules(lora: LoRA, tied_embeddings: bool) -> set[str]:
    """HF module names (lm_head, embed_tokens) trained fully: tied embeddings, both or neither."""
    saved = set(lora.modules_to_save)
    return set(SAVED_MODULES) if tied_embeddings and saved else saved


def write_peft_adapter(model: MegatronModel, out_dir: str, hf_config: dict, base_path: str | None = None,
                       hf_files: dict[str, bytes] | None = None) -> None:
    """Collective: a LoRA model's adapters as a peft adapter directory written by global rank 0
    (adapter_config.json + adapter_model.safetensors, peft's names `base_model.model.<module>.lora_A.weight`,
    and the tokenizer files of `hf_files`), naming `base_path` as its base model, so that
    AutoPeftModelForCausalLM.from_pretrained(out_dir) or PeftModel.from_pretrained(<that model>, out_dir) loads it."""
    from safetensors.torch import save_file

    adapters = list(iter_adapter_tensors(model))  # (HF module name, lora_A | lora_B, tensor)
    trained = model.lora.trained_prefixes(model.dims.tie_word_embeddings)
    saved = list(iter_hf_tensors(model, only=trained)) if trained else []  # modules_to_save, whole
    if model.ps.rank != 0:
        return
    # q, k and v (gate and up) share one A: each gets its own copy in the file
    tensors = {f"base_model.model.{module}.{which}.weight": t.clone() for module, which, t in adapters}
    tensors.update({f"base_model.model.{name}": t.contiguous() for name, t in saved})
    lora = model.lora
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": sorted({module.rpartition(".")[2] for module, _, _ in adapters}),
              "base_model_name_or_path": base_path,
              "modules_to_save": sorted({name.split(".")[-2] for name, _ in saved}) or None,
              "use_rslora": False, "init_lora_weights": True}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name, data in (hf_files or {}).items():
        if name in _TOKENIZER_FILES:
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(data)


def write_base(model: MegatronModel, out_dir: str, hf_config: dict, hf_files: dict[str, bytes],
               start: Mapping[str, torch.Tensor], max_shard_bytes: int = 2 << 30) -> None:
    """Collective: a LoRA model's base as an HF directory written by global rank 0: its weights without
    the adapters' update (in the model's dtype), the fully trained modules at their `start` values
    (AdapterBase), config.json and `hf_files`."""
    saved = _saved_modules(model.lora, model.dims.tie_word_embeddings)
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes) if model.ps.rank == 0 else None
    for name, tensor in iter_hf_tensors(model, merged=False):
        if name.rsplit(".", 2)[-2] in saved and name in start:
            tensor = start[name].to(tensor.dtype)
        writer.add(name, tensor)
    if model.ps.rank == 0:
        writer.close()
        _write_config_and_files(out_dir, model, hf_config, hf_files)


def _write_config_and_files(out_dir: str, model: MegatronModel, hf_config: dict, hf_files: dict[str, bytes]) -> None:
    """Rank 0's part of an HF directory beside the weights: config.json (saying the model's dtype) and
    `hf_files` (tokenizer files; their own config.json, if any, is the model's)."""
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.precision.hf_config(hf_config), f, indent=2)
    for name, data in hf_files.items():
        if name != "config.json":
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(data)


def verify_model(model: MegatronModel, hf_dir: str, *, tol: float | None = None, seed: int = 0) -> dict:
    """Collective: round trip bit-exact and logits vs transformers; raises on failure. Transformers
    computes in float32 (the exact values of the saved weights); the Megatron model in its own dtype,
    so `tol` defaults to its precision's (megappo.models.precision.LOGIT_TOL, relative to the
    largest |logit| when that exceeds 1)."""
    if tol is None:
        tol = LOGIT_TOL[model.precision.name]
    ps = model.ps
    # (1) bit-exact: gathered Megatron tensors == the HF directory's tensors
    mismatched, count, head_missing = [], 0, False
    weights = HFWeights(hf_dir) if ps.rank == 0 else None
    names = weights.names() if weights else set()
    for name, tensor in iter_hf_tensors(model):
        if model.has_value_head and name.startswith("score.") and name not in names:
            head_missing = True  # an LM checkpoint for a critic: the head was initialised
            continue
        count += 1
        if not torch.equal(tensor, weights.get(name).to(tensor.dtype)):
            mismatched.append(name)
    flags = torch.tensor([len(mismatched), int(head_missing)], dtype=torch.int64, device=ps.device)
    dist.broadcast(flags, src=0)
    if flags[0].item():
        raise ModelConfigError(f"round trip is not bit-exact for {flags[0].item()} tensors, e.g. {mismatched[:3]}")
    if flags[1].item():
        return {"tensors_bit_exact": count if ps.rank == 0 else None, "max_abs_logit_diff": None,
                "note": "value head not in the HF checkpoint: initialised, outputs not compared"}
    # (2) logits: Megatron vs transformers on the same sample inputs
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.dims.vocab_size, (2, 16), generator=gen)
    mbs = [{"input_ids": input_ids[i:i + 1]} for i in range(2)]
    outs = run_micro_batches(model, mbs, lambda out, mb: (out.sum() * 0, out.detach()), forward_only=True)
    diff = torch.zeros(1, dtype=torch.float64, device=ps.device)
    if ps.is_last_stage:
        got = torch.cat(outs)
        if not model.has_value_head:
            got = gather_vocab_logits(got, model)
        if ps.tp_rank == 0:
            ref = _hf_outputs(hf_dir, input_ids, model.has_value_head)
            diff[0] = (got.float().cpu() - ref.float()).abs().max() / max(1.0, ref.abs().max().item())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if diff.item() > tol:
        raise ModelConfigError(f"Megatron ({model.precision.name}) and transformers outputs differ by {diff.item():.3e} "
                               f"(> {tol}, relative to the largest |logit| when above 1)")
    return {"tensors_bit_exact": count if ps.rank == 0 else None, "max_abs_logit_diff": diff.item()}


def _hf_outputs(hf_dir: str, input_ids: torch.Tensor, value_head: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with torch.no_grad():
        if value_head:
            m = AutoModelForTokenClassification.from_pretrained(hf_dir, num_labels=1, dtype=torch.float32,
                                                                use_safetensors=True)
            return m(input_ids=input_ids).logits.squeeze(-1)
        m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, use_safetensors=True)
        return m(input_ids=input_ids).logits
