"""Routing replay, trainer side: Megatron-Core's MoE routers take the engine's expert choices.

Megatron-Core builds a `RouterReplay` into every `TopKRouter` when the TransformerConfig
says `moe_enable_routing_replay`; its REPLAY_FORWARD action makes the router use given
top-k ids (the gate weights are still computed from the trainer's own scores at those ids,
so gradients reach the router). `replayed_routes(chunk, routes, known)` sets, for one
forward call of one model chunk, each of its routers' ids from the micro-batch's record and
clears them afterwards. The routers of this chunk only: a process holds several models
(actor, reference) whose routers Megatron lists in one global registry, so that registry's
static methods are not used.

While a record is replayed, each router also computes the top-k it would have chosen
itself, and `RouteReplay` counts the (token, layer) pairs where the two sets differ: the
routes that replay changed. With `replay=False` the same count says how often the
trainer's routers disagree with the engine's while they choose for themselves.

Activation recomputation would route again in the backward (REPLAY_BACKWARD): only the
forward is replayed, so the config refuses replay together with actor.recompute.

Shape legend: t tokens of a micro-batch in the router's order ([S, B] flattened: s-major),
L decoder layers (global), k experts per token.

This module does not know about PPO, engines or how records are made
(`megappo.rollout.routes`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from megappo.models.builders import moe_routers
from megappo.errors import ModelConfigError


@dataclasses.dataclass
class RouteReplay:
    """How a model's passes use routing records: replay them (or only compare, `replay=False`),
    counting the (token, layer) pairs of the engine's record that differ from the trainer's
    own top-k."""

    replay: bool = True
    differ: int = 0
    total: int = 0

    def take(self) -> tuple[int, int]:
        out = (self.differ, self.total)
        self.differ = self.total = 0
        return out


@contextlib.contextmanager
def replayed_routes(chunk: torch.nn.Module, routes: torch.Tensor | None, known: torch.Tensor | None,
                    how: RouteReplay | None):
    """Inside the block, this chunk's routers use `routes` [t, L, k] (expert ids; `known` [t, L]
    marks the engine's, the rest are fillers that no log-prob reads) and count disagreements
    into `how`; with `how.replay` false they only count and choose themselves. No-op when
    `routes` or `how` is None or the chunk has no MoE layer."""
    routers = moe_routers(chunk) if routes is not None and how is not None else []
    if routers and routers[0][1].router_replay is None:
        raise ModelConfigError("this model was built without routing replay; build it with "
                               "moe_enable_routing_replay=True (actor.moe_routing=replay does).")
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for index, router in routers:
        replay = router.router_replay
        target = routes[:, index].long()
        replay.target_topk_idx = target
        replay.get_replay_topk = _counting(replay, target, known[:, index], how)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, router in routers:
            replay = router.router_replay
            replay.clear_router_replay_action()
            replay.clear_indices()
            del replay.get_replay_topk  # the class's method again


def _counting(replay, target: torch.Tensor, known: torch.Tensor, how: RouteReplay):
    """Replay's top-k (`target`), counting where it differs from the router's own choice."""
    cls_method = type(replay).get_replay_topk.__get__(replay)

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        with torch.no_grad():
            differ = (own.sort(-1).values != target.to(own.device).sort(-1).values).any(-1)
            mask = known.to(differ.device)
            how.differ += int((differ & mask).sum())
            how.total += int(mask.sum())
        if not how.replay:
            return own_probs, own
        return cls_method(scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk

