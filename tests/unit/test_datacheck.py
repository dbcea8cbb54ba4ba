"""The start-up data check: unknown characters, missing ground truth and empty prompts, counted; the policy."""

import pytest

from megappo.data.prompts import DataError, build_prompts, numbered
from megappo.trainer.data_check import check_data, check_rows
from megappo.data.tokenizer import load_tokenizer, unknown_characters, unknown_token

TOK = load_tokenizer("builtin:digits")


def row(prompt, truth="4", **extra):
    return {"prompt": prompt, "reward_model": {"style": "rule", "ground_truth": truth}, **extra}


def test_builtin_tokenizer_turns_unknown_characters_into_padding_and_the_check_sees_them():
    # the defect: 'What is 3+4?' encodes with <pad> for every letter; nothing said so
    ids = TOK.encode("What is 3+4?", add_special_tokens=False)
    assert ids.count(TOK.pad_token_id) == 6 and unknown_token(TOK) == "<pad>"
    assert unknown_characters(TOK, ["3+4=", "What is 3+4?", "é"]) == ["", "Whatis", "é"]


def test_clean_rows_pass_untouched(capsys):
    rows = [row(f"{d}>", str(d + 1)) for d in range(9)] + [row([{"role": "user", "content": "9>"}], "0")]
    report = check_rows(rows, TOK, reward_functions=["digit_successor"], source="x")
    assert report.problems == {}
    assert check_data(rows, TOK, policy="error", prompt_key="prompt", reward_functions=["digit_successor"],
                      source="x") == (rows, numbered("x", len(rows)))
    assert capsys.readouterr().out == ""  # a clean dataset prints nothing


BAD_ROWS = [
    row("3>"),                                                   # 0 fine
    row("What is 3+4?", "7"),                                    # 1 letters
    {"prompt": "2>", "reward_model": {"groundtruth": "3"}},      # 2 misspelled key
    row(""),                                                     # 3 empty prompt
    row([{"role": "user", "content": "  "}]),                    # 4 chat prompt without text
    {"question": "5>", "reward_model": {"ground_truth": "6"}},   # 5 no prompt column
    {"prompt": "6>", "ground_truth": "7"},                       # 6 ground truth at the top level
    row("7>", "eight"),                                          # 7 an answer no response can write
    row("8>", "9"),                                              # 8 fine
]


def test_counts_examples_and_fixes():
    report = check_rows(BAD_ROWS, TOK, reward_functions=["exact_match"], source="data.train_files ['t.jsonl']")
    p = report.problems
    assert sorted(p) == ["missing:reward_model.ground_truth", "no_prompt", "unknown_answer_chars",
                         "unknown_prompt_chars"]
    assert p["no_prompt"].rows == [3, 4, 5]
    assert p["unknown_prompt_chars"].rows == [1] and set(p["unknown_prompt_chars"].chars) == set("Whatis")
    assert p["unknown_answer_chars"].rows == [7] and set(p["unknown_answer_chars"].chars) == set("eight")
    assert p["missing:reward_model.ground_truth"].rows == [2, 6]
    text = report.describe()
    assert text.startswith("data check of data.train_files ['t.jsonl'] (9 rows):\n")
    assert ("  3 of 9 rows have no prompt in 'prompt'; e.g. row 4 of data.train_files ['t.jsonl']: prompt=''; "
            "row 5 of data.train_files ['t.jsonl']: prompt=[{'role': 'user', 'content': '  '}]; row 6 of "
            "data.train_files ['t.jsonl']: keys ['question', 'reward_model'] (data.prompt_key=question?). Fix: give every "
            "row a prompt") in text
    assert ("  1 of 9 rows have prompt characters the tokenizer does not know (encoded as '<pad>', so the model sees "
            "that instead): 6 distinct characters") in text
    assert "e.g. row 2 of data.train_files ['t.jsonl']: 'What is 3+4?'. Fix: use a tokenizer that has them (model.tokenizer)" in text
    assert ("  2 of 9 rows lack reward_model.ground_truth, which reward function(s) ['exact_match'] read (every "
            "response would score 0); e.g. row 3 of data.train_files ['t.jsonl']: reward_model has 'groundtruth', not "
            "'ground_truth'; row 7 of data.train_files ['t.jsonl']: "
            "'ground_truth' is at the top level of the row, not under 'reward_model'. Fix: write it in every row "
            "(verl layout: {\"reward_model\": {\"ground_truth\": \"...\"}})") in text


def test_policies(capsys):
    kw = dict(prompt_key="prompt", reward_functions=["exact_match"], source="t.jsonl")
    with pytest.raises(DataError) as e:
        check_data(BAD_ROWS, TOK, policy="error", **kw)
    assert str(e.value).endswith("Fix the rows as said, or set data.bad_row_policy=skip (drop these rows) or "
                                 "data.bad_row_policy=warn (train on them as they are).")
    assert capsys.readouterr().out == ""
    kept, origins = check_data(BAD_ROWS, TOK, policy="skip", **kw)
    assert kept == [BAD_ROWS[0], BAD_ROWS[8]] and [str(o) for o in origins] == ["row 1 of t.jsonl", "row 9 of t.jsonl"]
    assert capsys.readouterr().out.splitlines()[-1] == "megappo: data.bad_row_policy=skip: dropped 7 rows."
    kept, _ = check_data(BAD_ROWS, TOK, policy="warn", **kw)  # rows without a prompt cannot be kept
    assert kept == [r for i, r in enumerate(BAD_ROWS) if i not in (3, 4, 5)]
    out = capsys.readouterr().out
    assert out.startswith("megappo: warning: data check of t.jsonl (9 rows):")
    assert out.splitlines()[-1] == ("megappo: data.bad_row_policy=warn: dropped 3 rows without a prompt, training on "
                                    "the others as they are.")
    # what is kept tokenizes (the unknown characters as padding, as the user was told)
    examples, _ = build_prompts(kept, TOK, apply_chat_template=False)
    assert len(examples) == 6
    with pytest.raises(DataError, match="no row of t.jsonl is left to train on after data.bad_row_policy=skip"):
        check_data([BAD_ROWS[3]], TOK, policy="skip", **kw)


def test_fields_follow_the_reward_functions():
    rg = {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "extra_info": {"task": "basic_arithmetic"}}
    report = check_rows([rg], TOK, reward_functions=["reasoning_gym"])
    assert list(report.problems) == ["missing:extra_info.entry"]
    assert "e.g. row 1 of dataset: extra_info has 'task', not 'entry'" not in report.describe()  # no close spelling: keys
    assert "e.g. row 1 of dataset: extra_info has keys ['task']" in report.describe()
    assert check_rows([{"prompt": "1>"}], TOK, reward_functions=[]).problems == {}  # a reward model needs no truth


def trained(model, pre_tokenizer, trainer, **special):
    """A small HF fast tokenizer of the given kind, trained in memory (no download)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog 1234567890"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def test_hf_tokenizers_with_and_without_an_unknown_token():
    from tokenizers import models, pre_tokenizers, trainers

    # byte-level BPE (GPT-2, Llama 3, Qwen) encodes every text, even though GPT-2 names an unk_token
    gpt2_like = trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False),
                        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
                        unk_token="<|endoftext|>", eos_token="<|endoftext|>")
    assert unknown_token(gpt2_like) is None and unknown_characters(gpt2_like, ["héllo ü"]) == [""]
    # WordPiece (BERT-like) has [UNK]: the word it replaces is reported
    bert_like = trained(models.WordPiece(unk_token="[UNK]"), pre_tokenizers.Whitespace(),
                        trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]", "[PAD]"]),
                        unk_token="[UNK]", pad_token="[PAD]")
    assert unknown_token(bert_like) == "[UNK]"
    assert unknown_characters(bert_like, ["the fox", "the fox ü 7"]) == ["", "ü"]
    report = check_rows([row("the fox ü 7", "7")], bert_like, reward_functions=["exact_match"])
    assert report.problems["unknown_prompt_chars"].rows == [0] and "(encoded as '[UNK]'" in report.describe()


def test_answers_that_cannot_fit_the_token_budget_are_counted_with_the_budget_they_need():
    """The own-data trip: 3-character answers and the demo's rollout.max_new_tokens=2 trained silently,
    every response cut at the budget."""
    rows = [row("1+2=", "3"), row("60+63=", "123"), row("5+5=", "10"), row("99+1=", "100")]
    report = check_rows(rows, TOK, reward_functions=["digit_successor"], source="x", max_new_tokens=2)
    problem = report.problems["answer_too_long"]
    assert problem.rows == [1, 2, 3]  # '3' + EOS fits in 2; '10' + EOS needs 3, '123' / '100' + EOS 4
    text = report.describe()
    assert "3 of 4 rows have a ground truth that does not fit in rollout.max_new_tokens=2" in text
    assert "raise rollout.max_new_tokens to at least 4" in text and "row 2 of x: '123' = 4 tokens with EOS" in text
    assert "answer_too_long" not in check_rows(rows, TOK, reward_functions=["digit_successor"],
                                               max_new_tokens=4).problems
    assert check_rows(rows, TOK, reward_functions=["digit_successor"]).problems == {}  # no budget given
    with pytest.raises(DataError, match="data.bad_row_policy=skip"):
        check_data(rows, TOK, policy="error", prompt_key="prompt", reward_functions=["digit_successor"], source="x",
                   max_new_tokens=2)
