"""rollout.mode (megappo.rollout.schedule): which policy version generates each step's batch,
when a weight update may reach the engine, staleness, and the batch a checkpoint buffers.

A fake engine records the version it holds when each generation reads it, twice per
generation (start and end), with a sleep between: a weight update that slipped into a
generation would show as two different versions."""

import threading
import time

import pytest
import torch

from megappo.config import ConfigError, load_config
from megappo.rollout.engine import WeightSyncError
from megappo.rollout.schedule import SCHEDULES, Async, OneStepOff, Synchronous
from megappo.types import RolloutBatch


class FakeEngine:
    def __init__(self):
        self.version = 0
        self.log = []  # (step, version at start, version at end) of each generation

    def update_weights(self, buckets):
        for bucket in buckets:
            for _name, tensor in bucket:
                self.version = int(tensor.item())

    def fingerprints(self, names):
        return {"w": torch.tensor([self.version])}

    def generate(self, step):
        first = self.version
        time.sleep(0.05)
        self.log.append((step, first, self.version))
        return RolloutBatch(prompt_ids=torch.full((1, 1), step), prompt_mask=torch.ones(1, 1),
                            response_ids=torch.zeros(1, 1), response_mask=torch.ones(1, 1),
                            rollout_log_probs=torch.zeros(1, 1), finish_reasons=["stop"],
                            prompt_index=torch.zeros(1, dtype=torch.long))


def train(schedule, engine, first: int, last: int, train_seconds: float = 0.01, warmup: int = 0):
    """The orchestrator's loop with its order: batch, train, sync (the bridge's update), synced. Steps
    1..`warmup` (run.critic_warmup) leave the actor as it is and send no update."""
    synced = schedule.gated(engine)
    held = first - 1 if first - 1 > warmup else 0  # the weights a resumed run starts from
    synced.update_weights([[("w", torch.tensor(held))]])  # train()'s sync before the first step
    schedule.synced(first - 1)
    out = []
    for step in range(first, last + 1):
        batch = schedule.next_batch(step, engine.generate)
        time.sleep(train_seconds)  # training
        if step > warmup:
            synced.update_weights([[("w", torch.tensor(step))]])
        schedule.synced(step)
        out.append((step, int(batch.prompt_ids.item()), batch.policy_version, schedule.metrics()))
    return out


def test_sync_generates_each_batch_with_the_latest_weights():
    engine = FakeEngine()
    out = train(Synchronous(), engine, 1, 4)
    assert [(s, b, v) for s, b, v, _ in out] == [(1, 1, 0), (2, 2, 1), (3, 3, 2), (4, 4, 3)]
    assert all(m["rollout/staleness"] == 0 for *_, m in out)
    assert engine.log == [(1, 0, 0), (2, 1, 1), (3, 2, 2), (4, 3, 3)]


@pytest.mark.parametrize("train_seconds", [0.0, 0.2])  # generation slower, then faster, than training
def test_one_step_off_generates_the_next_batch_one_version_behind(train_seconds):
    engine = FakeEngine()
    schedule = OneStepOff(last_step=5)
    out = train(schedule, engine, 1, 5, train_seconds)
    assert [(s, b, v) for s, b, v, _ in out] == [(1, 1, 0), (2, 2, 0), (3, 3, 1), (4, 4, 2), (5, 5, 3)]
    assert [m["rollout/staleness"] for *_, m in out] == [0, 1, 1, 1, 1]
    # every generation saw one version from start to end: updates waited for it
    assert engine.log == [(1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 2, 2), (5, 3, 3)]
    assert schedule.settle() == []  # nothing generated beyond the last step
    schedule.close()


def test_a_generation_overlaps_training_and_a_checkpoint_buffers_it():
    engine = FakeEngine()
    schedule = OneStepOff(last_step=10)
    out = train(schedule, engine, 1, 3, train_seconds=0.2)
    assert out[-1][3]["timing_s/gen_wait"] < 0.05  # the 0.05 s generation ran while training slept
    [(step, batch)] = schedule.settle()  # what Run.save_checkpoint stores after step 3
    assert step == 4 and int(batch.prompt_ids.item()) == 4 and batch.policy_version == 2
    schedule.close()

    # a resumed run: the buffered batch, then the same versions as an uninterrupted run
    resumed, engine2 = OneStepOff(last_step=6), FakeEngine()
    resumed.restore([(step, batch)])
    got = train(resumed, engine2, 4, 6)
    straight = train(OneStepOff(last_step=6), FakeEngine(), 1, 6)
    assert [(s, b, v) for s, b, v, _ in got] == [(s, b, v) for s, b, v, _ in straight[3:]]
    assert engine2.log[0][0] == 5  # step 4 was not generated again


def test_a_failed_generation_raises_in_the_trainer():
    schedule, engine = OneStepOff(last_step=3), FakeEngine()

    def generate(step):
        if step == 2:
            raise ValueError("reward function broke")
        return engine.generate(step)

    schedule.next_batch(1, generate)
    with pytest.raises(ValueError, match="reward function broke"):  # at the sync that waits for it
        schedule.gated(engine).update_weights([[("w", torch.tensor(1))]])
    assert not schedule._gate.locked()
    schedule.close()


def versions(out):
    return [(s, b, v) for s, b, v, _ in out]


@pytest.mark.parametrize("train_seconds", [0.0, 0.2])
def test_async_generates_step_j_with_version_j_minus_1_minus_max_staleness(train_seconds):
    engine = FakeEngine()
    schedule = Async(last_step=7, max_staleness=2)
    out = train(schedule, engine, 1, 7, train_seconds)
    assert versions(out) == [(1, 1, 0), (2, 2, 0), (3, 3, 0), (4, 4, 1), (5, 5, 2), (6, 6, 3), (7, 7, 4)]
    assert [m["rollout/staleness"] for *_, m in out] == [0, 1, 2, 2, 2, 2, 2]
    # each generation saw one version, the one the schedule fixed for it, whatever the timing
    assert engine.log == [(1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 1, 1), (5, 2, 2), (6, 3, 3), (7, 4, 4)]
    with schedule.at_latest():  # validation: the engine takes the trainer's weights
        assert engine.version == 7
    assert schedule.settle() == []
    schedule.close()


def test_async_with_max_staleness_1_is_one_step_off():
    straight = train(OneStepOff(last_step=6), FakeEngine(), 1, 6)
    assert versions(train(Async(last_step=6, max_staleness=1), FakeEngine(), 1, 6)) == versions(straight)


def test_async_runs_ahead_while_training_is_slower():
    schedule = Async(last_step=6, max_staleness=3)
    out = train(schedule, FakeEngine(), 1, 6, train_seconds=0.2)  # generations take 0.05 s
    assert max(m["perf/rollout_batches_ahead"] for *_, m in out) >= 1
    assert out[-1][3]["timing_s/gen_wait"] < 0.05
    schedule.close()


def test_async_checkpoint_buffers_every_batch_the_synced_weights_allow_and_resumes_exactly():
    schedule = Async(last_step=8, max_staleness=2)
    train(schedule, FakeEngine(), 1, 3)
    buffered = schedule.settle()  # after step 3 (version 3): steps 4..3+1+2 use versions <= 3
    assert [(s, b.policy_version) for s, b in buffered] == [(4, 1), (5, 2), (6, 3)]
    schedule.close()

    resumed, engine2 = Async(last_step=8, max_staleness=2), FakeEngine()
    resumed.restore(buffered)
    got = train(resumed, engine2, 4, 8)
    straight = train(Async(last_step=8, max_staleness=2), FakeEngine(), 1, 8)
    assert versions(got) == versions(straight)[3:]
    assert [entry[0] for entry in engine2.log] == [7, 8]  # the buffered steps were not generated again
    resumed.close()


def test_async_errors_of_the_generation_thread_reach_the_trainer():
    schedule, engine = Async(last_step=4, max_staleness=2), FakeEngine()

    def generate(step):
        if step == 2:
            raise ValueError("reward function broke")
        return engine.generate(step)

    synced = schedule.gated(engine)
    synced.update_weights([[("w", torch.tensor(0))]])
    schedule.synced(0)
    schedule.next_batch(1, generate)
    with pytest.raises(ValueError, match="reward function broke"):
        schedule.next_batch(2, generate)
    schedule.close()


def test_async_verifies_the_engine_when_it_applies_a_staged_update():
    class Corrupting(FakeEngine):
        def fingerprint_of(self, name, tensor):
            return tensor.clone()

        def fingerprints(self, names):
            return {"w": torch.tensor([self.version + 100])}  # not what was sent

    schedule, engine = Async(last_step=3, max_staleness=1), Corrupting()
    staging = schedule.gated(engine)

    def buckets():  # what the bridge does when it verifies: fingerprint each tensor as it streams
        tensor = torch.tensor([0])
        staging.fingerprint_of("w", tensor)
        yield [("w", tensor)]

    staging.update_weights(buckets())
    assert staging.fingerprints(["w"]) == {"w": torch.tensor([0])}  # the bridge's check: the staged copy
    schedule.synced(0)
    with pytest.raises(WeightSyncError, match="policy version 0"):
        schedule.next_batch(1, engine.generate)
    schedule.close()


def test_schedules_by_name():
    assert type(SCHEDULES["sync"](3, 0)) is Synchronous and type(SCHEDULES["one_step_off"](3, 1)) is OneStepOff
    assert type(SCHEDULES["async"](3, 2)) is Async and SCHEDULES["async"](3, 2).max_staleness == 2


DEMO = "recipes/demo-cpu.yaml"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=one_step_off", "actor.old_logprob=bypass"], "Fix: set actor.old_logprob=is_correct"),
    (["rollout.placement=separate", "rollout.engine=sglang"], "Fix: set rollout.placement=colocated"),
    (["rollout.engine_cores=[0]"], "Fix: set rollout.placement=separate or rollout.engine_cores=[]"),
])
def test_config_refuses_what_async_cannot_do(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert message in str(err.value)


def test_config_async_mode_and_its_staleness_bound():
    cfg = load_config(DEMO, ["rollout.mode=async", "actor.old_logprob=is_correct"])
    assert cfg.rollout.staleness_limit == 2
    assert load_config(DEMO, ["rollout.mode=async", "rollout.max_staleness=4",
                              "actor.old_logprob=recompute"]).rollout.staleness_limit == 4
    assert load_config(DEMO, ["rollout.mode=one_step_off", "actor.old_logprob=recompute"]).rollout.staleness_limit == 1
    for overrides, message in [(["rollout.max_staleness=3"], "Fix: set rollout.mode=async, or remove"),
                               (["rollout.mode=async", "rollout.max_staleness=0", "actor.old_logprob=is_correct"],
                                "Fix: set rollout.max_staleness=1 or more"),
                               (["rollout.mode=async", "actor.old_logprob=bypass"], "Fix: set actor.old_logprob=is_correct")]:
        with pytest.raises(ConfigError) as err:
            load_config(DEMO, overrides)
        assert message in str(err.value)


def test_config_accepts_the_recommended_async_setting():
    cfg = load_config(DEMO, ["rollout.mode=one_step_off", "rollout.placement=separate", "rollout.engine_cores=[1]",
                             "actor.old_logprob=is_correct"])
    assert (cfg.rollout.mode, cfg.rollout.placement, cfg.rollout.engine_cores) == ("one_step_off", "separate", [1])


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_config_accepts_overlapped_modes_with_sglang(mode):
    """SGLangEngine takes calls from any thread (the generation thread): tests/sglang/test_engine_threads.py."""
    cfg = load_config(DEMO, [f"rollout.mode={mode}", "rollout.engine=sglang", "actor.old_logprob=is_correct"])
    assert (cfg.rollout.mode, cfg.rollout.engine, cfg.rollout.placement) == (mode, "sglang", "colocated")


@pytest.mark.parametrize("make", [Synchronous, lambda: OneStepOff(last_step=7), lambda: Async(7, 1),
                                  lambda: Async(7, 2)], ids=["sync", "one_step_off", "async1", "async2"])
def test_critic_warmup_steps_send_no_update_and_the_engine_keeps_the_first_weights(make):
    """run.critic_warmup=3: steps 1-3 send nothing (the actor did not change); batches carry the
    same versions as without warmup, and each generation reads the weights its version has: those
    of version 0 up to version 3. Async: a version published without an update is one the
    generation thread need not wait for (it would wait forever)."""
    engine, schedule = FakeEngine(), make()
    out = train(schedule, engine, 1, 7, warmup=3)
    straight = train(make(), FakeEngine(), 1, 7)
    assert versions(out) == versions(straight)
    assert all(first == last == (v if v > 3 else 0) for (_, first, last), (_, _, v) in zip(engine.log, versions(out)))
    schedule.close()


def test_async_resumed_during_critic_warmup_generates_what_a_straight_run_does():
    schedule = Async(last_step=7, max_staleness=2)
    train(schedule, FakeEngine(), 1, 2, warmup=3)
    buffered = schedule.settle()
    schedule.close()
    resumed, engine2 = Async(last_step=7, max_staleness=2), FakeEngine()
    resumed.restore(buffered)
    got = train(resumed, engine2, 3, 7, warmup=3)
    straight_engine = FakeEngine()
    straight = train(Async(last_step=7, max_staleness=2), straight_engine, 1, 7, warmup=3)
    assert versions(got) == versions(straight)[2:]
    assert engine2.log == [e for e in straight_engine.log if e[0] not in dict(buffered)][-len(engine2.log):]
    resumed.close()
