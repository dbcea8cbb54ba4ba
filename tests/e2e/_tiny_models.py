"""Tiny stand-ins for the GPU recipes' instruct models, built offline: an HF directory with
config.json (a family's tiny config from megappo.models.hf_reference.TINY_CONFIGS), bf16
safetensors, and a byte-level BPE tokenizer with a ChatML chat template and <|im_end|> as EOS,
as Qwen2.5 / Qwen3 instruct checkpoints ship (Llama 3's is byte-level BPE too).

`tiny_instruct_model(out, config, rows, answer)` fine-tunes the random model for a few
steps on the prompts of `rows` (verl-layout dataset rows) followed by `answer(d)` for random
digits d, so that it answers in the format the recipe's reward function reads ("#### 7",
"\\boxed{7}") with about one answer in ten right: the reward is neither always 0 nor always 1.

The tokenizer has no merges: each byte is one token (259 ids with the 3 special tokens), so any
text encodes, and every family's tokenizer class in transformers (Qwen2Tokenizer rebuilds the
pre-tokenizer from the model type) encodes it to the same ids.

This module does not know about megappo's trainer; it uses transformers, tokenizers and torch.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, turn end (= EOS)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer():
    """A transformers fast tokenizer: byte-level BPE without merges, ChatML template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL[0], eos_token=SPECIAL[2],
                                   chat_template=CHAT_TEMPLATE)


def tiny_config(family: str, layers: int) -> dict:
    """TINY_CONFIGS[family] with `layers` decoder layers (an MoE's dense layers kept below it)."""
    cfg = dict(TINY_CONFIGS[family], num_hidden_layers=layers)
    if "mlp_only_layers" in cfg:
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
    return cfg


def tiny_instruct_model(out: str, cfg: dict, rows: Sequence[dict], answer: Callable[[int], str], *,
                        steps: int = 80, seed: int = 0) -> str:
    """Write the HF directory `out` of a model with HF config `cfg` (see the module docstring)."""
    tok = byte_level_tokenizer()
    assert len(tok) <= cfg["vocab_size"]
    model = build_hf_model(cfg, seed=seed).train()
    prompts = [list(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
               for row in rows]
    digits = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        seqs = [p + tok.encode(answer(digits.randrange(10)), add_special_tokens=False) + [tok.eos_token_id]
                for p in prompts]
        longest = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (longest - len(s)) for s in seqs])
        pos = torch.arange(longest)[None]
        real = pos < torch.tensor([[len(s)] for s in seqs])
        target = real & (pos >= torch.tensor([[len(p)] for p in prompts]))  # the answer tokens and EOS
        logits = model(ids, attention_mask=real.long()).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * target[:, 1:]).sum() / target[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for where in (model.config, model.generation_config):
        where.bos_token_id, where.eos_token_id, where.pad_token_id = None, tok.eos_token_id, tok.pad_token_id
    model.to(torch.bfloat16).save_pretrained(out)  # instruct checkpoints ship bf16 weights
    tok.save_pretrained(out)
    return out
