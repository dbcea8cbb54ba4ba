"""The built-in character tokenizer and the vocabulary check."""

import pytest

from megappo.data.tokenizer import check_vocab, load_tokenizer


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


def test_builtin_tokenizer_files_load_in_plain_transformers(tmp_path):
    """The files `megappo export` writes for a built-in tokenizer: AutoTokenizer loads them (no
    megappo code) with the same ids for every character and the special tokens, and decodes alike."""
    import json

    from transformers import AutoTokenizer

    from megappo.data.tokenizer import BUILTIN_ALPHABETS, builtin_tokenizer_files, special_token_ids

    tok = load_tokenizer("builtin:digits")
    for name, data in builtin_tokenizer_files(tok).items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # as in an exported model directory
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    alphabet = BUILTIN_ALPHABETS["digits"]
    for ch in alphabet:
        assert hf.encode(ch, add_special_tokens=False) == tok.encode(ch, add_special_tokens=False), ch
    text = "7>8 0=1?" + alphabet
    assert hf(text).input_ids == tok(text).input_ids  # add_special_tokens as the default: the same (none)
    assert hf.convert_ids_to_tokens(list(range(3))) == ["<pad>", "<eos>", "<bos>"]
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (0, 1, 2) and len(hf) == len(tok)
    ids = list(range(len(tok)))
    assert hf.decode(ids) == tok.decode(ids)
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True) == alphabet
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == special_token_ids(tok) == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def test_export_carries_the_tokenizer_from_where_the_run_took_it(tmp_path):
    """A model built from model.hf_config with an HF tokenizer directory exports that directory's
    tokenizer files; a model directory's files come along, a separate tokenizer's win."""
    from types import SimpleNamespace

    from megappo.trainer.setup import export_files

    tok_dir, model_dir = tmp_path / "tok", tmp_path / "model"
    tok_dir.mkdir()
    model_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("tok")
    (tok_dir / "generation_config.json").write_text("tok-gen")
    (model_dir / "tokenizer.json").write_text("model-tok")
    (model_dir / "generation_config.json").write_text("model-gen")
    assert export_files(SimpleNamespace(path=None, tokenizer=str(tok_dir)), None) == {
        "tokenizer.json": b"tok", "generation_config.json": b"tok-gen"}
    assert export_files(SimpleNamespace(path=str(model_dir), tokenizer=None), None) == {
        "tokenizer.json": b"model-tok", "generation_config.json": b"model-gen"}
    assert export_files(SimpleNamespace(path=str(model_dir), tokenizer=str(tok_dir)), None) == {
        "tokenizer.json": b"tok", "generation_config.json": b"model-gen"}
