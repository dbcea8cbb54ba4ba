"""Router statistics of a mixture-of-experts model: load-balancing loss and expert load.

`RouterStats(model)` hooks every router (Megatron's TopKRouter) of this rank's chunks while
the `with` block is open and accumulates, per global layer, from each routed micro-batch:
  tokens routed to each expert  (the routing map [T, E] summed over tokens),
  router probabilities summed   (softmax of the router logits [T, E] summed over tokens),
  tokens seen T and top-k assignments T * k.
`metrics(prefix)` is a collective over the model's ranks (each routes its own tokens: other
data-parallel rows, other pipeline stages' layers; a TP group routes one sequence-parallel
shard per rank) and returns, on every rank:
  {prefix}/moe_aux_loss            the Switch load-balancing loss E * sum_e f_e * P_e, averaged
                                   over MoE layers (f_e: share of assignments, P_e: mean router
                                   probability); 1.0 when balanced, before the loss coefficient
  {prefix}/moe_load_max_over_mean  the busiest expert's tokens over the mean, worst MoE layer
  {prefix}/moe_load_max_over_mean/layer_{i}  the same per MoE layer i (0-based, global)
  {prefix}/moe_tokens_dropped      top-k assignments no expert took (0 without a capacity factor)
Padding tokens of a padded micro-batch are routed too and counted.

This module does not know about PPO, losses or the orchestrator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megappo.models.builders import MegatronModel, moe_routers


class RouterStats:
    """Accumulates router statistics of `model` while open (a context manager)."""

    def __init__(self, model: MegatronModel):
        self.model = model
        d = model.dims
        self.num_layers, self.num_experts, self.topk = d.num_layers, d.num_experts, d.moe_topk
        self.routed = torch.zeros(d.num_layers, d.num_experts, dtype=torch.float64)  # [L, E] tokens per expert
        self.probs = torch.zeros(d.num_layers, d.num_experts, dtype=torch.float64)  # [L, E] summed probabilities
        self.tokens = torch.zeros(d.num_layers, dtype=torch.float64)  # [L]
        self._handles: list = []

    def __enter__(self) -> "RouterStats":
        for chunk in self.model.chunks:
            for _, router in moe_routers(chunk):
                self._handles.append(router.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @torch.no_grad()
    def _hook(self, router, args, output) -> None:
        _, routing_map = output  # [T, E] bool
        hidden = args[0].reshape(-1, args[0].shape[-1]).float()  # [T, H]
        probs = torch.softmax(torch.nn.functional.linear(hidden, router.weight.float()), dim=-1)  # [T, E]
        layer = router.layer_number - 1
        self.routed[layer] += routing_map.sum(0).double().cpu()
        self.probs[layer] += probs.sum(0).double().cpu()
        self.tokens[layer] += hidden.shape[0]

    def metrics(self, prefix: str) -> dict[str, float]:
        """Collective over the model's ranks: the metrics above (empty for a dense model)."""
        if not self.model.dims.is_moe:
            return {}
        ps = self.model.ps
        packed = torch.cat([self.routed.flatten(), self.probs.flatten(), self.tokens]).to(ps.device)
        if ps.world_size > 1:
            dist.all_reduce(packed)
        packed = packed.cpu()
        L, E = self.num_layers, self.num_experts
        routed, probs, tokens = packed[:L * E].view(L, E), packed[L * E:2 * L * E].view(L, E), packed[2 * L * E:]
        out: dict[str, float] = {}
        aux, worst, dropped = [], 0.0, 0.0
        for i in range(L):
            if tokens[i] == 0:
                continue  # a dense layer
            assignments = tokens[i] * self.topk
            f, p = routed[i] / assignments, probs[i] / tokens[i]
            aux.append(float(E * (f * p).sum()))
            load = float(routed[i].max() / routed[i].mean().clamp(min=1e-12))
            out[f"{prefix}/moe_load_max_over_mean/layer_{i}"] = load
            worst = max(worst, load)
            dropped += float(assignments - routed[i].sum())
        if aux:
            out[f"{prefix}/moe_aux_loss"] = sum(aux) / len(aux)
            out[f"{prefix}/moe_load_max_over_mean"] = worst
            out[f"{prefix}/moe_tokens_dropped"] = dropped
        return out
