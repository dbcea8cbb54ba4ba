"""Datasets in verl's layout, the long-prompt policies, the sampler, and reward functions."""

import json

import pytest

from megappo.data.prompts import DataError, PromptSampler, build_prompts, builtin_rows, load_rows, read_rows
from megappo.rewards import gsm8k, last_boxed, math_boxed, score_batch


class CharTokenizer:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_verl_layout_jsonl_and_parquet(tmp_path):
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train"}}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    examples, stats = build_prompts(load_rows([path]), CharTokenizer())
    assert examples[0].prompt_ids == [ord(c) for c in "1+1?"] and examples[0].ground_truth == "2"
    assert examples[0].data_source == "openai/gsm8k" and stats == {"skipped_long": 0, "truncated_long": 0}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "a.parquet"))
    assert load_rows([str(tmp_path / "a.parquet")])[0]["reward_model"]["ground_truth"] == "2"


def test_row_without_prompt_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, {"question": "y"}])
    with pytest.raises(DataError, match=f"^{path}:2 has no 'prompt' \\(keys: \\['question'\\]\\)"):
        build_prompts(*read_rows([path])[:1], CharTokenizer(), source=path, origins=read_rows([path])[1])
    with pytest.raises(DataError, match=f"^row 2 of {path} has no 'prompt'"):  # rows given without their origins
        build_prompts(load_rows([path]), CharTokenizer(), source=path)


def test_missing_empty_and_malformed_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows([str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_rows([str(tmp_path / "empty.jsonl")])
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2 is not valid JSON"):
        load_rows([str(tmp_path / "bad.jsonl")])


@pytest.mark.parametrize("policy,kept,stat", [("skip", 1, "skipped_long"), ("truncate", 2, "truncated_long")])
def test_long_prompt_policies_are_counted(policy, kept, stat):
    rows = [{"prompt": "short"}, {"prompt": "a much longer prompt"}]
    examples, stats = build_prompts(rows, CharTokenizer(), max_prompt_length=8, long_prompt_policy=policy)
    assert len(examples) == kept and stats[stat] == 1
    if policy == "truncate":
        assert examples[1].prompt_ids == [ord(c) for c in "r prompt"]  # the end is kept
    with pytest.raises(DataError, match="max_prompt_length=8"):
        build_prompts(rows, CharTokenizer(), max_prompt_length=8, long_prompt_policy="error")


def test_sampler_resumes_exactly_and_reshuffles_per_epoch():
    a = PromptSampler(10, 3, seed=4)
    seen = [a.next_batch() for _ in range(5)]  # crosses into epoch 1 (3 batches per epoch)
    assert len(set(sum(seen[:3], []))) == 9  # one epoch: no index twice
    assert a.epoch == 1 and seen[0] != seen[3]
    b = PromptSampler(10, 3, seed=4)
    for _ in range(2):
        b.next_batch()
    state = b.state_dict()
    c = PromptSampler(10, 3, seed=4)
    c.load_state_dict(state)
    assert [c.next_batch() for _ in range(3)] == seen[2:5]
    with pytest.raises(DataError, match="another dataset or seed"):
        PromptSampler(11, 3, seed=4).load_state_dict(state)
    with pytest.raises(DataError, match="larger than the dataset"):
        PromptSampler(2, 3)


def test_builtin_sources():
    rows = builtin_rows("digit_successor", 20, seed=0)
    assert all(r["reward_model"]["ground_truth"] == str((int(r["prompt"][0]) + 1) % 10) for r in rows)
    rg = builtin_rows("reasoning_gym:basic_arithmetic", 3, seed=1)
    assert rg[0]["extra_info"]["task"] == "basic_arithmetic"
    assert score_batch(["reasoning_gym"], None, [rg[0]["reward_model"]["ground_truth"], "nonsense"],
                       [None, None], [rg[0]["extra_info"]] * 2) == [1.0, 0.0]
    with pytest.raises(DataError, match="unknown data.builtin"):
        builtin_rows("gsm8k_real", 1, 0)


def test_reward_functions_by_hand():
    assert gsm8k("so the answer is\n#### 1,234", "1234", {}) == 1.0
    assert gsm8k("#### 12\n#### 13", "13", {}) == 1.0  # the last marked answer counts
    assert gsm8k("the answer is 72", "72", {}) == 0.0  # strict: needs ####
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert math_boxed("$\\boxed{\\dfrac{1}{2}}$", "\\frac{1}{2}", {}) == 1.0
    assert math_boxed("no box", "1", {}) == 0.0
    stopped = {"finish_reason": "stop"}
    assert score_batch(["exact_match", "digit_successor"], [0.5, 1.0], ["4"], ["4"], [stopped]) == [1.5]
    with pytest.raises(ValueError, match="unknown reward function 'bleu'"):
        score_batch(["bleu"], None, ["x"], ["x"], [{}])


def test_digit_successor_needs_the_digit_then_eos():
    """The demo's reward: full score only for the digit followed by EOS; the right digit without
    stopping gets the partial score (the exported model would print junk after it)."""
    from megappo.rewards import DIGIT_NOT_STOPPED, digit_successor

    stop, length = {"finish_reason": "stop"}, {"finish_reason": "length"}
    assert digit_successor("4", "4", stop) == 1.0
    assert digit_successor("4", "4", length) == DIGIT_NOT_STOPPED == 0.5  # '4' then a special token, no EOS
    assert digit_successor("41", "4", length) == DIGIT_NOT_STOPPED  # '0>' -> '14' was scored 1 before
    assert digit_successor("5", "4", stop) == 0.0
    assert digit_successor("?4", "4", length) == 0.0  # the answer must come first
    assert digit_successor("", "4", stop) == 0.0
