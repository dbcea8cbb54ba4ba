"""PF-PPO through the CLI (algorithm.use_pf_ppo with GAE, the demo's estimator): each step trains on its
samples resampled by score, says what share it kept, and a rerun draws the same samples (the generator is
seeded by run.seed and the step)."""

import pytest

from tests.e2e._runs import metrics
from tests.e2e.test_algorithms import ONE_RANK, train

pytestmark = pytest.mark.one_process  # a world of one (tests/conftest.py)

PF_PPO = [*ONE_RANK, "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_random"]


def test_pf_ppo_trains_on_the_resampled_batch_and_reruns_the_same(tmp_path):
    rows = train(tmp_path / "a", PF_PPO)
    assert len(rows) == 2
    for r in rows:
        assert 0 < r["pf_ppo/unique_fraction"] <= 1  # the share of distinct samples the update trained on
        assert "critic/vf_loss" in r and "actor/pg_loss" in r
    assert min(r["pf_ppo/unique_fraction"] for r in rows) < 1  # drawn with replacement: repeats
    train(tmp_path / "b", PF_PPO)
    assert metrics(tmp_path / "a") == metrics(tmp_path / "b")
