"""What each advantage estimator needs from a trainer step, declared once, in plain Python.

Owns: `EstimatorSpec` and `ESTIMATOR_SPECS` (algorithm.adv_estimator -> what the estimator reads
besides the token-level rewards and the response mask), and the policy losses' names
(`POLICY_LOSS_NAMES`, actor.policy_loss.loss_mode). megappo.ppo.advantages registers each
estimator's function under the same name (`ESTIMATORS`; a unit test keeps the two registries equal)
and checks each function's inputs against its spec once, at import. Everything that depends on the
estimator asks its spec instead of comparing names: the config's checks (a critic, rollout.n >= 2,
reward functions for GDPO), the orchestrator's passes (the greedy baseline, sum pi^2, the reward
components) and the planner. Adding an estimator: its function and its entry here (and its tests).

Does not know about tensors, configs or the trainer (no torch: the config and `megappo plan` read it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """What one estimator reads beyond the token-level rewards and the response mask."""

    critic: bool = False  # the critic's values (GAE): the run needs a critic
    grouped: bool = False  # the other samples of the same prompt (`index`): rollout.n >= 2
    greedy_baseline: bool = False  # each prompt's greedy sample's reward (ReMax): one more generation per step
    sum_pi_squared: bool = False  # the old policy's log-probs and sum over the vocabulary of pi^2 per token
    components: bool = False  # each reward function's score apart (GDPO; reward.functions), passed when there
    # are several (the function falls back to the one score without them)

    @property
    def inputs(self) -> frozenset[str]:
        """The estimator function's required inputs beyond the rewards and the mask (its keyword names)."""
        return frozenset(
            name for name, needed in (("values", self.critic), ("index", self.grouped),
                                      ("reward_baselines", self.greedy_baseline),
                                      ("old_log_probs", self.sum_pi_squared), ("sum_pi_squared", self.sum_pi_squared))
            if needed)


_GROUPED = EstimatorSpec(grouped=True)

#: verl 0.9.1's advantage estimators (megappo.ppo.advantages.ESTIMATORS holds their functions)
ESTIMATOR_SPECS: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(critic=True),
    "grpo": _GROUPED,
    "grpo_vectorized": _GROUPED,
    "rloo": _GROUPED,
    "rloo_vectorized": _GROUPED,
    "reinforce_plus_plus": EstimatorSpec(),
    "reinforce_plus_plus_baseline": _GROUPED,
    "remax": EstimatorSpec(greedy_baseline=True),
    "opo": _GROUPED,
    "gpg": _GROUPED,
    "grpo_passk": _GROUPED,
    "gdpo": EstimatorSpec(grouped=True, components=True),
    "optimal_token_baseline": EstimatorSpec(grouped=True, sum_pi_squared=True),
    "tir_optimal_token_baseline": EstimatorSpec(grouped=True, sum_pi_squared=True),
}


#: verl 0.9.1's policy losses (actor.policy_loss.loss_mode): megappo.ppo.policy_losses.POLICY_LOSSES holds their
#: functions, each declaring its knobs in its signature (checked against this list at import)
POLICY_LOSS_NAMES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                     "cispo", "bypass_mode")


def estimator_spec(name: str) -> EstimatorSpec:
    if name not in ESTIMATOR_SPECS:
        raise ValueError(f"unknown advantage estimator '{name}' (algorithm.adv_estimator); "
                         f"choose from {sorted(ESTIMATOR_SPECS)}")
    return ESTIMATOR_SPECS[name]
