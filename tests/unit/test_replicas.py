"""Rank 0's side of rollout replicas (megappo.rollout.replicas) without processes: where the replicas
live, how a call's prompts are split, and what a weight update must carry."""

import pathlib

import pytest
import torch

from megappo.rollout.replicas import SYNC_ID, ReplicaSet, leaders, node_slot, split_prompts


def test_leaders_spread_evenly_over_the_job():
    assert leaders(8, 1) == (0,)
    assert leaders(8, 2) == (0, 4)  # two nodes of 4: one replica each
    assert leaders(8, 8) == tuple(range(8))
    assert leaders(6, 4) == (0, 1, 3, 4)
    with pytest.raises(ValueError, match="rollout.replicas=3 needs 1 <= replicas <= the job's 2 rank"):
        leaders(2, 3)


def test_node_slot_counts_the_replicas_led_from_lower_ranks_of_the_same_node():
    # 2 nodes of 8 ranks, 4 replicas led by 0, 4, 8, 12: each node's first engine in slot 0, its second in slot 1
    four = leaders(16, 4)
    assert [node_slot(r, r % 8, four) for r in four] == [0, 1, 0, 1]
    assert [node_slot(r, r % 4, leaders(8, 8)) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # nodes of 4
    assert node_slot(0, 0, (0,)) == 0


def spans_cover(spans, count):
    return spans[0][0] == 0 and spans[-1][1] == count and all(a < b for a, b in spans) and all(
        prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:]))


@pytest.mark.parametrize("count,parts", [(1, 1), (7, 2), (7, 4), (3, 4), (64, 8), (5, 5)])
def test_split_gives_contiguous_non_empty_chunks_of_whole_prompts(count, parts):
    prompts = [[1] * (1 + (7 * i) % 11) for i in range(count)]
    spans = split_prompts(prompts, parts, max_new_tokens=16)
    assert len(spans) == min(count, parts) and spans_cover(spans, count)


def test_split_balances_expected_tokens_not_prompt_counts():
    # one long prompt then many short ones: the first replica takes the long one and few others
    prompts = [[1] * 200] + [[1] * 4] * 30
    (a, b), (c, d) = split_prompts(prompts, 2, max_new_tokens=8)
    weight = [len(p) + 8 for p in prompts]
    first, second = sum(weight[a:b]), sum(weight[c:d])
    assert b - a < d - c and abs(first - second) <= max(weight)
    # equal prompts: equal shares (a prompt at most apart)
    spans = split_prompts([[1, 2]] * 10, 4, max_new_tokens=8)
    assert sorted(b - a for a, b in spans) == [2, 2, 3, 3]


class Recorder:
    def __init__(self):
        self.calls = []

    def update_weights(self, buckets):
        self.calls.append([name for bucket in buckets for name, _ in bucket])


def test_an_update_without_its_sync_id_is_refused():
    engine = ReplicaSet(Recorder(), [], pad_token_id=0)
    with pytest.raises(ValueError, match="starts with the sync's id"):
        engine.update_weights([[("w", torch.zeros(2))]])
    engine.update_weights([[(SYNC_ID, torch.tensor(1))], [("w", torch.zeros(2))]])
    assert engine.local.calls == [["w"]]  # rank 0's engine never sees the id


def test_replicas_take_weights_by_tensor_or_distributed_not_disk():
    """rollout.replicas works with sync_mode=tensor (colocated) and distributed (each replica on GPUs of its own);
    the disk fallback is for one engine, refused with the fix named."""
    from megappo.config import ConfigError
    from megappo.config import load_config

    demo = str(pathlib.Path(__file__).parents[2] / "recipes" / "demo-cpu.yaml")
    for mode in ("tensor", "distributed"):
        assert load_config(demo, ["rollout.engine=sglang", f"rollout.sync_mode={mode}",
                                                     "rollout.replicas=2"]).rollout.replicas == 2
    with pytest.raises(ConfigError, match=r"rollout.replicas=2 with rollout.sync_mode=disk: .* Fix: set "
                                          r"rollout.sync_mode=tensor"):
        load_config(demo, ["rollout.engine=sglang", "rollout.sync_mode=disk", "rollout.replicas=2"])
