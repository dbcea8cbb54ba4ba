"""Routing replay, engine side: which experts the rollout engine routed every token to.

An MoE model's router picks top-k experts per token and layer. The trainer recomputes the
same tokens with other kernels (and, after an update, other weights), and a near-tie in
the router flips an expert: the trainer then scores a token with a computation the engine
never ran, and the importance ratio breaks. Replay records the engine's choices and makes
the trainer's routers use them (`megappo.models.routing_replay`).

Records are `[N, T, L, k]` int16 expert ids aligned with `RolloutBatch.sequences()`: T = P + R
positions (the left-padded prompt, then the response), L decoder layers (a dense layer of
a mixed model, a padding position and a sequence's last token, which the engine never runs,
hold -1: the trainer's own router decides there, see `fill_unknown`).

`RouteRecorder(model, arch)` hooks the routers of a transformers MoE model (the hf
engine): each forward call's top-k ids are kept per layer. SGLang returns the same record
with `--enable-return-routed-experts` (`decode_sglang_routes`).

Shape legend: N samples, B rows of one forward call, S its positions, T = P + R, L decoder
layers, k experts per token, E experts.

This module does not know about Megatron, PPO or configs.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

UNKNOWN = -1

#: HF architecture -> the attribute path, under each decoder layer, of the router module whose
#: forward returns (router_logits, router_scores, router_indices [B*S, k]) in transformers 5
ROUTERS = {
    "Qwen3MoeForCausalLM": "mlp.gate",
    "MixtralForCausalLM": "mlp.gate",
}


def is_moe_arch(arch: str) -> bool:
    return arch in ROUTERS


class RouteRecorder:
    """Collects the top-k expert ids of every router call of an HF MoE model, per layer.

    Use as a context manager around forward calls; after each call `take(B, S)` returns
    [B, S, L, k] int16 (-1 for dense layers)."""

    def __init__(self, model: torch.nn.Module, arch: str, top_k: int):
        if arch not in ROUTERS:
            raise ValueError(f"routing replay needs an MoE model with a known router; '{arch}' is not one of "
                             f"{sorted(ROUTERS)}. Fix: set actor.moe_routing=recompute.")
        layers = model.get_decoder().layers
        self.top_k, self.num_layers = top_k, len(layers)
        self._routers = {}
        for i, layer in enumerate(layers):
            module = layer
            for part in ROUTERS[arch].split("."):
                module = getattr(module, part, None)
                if module is None:
                    break
            if module is not None and isinstance(module, torch.nn.Module) and hasattr(module, "top_k"):
                self._routers[i] = module  # a dense layer of a mixed model has no router
        self._calls: dict[int, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> "RouteRecorder":
        for i, router in self._routers.items():
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def record(_module, _args, output):
            self._calls[layer] = output[2].detach()  # [B*S, k] router_indices

        return record

    def take(self, rows: int, positions: int) -> torch.Tensor:
        """[B, S, L, k] ids of the last forward call (rows x positions tokens), -1 on dense layers."""
        out = torch.full((rows, positions, self.num_layers, self.top_k), UNKNOWN, dtype=torch.int16)
        for layer, ids in self._calls.items():
            out[:, :, layer] = ids.reshape(rows, positions, -1).to(torch.int16).cpu()
        self._calls.clear()
        return out


def decode_sglang_routes(encoded: str, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's `meta_info["routed_experts"]` (base64 of int32 [seqlen - 1, L, k], positions
    0 .. seqlen - 2 of prompt + output) -> [seqlen - 1, L, k] int16."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    return torch.from_numpy(flat.copy()).reshape(-1, num_layers, top_k).to(torch.int16)


def fill_unknown(routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., L, k] ids with -1 -> (ids with each unknown (token, layer) set to experts 0..k-1,
    [..., L] bool: known). The filled tokens are ones whose output no log-prob reads (padding,
    a sequence's last token) or dense layers, which have no router."""
    known = (routes >= 0).all(-1)
    k = routes.shape[-1]
    filler = torch.arange(k, dtype=routes.dtype).expand_as(routes)
    return torch.where(known[..., None], routes, filler), known
