"""A reward function as verl's compute_score writes them: a dict with the score and `acc`.

The score is reasoning-gym's partial credit (megappo's built-in `reasoning_gym`), `acc` whether the
final answer is exactly right (`reasoning_gym_exact`): DAPO's dynamic sampling filters groups on
`acc` (`algorithm.filter_groups.metric=acc`) while the policy trains on the partial credit.
Used by the SmolLM2 DAPO comparison in benchmarks/RESULTS.md:
`reward.functions=[benchmarks/rewards/reasoning_gym_acc.py:partial_credit_and_acc]`.
"""

from megappo.rewards import reasoning_gym_exact, reasoning_gym_score


def partial_credit_and_acc(response: str, ground_truth, extra: dict) -> dict:
    return {"score": reasoning_gym_score(response, ground_truth, extra),
            "acc": reasoning_gym_exact(response, ground_truth, extra)}
