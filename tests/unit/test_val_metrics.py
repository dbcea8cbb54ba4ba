"""Validation statistics per data source (megappo.metrics.validation) against a reference written the way verl
0.9.1's process_validation_metrics computes them: a Python loop per prompt, per bootstrap draw, with
numpy's global generator reseeded for every call. Equal exactly (the same draws, the same reductions).
Also megappo's unbiased pass@k, and validation's own sampling parameters."""

import random
from collections import defaultdict

import numpy as np
import pytest

from megappo.metrics.validation import by_data_source


def reference(data_sources, prompts, variables, seed=42, n_bootstrap=1000):
    """verl's process_validation_metrics + _val_metrics_update, step by step."""
    def bootstrap(data, k, fns):
        np.random.seed(seed)
        data = np.array(data, dtype=object)
        idx = np.random.choice(len(data), size=(n_bootstrap, k), replace=True)
        results = [[fn(data[idx[b]]) for b in range(n_bootstrap)] for fn in fns]
        return [(float(np.mean(r)), float(np.std(r))) for r in results]

    def majority(sample):
        vote2vals = defaultdict(list)
        for d in sample:
            vote2vals[d["pred"]].append(d["val"])
        counts = {p: len(v) for p, v in vote2vals.items()}
        return vote2vals[max(counts, key=counts.get)][0]

    tree = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, prompt) in enumerate(zip(data_sources, prompts)):
        for name, values in variables.items():
            tree[source][prompt][name].append(values[i])
    per = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for source, by_prompt in tree.items():
        for prompt, var2vals in by_prompt.items():
            preds = var2vals.get("pred")
            for name, vals in var2vals.items():
                vals = [v for v in vals if v is not None]
                if not vals or isinstance(vals[0], str):
                    continue
                n = len(vals)
                metric = {f"mean@{n}": float(np.mean(vals))}
                if n > 1:
                    metric[f"std@{n}"] = float(np.std(vals))
                    ns, k = [], 2
                    while k < n:
                        ns.append(k)
                        k *= 2
                    for k in ns + [n]:
                        (bm, bs), (wm, ws) = bootstrap(vals, k, [np.max, np.min])
                        metric.update({f"best@{k}/mean": bm, f"best@{k}/std": bs, f"worst@{k}/mean": wm,
                                       f"worst@{k}/std": ws})
                        if preds is not None and len(preds) == n and all(p is not None for p in preds):
                            [(mm, ms)] = bootstrap([{"val": v, "pred": p} for v, p in zip(vals, preds)], k, [majority])
                            metric.update({f"maj@{k}/mean": mm, f"maj@{k}/std": ms})
                for stat, value in metric.items():
                    per[source][name][stat].append(value)
    out = {}
    for source, var2stats in per.items():
        core = "acc" if "acc" in var2stats else "reward"
        for name, stats in var2stats.items():
            n_max = max(int(s.split("@")[-1].split("/")[0]) for s in stats)
            for stat, values in stats.items():
                sec = "val-core" if name == core and any(stat.startswith(p) for p in ("mean", "maj", "best")) \
                    and f"@{n_max}" in stat else "val-aux"
                out[f"{sec}/{source}/{name}/{stat}"] = float(np.mean(values))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_equal_to_verls_loop(n):
    rng = random.Random(n)
    prompts = [p for p in range(6) for _ in range(n)]
    sources = ["openai/gsm8k" if p % 3 else "aime" for p in prompts]
    preds = [rng.choice(["12", "7", "x"]) for _ in prompts]  # few distinct answers: ties in the votes
    variables = {"reward": [rng.choice([0.0, 0.5, 1.0, -0.2]) for _ in prompts],
                 "acc": [bool(rng.getrandbits(1)) for _ in prompts],
                 "pred": preds,
                 "format": [None if rng.random() < 0.2 else rng.random() for _ in prompts]}  # some missing
    got = by_data_source(sources, prompts, variables)
    assert {k: v for k, v in got.items() if "/pass@" not in k} == reference(sources, prompts, variables)
    assert ("val-core/aime/acc/mean@%d" % n) in got and "val-aux/aime/reward/mean@%d" % n in got
    if n > 1:
        assert f"val-core/openai/gsm8k/acc/maj@{n}/mean" in got and f"val-aux/aime/acc/worst@{n}/mean" in got


def test_known_values_without_acc_or_pred():
    # one source, two prompts of 4 responses: the reward is the core variable; no pred, no maj
    got = by_data_source(["s"] * 8, [0, 0, 0, 0, 1, 1, 1, 1],
                         {"reward": [1, 1, 1, 1, 0, 0, 0, 1], "note": ["a"] * 8})
    assert got["val-core/s/reward/mean@4"] == pytest.approx((1 + 0.25) / 2)
    assert got["val-aux/s/reward/std@4"] == pytest.approx((0 + np.std([0, 0, 0, 1])) / 2)
    assert got["val-core/s/reward/best@4/mean"] <= 1.0 and got["val-aux/s/reward/best@2/mean"] > 0.5
    # prompt 0 always gives 1; prompt 1 draws its one 1 four times with probability 1/256
    assert got["val-aux/s/reward/worst@4/mean"] == pytest.approx((1 + 1 / 256) / 2, abs=0.01)
    assert not [k for k in got if "maj@" in k or "/note/" in k]


@pytest.mark.parametrize("n, correct", [(2, 1), (5, 0), (5, 2), (8, 3), (8, 8)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_response(n, correct):
    """megappo's own statistic beside verl's: the unbiased pass@k of 0/1 values, against counting the k-subsets
    (without replacement) that hold a 1; a variable that is not 0/1 (reward 0.5) gets none."""
    from itertools import combinations

    values = [1] * correct + [0] * (n - correct)
    got = by_data_source(["s"] * n, [0] * n, {"acc": values, "reward": [0.5] * n})
    ks = [1] + [k for k in (2, 4, 8) if k < n] + ([n] if n > 1 else [])
    for k in dict.fromkeys(ks):
        subsets = list(combinations(values, k))
        assert got[f"val-aux/s/acc/pass@{k}"] == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)
    assert not [key for key in got if "/reward/pass@" in key]


def test_validation_samples_with_its_own_top_p_and_top_k_or_the_trainings():
    """rollout.val_top_p / val_top_k (verl's val_kwargs.top_p / top_k; DAPO validates at top_p 0.7)."""
    from megappo.config import RolloutConfig
    from megappo.trainer.loop import validation_params

    own = validation_params(RolloutConfig(top_p=0.9, top_k=50, val_top_p=0.7, val_top_k=-1, val_temperature=1.0,
                                          val_n=4, seed=3), (2,))
    assert (own.top_p, own.top_k, own.temperature, own.n, own.seed, own.eos_token_ids) == (0.7, -1, 1.0, 4, 3, (2,))
    same = validation_params(RolloutConfig(top_p=0.9, top_k=50), (2,))
    assert (same.top_p, same.top_k, same.temperature, same.n) == (0.9, 50, 0.0, 1)


def reference_validation_steps(total_steps, test_freq):
    """verl 0.9.1's RayPPOTrainer.fit: `test_freq > 0 and (is_last_step or global_steps % test_freq == 0)`."""
    return [s for s in range(1, total_steps + 1) if test_freq > 0 and (s == total_steps or s % test_freq == 0)]


@pytest.mark.parametrize("total,every", [(30, 20), (40, 20), (7, 1), (5, 0), (3, 10), (100, 20)])
def test_validation_steps_are_verls_every_val_every_and_the_last(total, every):
    """A 30-step run with val_every=20 validates after steps 20 and 30; the last step once, when it is a multiple
    too; val_every=0: never during training."""
    from megappo.trainer.loop import validates_at

    got = [s for s in range(1, total + 1) if validates_at(s, total, every)]
    assert got == reference_validation_steps(total, every)


def test_validation_at_the_last_step_in_numbers():
    from megappo.trainer.loop import validates_at

    assert [s for s in range(1, 31) if validates_at(s, 30, 20)] == [20, 30]
    assert [s for s in range(1, 41) if validates_at(s, 40, 20)] == [20, 40]
    assert not any(validates_at(s, 5, 0) for s in range(1, 6))
