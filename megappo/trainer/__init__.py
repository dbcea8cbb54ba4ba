"""The trainer: a training run from its command to its last checkpoint.

A run goes, in this order:

  megappo.cli            `megappo train RECIPE` parses the recipe, runs the preflight checks and
                         launches the ranks; on each rank:
  setup.create_run       builds the `Run`: parallel layout, the roles' models and optimizers, the
                         rollout engine(s) and bridge, the prompts, the scorer, a resumed checkpoint
  loop.train             the first weight sync, validation, then one step per iteration, metrics
                         logged, checkpoints when due, a clean stop on Ctrl-C / SIGTERM
  step.ppo_step          one PPO step: generate, score, log-probs and values, advantages, the
                         critic and actor updates, the weight sync

and beside it:

  roles          the actor / reference / critic / reward model on Megatron: passes and updates
  checkpointing  trainer checkpoints: layout, latest pointer, keep-last, resume, RNG
  convert        HF <-> Megatron conversion, exports and their verification
  preflight      checks before any rank starts or any model is built; data_check: the prompt rows
  runlock        one run per directory; earlier_runs: an earlier run's files set aside first

The PPO math is `megappo.ppo`'s, generation `megappo.rollout`'s, scoring `megappo.rewards`'.
"""
