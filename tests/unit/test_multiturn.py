"""Multi-turn rollouts (megappo.rollout.multiturn): token-in/token-out with a tokenizer that does not
round-trip, observation ids from a chat template, budgets, masks and metrics, environment loading,
the single-turn path unchanged, and the lookup demo's random-policy score."""

import dataclasses
import os
import random
import re
import types

import pytest
import torch

from megappo.config import ConfigError, load_config
from megappo.data.prompts import RowOrigin, build_prompts, builtin_rows
from megappo.envs.base import Action, Environment, StepResult
from megappo.envs.loading import check_env, env_class
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.trainer.step import last_action_token, rollout, to_seqs
from megappo.parallel.packing import MicroBatching, micro_batch_tensors
from megappo.rollout.hf.engine import HFEngine
from megappo.rollout.multiturn import (ObservationEncoder, ObservationError, observation_encoder,
                                       random_policy_episode_score, run_episodes, turn_seed)
from megappo.data.tokenizer import load_tokenizer
from megappo.types import RolloutBatch, SamplingParams
from megappo.user_code import UserCodeError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "recipes", "demo-multiturn-cpu.yaml")

#: Qwen2.5's shape: a default system prompt when the first message is not a system message
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nbe nice<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def bpe_tokenizer(chat_template=None):
    """Characters plus the merges 'ab' and 'bc': sampled 'a','b' decode to 'ab', which encodes as
    one token; special tokens vanish from decoded text. decode/encode does NOT round-trip."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyzABQ") + [" ", "\n", "=", ">", "?", "<", "/"]
    vocab = {"<pad>": 0, "<|im_end|>": 1, "<|im_start|>": 2}
    for ch in chars + ["ab", "bc"]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c")], unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.clean_up_tokenization_spaces = False
    if chat_template:
        fast.chat_template = chat_template
    return fast


def examples(tok, prompts, render=False):
    rows = [{"prompt": p, "reward_model": {"ground_truth": str(i)}} for i, p in enumerate(prompts)]
    return build_prompts(rows, tok, apply_chat_template=render)[0]


class Echo(Environment):
    """Answers every action with a fixed text; done when the action holds a 'z'."""

    observation_role = "user"

    def __init__(self, text="x=abc>"):
        self.text, self.resets, self.closed = text, 0, False

    async def reset(self, episode):
        self.resets += 1

    async def step(self, action):
        return StepResult(observation=self.text, reward=0.25, done="z" in action.text,
                          metrics={"steps": 1.0, "len": float(len(action.token_ids))})

    async def close(self):
        self.closed = True


class Recording:
    """An engine wrapper that records every turn's contexts and outputs."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, contexts, params):
        out = self.engine.generate(contexts, params)
        self.calls.append(([list(c) for c in contexts], params, out))
        return out


def test_trainer_input_ids_equal_the_engine_contexts_turn_by_turn():
    """A real hf engine (tiny Llama) plays 3-turn episodes; the tokenizer does not round-trip. Every
    turn's contexts are exact prefixes of the rows the trainer packs, the action tokens in them are
    what the engine sampled (response_mask 1, the engine's log-probs), observation ids are the
    chat template's observation turn (response_mask 0, attended), and a plain forward of the
    trainer's sequences gives the engine's log-probs on action tokens."""
    tok = bpe_tokenizer(TEMPLATE)
    model = build_hf_model(dict(TINY_CONFIGS["llama"], vocab_size=64), seed=5)
    engine = Recording(HFEngine(model, pad_token_id=tok.pad_token_id))
    exs = examples(tok, ["abc?", "b?", "cab bc?"], render=True)
    envs = []

    def make_env():
        envs.append(Echo())
        return envs[-1]

    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, eos_token_ids=(tok.eos_token_id,), seed=7)
    enc = observation_encoder(tok, "user", True)
    batch = run_episodes(engine.generate, exs, params, make_env=make_env, tokenizer=tok, encode_observation=enc,
                         max_turns=3, max_turn_tokens=6, pad_token_id=tok.pad_token_id)
    assert len(envs) == 6 and all(e.resets == 1 and e.closed for e in envs)
    assert batch.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]

    seqs = to_seqs(dataclasses.replace(batch, examples=None))
    plan = MicroBatching(packed=True, max_tokens=10_000).plan(seqs.attention_mask, seqs.prompt_len, 1)
    (mb,) = micro_batch_tensors(plan, 0, seqs.input_ids, seqs.attention_mask, seqs.prompt_len, select="response",
                                per_row={})
    cu = mb["cu_seqlens"].tolist()
    trainer_rows = {int(r): mb["input_ids"][0, cu[j]:cu[j + 1]].tolist() for j, r in enumerate(mb["rows"])}

    R = batch.response_ids.shape[1]
    round_trip_broken = 0
    for i in range(6):
        row, prompt = trainer_rows[i], list(exs[i // 2].prompt_ids)
        resp = row[len(prompt):]
        assert row[:len(prompt)] == prompt
        action = batch.response_mask[i, :len(resp)].tolist()
        assert batch.real_response_mask[i].sum() == len(resp) and batch.response_mask[i, len(resp):].sum() == 0
        # replay the turns: each context of episode i is exactly the trainer's row up to that turn
        pos, turn = 0, 0
        for contexts, turn_params, out in engine.calls:
            if turn == 0:
                assert contexts == [list(e.prompt_ids) for e in exs] and turn_params.n == 2
                out_row = i
            else:
                matches = [j for j, c in enumerate(contexts) if c == prompt + resp[:pos]]
                if not matches or pos >= len(resp):
                    break
                out_row = matches[0]
                assert turn_params.n == 1 and turn_params.seed == turn_seed(7, turn)
            n_act = int(out.response_mask[out_row].sum())
            sampled = out.response_ids[out_row, :n_act].tolist()
            assert resp[pos:pos + n_act] == sampled and action[pos:pos + n_act] == [1] * n_act
            assert torch.equal(batch.rollout_log_probs[i, pos:pos + n_act], out.rollout_log_probs[out_row, :n_act])
            round_trip_broken += tok.encode(tok.decode(sampled, skip_special_tokens=True),
                                            add_special_tokens=False) != sampled
            pos += n_act
            if pos < len(resp):  # the observation: the template's user turn, after the action's <|im_end|>
                obs = enc("x=abc>", sampled)
                assert resp[pos:pos + len(obs)] == obs and action[pos:pos + len(obs)] == [0] * len(obs)
                pos += len(obs)
            turn += 1
        assert pos == len(resp), (i, pos, len(resp))
    assert round_trip_broken > 0  # the test means something: re-encoding would have changed tokens

    ids, mask = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    P = batch.prompt_ids.shape[1]
    lp = logits[:, P - 1:-1].float().log_softmax(-1).gather(-1, batch.response_ids[..., None])[..., 0]
    act = batch.response_mask.bool()
    assert act.sum() < batch.real_response_mask.sum()  # observations are there, and masked out
    assert torch.allclose(lp[act], batch.rollout_log_probs[act], atol=1e-4)
    assert R == batch.rollout_log_probs.shape[1] and (batch.rollout_log_probs[~act] == 0).all()


def test_observation_ids_continue_the_template_rendering():
    """prompt + action + observation ids == the template's rendering of the whole conversation (a
    tokenizer whose action text round-trips), with the default system prompt once; an action cut
    by its budget gets the whole turn closer."""
    tok = bpe_tokenizer(TEMPLATE)
    enc = ObservationEncoder(tok, "tool", use_chat_template=True)
    user = [{"role": "user", "content": "what is x?"}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    action = tok.encode("look up x", add_special_tokens=False) + [tok.eos_token_id]
    obs = enc("x=seven", action)
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "look up x"},
                                            {"role": "tool", "content": "x=seven"}], add_generation_prompt=True,
                                    tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert prompt + action + obs == whole
    assert tok.decode(obs).count("be nice") == 0 and tok.decode(obs).startswith("\n<|im_start|>tool")
    cut = enc("x=seven", action[:-1])  # no <|im_end|>: the assistant turn is closed first
    assert cut == [tok.eos_token_id] + obs
    # Qwen3's shape: the last assistant turn gets an empty think block, an earlier one does not
    qwen3 = bpe_tokenizer(TEMPLATE.replace("'<|im_start|>' + m['role'] + '\\n' + m['content']",
                                           "'<|im_start|>' + m['role'] + '\\n' + ('<think></think>' if loop.last and "
                                           "m['role'] == 'assistant' else '') + m['content']"))
    assert "think" in qwen3.apply_chat_template(user + [{"role": "assistant", "content": "a"}], tokenize=False)
    whole3 = qwen3.apply_chat_template(user + [{"role": "assistant", "content": "look up x"},
                                               {"role": "tool", "content": "x=seven"}], add_generation_prompt=True,
                                       tokenize=True)
    whole3 = list(whole3["input_ids"] if hasattr(whole3, "keys") else whole3)
    assert prompt + action + ObservationEncoder(qwen3, "tool", use_chat_template=True)("x=seven", action) == whole3
    plain = ObservationEncoder(tok, "tool", use_chat_template=False)  # data.apply_chat_template=false
    assert plain("x=seven", action) == tok.encode("x=seven", add_special_tokens=False)


class Scripted:
    """An engine that answers each context with the next of a fixed list of actions (by turn)."""

    def __init__(self, script, eos):
        self.script, self.eos, self.turns = script, eos, []

    def generate(self, contexts, params):
        turn = len(self.turns)
        self.turns.append((len(contexts), params.max_new_tokens, params.n))
        rows = [self.script[turn] for c in contexts for _ in range(params.n)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            r = r[:params.max_new_tokens]
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        reasons = ["stop" if self.eos in r[:params.max_new_tokens] else "length" for r in rows]
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask,
                            rollout_log_probs=-mask.float(), finish_reasons=reasons,
                            prompt_index=torch.arange(len(contexts)).repeat_interleave(params.n))


def play(script, *, max_turns, max_turn_tokens, max_new_tokens, text="ab"):
    tok = load_tokenizer("builtin:digits")
    eng = Scripted(script, tok.eos_token_id)
    exs = examples(tok, ["1?"])
    batch = run_episodes(eng.generate, exs, SamplingParams(max_new_tokens=max_new_tokens), make_env=lambda: Echo(text),
                         tokenizer=tok, encode_observation=observation_encoder(tok, "user", False),
                         max_turns=max_turns, max_turn_tokens=max_turn_tokens, pad_token_id=0)
    return batch, eng


def test_budgets_masks_and_metrics():
    # digits tokenizer: '5' -> 8, EOS 1; Echo's observation "12" -> [4, 5]; 'z' is not in the alphabet
    batch, eng = play([[8, 1], [9, 9, 1], [10, 1]], max_turns=3, max_turn_tokens=2, max_new_tokens=20, text="12")
    # turn 1's action is cut to the turn budget (2 tokens, "length"); the closer-less observation follows
    assert batch.response_ids[0].tolist() == [8, 1, 4, 5, 9, 9, 4, 5, 10, 1]
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert batch.real_response_mask[0].tolist() == [1] * 10
    assert [t[1] for t in eng.turns] == [2, 2, 2] and batch.finish_reasons == ["stop"]
    assert batch.env_scores.tolist() == [0.75]  # three steps of 0.25
    # one action of three was cut by its turn budget; the episode ended on max_turns, inside max_new_tokens
    assert batch.env_metrics == {"env/turns_mean": 3.0, "env/episode_length_mean": 10.0, "env/truncated_frac": 1.0,
                                 "env/action_clip_ratio": 1 / 3, "env/unknown_char_observations": 0.0,
                                 "env/len": 6.0, "env/steps": 3.0}
    assert batch.clip_ratio == 0.0
    assert int(last_action_token(batch.response_mask)[0]) == 9
    # the episode budget: after 2 + 2 tokens, 2 are left: the second action gets them, no observation after it
    batch, eng = play([[8, 1], [9, 9, 9, 1]], max_turns=5, max_turn_tokens=None, max_new_tokens=6, text="12")
    assert batch.response_ids[0].tolist() == [8, 1, 4, 5, 9, 9] and [t[1] for t in eng.turns] == [6, 2]
    assert batch.finish_reasons == ["length"] and batch.env_metrics["env/truncated_frac"] == 1.0
    assert batch.clip_ratio == 1.0 and batch.env_metrics["env/action_clip_ratio"] == 0.5
    # an observation that leaves no room for an action token is dropped and ends the episode
    batch, eng = play([[8, 1]], max_turns=5, max_turn_tokens=None, max_new_tokens=4, text="12")
    assert batch.response_ids[0].tolist() == [8, 1] and batch.finish_reasons == ["length"] and len(eng.turns) == 1
    assert batch.clip_ratio == 1.0 and batch.env_metrics["env/action_clip_ratio"] == 0.0


def test_a_sample_window_holds_for_the_first_turn_only():
    """Turn 0 is the single-turn call of the prompts, so a sample window given to run_episodes goes with
    it; a later turn has one context per running episode, for which no window of the whole call is known
    here: it gets none (a caller splitting across replicas windows each turn's engine call itself)."""
    tok = load_tokenizer("builtin:digits")
    eng, windows = Scripted([[8, 1], [9, 1], [10, 1]], tok.eos_token_id), []

    def generate(contexts, params):
        windows.append(params.sample_window)
        return eng.generate(contexts, params)

    run_episodes(generate, examples(tok, ["1?", "2?"]), SamplingParams(n=2, max_new_tokens=20, sample_window=(4, 12)),
                 make_env=lambda: Echo("12"), tokenizer=tok, encode_observation=observation_encoder(tok, "user", False),
                 max_turns=3, max_turn_tokens=None, pad_token_id=0)
    assert windows == [(4, 12), None, None] and [t[0] for t in eng.turns] == [2, 4, 4]


class Once(Environment):
    """Ends every episode after its first action; declares a counter it reports only for a '7'."""

    metric_keys = ("sevens", "actions")

    async def step(self, action):
        return StepResult(done=True, metrics={"sevens": 1} if action.text == "7" else {})


def test_action_budget_ends_are_not_response_budget_ends_and_declared_metrics_are_always_logged():
    """An action cut by max_turn_tokens that the environment then ends: the reward functions still
    see finish reason 'length', but the response did not reach max_new_tokens (clip ratio 0, the
    cut action in env/action_clip_ratio); a declared metric key no episode reported is logged as 0."""
    tok = load_tokenizer("builtin:digits")
    eng = Scripted([[9, 9, 9, 1]], tok.eos_token_id)
    batch = run_episodes(eng.generate, examples(tok, ["1?", "2?"]), SamplingParams(n=2, max_new_tokens=20),
                         make_env=Once, tokenizer=tok, encode_observation=observation_encoder(tok, "tool", False),
                         max_turns=3, max_turn_tokens=2, pad_token_id=0)
    assert batch.finish_reasons == ["length"] * 4 and batch.env_metrics["env/truncated_frac"] == 0.0
    assert batch.clip_ratio == 0.0 and batch.env_metrics["env/action_clip_ratio"] == 1.0
    assert batch.env_metrics["env/sevens"] == 0.0 and batch.env_metrics["env/actions"] == 0.0
    single = RolloutBatch(prompt_ids=torch.zeros(2, 1), prompt_mask=torch.ones(2, 1), response_ids=torch.zeros(2, 1),
                          response_mask=torch.ones(2, 1), rollout_log_probs=torch.zeros(2, 1),
                          finish_reasons=["length", "stop"], prompt_index=torch.arange(2))
    assert single.clip_ratio == 0.5  # single-turn: verl's count of finish reasons


def test_last_action_token_skips_observation_holes():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert last_action_token(mask).tolist() == [4, 0, 0, 5]


def fake_run(env, engine, tok, **rollout):
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(env=env, env_args={}, max_turns=4, max_turn_tokens=None,
                                                              bad_observation_policy="error", **rollout),
                                data=types.SimpleNamespace(apply_chat_template=False, apply_chat_template_kwargs={}))
    return types.SimpleNamespace(cfg=cfg, engine=engine, tokenizer=tok)


def test_single_turn_path_is_the_engine_call():
    """rollout.env=single_turn: the orchestrator's rollout is the engine's batch itself, same tokens
    for the same seed; the runner with SingleTurn (by path) samples the very same tokens."""
    tok = load_tokenizer("builtin:digits")
    model = build_hf_model(dict(TINY_CONFIGS["llama"], vocab_size=19), seed=2)
    engine = HFEngine(model, pad_token_id=0)
    exs = examples(tok, ["1>", "22>", "3>"])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, eos_token_ids=(1,), seed=11)
    direct = engine.generate([e.prompt_ids for e in exs], params)
    today = rollout(fake_run("single_turn", engine, tok), exs, params)
    runner = rollout(fake_run("megappo.envs.base:SingleTurn", engine, tok), exs, params)
    for got in (today, runner):
        for f in ("prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "prompt_index"):
            assert torch.equal(getattr(got, f), getattr(direct, f)), f
        assert got.finish_reasons == direct.finish_reasons
    assert today.response_attention_mask is None and today.env_scores is None
    assert runner.env_metrics["env/turns_mean"] == 1.0 and runner.env_scores.tolist() == [0.0] * 6


def test_env_loading_and_start_up_errors(tmp_path, monkeypatch):
    assert env_class("single_turn").__name__ == "SingleTurn" and env_class("lookup").__name__ == "LookupEnv"
    own = tmp_path / "my_env.py"
    own.write_text("from megappo.envs.base import Environment, StepResult\n"
                   "class MyEnv(Environment):\n"
                   "    def __init__(self, bonus=1.0):\n        self.bonus = bonus\n"
                   "    async def step(self, action):\n        return StepResult(reward=self.bonus, done=True)\n"
                   "class NotAnEnv:\n    pass\n")
    assert check_env(f"{own}:MyEnv", {"bonus": 2.0}).__name__ == "MyEnv"
    monkeypatch.chdir(tmp_path)
    assert check_env("my_env:MyEnv", {}).__name__ == "MyEnv"  # a module from the working directory
    for spec, args, message in [
        ("nowhere.py:MyEnv", {}, "does not exist"),
        ("no_such_module_xyz:Env", {}, "cannot import"),
        ("single_trun", {}, "neither a built-in environment"),
        ("my_env:Missing", {}, r"has no 'Missing' \(its Environment classes: \['MyEnv'\]\)"),
        ("my_env:NotAnEnv", {}, "is not a subclass of megappo.envs.base.Environment"),
        ("my_env:MyEnv", {"bonsu": 1}, "unexpected keyword argument 'bonsu'"),
        ("single_turn", {"x": 1}, "takes no arguments"),
        ("lookup", {"answer_reward": -1}, "answer_reward=-1"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            check_env(spec, args)
        assert "Fix:" in str(info.value)


def test_bad_env_is_refused_before_any_model_is_built():
    from megappo.trainer.preflight import check_inputs

    cfg = load_config(DEMO, ["rollout.env=megappo.envs.lookup:Nope"])
    with pytest.raises(ConfigError, match="has no 'Nope'.*Fix:"):
        check_inputs(cfg, 2)
    with pytest.raises(ConfigError, match="max_turns"):
        load_config(DEMO, ["rollout.max_turns=0"])


def demo_score(capsys):
    """docs/environments.md's snippet that computes the demo's random-policy score, run as is from the
    repository root: (its config, tokenizer, examples, environment class, score)."""
    page = open(os.path.join(REPO, "docs", "environments.md")).read()
    code = re.search(r"```python\n(from megappo.config import load_config.*?random_policy_episode_score.*?)```",
                     page, re.S).group(1)
    cwd, names = os.getcwd(), {}
    os.chdir(REPO)
    try:
        exec(compile(code, "docs/environments.md", "exec"), names)
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out == f"uniform sampling scores {names['score']:.3f}\n"
    return names["cfg"], names["tok"], names["examples"], names["env"], names["score"]


class Uniform:
    """A random policy: uniform tokens until EOS or the turn's budget."""

    def __init__(self, vocab, eos, seed):
        self.vocab, self.eos, self.rng = vocab, eos, random.Random(seed)

    def generate(self, contexts, params):
        rows = []
        for _ in range(len(contexts) * params.n):
            r = []
            while len(r) < params.max_new_tokens and (not r or r[-1] != self.eos):
                r.append(self.rng.randrange(self.vocab))
            rows.append(r)
        width = max(map(len, rows))
        ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask,
                            rollout_log_probs=mask.float(), finish_reasons=["stop" if r[-1] == self.eos else "length"
                                                                            for r in rows],
                            prompt_index=torch.arange(len(contexts)).repeat_interleave(params.n))


def test_lookup_demo_random_policy_score_is_what_the_recipe_states(capsys):
    """The exact enumeration (docs/environments.md's snippet) against episodes of a uniform policy
    played by the runner itself, and the number the recipe and docs/environments.md quote."""
    cfg, tok, exs, env, exact = demo_score(capsys)
    assert exact <= 0.2
    n = 4000
    batch = run_episodes(Uniform(19, tok.eos_token_id, 0).generate, exs, SamplingParams(n=n // len(exs) + 1,
                         max_new_tokens=cfg.rollout.max_new_tokens), make_env=lambda: env(**cfg.rollout.env_args),
                         tokenizer=tok, encode_observation=observation_encoder(tok, env.observation_role, False),
                         max_turns=cfg.rollout.max_turns, max_turn_tokens=cfg.rollout.max_turn_tokens, pad_token_id=0)
    sampled = batch.env_scores.double()
    sigma = sampled.std().item() / sampled.numel() ** 0.5
    assert abs(sampled.mean().item() - exact) < 4 * sigma, (sampled.mean().item(), exact)
    stated = re.compile(r"random-policy score[^0-9]{0,40}?(\d+\.\d+)", re.IGNORECASE)
    for path in (DEMO, os.path.join(REPO, "docs", "environments.md")):
        text = " ".join(open(path).read().split())
        values = [m.group(1) for m in stated.finditer(text)]
        assert values, f"{path} does not state the random-policy score ({exact:.3f})"
        for v in values:
            assert float(v) == round(exact, len(v.split(".")[1])), f"{path} states {v}, the code gives {exact:.4f}"


def test_lookup_env_rewards():
    import asyncio

    from megappo.envs.base import Episode
    from megappo.envs.lookup import LookupEnv

    async def episode(*actions):
        env = LookupEnv()
        await env.reset(Episode(prompt_ids=(4, 5), ground_truth="7", extra={}, data_source="lookup", index=0))
        return [await env.step(Action(text=t, token_ids=(), finish_reason=r, turn=i))
                for i, (t, r) in enumerate(actions)]

    look, answer = asyncio.run(episode(("=", "stop"), ("7", "stop")))
    assert (look.observation, look.reward, look.done) == ("7>", 0.2, False) and (answer.reward, answer.done) == (0.8, True)
    assert [r.reward for r in asyncio.run(episode(("=", "stop"), ("=", "stop"), ("77", "length")))] == [0.2, 0.0, 0.4]
    assert [r.reward for r in asyncio.run(episode(("3", "stop")))] == [0.0]


def docs_guess_env(tmp_path):
    """docs/environments.md's GuessEnv, copied as is into the user's own file, as `rollout.env` names it."""
    page = open(os.path.join(REPO, "docs", "environments.md")).read()
    code = re.search(r"```python\n(from megappo.envs.base import .*?class GuessEnv.*?)```", page, re.S).group(1)
    (tmp_path / "my_env.py").write_text(code)
    return check_env(f"{tmp_path / 'my_env.py'}:GuessEnv", {"max_guesses": 3})


def play_guesses(env, tok, policy="error", guesses=("5", "7")):
    exs = [dataclasses.replace(e, ground_truth="7") for e in examples(tok, ["1?"])]
    actions = [tok.encode(g, add_special_tokens=False) + [tok.eos_token_id] for g in guesses]
    return run_episodes(Scripted(actions, tok.eos_token_id).generate, exs,
                        SamplingParams(max_new_tokens=20, eos_token_ids=(tok.eos_token_id,)),
                        make_env=lambda: env(max_guesses=3), tokenizer=tok,
                        encode_observation=observation_encoder(tok, env.observation_role, False, policy),
                        max_turns=3, max_turn_tokens=None, pad_token_id=0), actions


def test_observations_the_tokenizer_cannot_write_are_refused_or_counted(tmp_path, capsys):
    """The docs' GuessEnv with the demo's builtin:digits: 'higher' has no tokens but would become
    <pad> tokens. Policy error (the default) stops with the environment, the characters and the
    fix; warn trains on it, counts it per step and warns once per run."""
    env = docs_guess_env(tmp_path)
    tok = load_tokenizer("builtin:digits")
    with pytest.raises(ObservationError, match=r"my_env.py:GuessEnv.step returned StepResult.observation='higher' "
                                               r"with characters .*'higer'.*Fix: use a tokenizer .*"
                                               r"rollout.bad_observation_policy=warn"):
        play_guesses(env, tok)
    for _ in range(2):  # two steps
        batch, _ = play_guesses(env, tok, "warn", guesses=("5", "3", "7"))
        assert batch.env_metrics["env/unknown_char_observations"] == 2.0  # 'higher', then 'higher'
        assert batch.env_scores.tolist() == [1.0]
    out = capsys.readouterr().out
    assert out.count(f"megappo: warning: {tmp_path}/my_env.py:GuessEnv.step returned StepResult.observation") == 1, out
    assert "rollout.bad_observation_policy=warn: training on such observations" in out


class Counting(Environment):
    async def step(self, action):
        return StepResult(observation=7)


def test_an_observation_that_is_not_text_names_the_environment():
    tok = load_tokenizer("builtin:digits")
    with pytest.raises(TypeError, match=r"test_multiturn:Counting.step returned StepResult.observation=7 of type int"
                                        r"; an observation is text \(str\) or None. Fix: "):
        run_episodes(Scripted([[8, 1]], tok.eos_token_id).generate, examples(tok, ["1?"]),
                     SamplingParams(max_new_tokens=20), make_env=Counting, tokenizer=tok,
                     encode_observation=observation_encoder(tok, "tool", False), max_turns=3, max_turn_tokens=None,
                     pad_token_id=0)


FAILING_ENV = '''
from megappo.envs.base import Environment, StepResult

CLOSED = []

class Flaky(Environment):
    async def reset(self, episode):
        self.row = episode.index

    async def step(self, action):
        if action.turn == 1 and self.row == 1:
            return {"oops": 1}["answer"]
        return StepResult(observation="1")

    async def close(self):
        CLOSED.append(self.row)
'''


def test_what_an_environment_raises_names_its_class_the_row_and_the_turn(tmp_path, monkeypatch):
    """Row 1's environment raises in its second step: one UserCodeError naming the user's class and
    method, the row, its prompt and the turn, with the exception as its cause; every environment is
    still closed. A reset that raises is named the same way, without a turn."""
    (tmp_path / "flaky_env.py").write_text(FAILING_ENV)
    monkeypatch.chdir(tmp_path)
    env = check_env("flaky_env.py:Flaky", {})
    tok = load_tokenizer("builtin:digits")
    exs = [dataclasses.replace(e, origin=RowOrigin("val.jsonl", 2 * i + 1, split="validation"))  # rows 1 and 3
           for i, e in enumerate(examples(tok, ["1?", "2?"]))]
    eng = Scripted([[8, 1], [9, 1], [10, 1]], tok.eos_token_id)
    kw = dict(make_env=env, tokenizer=tok, encode_observation=observation_encoder(tok, "tool", False), max_turns=3,
              max_turn_tokens=None, pad_token_id=0)
    with pytest.raises(UserCodeError) as raised:
        run_episodes(eng.generate, exs, SamplingParams(max_new_tokens=20), **kw)
    assert str(raised.value) == (f"environment {tmp_path}/flaky_env.py:Flaky.step raised KeyError: 'answer' on val.jsonl:3 "
                                 "(validation row, prompt '2?'), turn 1. Fix: correct that code (its traceback is above).")
    assert isinstance(raised.value.__cause__, KeyError)
    assert sorted(env.step.__globals__["CLOSED"]) == [0, 1]

    async def broken_reset(self, episode):
        raise RuntimeError("no sandbox")

    monkeypatch.setattr(env, "reset", broken_reset)
    with pytest.raises(UserCodeError, match=r"^environment .*/flaky_env.py:Flaky.reset raised RuntimeError: no sandbox "
                                            r"on val.jsonl:1 \(validation row, prompt '1\?'\)\. Fix"):
        run_episodes(Scripted([[8, 1]], tok.eos_token_id).generate, exs, SamplingParams(max_new_tokens=20), **kw)


def test_chat_template_kwargs_reach_every_rendering():
    """data.apply_chat_template_kwargs (verl's key; Qwen3's enable_thinking) in the prompts and in the turns a
    multi-turn episode appends: each opens the next assistant turn as the template does with those arguments."""
    think = TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}",
                             "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
                             "{{ '<think></think>' }}{% endif %}")
    tok = bpe_tokenizer(think)
    off = {"enable_thinking": False}
    user = [{"role": "user", "content": "what is x?"}]
    plain, = build_prompts([{"prompt": user, "reward_model": {"ground_truth": "1"}}], tok)[0]
    prompt, = build_prompts([{"prompt": user, "reward_model": {"ground_truth": "1"}}], tok, template_kwargs=off)[0]
    assert tok.decode(prompt.prompt_ids).endswith("assistant\n<think></think>")
    assert not tok.decode(plain.prompt_ids).endswith("</think>")
    direct = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, **off)
    assert list(prompt.prompt_ids) == list(direct["input_ids"] if hasattr(direct, "keys") else direct)
    action = tok.encode("look up x", add_special_tokens=False) + [tok.eos_token_id]
    obs = observation_encoder(tok, "tool", True, "error", off)("x=seven", action)
    assert tok.decode(obs) == "\n<|im_start|>tool\nx=seven<|im_end|>\n<|im_start|>assistant\n<think></think>"
    assert not tok.decode(observation_encoder(tok, "tool", True)("x=seven", action)).endswith("</think>")
