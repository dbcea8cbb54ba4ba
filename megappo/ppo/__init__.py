"""megappo's PPO math: pure tensor functions with verl 0.9.1 semantics (torch only).

  stats       masked sum / mean / var / whiten
  specs       what each advantage estimator needs from a step (a critic, groups, a greedy
              baseline, sum pi^2, reward components): ESTIMATOR_SPECS, plain Python
  advantages  GAE (vectorised, with the reverse loop as reference), GRPO, RLOO,
              REINFORCE++, REINFORCE++-baseline, ReMax; the `ESTIMATORS` registry
  advantages_extra  OPO, GPG, GRPO pass@k, GDPO, optimal token baselines (plain and
              multi-turn), registered in advantages.ESTIMATORS
  kl          KL estimators (k1/k2/k3/abs and straight-through "+"), KL controllers,
              the KL penalty in the reward
  overlong    DAPO's overlong reward shaping: the penalty of responses near the budget
  losses      loss aggregation with global counts, the policy losses' inputs record
              (LossInputs), clipped policy / value losses, full-vocabulary log-probs
              and entropy, entropy and KL loss terms
  policy_losses  verl's policy losses by name (actor.policy_loss.loss_mode): the
              `POLICY_LOSSES` registry (vanilla = losses.policy_loss, dppo_tv, dppo_kl,
              gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo), get_policy_loss,
              POLICY_LOSS_KNOBS, compute_policy_loss
  pf_ppo      PF-PPO's weights by score and the resampling draw
  rollout_correction  rollout IS weights (token / sequence, TIS / IcePop) and rejection
              masks with verl's metrics, verl's presets, the bypass-mode losses

No torch.distributed, no megatron, no config objects: scalars and cross-rank counts come
in as arguments. The vocabulary-parallel log-probs live in megappo.parallel.vocab_parallel.
Shapes: [B, T] = (sequences, response tokens); [B, T, V] = full-vocabulary logits.
"""
