"""DAPO's dynamic sampling (megappo.rollout.dynamic_sampling) without processes: which groups are uniform,
the metric values, the seeds and bounds of the rounds, joining round batches (MoE routes with their rows),
and `fill_batch` over a fake generator (plain functions in place of the engine and the reward functions)."""

import dataclasses

import pytest
import torch

from megappo.data.prompts import PromptExample
from megappo.rollout.dynamic_sampling import (ROUND_SEED_STRIDE, FilterLimitError, GroupFilter, LimitCount, concat, fill_batch,
                                      metric_values, round_seed, take, uniform_groups)
from megappo.errors import ConfigError
from megappo.types import RolloutBatch


def test_uniform_groups_by_hand():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert uniform_groups(values, index, 4).tolist() == [True, False, True, True]
    # samples need not be adjacent; a group of one is uniform
    assert uniform_groups(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1, 0, 1]), 2).tolist() == [True, False]


def test_metric_values():
    scores = torch.tensor([1.0, 0.5, 0.0])
    assert metric_values("reward", scores, [{}] * 3) is scores
    assert metric_values("seq_reward", scores, [{}] * 3) is scores
    assert metric_values("acc", scores, [{}] * 3).tolist() == [1.0, 0.0, 0.0]  # no function returned acc
    fields = [{"acc": True}, {"acc": False}, {"acc": 1}]
    assert metric_values("acc", scores, fields).tolist() == [1.0, 0.0, 1.0]
    assert metric_values("pred_len", scores, [{"pred_len": 3}] * 3).tolist() == [3.0] * 3
    with pytest.raises(ConfigError, match=r"metric=pred_len: the reward functions \['mine.py:f'\] returned no "
                                          r"'pred_len' field for 1 of 3 responses.*Fix:"):
        metric_values("pred_len", scores, [{"pred_len": 1}, {}, {"pred_len": 2}], ["mine.py:f"])


def test_round_seeds_and_bounds():
    assert round_seed(42, 0) == 42 and round_seed(42, 2) == 42 + 2 * ROUND_SEED_STRIDE and round_seed(None, 3) is None
    seeds = {round_seed(1 + step, r) for step in range(1, 1000) for r in range(5)}
    assert len(seeds) == 999 * 5  # distinct over steps and rounds
    f = GroupFilter(groups=4, metric="reward", max_gen_batches=5, inflight=2, on_limit="fill")
    assert [f.next_call(done) for done in (0, 2, 4, 5)] == [2, 2, 1, 0]
    assert GroupFilter(groups=4, metric="reward", max_gen_batches=0, inflight=3, on_limit="fill").next_call(99) == 3


def batch(prompt_lens, response_lens, n, scores=None, first_row=0):
    """A RolloutBatch of len(prompt_lens) prompts x n samples; token ids: 10 + row for prompts, 100 + row
    for responses; pad 0."""
    rows = len(prompt_lens) * n
    P, R = max(prompt_lens), max(response_lens)
    pid, pmask = torch.zeros(rows, P, dtype=torch.long), torch.zeros(rows, P, dtype=torch.long)
    rid, rmask = torch.zeros(rows, R, dtype=torch.long), torch.zeros(rows, R, dtype=torch.long)
    for i in range(rows):
        p, r = prompt_lens[i // n], response_lens[i % len(response_lens)]
        pid[i, P - p:], pmask[i, P - p:] = 10 + first_row + i // n, 1
        rid[i, :r], rmask[i, :r] = 100 + first_row + i, 1
    examples = [PromptExample([1], "x", str(i // n), {}, first_row + i // n) for i in range(rows)]
    return RolloutBatch(prompt_ids=pid, prompt_mask=pmask, response_ids=rid, response_mask=rmask,
                        rollout_log_probs=-rmask.float(), finish_reasons=["stop"] * rows,
                        prompt_index=torch.arange(rows) // n, examples=examples,
                        env_scores=torch.arange(rows, dtype=torch.float32), env_metrics={"env/turns_mean": 1.0 + first_row,
                                                                                        "env/lookups": 2.0},
                        scores=scores)


def test_concat_pads_and_take_picks_groups_in_order():
    a, b = batch([2, 1], [1, 3], 2), batch([4], [2], 2, first_row=100)
    whole = concat([a, b], pad_token_id=0)
    assert whole.prompt_ids.shape == (6, 4) and whole.response_ids.shape == (6, 3)
    assert whole.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert whole.prompt_ids[0].tolist() == [0, 0, 10, 10] and whole.prompt_ids[4].tolist() == [110] * 4
    assert whole.response_ids[4].tolist() == [200, 200, 0]
    assert whole.env_metrics == {"env/turns_mean": (4 * 1.0 + 2 * 101.0) / 6, "env/lookups": 4.0}
    picked = take(whole, torch.tensor([4, 5, 2, 3]))  # group 2 then group 1
    assert picked.prompt_index.tolist() == [0, 0, 1, 1]
    assert picked.prompt_ids.shape == (4, 4)
    assert [e.index for e in picked.examples] == [100, 100, 1, 1] and picked.env_scores.tolist() == [0, 1, 2, 3]
    picked = take(whole, torch.tensor([2, 4]))  # the padding no row of it needs is dropped
    assert picked.prompt_ids.tolist() == [[0, 0, 0, 11], [110] * 4]
    assert picked.response_ids.tolist() == [[102, 0], [200, 200]] and picked.response_mask.tolist() == [[1, 0], [1, 1]]
    assert take(whole, torch.tensor([2, 3])).prompt_ids.tolist() == [[11], [11]]


class Fake:
    """Prompts 0, 1, 2, ... drawn `size` at a time; prompt p's samples score `outcome(p)` (a list of n)."""

    def __init__(self, size, outcome, n=2):
        self.size, self.outcome, self.n, self.drawn, self.seeds = size, outcome, n, 0, []

    def draw(self):
        self.drawn += self.size
        return list(range(self.drawn - self.size, self.drawn))

    def generate(self, prompts, seed):
        self.seeds.append(seed)
        scores = torch.tensor([s for p in prompts for s in self.outcome(p)], dtype=torch.float32)
        out = batch([1] * len(prompts), [1], self.n, first_row=prompts[0])
        out.examples = [PromptExample([1], "x", None, {}, p) for p in prompts for _ in range(self.n)]
        out.env_scores = scores
        return out

    def score(self, b):
        return b.env_scores.clone(), None, [{}] * b.num_samples


def run_fill(fake, f, seed=7):
    return fill_batch(f, step=3, seed=seed, draw=fake.draw, generate=fake.generate, score=fake.score, pad_token_id=0)


def test_fill_batch_keeps_groups_that_differ_over_rounds():
    fake = Fake(4, lambda p: [0.0, 1.0] if p % 3 == 0 else [1.0, 1.0])  # prompts 0, 3, 6, 9, ... differ
    out = run_fill(fake, GroupFilter(groups=3, metric="reward", max_gen_batches=0, inflight=1, on_limit="fill"))
    assert [e.index for e in out.examples] == [0, 0, 3, 3, 6, 6]
    assert out.scores.tolist() == [0.0, 1.0] * 3 and out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert fake.seeds == [7, 7 + ROUND_SEED_STRIDE]  # round 0: the step's seed
    m = out.gen_metrics
    assert m["train/num_gen_batches"] == 2 and m["filter_groups/generated_groups"] == 8
    assert m["filter_groups/kept_groups"] == 3 and m["filter_groups/kept_fraction"] == 3 / 8
    assert m["filter_groups/evicted_samples"] == 10 and m["filter_groups/discarded_surplus_samples"] == 0
    assert m["filter_groups/hit_limit"] == 0
    assert m["filter_groups/generated_score_mean"] == (3 * 1.0 + 5 * 2.0) / 16  # every sample of both rounds


def test_fill_batch_discards_the_surplus_and_asks_for_inflight_batches_per_call():
    fake = Fake(2, lambda p: [0.0, 1.0] if p != 1 else [1.0, 1.0])  # every group but prompt 1's differs
    out = run_fill(fake, GroupFilter(groups=3, metric="reward", max_gen_batches=0, inflight=3, on_limit="fill"))
    assert [e.index for e in out.examples] == [0, 0, 2, 2, 3, 3] and fake.seeds == [7]
    m = out.gen_metrics
    assert m["train/num_gen_batches"] == 3 and m["filter_groups/discarded_surplus_samples"] == 4
    assert m["filter_groups/kept_groups"] == 3 and m["filter_groups/evicted_samples"] == 2


def test_at_the_limit_fill_tops_up_with_the_latest_dropped_groups(capsys):
    fake = Fake(2, lambda p: [0.0, 1.0] if p == 1 else [0.0, 0.0])
    f = GroupFilter(groups=3, metric="reward", max_gen_batches=2, inflight=1, on_limit="fill", gen_batch_size=2)
    out = run_fill(fake, f)
    assert [e.index for e in out.examples] == [1, 1, 3, 3, 2, 2]
    m = out.gen_metrics
    assert m["filter_groups/hit_limit"] == 1 and m["filter_groups/kept_groups"] == 1
    assert m["filter_groups/evicted_samples"] == 2  # prompt 0's; 2 and 3 filled the batch
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megappo: warning: step 3: algorithm.filter_groups kept 1 of 4 groups")
    assert "topped up with 2 dropped groups" in err and "raise algorithm.filter_groups.max_num_gen_batches" in err


def test_the_limit_warning_is_said_once_a_run_and_counted_at_the_end(capsys):
    """A run whose steps 2, 3 and 5 of 5 hit the bound: one warning (step 2's), then the count at the end."""
    f = GroupFilter(groups=3, metric="reward", max_gen_batches=2, inflight=1, on_limit="fill", gen_batch_size=2)
    easy = lambda p: [0.0, 1.0]  # noqa: E731  every group differs: the first batch fills the step
    hard = lambda p: [0.0, 1.0] if p % 4 == 1 else [0.0, 0.0]  # noqa: E731  one group in 4 differs
    limits = LimitCount()
    for step, outcome in zip(range(1, 6), (easy, hard, hard, easy, hard)):
        fake = Fake(2, outcome)
        out = fill_batch(f, step=step, seed=step, draw=fake.draw, generate=fake.generate, score=fake.score,
                         pad_token_id=0, limits=limits)
        assert out.gen_metrics["filter_groups/hit_limit"] == float(outcome is hard)
    err = capsys.readouterr().err
    assert err.count("megappo: warning:") == 1 and err.startswith("megappo: warning: step 2: algorithm.filter_groups")
    assert "said once" in err and "raise algorithm.filter_groups.max_num_gen_batches" in err
    said = limits.summary(f.max_gen_batches)
    assert said.startswith("megappo: warning: dynamic sampling hit algorithm.filter_groups.max_num_gen_batches=2 on 3 "
                           "of 5 steps (the first: step 2)")
    assert "Fix: raise algorithm.filter_groups.max_num_gen_batches" in said and "\n" not in said
    assert LimitCount().summary(2) is None  # no hit: nothing said at the end


def test_at_the_limit_stop_raises_the_fix():
    fake = Fake(2, lambda p: [1.0, 1.0])
    f = GroupFilter(groups=2, metric="reward", max_gen_batches=3, inflight=2, on_limit="stop", gen_batch_size=2)
    with pytest.raises(FilterLimitError, match=r"kept 0 of 6 groups .* in 3 generation batches .*generated too many"
                                               r".*Fix: raise algorithm.filter_groups.max_num_gen_batches"):
        run_fill(fake, f)
    assert fake.seeds == [7, 7 + ROUND_SEED_STRIDE]  # 2 batches, then the one the bound still allows


def test_the_config_draws_gen_batch_size_prompts_and_refuses_a_bound_that_cannot_fill_a_step():
    from megappo.config import load_config

    demo = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "recipes/demo-cpu.yaml")
    on = ["algorithm.filter_groups.enable=true", "rollout.n=4", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
          "critic.ppo_mini_batch_size=16"]
    assert load_config(demo, [*on, "data.gen_batch_size=24"]).prompts_per_draw == 24
    assert load_config(demo, on).prompts_per_draw == 16  # gen_batch_size null: train_batch_size
    assert load_config(demo, ["data.gen_batch_size=24"]).prompts_per_draw == 64  # not filtering: the step's prompts
    assert load_config(demo, [*on, "data.gen_batch_size=4", "algorithm.filter_groups.max_num_gen_batches=4"])
    with pytest.raises(ConfigError, match=r"max_num_gen_batches=3 generation batches of data.gen_batch_size=4 prompts "
                                          r"hold fewer than data.train_batch_size=16.*Fix: raise"):
        load_config(demo, [*on, "data.gen_batch_size=4", "algorithm.filter_groups.max_num_gen_batches=3"])


def with_routes(b, layers=2, top_k=2):
    """`b` with routes [N, P+R, layers, top_k] as the engine returns them for a MoE model: at every real token,
    expert ids made from the token's id (id, id + 1000 x layer, ...); -1 at padding."""
    ids = torch.cat([b.prompt_ids, b.response_ids], dim=1)
    real = torch.cat([b.prompt_mask, b.real_response_mask], dim=1).bool()
    codes = ids[..., None, None] + 1000 * torch.arange(layers)[:, None] + 10_000 * torch.arange(top_k)
    b.routes = torch.where(real[..., None, None], codes, -1).to(torch.int16)
    return b


def assert_routes_follow(b):
    """Each row's routes are still those of its own tokens, column for column, -1 on its padding."""
    assert b.routes.shape[:2] == (b.num_samples, b.prompt_ids.shape[1] + b.response_ids.shape[1])
    expected = with_routes(dataclasses.replace(b, routes=None), b.routes.shape[2], b.routes.shape[3]).routes
    assert torch.equal(b.routes, expected)


def test_concat_and_take_carry_each_rows_routes():
    """DAPO with routing replay: the routes of a MoE rollout are joined and picked with their rows (and
    padded / cut with their columns), so the replayed experts are the ones each kept sample was generated with."""
    a, b = with_routes(batch([2, 1], [1, 3], 2)), with_routes(batch([4], [2], 2, first_row=100))
    whole = concat([a, b], pad_token_id=0)
    assert_routes_follow(whole)
    assert whole.routes.dtype == torch.int16 and (whole.routes[0, :2] == -1).all()  # prompt 0's left padding
    for rows in ([4, 5, 2, 3], [2, 4], [1]):
        picked = take(whole, torch.tensor(rows))
        assert_routes_follow(picked)
        first = whole.routes[rows, whole.prompt_ids.shape[1]]  # each picked row's first response token's experts
        assert torch.equal(picked.routes[:, picked.prompt_ids.shape[1]], first)


def test_fill_batch_keeps_the_routes_of_the_groups_it_keeps():
    class Routed(Fake):
        def generate(self, prompts, seed):
            return with_routes(super().generate(prompts, seed))

    fake = Routed(2, lambda p: [float(p % 2), 0.0])  # odd prompts differ: kept
    out = run_fill(fake, GroupFilter(groups=2, metric="reward", max_gen_batches=0, inflight=1, on_limit="fill"))
    assert [e.index for e in out.examples] == [1, 1, 3, 3]
    assert_routes_follow(out)
