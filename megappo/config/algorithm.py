"""The algorithm: `algorithm` (advantage estimator, discounting, in-reward KL and its controller
`algorithm.kl_ctrl`, PF-PPO's `algorithm.pf_ppo`, DAPO's dynamic sampling `algorithm.filter_groups`)
and the engine/trainer mismatch's correction `algorithm.rollout_correction`, whose option grammar
is megappo.ppo.correction_spec's.

Cross-section rules beside these sections: `check_estimator_needs` (a critic, groups of samples),
`check_gdpo_components` (reward components), `check_filter_groups` (samples per prompt, scores at
generation, batch sizes) and `check_rollout_correction` (the old log-probs' source and the policy
loss). They read the root `Config` (megappo.config.root, which imports this module) through its
derived values.

Owns: these sections, their defaults and checks. Does not know the estimators' or corrections'
math (megappo.ppo); what each estimator needs comes from megappo.ppo.specs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Union

from megappo.ppo.correction_spec import validate as validate_correction
from megappo.config.roles import KLEstimator
from megappo.config.schema import _at_least, _default, _require, _Section
from megappo.errors import P, ConfigError
from megappo.ppo.specs import ESTIMATOR_SPECS, EstimatorSpec

#: verl 0.9.1's advantage estimators: the names megappo.ppo.specs declares (megappo.ppo.advantages.ESTIMATORS)
ADV_ESTIMATORS = tuple(ESTIMATOR_SPECS)


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig(_Section):
    """Correction of the engine/trainer mismatch (megappo.ppo.rollout_correction; docs/ppo-math.md), verl's
    algorithm.rollout_correction: importance weights and rejection of tokens or sequences, from the
    trainer's and the engine's log-probs."""

    rollout_is: Optional[Literal["token", "sequence"]] = None
    """Importance weights pi_trainer / pi_engine per `token` or `sequence`; `null`: none."""
    rollout_is_threshold: Union[float, str] = 2.0
    """A number: truncate above it (TIS); `"lower_upper"` (e.g. `"0.5_2.0"`): weights outside become 0 (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their mean over the batch (bypass mode: over each mini-batch, from one extra forward
    pass; docs/ppo-math.md)."""
    rollout_rs: Optional[str] = None
    """Rejection of tokens or sequences past the threshold, comma-separated: `token_k1`, `token_k2`, `token_k3`,
    `seq_sum_k1/k2/k3`, `seq_mean_k1/k2/k3`, `seq_max_k2/k3`."""
    rollout_rs_threshold: Union[float, str, None] = None
    """One per `rollout_rs` option or one for all; `k1` takes `"lower_upper"` (or `u`: `[1/u, u]`)."""
    bypass_mode: bool = False
    """`true`: the engine's log-probs are the old policy's (2 policies, no recomputation) and the loss forms the
    weights from the current ones; `false`: decoupled (the trainer recomputes them; 3 policies)."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass: `ppo_clip` against the engine's log-probs, or `reinforce` weighted by IS weights."""

    def check(self) -> None:
        try:
            validate_correction(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).replace("algorithm.rollout_correction.", P)) from None
        _require(self.loss_type == "ppo_clip" or self.bypass_mode,
                 f"{P}loss_type={self.loss_type} applies in bypass mode only. Fix: set {P}bypass_mode=true or "
                 f"{P}loss_type=ppo_clip.")

    @property
    def enabled(self) -> bool:
        """Whether anything is corrected or the engine's log-probs replace the recomputed ones."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


@dataclasses.dataclass(frozen=True)
class KLCtrlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """`fixed` or `adaptive` (towards `target_kl`; needs `use_kl_in_reward`)."""
    kl_coef: float = 0.001
    """(Initial) coefficient of the in-reward KL penalty (>= 0)."""
    target_kl: float = 0.1
    """Adaptive: the KL aimed for."""
    horizon: int = 10000
    """Adaptive: steps over which the coefficient adapts."""

    def check(self) -> None:
        _require(self.kl_coef >= 0 and self.target_kl > 0, f"{P}kl_coef={self.kl_coef} must be >= 0 and "
                 f"{P}target_kl={self.target_kl} > 0. Fix: e.g. {P}kl_coef=0.001 {P}target_kl=0.1.")
        _at_least(self, horizon=1)


@dataclasses.dataclass(frozen=True)
class PfPpoConfig(_Section):
    """PF-PPO's resampling of a step's batch by score (verl's algorithm.pf_ppo): megappo.ppo.pf_ppo."""

    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    """A sample's weight from its score s: `pow` |s|^`weight_pow`; `max_min` 1 at the batch's highest or lowest
    score, else 0; `max_random` 0.4 at the highest, else 0.1."""
    weight_pow: float = 2.0
    """`pow`'s exponent."""

    def check(self) -> None:
        _require(self.weight_pow >= 0, f"{P}weight_pow={self.weight_pow} must be >= 0. Fix: e.g. {P}weight_pow=2.0.")


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig(_Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): docs/dapo.md."""

    enable: bool = False
    """DAPO's dynamic sampling ([dapo.md](dapo.md)): groups whose samples share one `metric` value are dropped and
    more prompts generated (`data.gen_batch_size` at a time) until `data.train_batch_size` groups are kept. Needs
    `rollout.n >= 2`."""
    metric: str = "reward"
    """`reward` / `seq_reward` / `score`: the score; `acc`: your function's `acc` field (else score >= 1); any other
    field it returns."""
    max_num_gen_batches: int = 0
    """Generation batches per step at most (`0`: no bound); times `data.gen_batch_size` must reach
    `data.train_batch_size`."""
    max_inflight_gen_batches: int = 1
    """Generation batches asked of the engine in one call (more work per call)."""
    on_limit: Literal["fill", "stop"] = "fill"
    """At the bound: `fill` tops up with dropped groups and counts `filter_groups/hit_limit` (warned once, the count
    of such steps at the run's end); `stop` ends the run (verl)."""

    def check(self) -> None:
        _at_least(self, max_num_gen_batches=0, max_inflight_gen_batches=1)
        _require(self.metric != "seq_final_reward", f"{P}metric=seq_final_reward is the score after the in-reward KL "
                 f"penalty, which needs the reference pass after generation; megappo filters at generation. Fix: "
                 f"write {P}metric=reward (the score before the penalty).")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig(_Section):
    adv_estimator: Literal[ADV_ESTIMATORS] = "gae"
    """`gae` (needs the critic), `grpo`, `rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `remax` (a
    greedy response's reward is the baseline), `opo`, `gpg`, `grpo_passk`, `gdpo`, `optimal_token_baseline`,
    `tir_optimal_token_baseline`, `grpo_vectorized`, `rloo_vectorized`; grouped ones need `rollout.n >= 2`
    ([ppo-math.md](ppo-math.md#advantage-estimators))."""
    gamma: float = 1.0
    """Discount, in [0, 1]."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (`false`: Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract `kl_coef * KL(actor, ref)` from the token rewards; builds the reference model."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator of that penalty (names as `actor.kl_loss_type`)."""
    kl_ctrl: KLCtrlConfig = _default(KLCtrlConfig)
    """Its coefficient controller:"""
    gdpo_reward_keys: Optional[list[str]] = None
    """`gdpo`: the `reward.functions` normalised apart (each one a component); `null`: all."""
    gdpo_reward_weights: Optional[list[float]] = None
    """`gdpo`: one weight per component; `null`: all 1.0."""
    rollout_correction: RolloutCorrectionConfig = _default(RolloutCorrectionConfig)
    """Correction of the engine/trainer log-prob mismatch, verl's keys
    ([ppo-math.md](ppo-math.md#rollout-correction)):"""
    filter_groups: FilterGroupsConfig = _default(FilterGroupsConfig)
    """DAPO's dynamic sampling:"""
    mask_truncated_completions: bool = False
    """Responses cut at `rollout.max_new_tokens` carry no loss but count in their group's baseline (DAPO's overlong
    filtering)."""
    use_pf_ppo: bool = False
    """PF-PPO (verl's): after GAE the step trains on its samples drawn again with replacement, weighted by score
    ([ppo-math.md](ppo-math.md#pf-ppo)); `gae` only, as in verl."""
    pf_ppo: PfPpoConfig = _default(PfPpoConfig)
    """PF-PPO's weights (with `use_pf_ppo`):"""

    def check(self) -> None:
        _require(not self.use_pf_ppo or self.adv_estimator == "gae",
                 f"{P}use_pf_ppo=true resamples the batch after GAE; verl applies it with {P}adv_estimator=gae only "
                 f"and ignores it with {self.adv_estimator}. Fix: set {P}adv_estimator=gae, or {P}use_pf_ppo=false.")
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            _require(0 <= v <= 1, f"{P}{name}={v} must be in [0, 1]. Fix: e.g. {P}{name}=1.0.")
        _require(self.use_kl_in_reward or self.kl_ctrl.type == "fixed",
                 f"{P}kl_ctrl.type=adaptive only steers the in-reward KL penalty, which is off. Fix: set "
                 f"{P}use_kl_in_reward=true or {P}kl_ctrl.type=fixed.")

    @property
    def estimator(self) -> EstimatorSpec:
        """What the estimator needs from the step (megappo.ppo.specs)."""
        return ESTIMATOR_SPECS[self.adv_estimator]

    @property
    def needs_critic(self) -> bool:
        return self.estimator.critic

    @property
    def grouped(self) -> bool:
        """Estimators whose baseline is the other samples of the same prompt."""
        return self.estimator.grouped


# -- rules across sections ----------------------------------------------------------------------

def check_estimator_needs(cfg: "Config") -> None:
    """What the estimator needs: a critic (gae), several samples per prompt (the grouped ones)."""
    est, n = cfg.algorithm.adv_estimator, cfg.rollout.n
    _require(cfg.critic.enable is not False or not cfg.algorithm.needs_critic,
             "algorithm.adv_estimator=gae needs a critic, but critic.enable=false. Fix: set critic.enable=null "
             "(auto) or choose an outcome estimator, e.g. algorithm.adv_estimator=grpo.")
    _require(not cfg.algorithm.grouped or n >= 2,
             f"algorithm.adv_estimator={est} compares samples of the same prompt, but rollout.n={n}. "
             f"Fix: set rollout.n >= 2 (e.g. rollout.n=8).")


def check_gdpo_components(cfg: "Config") -> None:
    """GDPO's reward components are reward functions, with one weight each."""
    est = cfg.algorithm.adv_estimator
    keys, weights = cfg.gdpo_components, cfg.algorithm.gdpo_reward_weights
    _require(not cfg.algorithm.estimator.components or bool(keys),
             f"algorithm.adv_estimator={est} normalises each reward component apart, but reward.functions is empty. "
             "Fix: list the components in reward.functions (e.g. [format_reward, exact_match]).")
    unknown = [k for k in keys if k not in cfg.reward.functions]
    _require(not unknown, f"algorithm.gdpo_reward_keys: {unknown} are not in reward.functions "
                          f"{cfg.reward.functions}. Fix: name functions of reward.functions (each one a component).")
    _require(weights is None or len(weights) == len(keys),
             f"algorithm.gdpo_reward_weights has {len(weights or ())} entries for {len(keys)} components. Fix: give "
             "one weight per component of algorithm.gdpo_reward_keys, or null (all 1.0).")


def check_filter_groups(cfg: "Config") -> None:
    """Dynamic sampling needs groups that can differ, scores known at generation and batches that can fill."""
    n = cfg.rollout.n
    fg = cfg.algorithm.filter_groups
    _require(not fg.enable or n >= 2,
             f"algorithm.filter_groups keeps groups whose samples differ, but rollout.n={n}: a group of one never "
             "differs, so every group would be dropped. Fix: set rollout.n >= 2 (DAPO uses 8-16).")
    _require(not fg.enable or fg.metric not in ("reward", "seq_reward", "score") or not cfg.reward.model_path,
             "algorithm.filter_groups.metric=reward filters at generation on rank 0, before the reward model's "
             "pass, so the reward model's scores are not known yet. Fix: filter on a rule-based function's field "
             "(algorithm.filter_groups.metric=acc) or drop reward.model_path.")
    gen_batch = cfg.data.gen_batch_size or cfg.data.train_batch_size
    bounded = fg.enable and fg.max_num_gen_batches
    _require(not bounded or fg.max_num_gen_batches * gen_batch >= cfg.data.train_batch_size,
             f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} generation batches of "
             f"data.gen_batch_size={gen_batch} prompts hold fewer than data.train_batch_size="
             f"{cfg.data.train_batch_size}: no step could fill its batch. Fix: raise max_num_gen_batches (0: no "
             "bound) or data.gen_batch_size.")


def check_rollout_correction(cfg: "Config") -> None:
    """The old log-probs' source is set once (preset or section) and the policy loss fits bypass mode."""
    rc = cfg.algorithm.rollout_correction
    _require(cfg.actor.old_logprob == "recompute" or not rc.enabled,
             f"actor.old_logprob={cfg.actor.old_logprob} is a preset of algorithm.rollout_correction, which is set "
             "as well; megappo will not guess which one you meant. Fix: remove actor.old_logprob and write it with "
             "algorithm.rollout_correction: is_correct = rollout_is=token rollout_is_threshold=<actor.is_truncate>; "
             "bypass = bypass_mode=true.")
    mode = cfg.actor.policy_loss.loss_mode
    bypass = cfg.bypass_old_logprobs
    _require(mode != "bypass_mode" or bypass,
             "actor.policy_loss.loss_mode=bypass_mode takes the engine's log-probs as the old policy's, but they are "
             "recomputed. Fix: set algorithm.rollout_correction.bypass_mode=true (it selects that loss itself).")
    _require(not rc.bypass_mode or mode in ("vanilla", "bypass_mode"),
             f"algorithm.rollout_correction.bypass_mode=true trains with verl's bypass loss (loss_type="
             f"{rc.loss_type}), not actor.policy_loss.loss_mode={mode} (verl would replace it silently). Fix: "
             f"set algorithm.rollout_correction.bypass_mode=false to train with {mode} (decoupled correction), or "
             "remove actor.policy_loss.loss_mode.")
    _require(not cfg.algorithm.estimator.sum_pi_squared or not bypass,
             f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs the trainer's old log-probs and their "
             "sum of squared probabilities, which bypass mode does not compute. Fix: set actor.old_logprob=recompute "
             "and algorithm.rollout_correction.bypass_mode=false.")
