"""transformers' fused in-memory MoE tensors <-> HF checkpoint names (pure: torch only).

transformers >= 5 holds a MoE layer's experts fused in memory:
  {p}.mlp.experts.gate_up_proj  [E, 2*F, H]  expert j's gate rows [:F], then its up rows [F:]
  {p}.mlp.experts.down_proj     [E, H, F]
  {p}.mlp.gate.weight           [E, H]      the router
while `save_pretrained`, the Hub and SGLang use one tensor per expert (the checkpoint names):
  Qwen3-MoE: {p}.mlp.experts.{j}.{gate,up,down}_proj.weight,        {p}.mlp.gate.weight
  Mixtral:   {p}.block_sparse_moe.experts.{j}.{w1,w3,w2}.weight,     {p}.block_sparse_moe.gate.weight
megappo's HF names (name map, bridge, conversion) are the checkpoint names. `checkpoint_views`
maps each of them to a view of the in-memory tensor, so an engine can copy a per-expert
tensor into its fused parameter in place and fingerprint it by its checkpoint name.
Legend: E experts, F expert ffn size, H hidden, p = model.layers.{i}.

This module does not know about Megatron, process groups or engines.
"""

from __future__ import annotations

from typing import Mapping

import torch

#: model_type -> (router's checkpoint name, expert checkpoint name, (gate, up, down) names), with
#: {p} the layer prefix and {j} the expert
CHECKPOINT_NAMES = {
    "qwen3_moe": ("{p}.mlp.gate.weight", "{p}.mlp.experts.{j}.{w}.weight", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("{p}.block_sparse_moe.gate.weight", "{p}.block_sparse_moe.experts.{j}.{w}.weight",
                ("w1", "w3", "w2")),
}

_GATE_UP = ".mlp.experts.gate_up_proj"
_DOWN = ".mlp.experts.down_proj"
_ROUTER = ".mlp.gate.weight"


def checkpoint_views(params: Mapping[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """In-memory named tensors -> checkpoint-named tensors; fused expert tensors become
    per-expert views of the same storage (writing into a view writes the parameter)."""
    if model_type not in CHECKPOINT_NAMES:
        return dict(params)
    router, expert, (gate, up, down) = CHECKPOINT_NAMES[model_type]
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name.endswith(_GATE_UP):
            p, f = name[: -len(_GATE_UP)], t.shape[1] // 2
            for j in range(t.shape[0]):
                out[expert.format(p=p, j=j, w=gate)] = t[j, :f]
                out[expert.format(p=p, j=j, w=up)] = t[j, f:]
        elif name.endswith(_DOWN):
            p = name[: -len(_DOWN)]
            for j in range(t.shape[0]):
                out[expert.format(p=p, j=j, w=down)] = t[j]
        elif name.endswith(_ROUTER) and t.dim() == 2:
            out[router.format(p=name[: -len(_ROUTER)])] = t
        else:
            out[name] = t
    return out


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's state dict under checkpoint names (what save_pretrained writes),
    each tensor a contiguous copy."""
    views = checkpoint_views(model.state_dict(), getattr(model.config, "model_type", ""))
    return {name: t.detach().clone().contiguous() for name, t in views.items()}
