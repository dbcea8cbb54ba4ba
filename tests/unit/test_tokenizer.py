"""The built-in character tokenizer and the vocabulary check."""

import pytest

from megappo.tokenizer import check_vocab, load_tokenizer


def test_builtin_digits_round_trip():
    tok = load_tokenizer("builtin:digits")
    ids = tok.encode("3>4 5", add_special_tokens=False)
    assert len(ids) == 5 and tok.decode(ids) == "3>4 5"
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1) and len(tok) == 19


def test_unknown_builtin_and_vocab_too_large():
    with pytest.raises(ValueError, match="unknown built-in tokenizer 'builtin:words'"):
        load_tokenizer("builtin:words")
    with pytest.raises(ValueError, match="tokenizer has 19 tokens but the model's vocab_size is 16"):
        check_vocab(load_tokenizer("builtin:digits"), 16)
