"""data.system_prompt and data.few_shot: one system message before every prompt that has none, and
example turns after it (how a recipe tells a small model about its tools when the chat template has
no `tools=`), rendered by a real chat template."""

import pathlib

import pytest

from megappo.config import ConfigError, load_config
from megappo.data.prompts import build_prompts

# SmolLM2-Instruct's chat template: a default system prompt when the first message is not a system one
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A byte-level BPE fast tokenizer, trained in memory, with SmolLM2's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["use the calculator tool: what is 2 + 3?"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=SMOLLM2_TEMPLATE, eos_token="<|im_end|>")


ROWS = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]},
        {"prompt": [{"role": "system", "content": "Own rules."}, {"role": "user", "content": "What is 2 + 3?"}]},
        {"prompt": "What is 2 + 3?"}]


def test_system_prompt_replaces_the_templates_default_and_keeps_a_rows_own(chat_tokenizer):
    examples, _ = build_prompts(ROWS, chat_tokenizer, system_prompt="Use the calculator tool.")
    texts = [chat_tokenizer.decode(e.prompt_ids) for e in examples]
    asked = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert texts[0] == texts[2] == "<|im_start|>system\nUse the calculator tool.<|im_end|>\n" + asked
    assert texts[1] == "<|im_start|>system\nOwn rules.<|im_end|>\n" + asked
    default, _ = build_prompts(ROWS[:1], chat_tokenizer)  # without it: the template's own default, as before
    assert chat_tokenizer.decode(default[0].prompt_ids).startswith("<|im_start|>system\nYou are a helpful AI")


def test_system_prompt_without_a_chat_template(chat_tokenizer):
    examples, _ = build_prompts(ROWS, chat_tokenizer, apply_chat_template=False, system_prompt="Tools: none.")
    assert [chat_tokenizer.decode(e.prompt_ids) for e in examples] == [
        "Tools: none.\nWhat is 2 + 3?", "Own rules.\nWhat is 2 + 3?", "Tools: none.\nWhat is 2 + 3?"]
    plain, _ = build_prompts(ROWS[2:], chat_tokenizer, apply_chat_template=False)
    assert chat_tokenizer.decode(plain[0].prompt_ids) == "What is 2 + 3?"


def test_system_prompt_is_a_data_key():
    demo = str(pathlib.Path(__file__).resolve().parents[2] / "recipes" / "demo-cpu.yaml")
    assert load_config(demo).data.system_prompt is None
    assert load_config(demo, ["data.system_prompt=Use the tools."]).data.system_prompt == "Use the tools."
    with pytest.raises(ConfigError, match="data.system_promt"):
        load_config(demo, ["data.system_promt=x"])


SHOTS = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "<tool_call>1+1</tool_call>"},
         {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]


def test_few_shot_turns_come_after_the_system_message(chat_tokenizer):
    examples, _ = build_prompts(ROWS, chat_tokenizer, system_prompt="Use the calculator tool.", few_shot=SHOTS)
    texts = [chat_tokenizer.decode(e.prompt_ids) for e in examples]
    shots = ("<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n<tool_call>1+1</tool_call><|im_end|>\n"
             "<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n")
    asked = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert texts[0] == texts[2] == "<|im_start|>system\nUse the calculator tool.<|im_end|>\n" + shots + asked
    assert texts[1] == "<|im_start|>system\nOwn rules.<|im_end|>\n" + shots + asked
    no_system, _ = build_prompts(ROWS[:1], chat_tokenizer, few_shot=SHOTS)  # the template's default system prompt
    assert chat_tokenizer.decode(no_system[0].prompt_ids).endswith("trained by Hugging Face<|im_end|>\n" + shots + asked)


@pytest.mark.parametrize("override,message", [
    ("data.few_shot=[{role: user}]", r"data.few_shot\[0\]=\{'role': 'user'\} is not a chat message. Fix: write "
                                    r"\{role: user, content: ...\} \(role user, assistant or tool; the system message "
                                    r"is data.system_prompt\)"),
    ("data.few_shot=[{role: system, content: x}]", r"few_shot\[0\]=.* is not a chat message"),
    ("data.few_shot=[{role: assistant, content: x}]", "data.few_shot starts with a turn of role 'assistant'. Fix: "
                                                      "start it with the example's question, a user turn."),
])
def test_bad_few_shot(override, message):
    demo = str(pathlib.Path(__file__).resolve().parents[2] / "recipes" / "demo-cpu.yaml")
    with pytest.raises(ConfigError, match=message):
        load_config(demo, [override])
