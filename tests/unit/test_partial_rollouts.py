"""Partial rollouts (megappo.rollout.partial) on the real hf engine (a tiny random Llama whose
responses end at any of 15 stop tokens: lengths spread from 1 to the budget, a long tail): a step's
batch is complete groups only; unfinished samples carry their tokens, engine log-probs and per-token
policy versions to a later step and resume from prompt + tokens so far; their state survives a
checkpoint round trip bit for bit; stale samples restart or their groups drop; the length budget and
the stop tokens hold after every resume. The whole run (kill and resume): tests/e2e/test_resume.py."""

import copy
import dataclasses
import io
import types

import pytest
import torch

from megappo.config import load_config
from megappo.errors import CheckpointError, ConfigError
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.rollout.batches import concat
from megappo.rollout.dynamic_sampling import DynamicSampling, FilterLimitError, GroupFilter, uniform_groups
from megappo.rollout.hf.engine import HFEngine
from megappo.envs.base import Environment, StepResult
from megappo.rollout.partial import PENDING, PartialRollouts, state_problem, token_age_metrics
from megappo.rollout.partial_episodes import Episodes
from megappo.rollout.routes import UNKNOWN, RouteRecorder
from megappo.rollout.schedule import _stamped
from megappo.types import SamplingParams

STOP = tuple(range(10, 25))  # 15 of 300 tokens: a sample stops with about 5% a token
MAX_NEW, CHUNK, GROUPS, N = 32, 4, 4, 2


@pytest.fixture(scope="module")
def engine():
    return HFEngine(build_hf_model(TINY_CONFIGS["llama"], seed=3), pad_token_id=0)


def prompts():
    """draw(): 4 new prompt records a call, numbered (index) in order; draw.calls counts the calls."""
    count = iter(range(10**6))

    def draw():
        draw.calls += 1
        return [types.SimpleNamespace(prompt_ids=[5 + k % 50, 17, 42], index=k, ground_truth=None, extra={},
                                      data_source="test", origin=None) for k in [next(count) for _ in range(GROUPS)]]

    draw.calls = 0
    return draw


def partial(**kw) -> PartialRollouts:
    args = dict(batch_size=GROUPS, n=N, over_sample=2, chunk_tokens=CHUNK, max_new_tokens=MAX_NEW,
                max_token_staleness=2, on_stale="restart", pad_token_id=0)
    return PartialRollouts(**{**args, **kw})


def params(step: int) -> SamplingParams:
    return SamplingParams(n=N, temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=STOP, seed=100 + step)


def step_of(p: PartialRollouts, step: int, draw, engine):
    """Step `step`'s batch, stamped with the version that generated it (step - 1, as the sync schedule does)."""
    return _stamped(p.next_batch(step, params(step), draw=draw, generate=engine.generate), step - 1)


def carried(p: PartialRollouts) -> dict:
    """(group key, sample i) -> (tokens, log-probs) of the carried samples with tokens."""
    return {(g.key, i): (list(s.tokens), list(s.log_probs)) for g in p.groups for i, s in enumerate(g.samples)
            if s.tokens}


def saved_and_loaded(p: PartialRollouts) -> dict:
    """`p`'s state through torch.save and torch.load(weights_only=True), as a checkpoint holds it: plain data only."""
    buffer = io.BytesIO()
    torch.save(p.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def check_invariants(batch) -> None:
    """Every sample finished; its length within the budget; a stop token only at its end, where 'stop'
    says one is; 'length' exactly at the budget."""
    lengths = batch.response_mask.sum(-1).tolist()
    for row, (length, reason) in enumerate(zip(lengths, batch.finish_reasons)):
        tokens = batch.response_ids[row, :length].tolist()
        assert 1 <= length <= MAX_NEW and reason in ("stop", "length")
        assert not any(t in STOP for t in tokens[:-1]), tokens
        assert (tokens[-1] in STOP) == (reason == "stop")
        assert reason == "stop" or length == MAX_NEW
        assert (batch.token_versions[row, :length] >= 0).all() and (batch.token_versions[row, length:] == 0).all()
    counts = torch.bincount(batch.prompt_index)
    assert (counts == N).all() and len(counts) == GROUPS  # whole groups, prompt-major


def test_a_step_trains_complete_groups_and_resumes_the_rest_from_their_tokens(engine):
    p, draw = partial(), prompts()
    resumed_any = False
    for step in range(1, 6):
        before = carried(p)
        keys = {id(e): g.key for g in p.groups for e in [g.example]}
        batch = step_of(p, step, draw, engine)
        check_invariants(batch)
        m = batch.gen_metrics
        assert m["partial/carried_groups"] == len(p.groups) and m["partial/engine_calls"] >= 0
        assert m["partial/aborted"] == sum(1 for g in p.groups for s in g.samples if s.finish is None and s.tokens)
        # a carried sample continues its own tokens and log-probs; its earlier tokens keep their version
        for row, example in enumerate(batch.examples):
            i = int((batch.prompt_index[:row] == batch.prompt_index[row]).sum())
            old = before.get((keys.get(id(example)), i))
            if old:
                length = int(batch.response_mask[row].sum())
                assert batch.response_ids[row, :len(old[0])].tolist() == old[0]
                assert batch.rollout_log_probs[row, :len(old[1])].tolist() == old[1]
                assert (batch.token_versions[row, :len(old[0])] < step - 1).all()
                assert (batch.token_versions[row, len(old[0]):length] == step - 1).all()
                resumed_any |= length > len(old[0])
                # the continuation was sampled from prompt + its own earlier tokens: every token's engine
                # log-prob is the model's on that whole sequence (one weights version here)
                ids = torch.cat([torch.tensor(example.prompt_ids), batch.response_ids[row, :length]])[None]
                with torch.no_grad():
                    logits = engine.model(input_ids=ids).logits[0, len(example.prompt_ids) - 1:-1].float()
                want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(example.prompt_ids):, None])[:, 0]
                torch.testing.assert_close(batch.rollout_log_probs[row, :length], want, rtol=0, atol=1e-4)
        for g in p.groups:  # what is carried: unfinished samples stopped at a chunk's end, or finished ones
            for s in g.samples:
                assert s.finish is not None or len(s.tokens) % CHUNK == 0 and len(s.tokens) < MAX_NEW
                assert len(s.tokens) == len(s.log_probs) == len(s.versions)
    assert resumed_any, "no sample was resumed: the test's lengths no longer have a tail"


def test_the_carried_state_survives_a_checkpoint_bit_for_bit(engine):
    a, b, draw_a, draw_b = partial(), partial(), prompts(), prompts()
    examples = {}
    for step in (1, 2):
        batch = step_of(a, step, draw_a, engine)
        examples.update({e.index: e for e in batch.examples})
        examples.update({g.example.index: g.example for g in a.groups})
    b.load_state_dict(saved_and_loaded(a), [examples.get(i) for i in range(max(examples) + 1)])
    for _ in range(draw_a.calls):  # b's sampler at a's cursor
        draw_b()
    assert any(s.finish is None and s.tokens for g in b.groups for s in g.samples), "nothing carried unfinished"
    for step in (3, 4):
        x, y = step_of(a, step, draw_a, engine), step_of(b, step, draw_b, engine)
        for f in ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "token_versions", "prompt_index"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
        assert x.finish_reasons == y.finish_reasons and x.gen_metrics == y.gen_metrics


def test_a_carried_state_this_run_cannot_resume_is_refused_with_the_fix(engine):
    """Another dataset, rollout.n or multi-turn setting than the checkpoint's, or a file that is not a carried
    state: one error naming partial_rollouts.pt, what differs and the fix; a matching state loads."""
    a, draw = partial(), prompts()
    step_of(a, 1, draw, engine)
    state, rows = saved_and_loaded(a), 4 * draw.calls
    examples = [types.SimpleNamespace(index=i) for i in range(rows)]
    assert state["groups"] and any(s["tokens"] for g in state["groups"] for s in g["samples"])
    assert state_problem(state, rows, N, multi_turn=False) is None
    partial().load_state_dict(state, examples)
    last = max(g["example"] for g in state["groups"])
    with pytest.raises(CheckpointError) as refused:
        partial().load_state_dict(state, examples[:last])
    assert str(refused.value) == (
        f"the checkpoint's partial_rollouts.pt (rollout.partial's carried samples) cannot be resumed: a carried "
        f"group's prompt is row {last} of the training data, which has {last} rows here. Fix: resume with the "
        f"settings it was saved with (data.train_files, rollout.n, rollout.env), or with "
        f"rollout.partial.enable=false, which drops the carried samples (their prompts are then not trained on "
        f"until the next epoch)")
    with pytest.raises(CheckpointError, match=f"a carried group has {N} samples, rollout.n is {N + 1} here"):
        partial(n=N + 1).load_state_dict(state, examples)
    assert state_problem(state, rows, N, multi_turn=True) == (
        "a sample with tokens but no episode, and this run's rollout.env is multi-turn")
    with_episode = copy.deepcopy(state)
    with_episode["groups"][0]["samples"][0]["episode"] = {"turns": 1}
    assert state_problem(with_episode, rows, N, multi_turn=False) == (
        "a sample of a multi-turn episode, and this run has no rollout.env")
    uneven = copy.deepcopy(state)
    sample = next(s for g in uneven["groups"] for s in g["samples"] if s["tokens"])
    sample["log_probs"].pop()
    assert "differ in length" in state_problem(uneven, rows, N, multi_turn=False)
    for bad in ([], {"next_key": 1}, {"next_key": 1, "groups": [{"key": 0}]},
                {"next_key": 1, "groups": [{**state["groups"][0], "samples": [{"tokens": []}] * N}]}):
        assert state_problem(bad, rows, N, multi_turn=False), bad


@pytest.mark.parametrize("on_stale", ["restart", "drop"])
def test_a_sample_past_the_token_staleness_bound_restarts_or_drops_its_group(engine, on_stale):
    p, draw = partial(max_token_staleness=0, on_stale=on_stale), prompts()
    step_of(p, 1, draw, engine)  # its tokens: version 0
    with_tokens = [(g.key, s) for g in p.groups for s in g.samples if s.tokens]
    stale_groups = {k for k, _ in with_tokens}
    assert with_tokens
    keys_before = [g.key for g in p.groups]
    batch = step_of(p, 3, draw, engine)  # the trainer at version 2: every carried token is 2 behind
    m = batch.gen_metrics
    if on_stale == "restart":
        assert m["partial/restarted"] == len(with_tokens) and m["partial/dropped_groups"] == 0
    else:
        assert m["partial/dropped_groups"] == len(stale_groups) and m["partial/restarted"] == 0
        assert not stale_groups & {g.key for g in p.groups}
    assert (batch.token_versions == 2).logical_or(batch.response_mask == 0).all()  # nothing older than 0 steps
    assert keys_before  # (the groups existed)


def test_a_chunk_of_the_whole_budget_carries_no_unfinished_sample(engine):
    p, draw = partial(chunk_tokens=MAX_NEW), prompts()
    batch = step_of(p, 1, draw, engine)
    check_invariants(batch)
    assert batch.gen_metrics["partial/engine_calls"] == 1 and batch.gen_metrics["partial/aborted"] == 0
    assert all(s.finish is not None for g in p.groups for s in g.samples)


def test_token_ages():
    versions = torch.tensor([[3, 4, 0], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = types.SimpleNamespace(token_versions=versions, response_mask=mask)
    assert token_age_metrics(batch, 4) == {"rollout/token_age/mean": pytest.approx(1 / 3), "rollout/token_age/max": 1.0}
    assert token_age_metrics(types.SimpleNamespace(token_versions=None), 4) == {}
    assert PENDING < 0


def test_token_versions_join_with_the_responses(engine):
    a, b = step_of(partial(), 1, prompts(), engine), step_of(partial(chunk_tokens=MAX_NEW), 1, prompts(), engine)
    joined = concat([a, b], pad_token_id=0)
    width = joined.response_ids.shape[1]
    assert joined.token_versions.shape == joined.response_ids.shape
    assert torch.equal(joined.token_versions[:a.num_samples, :a.response_ids.shape[1]], a.token_versions)
    assert (joined.token_versions[:a.num_samples, a.response_ids.shape[1]:width] == 0).all()


def test_config_refuses_what_partial_rollouts_cannot_carry_yet():
    on = ["rollout.partial.enable=true", "algorithm.adv_estimator=grpo", "rollout.n=4"]
    cfg = load_config("recipes/demo-cpu.yaml", on + ["rollout.max_new_tokens=16"])
    assert cfg.rollout.partial_chunk_tokens == 4
    assert load_config("recipes/demo-cpu.yaml", on + ["rollout.max_new_tokens=6"]).rollout.partial_chunk_tokens == 6
    for extra, named in [(["rollout.partial.chunk_tokens=3", "rollout.max_new_tokens=16"], "does not divide"),
                         (["rollout.partial.over_sample=0.5"], "over_sample")]:
        with pytest.raises(ConfigError, match=named) as e:
            load_config("recipes/demo-cpu.yaml", on + extra)
        assert "Fix:" in str(e.value)
    assert dataclasses.asdict(load_config("recipes/demo-cpu.yaml").rollout.partial)["enable"] is False


def parity_scores(batch):
    """A rule score: 1 for an odd response length, else 0 (about half the groups of 2 differ)."""
    scores = (batch.response_mask.sum(-1) % 2).float()
    return scores, scores[:, None].clone(), [{"acc": float(s)} for s in scores.tolist()]


def dynamic(max_gen_batches=0, on_limit="fill"):
    f = GroupFilter(groups=GROUPS, metric="acc", max_gen_batches=max_gen_batches, inflight=1, on_limit=on_limit,
                    gen_batch_size=GROUPS)
    return DynamicSampling(f, parity_scores)


def test_dynamic_sampling_judges_each_group_as_it_completes_and_refills_the_pool(engine):
    p, draw = partial(), prompts()
    d = dynamic()
    for step in range(1, 5):
        calls_before, judged_before = draw.calls, sum(g.scored is not None for g in p.groups)
        batch = _stamped(p.next_batch(step, params(step), draw=draw, generate=engine.generate, dynamic=d), step - 1)
        check_invariants(batch)
        m = batch.gen_metrics
        scores, components, fields = parity_scores(batch)
        assert torch.equal(batch.scores, scores) and torch.equal(batch.score_components, components)
        assert batch.score_fields == fields  # the judged scores travel with the batch, row by row
        assert not uniform_groups(scores, batch.prompt_index, GROUPS).any()  # only informative groups trained
        assert m["filter_groups/hit_limit"] == 0 and m["train/num_gen_batches"] == draw.calls - calls_before
        # kept groups: trained now or carried with their scores, none lost and none judged twice
        assert m["filter_groups/kept_groups"] + judged_before == GROUPS + sum(g.scored is not None for g in p.groups)
        assert 0 < m["filter_groups/kept_fraction"] <= 1
        # the pool holds no judged uniform group; a judged group kept beyond the batch is carried with its scores
        for g in p.groups:
            assert g.scored is None or not uniform_groups(g.scored["scores"], torch.arange(N) * 0, 1).item()
    assert draw.calls > 2 + 3, "no uniform group was replaced by a new prompt"  # 2 draws fill the pool at step 1


@pytest.mark.parametrize("on_limit", ["fill", "stop"])
def test_dynamic_sampling_at_its_bound_tops_up_or_stops(engine, on_limit):
    p, draw = partial(over_sample=1), prompts()
    d = dynamic(max_gen_batches=1, on_limit=on_limit)
    d.score = lambda batch: (torch.zeros(batch.num_samples), None, [{} for _ in range(batch.num_samples)])  # all uniform
    if on_limit == "stop":
        with pytest.raises(FilterLimitError, match="Fix:"):
            p.next_batch(1, params(1), draw=draw, generate=engine.generate, dynamic=d)
        return
    batch = p.next_batch(1, params(1), draw=draw, generate=engine.generate, dynamic=d)
    assert draw.calls == 1 and batch.gen_metrics["filter_groups/hit_limit"] == 1
    assert batch.gen_metrics["filter_groups/kept_groups"] == 0 and len(torch.bincount(batch.prompt_index)) == GROUPS
    assert torch.equal(batch.scores, torch.zeros(GROUPS * N)) and batch.score_components is None


def test_judged_groups_survive_a_checkpoint(engine):
    a, b, draw_a, draw_b = partial(over_sample=3), partial(over_sample=3), prompts(), prompts()
    examples = {}
    for step in (1, 2):
        batch = a.next_batch(step, params(step), draw=draw_a, generate=engine.generate, dynamic=dynamic())
        examples.update({e.index: e for e in batch.examples})
        examples.update({g.example.index: g.example for g in a.groups})
    b.load_state_dict(saved_and_loaded(a), [examples.get(i) for i in range(max(examples) + 1)])
    for _ in range(draw_a.calls):
        draw_b()
    assert [g.scored is not None for g in a.groups] == [g.scored is not None for g in b.groups]
    for step in (3, 4):
        x = a.next_batch(step, params(step), draw=draw_a, generate=engine.generate, dynamic=dynamic())
        y = b.next_batch(step, params(step), draw=draw_b, generate=engine.generate, dynamic=dynamic())
        for f in ("response_ids", "rollout_log_probs", "scores", "prompt_index"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f
        assert x.score_fields == y.score_fields and x.gen_metrics.keys() == y.gen_metrics.keys()


def test_routes_of_resumed_samples_are_a_teacher_forced_pass(engine):
    """Routing replay: a resumed sample's routes hold every position's experts from the call that first
    fed it; under one weights version that is a teacher-forced pass over the whole sequence (the engine's
    own claim, tests/unit/test_routes.py), every position but the never-fed last token."""
    from tests.unit.test_routes import tiny_moe

    model = tiny_moe("Qwen3MoeForCausalLM")
    moe = HFEngine(model, pad_token_id=0)
    p, draw = partial(max_new_tokens=16), prompts()
    stop = tuple(range(10, 14))  # 4 of 50 tokens: lengths spread over 16
    recorder = RouteRecorder(model, "Qwen3MoeForCausalLM", 2)
    resumed = 0
    for step in (1, 2, 3):
        args = dataclasses.replace(params(step), max_new_tokens=16, stop_token_ids=stop, return_routes=True)
        batch = p.next_batch(step, args, draw=draw, generate=moe.generate)
        resumed += batch.gen_metrics["partial/resumed"]
        ids, mask = batch.sequences()
        assert batch.routes.shape == ids.shape + (3, 2)
        for i in range(len(ids)):
            real = ids[i][mask[i].bool()]
            with torch.no_grad(), recorder:
                model(input_ids=real[None])
            reference = recorder.take(1, real.numel())[0]
            got = batch.routes[i][mask[i].bool()]
            assert torch.equal(got[:-1], reference[:-1]) and (got[-1] == UNKNOWN).all()
            assert (batch.routes[i][~mask[i].bool()] == UNKNOWN).all()
    assert resumed > 0
    state = saved_and_loaded(p)  # the carried routes are plain tensors in the checkpoint
    assert any(s["routes"] is not None for g in state["groups"] for s in g["samples"])


class Tally(Environment):
    """A stateful environment: each observation is its turn number and the running sum of the action tokens
    (mod 7), as two tokens; the episode ends after 3 actions or at an action that holds token 99.
    `flaky`: answers differently after a rebuild (a non-deterministic tool)."""

    observation_role = "user"
    made, closed = [], []

    def __init__(self, flaky=False):
        self.turn, self.total, self.flaky = 0, 0, flaky
        Tally.made.append(self)

    async def reset(self, episode):
        self.turn, self.total = 0, sum(episode.prompt_ids)

    async def step(self, action):
        self.turn += 1
        self.total += sum(action.token_ids)
        jitter = 1 if self.flaky and Tally.made.index(self) >= Tally.flaky_after else 0
        return StepResult(observation=f"{self.turn} {(self.total + jitter) % 7}", reward=0.25 * self.turn,
                          done=self.turn >= 3 or 99 in action.token_ids, metrics={"tally": 1.0})

    async def close(self):
        Tally.closed.append(self)


Tally.flaky_after = 10**9


def tally_observation(text, action_ids):
    return [200 + int(t) for t in text.split()]  # the turn and the sum, as tokens 200..


def episodes(flaky=False, max_new=32):
    return Episodes(Tally, {"flaky": flaky}, tokenizer=types.SimpleNamespace(decode=lambda ids, **kw: str(ids)),
                    encode_observation=tally_observation, max_turns=3, max_turn_tokens=12, max_new_tokens=max_new)


def replayed(example, tokens, mask):
    """The slow reference: a fresh Tally stepped through the sample's actions (runs of mask 1) -> the
    observations it answers, its score and whether it ended."""
    import asyncio

    env, obs, i, score, done = Tally(), [], 0, 0.0, False
    asyncio.run(env.reset(types.SimpleNamespace(prompt_ids=example.prompt_ids)))
    while i < len(tokens) and not done:
        j = i
        while j < len(tokens) and mask[j] == 1:
            j += 1
        result = asyncio.run(env.step(types.SimpleNamespace(token_ids=tuple(tokens[i:j]))))
        score, done = score + result.reward, result.done
        k = j
        while k < len(tokens) and mask[k] == 0:
            k += 1
        obs.append((tokens[j:k], tally_observation(result.observation, ())))
        i = k
    return obs, score


def test_multi_turn_episodes_abort_mid_turn_and_resume_with_their_environment(engine):
    Tally.made, Tally.closed = [], []
    p, draw = partial(episodes=episodes()), prompts()
    stop = tuple(range(10, 25)) + (99,)
    mid_turn = 0
    for step in range(1, 6):
        mid_turn += sum(1 for g in p.groups for s in g.samples
                        if s.finish is None and s.episode and len(s.tokens) > s.episode.action_start)
        args = dataclasses.replace(params(step), stop_token_ids=stop)
        batch = _stamped(p.next_batch(step, args, draw=draw, generate=engine.generate), step - 1)
        real = batch.response_attention_mask
        for row, example in enumerate(batch.examples):
            k = int(real[row].sum())
            tokens, mask = batch.response_ids[row, :k].tolist(), batch.response_mask[row, :k].tolist()
            assert k <= 32 and mask[0] == 1 and mask[-1] == 1 and (real[row, k:] == 0).all()
            obs, score = replayed(example, tokens, mask)
            assert all(got == want for got, want in obs[:-1]) and obs[-1][0] in ([], obs[-1][1])  # env's answers
            assert batch.env_scores[row].item() == pytest.approx(score)
            assert len(obs) <= 3 and all(len(a) <= 12 for a in _runs(tokens, mask))  # turn and token budgets
            assert (batch.rollout_log_probs[row, :k] * (1 - batch.response_mask[row, :k])).abs().sum() == 0
        assert batch.env_metrics["env/tally"] >= batch.num_samples and batch.clipped.dtype == torch.bool
    assert mid_turn > 0, "no episode was carried in the middle of an action"
    finished = [s for g in p.groups for s in g.samples if s.finish is not None]
    assert len(Tally.closed) >= 5 * GROUPS * N and all(s.episode.env is None for s in finished)


def _runs(tokens, mask):
    out, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("flaky", [False, True])
def test_carried_episodes_survive_a_checkpoint_by_replaying_their_actions(engine, flaky):
    """After a resume the environments are rebuilt by stepping new ones through the recorded actions; the
    run continues as it would have (bitwise), or an environment that answers otherwise restarts its episode."""
    Tally.made, Tally.flaky_after = [], 10**9
    stop = tuple(range(10, 25)) + (99,)
    a, b, draw_a, draw_b = partial(episodes=episodes()), partial(episodes=episodes(flaky)), prompts(), prompts()
    examples = {}
    for step in (1, 2):
        batch = a.next_batch(step, dataclasses.replace(params(step), stop_token_ids=stop), draw=draw_a,
                             generate=engine.generate)
        examples.update({e.index: e for e in batch.examples} | {g.example.index: g.example for g in a.groups})
    b.load_state_dict(saved_and_loaded(a), [examples.get(i) for i in range(max(examples) + 1)])
    for _ in range(draw_a.calls):
        draw_b()
    Tally.flaky_after = len(Tally.made)  # every environment made from now on (b's rebuilt ones) answers otherwise
    mid = sum(1 for g in b.groups for s in g.samples if s.finish is None and s.episode.actions)
    assert mid > 0, "no carried episode had finished an action"
    args = dataclasses.replace(params(3), stop_token_ids=stop)
    y = b.next_batch(3, args, draw=draw_b, generate=engine.generate)
    if flaky:
        assert y.gen_metrics["partial/restarted"] >= mid
        return
    Tally.flaky_after = 10**9
    x = a.next_batch(3, args, draw=draw_a, generate=engine.generate)
    for f in ("response_ids", "response_mask", "rollout_log_probs", "env_scores", "prompt_index"):
        assert torch.equal(getattr(x, f), getattr(y, f)), f
    assert x.gen_metrics == y.gen_metrics and x.env_metrics == y.env_metrics
