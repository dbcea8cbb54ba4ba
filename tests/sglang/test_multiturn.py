"""Multi-turn episodes (megappo.rollout.multiturn) driven through the real SGLang engine on CPU:
every turn is one `generate` call with the episodes' exact token ids (input_ids), observation
tokens are appended as ids, and the engine's log-probs of the action tokens equal a transformers
forward over the trainer's sequences (observations attended, not scored)."""

import torch

from megappo.envs.base import Environment, StepResult
from megappo.rollout.multiturn import run_episodes
from megappo.rollout.sglang_engine import SGLangEngine
from megappo.types import SamplingParams

TOL = 1e-5
OBS = [11, 12, 13]  # an observation's ids


class IdsTokenizer:
    """Token ids as text ('5 17 42'): what the environment reads of an action."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class Counting(Environment):
    observation_role = "user"

    async def step(self, action):
        return StepResult(observation="obs", reward=1.0, metrics={"tokens": float(len(action.token_ids))})


def test_sglang_drives_multi_turn_episodes(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    engine = SGLangEngine(tiny_llama_dir, pad_token_id=0, dtype="float32", engine_args={"max_total_tokens": 2048})
    calls = []

    def generate(contexts, params):
        out = engine.generate(contexts, params)
        calls.append(([list(c) for c in contexts], out))
        return out

    try:
        prompts = [type("Ex", (), dict(prompt_ids=p, ground_truth=None, extra={}, data_source="t", index=i))()
                   for i, p in enumerate([[5, 17, 42, 9], [7, 3]])]
        batch = run_episodes(generate, prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=30),
                             make_env=Counting, tokenizer=IdsTokenizer(), encode_observation=lambda text, ids: OBS,
                             max_turns=3, max_turn_tokens=5, pad_token_id=0)
    finally:
        engine.shutdown()
    assert len(calls) == 3 and batch.env_scores.tolist() == [3.0] * 4
    for i in range(4):  # the third turn's context of episode i: prompt + 2 actions + 2 observations
        n = int(batch.real_response_mask[i].sum())
        assert n == 5 + 3 + 5 + 3 + 5 and batch.response_mask[i, :n].tolist() == [1] * 5 + [0] * 3 + [1] * 5 + [0] * 3 + [1] * 5
        assert batch.response_ids[i, 5:8].tolist() == OBS and batch.response_ids[i, 13:16].tolist() == OBS
        assert calls[2][0][i] == list(prompts[i // 2].prompt_ids) + batch.response_ids[i, :16].tolist()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids, mask = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    p = batch.prompt_ids.shape[1]
    lp = logits[:, p - 1:-1].float().log_softmax(-1).gather(-1, batch.response_ids[..., None])[..., 0]
    diff = ((lp - batch.rollout_log_probs) * batch.response_mask).abs().max().item()
    assert diff <= TOL, diff
