"""The `judge` reward function against real localhost HTTP servers: megappo's judge server (the stand-in rule and
the hf engine on a tiny random model) and scripted fakes (503s, slow answers, a counter of requests in flight),
its failure policies, counts, rate limit and concurrency bound."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import socket
import threading
import time
import types

import pytest
import torch

from megappo.config import ConfigError, JudgeConfig, RewardConfig
from megappo.rewards import judge
from megappo.rewards.functions import score_records
from megappo.rewards.judge import PROMPT_KEY, JudgeUnavailable, judge_metrics, parse_score
from megappo.rewards.scoring import skipped_groups
from megappo.rewards.workers import RewardWorkers
from megappo.parallel.http_service import ServiceError
from megappo.rollout.judge_server import load_judge, serve, stand_in_exact
from megappo.rollout.judge_server import main as judge_server_main


@contextlib.contextmanager
def running(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()


class Fake(http.server.ThreadingHTTPServer):
    """A scripted chat-completions server: the first `fail` requests answer `status`, each answer waits `delay`
    seconds and says `content`; it records each request's start time and body and the most requests in flight."""

    daemon_threads = True

    def __init__(self, fail: int = 0, status: int = 503, delay: float = 0.0, content: str = "Score: 1"):
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.fail, self.status, self.delay, self.content = fail, status, delay, content
        self.starts, self.bodies, self.in_flight, self.most = [], [], 0, 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FakeHandler(http.server.BaseHTTPRequestHandler):
    server: Fake

    def do_POST(self):
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.starts.append(time.monotonic())
            s.bodies.append(body)
            s.in_flight += 1
            s.most = max(s.most, s.in_flight)
            failing = len(s.starts) <= s.fail
        try:
            time.sleep(s.delay)
            answer = {"error": "busy"} if failing else {"choices": [{"message": {"role": "assistant",
                                                                                  "content": s.content}}]}
            data = json.dumps(answer).encode()
            self.send_response(s.status if failing else 200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            pass
        finally:
            with s.lock:
                s.in_flight -= 1

    def log_message(self, *args):
        pass


def configure(url: str, **kw) -> JudgeConfig:
    cfg = JudgeConfig(url=url, backoff_s=0.01, **kw)
    judge.configure(cfg)
    return cfg


def score(responses, ground_truths, prompts=None, names=("judge",), weights=None):
    extras = [{PROMPT_KEY: p} for p in (prompts or ["What is 2 + 2?"] * len(responses))]
    return score_records(list(names), weights, responses, ground_truths, extras)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def no_client():
    yield
    judge.close()


def test_stand_in_judge_server_scores_through_the_reward_function_and_combines_by_weights():
    with running(serve(stand_in_exact)) as url:
        configure(url)
        out = score(["2 + 2 = 4", "it is 5", "4"], ["4", "4", "4"], names=("judge", "exact_match"), weights=[1.0, 0.5])
    assert [v[0] for v in out.values] == [1.0, 0.0, 1.0]
    assert out.totals == [1.0, 0.0, 1.5]
    metrics = judge_metrics(out.fields)
    assert metrics["reward/judge/failed"] == metrics["reward/judge/unparseable"] == metrics["reward/judge/retries"] == 0
    assert metrics["reward/judge/latency_s"] > 0


def test_a_server_with_a_key_answers_only_requests_that_carry_it(monkeypatch):
    """--api-key-env: a request without the key, or with another, is answered 401 (an error of the run, never a
    score); the trainer's reward.judge.api_key_env sends it; without a key the server listens on loopback only."""
    with running(serve(stand_in_exact, api_key="s3cret-judge")) as url:
        configure(url)
        with pytest.raises(JudgeUnavailable, match="HTTP 401"):
            score(["4"], ["4"])
        judge.close()
        monkeypatch.setenv("JUDGE_KEY", "not-it")
        configure(url, api_key_env="JUDGE_KEY")
        with pytest.raises(JudgeUnavailable, match="HTTP 401"):
            score(["4"], ["4"])
        judge.close()
        monkeypatch.setenv("JUDGE_KEY", "s3cret-judge")
        configure(url, api_key_env="JUDGE_KEY")
        assert [v[0] for v in score(["4", "5"], ["4", "4"]).values] == [1.0, 0.0]
    with pytest.raises(ServiceError, match="without an API key.*Fix: export a key"):
        serve(stand_in_exact, host="0.0.0.0")
    monkeypatch.delenv("JUDGE_KEY")
    assert judge_server_main(["--stand-in", "exact", "--api-key-env", "JUDGE_KEY"]) == 2  # unset: refused


def test_the_request_carries_the_template_with_prompt_response_and_ground_truth():
    fake = Fake()
    with running(fake) as url:
        configure(url, model="m", template="Q={prompt} A={response} GT={ground_truth}", max_tokens=7)
        score(["four"], ["4"], prompts=["two plus two"])
    assert fake.bodies == [{"model": "m", "messages": [{"role": "user", "content": "Q=two plus two A=four GT=4"}],
                            "temperature": 0.0, "max_tokens": 7}]


def test_hf_engine_judge_answers_and_its_garbage_follows_the_unparseable_policy():
    engine_judge = load_judge("tiny:llama")
    text, finish = engine_judge([{"role": "user", "content": "grade this: 1+1=2"}], 6)
    assert isinstance(text, str) and finish in ("stop", "length")
    with running(serve(engine_judge)) as url:
        configure(url, max_tokens=6, on_failure="score", failure_score=-1.0)
        out = score(["2"], ["2"])
        assert out.totals == [-1.0] and out.fields[0]["judge_unparseable"] == 1.0
        configure(url, max_tokens=6)  # on_failure=error
        with pytest.raises(JudgeUnavailable, match="score_pattern"):
            score(["2"], ["2"])


def test_503_is_retried_with_backoff_and_counted():
    fake = Fake(fail=2, status=503)
    with running(fake) as url:
        configure(url, retries=3)
        out = score(["x"], ["x"])
    assert out.totals == [1.0] and len(fake.starts) == 3
    assert judge_metrics(out.fields)["reward/judge/retries"] == 2.0


def test_429_past_the_retries_fails_and_400_is_not_retried():
    fake = Fake(fail=10, status=429)
    with running(fake) as url:
        configure(url, retries=2, on_failure="score", failure_score=0.25)
        out = score(["x"], ["x"])
    assert out.totals == [0.25] and len(fake.starts) == 3
    assert out.fields[0]["judge_failed"] == 1.0 and out.fields[0]["judge_retries"] == 2.0
    fake = Fake(fail=10, status=400)
    with running(fake) as url:
        configure(url, retries=2, on_failure="score")
        score(["x"], ["x"])
    assert len(fake.starts) == 1


def test_timeouts_are_counted_as_failures():
    with running(Fake(delay=1.0)) as url:
        configure(url, timeout_s=0.2, on_failure="score", failure_score=-0.5)
        out = score(["x", "y"], ["x", "y"])
    assert out.totals == [-0.5, -0.5]
    metrics = judge_metrics(out.fields)
    assert metrics["reward/judge/timeouts"] == metrics["reward/judge/failed"] == 2.0


def test_server_down_error_score_and_skip_group():
    url = f"http://127.0.0.1:{free_port()}"
    configure(url, retries=2)
    with pytest.raises(JudgeUnavailable, match=r"gave no answer.*after 2 retries.*Fix:.*on_failure=skip_group"):
        score(["x"], ["x"])
    configure(url, retries=1, on_failure="score", failure_score=0.5)
    out = score(["x"], ["x"])
    assert out.totals == [0.5] and out.fields[0]["judge_failed"] == 1.0 and out.fields[0]["judge_retries"] == 1.0
    configure(url, retries=0, on_failure="skip_group")
    out = score(["x"], ["x"])
    assert out.totals == [0.0] and out.fields[0]["judge_skip"] == 1.0


def test_skip_group_masks_every_sample_of_a_group_with_a_skipped_judgement():
    fields = [{"judge_skip": 0.0}, {"judge_skip": 1.0}, {"judge_skip": 0.0}, {"judge_skip": 0.0}, {}, {}]
    batch = types.SimpleNamespace(prompt_index=torch.tensor([0, 0, 1, 1, 2, 2]), score_fields=fields)
    assert skipped_groups(batch).tolist() == [True, True, False, False, False, False]
    batch.score_fields = [{"judge_skip": 0.0}] * 6
    assert skipped_groups(batch) is None
    batch.score_fields = [{"judge_skip": 1.0}, {}, {"judge_skip": 1.0}, {}, {}, {"judge_skip": 1.0}]
    with pytest.raises(JudgeUnavailable, match="every group"):
        skipped_groups(batch)


def test_rate_limit_is_honoured():
    fake = Fake()
    with running(fake) as url:
        configure(url, requests_per_s=20, max_concurrent=8)
        score([f"r{i}" for i in range(10)], ["r"] * 10)
    starts = sorted(fake.starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) == 10 and min(gaps) > 0.5 / 20 and starts[-1] - starts[0] >= 9 / 20 * 0.9


def test_concurrency_bound_is_honoured_and_used():
    fake = Fake(delay=0.2)
    with running(fake) as url:
        configure(url, max_concurrent=3)
        start = time.monotonic()
        out = score([f"r{i}" for i in range(9)], ["r"] * 9)
        took = time.monotonic() - start
    assert out.totals == [1.0] * 9 and fake.most == 3
    assert took < 9 * 0.2 * 0.8  # the batch's requests overlapped


def test_reward_workers_ask_the_judge_too():
    with running(serve(stand_in_exact)) as url:
        cfg = JudgeConfig(url=url)
        workers = RewardWorkers(["judge"], 1, 60.0, judge_cfg=cfg)
        try:
            extras = [{PROMPT_KEY: "p"}, {PROMPT_KEY: "p"}]
            outcomes = list(workers.start(["a 4", "5"], ["4", "4"], extras).outcomes())
        finally:
            workers.close()
    assert [o[0][1]["score"] for o in outcomes] == [1.0, 0.0]


def test_parse_score_and_config_checks():
    pattern = re.compile(JudgeConfig().score_pattern)
    assert parse_score("reasons... Score: 0.5\nScore: **7**", pattern) == 7.0
    assert parse_score("Score: 7", pattern, 0.0, 1.0) == 1.0 and parse_score("score = -3", pattern, 0.0) == 0.0
    assert parse_score("no number here", pattern) is None
    with pytest.raises(ConfigError, match="judge.url is not set"):
        RewardConfig(functions=["judge"])
    with pytest.raises(ConfigError, match="2 groups"):
        JudgeConfig(score_pattern="(a)(b)")
    with pytest.raises(ConfigError, match="KeyError"):
        JudgeConfig(template="{question}")
    with pytest.raises(ConfigError, match="above"):
        JudgeConfig(min_score=1, max_score=0)


def test_the_step_masks_skipped_groups_before_the_advantages():
    """make_experience with `skip`: the skipped group's rows of the loss mask are 0, and the other groups' GRPO
    advantages are what they are without the skipped group in the batch."""
    from megappo.config import config_from_dict
    from megappo.trainer.roles import SeqBatch
    from megappo.trainer.step import make_experience
    from megappo.types import RolloutBatch

    cfg = config_from_dict({"model": {"hf_config": {"architectures": ["LlamaForCausalLM"]}},
                            "algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 2}})
    run = types.SimpleNamespace(cfg=cfg)
    n, r = 6, 3
    mask = torch.ones(n, r, dtype=torch.long)
    batch = RolloutBatch(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                         response_ids=torch.ones(n, r, dtype=torch.long), response_mask=mask,
                         rollout_log_probs=torch.zeros(n, r), finish_reasons=["stop"] * n,
                         prompt_index=torch.tensor([0, 0, 1, 1, 2, 2]))
    seqs = SeqBatch(input_ids=torch.ones(n, 2 + r, dtype=torch.long), attention_mask=torch.ones(n, 2 + r),
                    response_mask=mask, prompt_len=2)
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    skip = torch.tensor([False, False, True, True, False, False])
    exp, _ = make_experience(run, batch, seqs, scores, torch.zeros(n, r), None, None, skip=skip)
    assert exp.seqs.response_mask.sum(-1).tolist() == [3, 3, 0, 0, 3, 3]
    full, _ = make_experience(run, batch, seqs, scores, torch.zeros(n, r), None, None)
    kept = ~skip
    assert torch.equal(exp.advantages[kept], full.advantages[kept])
    assert (exp.advantages[skip] == 0).all()
