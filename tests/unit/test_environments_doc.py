"""docs/environments.md's own-environment path, as the page writes it: its complete GuessEnv block
copied into my_env.py, named by the page's command line
(`megappo train RECIPE.yaml rollout.env=my_env.py:GuessEnv 'rollout.env_args={max_guesses: 3}'`),
read through megappo's config and start-up checks, then played through the multi-turn runner by a
policy that sees only tokens. No model is built: the policy bisects on the observations it reads
back from its own context, so the page's 'higher'/'lower' must reach it as tokens."""

import json
import os
import re
import shlex
import types

import pytest
import torch
import yaml

from megappo.config import ConfigError, load_config
from megappo.envs.loading import env_class
from megappo.trainer.step import rollout
from megappo.trainer.preflight import check_inputs, check_prompts, load_prompts
from megappo.data.tokenizer import load_tokenizer
from megappo.types import RolloutBatch, SamplingParams
from tests.e2e._tiny_models import byte_level_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "docs", "environments.md")
DEMO = os.path.join(REPO, "recipes", "demo-multiturn-cpu.yaml")

#: prompt -> (the number the row hides, the turns on which the policy answers without a number)
GAMES = {
    "Guess my number from 0 to 99 (game 1).": (49, ()),  # right at once
    "Guess my number from 0 to 99 (game 2).": (74, ()),  # higher, right
    "Guess my number from 0 to 99 (game 3).": (30, ()),  # lower, higher, wrong: out of guesses
    "Guess my number from 0 to 99 (game 4).": (24, (0,)),  # no number, lower, right on the last guess
    "Guess my number from 0 to 99 (game 5).": (30, (2,)),  # lower, higher, no number: out of guesses
}
TURN = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>\n<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def page_blocks():
    """(the own-environment command's overrides, the rollout YAML block, the GuessEnv python block)."""
    page = open(PAGE).read()
    line = re.search(r"^megappo train RECIPE\.yaml .*GuessEnv.*$", page, re.M).group(0)
    words = shlex.split(line, comments=True)
    assert words[:3] == ["megappo", "train", "RECIPE.yaml"], line
    block = yaml.safe_load(re.search(r"```yaml\n(rollout:\n.*?)```", page, re.S).group(1))["rollout"]
    code = re.search(r"```python\n(from megappo.envs.base import .*?class GuessEnv.*?)```", page, re.S).group(1)
    return words[3:], block, code


class Bisecting:
    """A policy over token ids: decodes its context, bisects 0..99 on the 'higher'/'lower' it was told
    after each earlier guess, and answers 'hmm' on the turns GAMES names for its prompt."""

    def __init__(self, tok):
        self.tok, self.told = tok, []

    def generate(self, contexts, params):
        rows = []
        for context in contexts:
            text = self.tok.decode(context)
            prompt = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text).group(1)
            turns = TURN.findall(text)
            self.told += [said for _, said in turns[len(turns) - 1:]]  # the newest observation
            low, high = 0, 99
            for guess, said in turns:
                if said == "higher":
                    low = int(guess) + 1
                elif said == "lower":
                    high = int(guess) - 1
            answer = "hmm" if len(turns) in GAMES[prompt][1] else str((low + high) // 2)
            rows += [self.tok.encode(answer, add_special_tokens=False) + [self.tok.eos_token_id]] * params.n
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            assert len(r) <= params.max_new_tokens  # the page's budgets fit every answer with its EOS
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=ids, response_mask=mask,
                            rollout_log_probs=-mask.float(), finish_reasons=["stop"] * len(rows),
                            prompt_index=torch.arange(len(contexts)).repeat_interleave(params.n))


def users_recipe(tmp_path, page_rollout):
    """RECIPE.yaml as a user writes it: the CPU demo's, with an HF tokenizer directory that has letters
    (ChatML, byte-level), their rows in data/guess.jsonl (no validation rows), and the page's rollout
    budgets; rollout.env and rollout.env_args are left to the command line."""
    tok_dir = tmp_path / "tokenizer"
    byte_level_tokenizer().save_pretrained(tok_dir)
    (tmp_path / "data").mkdir()
    with open(tmp_path / "data" / "guess.jsonl", "w") as f:
        for prompt, (number, _) in GAMES.items():
            f.write(json.dumps({"prompt": [{"role": "user", "content": prompt}],
                                "reward_model": {"ground_truth": str(number)}}) + "\n")
    recipe = yaml.safe_load(open(DEMO))
    recipe["model"]["tokenizer"] = str(tok_dir)
    recipe["model"]["hf_config"]["vocab_size"] = 260
    recipe["data"] = dict(recipe["data"], builtin=None, train_files=["data/guess.jsonl"], apply_chat_template=True)
    recipe["run"].update(val_every=0, val_before_train=False)
    recipe["rollout"].update({k: v for k, v in page_rollout.items() if k not in ("env", "env_args")})
    (tmp_path / "RECIPE.yaml").write_text(yaml.safe_dump(recipe))
    return "RECIPE.yaml"


def test_the_pages_guess_env_runs_as_its_command_names_it(tmp_path, monkeypatch):
    env_class.cache_clear()  # rollout.env is read once per process: another test may have named a my_env.py
    overrides, page_rollout, code = page_blocks()
    assert overrides == ["rollout.env=my_env.py:GuessEnv", "rollout.env_args={max_guesses: 3}"]
    monkeypatch.chdir(tmp_path)  # the user's directory: my_env.py, RECIPE.yaml, data/
    (tmp_path / "my_env.py").write_text(code)
    recipe = users_recipe(tmp_path, page_rollout)
    assert load_config(recipe).rollout.env == "lookup"  # the command line's overrides are what names GuessEnv

    # megappo train's start-up: the config, then every check before a rank starts
    cfg = load_config(recipe, overrides)
    assert (cfg.rollout.env, cfg.rollout.env_args) == ("my_env.py:GuessEnv", {"max_guesses": 3})
    assert (page_rollout["env"], page_rollout["env_args"]) == (cfg.rollout.env, cfg.rollout.env_args)  # the YAML
    check_inputs(cfg, cfg.launch_world_size)
    check_prompts(cfg)
    with pytest.raises(ConfigError, match=r"rollout.env_args=\{'max_guesses': 0\}: max_guesses must be >= 1\. Fix:"):
        check_inputs(load_config(recipe, [overrides[0], "rollout.env_args={max_guesses: 0}"]), cfg.launch_world_size)

    # the trainer's rollout (megappo.trainer.step.rollout) of the run's prompts, the policy as its engine
    tok = load_tokenizer(cfg.model.tokenizer)
    examples = load_prompts(cfg, tok)[0]
    policy = Bisecting(tok)
    run = types.SimpleNamespace(cfg=cfg, engine=policy, tokenizer=tok)
    params = SamplingParams(n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
                            eos_token_ids=(tok.eos_token_id,))
    batch = rollout(run, examples, params)
    assert batch.env_scores.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    # every episode ends by the environment (done), within max_guesses=3 guesses, a bad answer counted
    assert batch.env_metrics == {"env/turns_mean": (1 + 2 + 3 + 3 + 3) / 5, "env/truncated_frac": 0.0,
                                 "env/episode_length_mean": pytest.approx(batch.real_response_mask.sum().item() / 5),
                                 "env/action_clip_ratio": 0.0, "env/unknown_char_observations": 0.0,
                                 "env/bad_format": 2.0, "env/solved": 3.0}
    assert batch.finish_reasons == ["stop"] * 5 and not batch.clipped.any()
    # what the model read, as tokens: each observation the user turn of the chat template
    assert sorted(policy.told) == sorted(["higher", "lower", "higher", "Answer with a number.", "lower",
                                          "lower", "higher"])
    said = [tok.decode(batch.response_ids[i][(batch.response_mask[i] == 0) & (batch.real_response_mask[i] == 1)])
            for i in range(5)]
    assert said[1] == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert [re.findall(r"user\n(.*?)<\|im_end\|>", s) for s in said] == [
        [], ["higher"], ["lower", "higher"], ["Answer with a number.", "lower"], ["lower", "higher"]]
    assert tok.decode(batch.response_ids[4][batch.real_response_mask[4] == 1]).endswith("hmm<|im_end|>")

    # the metrics the page declares are logged when no episode reports them
    assert rollout(run, examples[:2], params).env_metrics["env/bad_format"] == 0.0
