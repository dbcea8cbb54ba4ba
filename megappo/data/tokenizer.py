"""Tokenizers: an HF tokenizer directory, or a built-in character tokenizer for the CPU demo.

`load_tokenizer(spec)`: a path is loaded with `AutoTokenizer` (offline); `builtin:digits`
builds a character-level tokenizer over digits and a few symbols in memory, with
<pad>=0, <eos>=1, <bos>=2 (no download, no files). The model's vocab must cover the
tokenizer's (`check_vocab`). `check_tokenizer_spec(spec)` is the cheap check before any rank
starts (a known built-in name, or an existing directory). `builtin_tokenizer_files(tok)` are
the files an exported model directory carries for a built-in tokenizer (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json), which
`transformers.AutoTokenizer.from_pretrained` loads with the same ids; `special_token_ids(tok)`
are the ids config.json names. `unknown_characters(tok, texts)` are the characters of each text
the tokenizer has no token for (the data check's and the multi-turn runner's observation check).
`chat_template_ids(tok, messages, ...)` renders chat messages with the tokenizer's template to token ids
(the prompts' and the multi-turn turns' one way, with data.apply_chat_template_kwargs).

This module does not know about models or training.
"""

from __future__ import annotations

import json
import os

from megappo.errors import ConfigError

BUILTIN_ALPHABETS = {"digits": "0123456789>+-=? "}


def chat_template_ids(tokenizer, messages: list[dict], *, generation_prompt: bool,
                      template_kwargs: dict | None = None) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (with the next assistant turn's
    opening when `generation_prompt`); `template_kwargs`: the template's own arguments (enable_thinking)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        **(template_kwargs or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a list of ids, or an encoding holding them


def char_tokenizer(alphabet: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.clean_up_tokenization_spaces = False
    return fast


def special_token_ids(tokenizer) -> dict[str, int]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"}: those the tokenizer has."""
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}
    return {k: v for k, v in ids.items() if v is not None}


def builtin_tokenizer_files(tokenizer) -> dict[str, bytes]:
    """A built-in tokenizer as the files of an HF model directory (name -> content).

    tokenizer.json is the `tokenizers` library's own serialisation (character-level WordLevel
    vocabulary, same ids); tokenizer_config.json names the generic fast tokenizer class and
    the special tokens, so `AutoTokenizer.from_pretrained(dir)` needs no megappo code."""
    special = {f"{name}_token": getattr(tokenizer, f"{name}_token") for name in ("bos", "eos", "pad")}
    special = {k: v for k, v in special.items() if v is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}

    def dump(obj) -> bytes:
        return (json.dumps(obj, indent=2) + "\n").encode()

    return {"tokenizer.json": tokenizer.backend_tokenizer.to_str(pretty=True).encode(),
            "tokenizer_config.json": dump(config), "special_tokens_map.json": dump(special),
            "generation_config.json": dump(special_token_ids(tokenizer))}


def _unknown_builtin(spec: str) -> ConfigError:
    return ConfigError(f"unknown built-in tokenizer '{spec}'. Fix: set model.tokenizer to one of "
                       f"{['builtin:' + k for k in BUILTIN_ALPHABETS]} or to an HF tokenizer directory.")


def check_tokenizer_spec(spec: str) -> None:
    """Cheap, before any rank starts: a built-in name megappo has, or an existing directory."""
    if spec.startswith("builtin:"):
        if spec.split(":", 1)[1] not in BUILTIN_ALPHABETS:
            raise _unknown_builtin(spec)
    elif not os.path.isdir(spec):
        raise ConfigError(f"tokenizer directory '{spec}' does not exist. Fix: set model.tokenizer (or model.path) to "
                          "an HF tokenizer directory, or model.tokenizer=builtin:digits for the CPU demo.")


def load_tokenizer(spec: str):
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN_ALPHABETS:
            raise _unknown_builtin(spec)
        return char_tokenizer(BUILTIN_ALPHABETS[name])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # the usual choice for decoder-only models without a pad token
    return tok


def check_vocab(tokenizer, model_vocab_size: int) -> None:
    """A tokenizer with ids beyond the model's embedding rows would index out of range."""
    from megappo.errors import ModelConfigError

    size = len(tokenizer)
    if size > model_vocab_size:
        raise ModelConfigError(
            f"the tokenizer has {size} tokens but the model's vocab_size is {model_vocab_size}: ids beyond the "
            "embedding would index out of range. Fix: use the model's own tokenizer (model.tokenizer) or a model "
            "with a larger vocabulary."
        )


def unknown_token(tokenizer) -> str | None:
    """The token that characters outside the tokenizer's vocabulary become, or None when every
    text encodes without one (byte-level BPE such as GPT-2, Llama 3, Qwen, or BPE with byte
    fallback, even when they name an unk_token). The built-in character tokenizers map unknown
    characters to <pad>."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _bytes_always_encode(json.loads(backend.to_str())):
        return None
    if getattr(tokenizer, "unk_token", None) is not None:
        return tokenizer.unk_token
    return getattr(getattr(backend, "model", None), "unk_token", None) or None


def _bytes_always_encode(spec: dict) -> bool:
    """A tokenizer.json whose model falls back to bytes or whose pre-tokenizer maps text to bytes."""
    if (spec.get("model") or {}).get("byte_fallback"):
        return True

    def byte_level(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(byte_level(v) for v in node.values())
        return isinstance(node, list) and any(byte_level(v) for v in node)

    return byte_level(spec.get("pre_tokenizer"))


def unknown_characters(tokenizer, texts: list[str]) -> list[str]:
    """For each text, the characters the tokenizer encodes as its unknown token (`unknown_token`),
    in order ('' when none). Needs a fast tokenizer for the character offsets; a slow one is
    not checked (every text gives '')."""
    return characters_encoded_as(tokenizer, unknown_token(tokenizer), texts)


def characters_encoded_as(tokenizer, unk: str | None, texts: list[str]) -> list[str]:
    """`unknown_characters` with the tokenizer's `unknown_token` already known (it reads the whole
    tokenizer.json, too slow to repeat for every observation of a run)."""
    if unk is None or not texts or not getattr(tokenizer, "is_fast", False):
        return [""] * len(texts)
    unk_id = tokenizer.convert_tokens_to_ids(unk)
    enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
    return ["".join(text[a:b] for i, (a, b) in zip(ids, offsets) if i == unk_id)
            for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"])]
