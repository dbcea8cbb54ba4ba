"""Rewards: what a response scores, from rule-based functions, your own code and (in a training step)
the reward model, and the one entry the trainer scores a batch with.

  functions  the reward-function registry (gsm8k, math_boxed, exact_match, reasoning_gym, ...), your
             own functions by path, calling them under a timeout and checking their values
             (`score_batch`, `score_records`, `RewardChecks`)
  workers    reward.num_workers processes that call the functions while the step's model passes run
  scoring    `Scorer`: a batch's scores and their metrics, for a training step, dynamic sampling's
             rounds and validation (rank 0)
  code_reward     the built-in `code` function: a response's program on its test cases, in the sandbox
  sandbox         the local code executor: one sandboxed, limited process per program
  sandbox_fusion  SandboxFusion's /run_code client (reward.sandbox.url) and its answers
  sandbox_server  a /run_code service on the local executor (python -m megappo.rewards.sandbox_server)
  judge           the built-in `judge` function: an LLM's score over chat completions (reward.judge), its client,
                  failure policy and metrics (a local judge server: python -m megappo.rollout.judge_server)

`megappo.rewards` also names what `functions` defines (`from megappo.rewards import score_batch`),
as it did when it was one module.
"""

from megappo.rewards.functions import (  # noqa: F401 - the package's names, as before the split
    CORRECT_SCORE, DIGIT_NOT_STOPPED, LARGE_REWARD, READS, REWARD_FUNCTIONS, Outcome, RewardChecks, RewardFn, Scored,
    call_functions, call_with_timeout, digit_successor, exact_match, final_answer_matches, get_reward_fn, gsm8k,
    last_boxed, math_boxed, reads, reasoning_gym_exact, reasoning_gym_score, score_batch, score_records,
)
