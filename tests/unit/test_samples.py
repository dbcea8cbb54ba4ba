"""Generation samples (logging.samples): picked and decoded from a batch, printed under the step line, kept in
samples.jsonl (truncated like metrics.jsonl on resume)."""

import json
import os

import torch

from megappo.data.prompts import PromptExample
from megappo.metrics.sinks import MetricLogger, format_sample
from megappo.metrics.sample_log import pick_samples, write_generations
from megappo.data.tokenizer import load_tokenizer
from megappo.types import RolloutBatch

TOK = load_tokenizer("builtin:digits")


def batch_of(prompts: list[str], responses: list[str], finished: list[bool]) -> RolloutBatch:
    """A prompt-major batch as an engine returns it: responses right-padded, EOS where finished."""
    enc = [TOK.encode(r, add_special_tokens=False) + ([TOK.eos_token_id] if f else [])
           for r, f in zip(responses, finished)]
    width = max(map(len, enc))
    ids = torch.tensor([e + [TOK.pad_token_id] * (width - len(e)) for e in enc])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in enc])
    examples = [PromptExample(prompt_ids=TOK.encode(p, add_special_tokens=False), data_source="my_sums",
                              ground_truth=str(i), extra={}, index=i) for i, p in enumerate(prompts)]
    n = len(prompts)
    return RolloutBatch(prompt_ids=torch.zeros(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2),
                        response_ids=ids, response_mask=mask, rollout_log_probs=torch.zeros(ids.shape),
                        finish_reasons=["stop" if f else "length" for f in finished],
                        prompt_index=torch.arange(n), examples=examples)


def test_pick_samples_spreads_over_the_batch_and_decodes_as_the_reward_saw_it():
    batch = batch_of([f"{d}+1=" for d in range(8)], [str(d + 1) for d in range(7)] + ["99"], [True] * 7 + [False])
    scores = torch.arange(8) / 8
    got = pick_samples(TOK, batch, scores, 2)
    assert [g["prompt"] for g in got] == ["0+1=", "4+1="]  # the first of each half
    assert got[0] == {"prompt": "0+1=", "response": "1", "score": 0.0, "ground_truth": "0", "data_source": "my_sums",
                      "finish_reason": "stop", "response_tokens": 2, "group": 0}
    last = pick_samples(TOK, batch, scores, 8)[-1]
    assert (last["response"], last["finish_reason"], last["response_tokens"], last["score"]) == ("99", "length", 2,
                                                                                                 0.875)
    assert pick_samples(TOK, batch, scores, 0) == [] and len(pick_samples(TOK, batch, scores, 100)) == 8
    assert pick_samples(TOK, batch, scores, -1) == pick_samples(TOK, batch, scores, 8)  # -1: every sample


def test_every_generation_of_a_step_with_its_reward_fields_in_one_file(tmp_path):
    """logging.rollout_dir / validation_dir: <dir>/<step>.jsonl holds every sample, its group and the fields its
    reward function returned; writing a step again (a resumed run replaying it) replaces the file."""
    batch = batch_of(["1+1=", "2+1="], ["2", "4"], [True, True])
    batch.prompt_index = torch.tensor([0, 0])  # two samples of one prompt
    batch.score_fields = [{"acc": True, "pred": "2"}, {"acc": False, "pred": "4", "extra": {"why": 3}}]
    records = pick_samples(TOK, batch, torch.tensor([1.0, 0.0]), -1)
    path = write_generations(str(tmp_path / "rollouts"), 7, records)
    assert path == str(tmp_path / "rollouts" / "7.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["group"], r["response"], r["score"], r["fields"]) for r in rows] == [
        (7, 0, "2", 1.0, {"acc": True, "pred": "2"}), (7, 0, "4", 0.0, {"acc": False, "pred": "4", "extra": {"why": 3}})]
    write_generations(str(tmp_path / "rollouts"), 7, records[:1])
    assert len(open(path).readlines()) == 1 and sorted(os.listdir(tmp_path / "rollouts")) == ["7.jsonl"]


def test_samples_under_the_step_line_and_in_samples_jsonl(tmp_path, capsys):
    log = MetricLogger(str(tmp_path), ["console", "jsonl"], console="full")  # full: every step's samples
    batch = batch_of(["3+1=", "What is 3+1?"], ["4", "4" * 200], [True, False])
    for step in (1, 2, 3):
        log.add_samples(step, pick_samples(TOK, batch, torch.tensor([1.0, 0.5]), 2))
        log.log(step, {"critic/score/mean": 0.75})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 1: critic/score/mean=0.75")
    assert lines[1] == "  sample: '3+1=' -> '4' | score 1 | truth '0' | stop"
    # the end of a long prompt (the unknown letters show as <pad>), the start of a long response
    assert lines[2] == ("  sample: '<pad><pad><pad><pad> <pad><pad> 3+1?' -> '" + "4" * 80 + "...' | score 0.5 | "
                        "truth '1' | length")
    assert lines[3].startswith("step 2:") and len(lines) == 9
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 3]
    assert records[1]["response"] == "4" * 200 and records[1]["prompt"] == "<pad>" * 4 + " " + "<pad>" * 2 + " 3+1?"
    # resumed from the step-2 checkpoint: step 3's samples go, as its metrics do; a fresh run starts empty
    log = MetricLogger(str(tmp_path), ["jsonl"], resume_step=2)
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 1, 2, 2]
    MetricLogger(str(tmp_path), ["jsonl"]).close()
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_compact_console_shows_the_samples_of_step_1_and_every_10th_step(tmp_path, capsys):
    """logging.console=compact (the default): the samples of steps 1, 10, 20 on the console; samples.jsonl has all."""
    log = MetricLogger(str(tmp_path), ["console", "jsonl"])
    batch = batch_of(["3+1="], ["4"], [True])
    for step in range(1, 21):
        log.add_samples(step, pick_samples(TOK, batch, torch.tensor([1.0]), 1))
        log.log(step, {"critic/score/mean": 0.75})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    shown = [lines[i - 1] for i, line in enumerate(lines) if line.startswith("  sample: ")]
    assert shown == ["step 1: score=0.75", "step 10: score=0.75", "step 20: score=0.75"], lines
    assert len(lines) == 23 and lines.count("  sample: '3+1=' -> '4' | score 1 | truth '0' | stop") == 3
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))


def test_format_sample_keeps_the_end_of_a_long_prompt():
    line = format_sample({"prompt": "x" * 100 + "Q?", "response": "A", "score": 1.0, "ground_truth": None,
                          "finish_reason": "stop"})
    assert line == f"  sample: '...{'x' * 58}Q?' -> 'A' | score 1 | stop"
