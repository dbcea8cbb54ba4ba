"""Rollout engine replicas through the CLI (rollout.replicas; docs/engines.md#replicas): the CPU demos on
2 gloo ranks (TP=2) with an hf engine on each rank train as with one engine on rank 0.

Each case runs the same recipe with rollout.replicas=1 and =2: the samples are the same tokens (scores,
response lengths, everything computed from them equal), and every metric agrees within 1e-5 (the
engines' log-probs of the same tokens, computed in batches of other shapes, differ by float rounding;
measured: 0 on these runs). The cases cover every path that generates: sync with validation (its
prompts split too), async (a generation thread of rank 0 that drives both replicas, weight updates
staged and applied in its order) with dynamic sampling's rounds (GRPO), multi-turn
episodes (each turn's engine call split over the replicas), LoRA with adapter-only sync (the base
weights then only the adapters and lm_head reach both replicas, each enabling adapters first), and
the MoE demo (EP2) with routing replay (each replica records its samples' expert routes; joined in
order, the actor and reference passes replay them). The two-node cases are in test_two_nodes.py.
"""

import os

import pytest

from tests.e2e._runs import metrics
from tests.e2e.test_async import IS, command
from tests.e2e.test_resume import REPO, run

CASES = {
    "sync+validation": ["recipes/demo-cpu.yaml", "run.total_steps=3", "run.val_every=2", "rollout.val_n=2",
                        "rollout.val_temperature=1.0"],
    "async+dynamic_sampling": ["recipes/demo-cpu.yaml", "run.total_steps=3", IS, "rollout.mode=async",
                               "rollout.max_staleness=2", "algorithm.filter_groups.enable=true",
                               "algorithm.adv_estimator=grpo", "rollout.n=4", "data.train_batch_size=16",
                               "actor.ppo_mini_batch_size=16"],
    "multiturn": ["recipes/demo-multiturn-cpu.yaml", "run.total_steps=2", "run.val_every=2"],
    "lora+adapter_sync": ["recipes/demo-cpu.yaml", "run.total_steps=3", "actor.lora.rank=8",
                          "actor.lora.modules_to_save=[lm_head]", "actor.optim.lr=3e-3", "critic.lora.rank=8",
                          "rollout.lora_sync=adapters"],
    "moe+routing_replay": ["recipes/demo-moe-cpu.yaml", "run.total_steps=3", "actor.moe_routing=replay",
                           "actor.use_kl_loss=true"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_replicas_generate_what_one_engine_does(tmp_path, case):
    recipe, *args = CASES[case]
    rows = {}
    for replicas in (1, 2):
        out = tmp_path / f"replicas{replicas}"
        cmd = command(out, *args, f"rollout.replicas={replicas}", "checkpoint.save_every=-1")
        cmd[cmd.index(os.path.join(REPO, "recipes/demo-cpu.yaml"))] = os.path.join(REPO, recipe)
        said = run(cmd)
        assert (" rollout_replicas=2 (ranks 0, 1)\n" in said) == (replicas == 2), said[-3000:]
        rows[replicas] = metrics(out)
    one, two = rows[1], rows[2]
    assert len(one) == len(two) >= 3 and [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            exact = key.startswith(("response_length/", "critic/score/", "val-core/", "reward/", "env/"))
            assert b[key] == (a[key] if exact else pytest.approx(a[key], abs=1e-5)), (a["step"], key, a[key], b[key])
