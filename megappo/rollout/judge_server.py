"""A local OpenAI-compatible judge: `/v1/chat/completions` served by megappo's hf engine, or by a deterministic
stand-in for tests and demos, started by one command:

    python -m megappo.rollout.judge_server --model HF_DIR [--port 8000] [--host 127.0.0.1] [--device cpu]
                                           [--api-key-env NAME]
    python -m megappo.rollout.judge_server --model tiny:llama          # a tiny random model (answers garbage)
    python -m megappo.rollout.judge_server --stand-in exact            # no model: a rule

then `reward.judge.url=http://127.0.0.1:8000`. A request `{"model", "messages", "max_tokens", ...}` is answered
`{"choices": [{"message": {"role": "assistant", "content": ...}, "finish_reason": ...}], ...}`:

  HF_DIR      the messages rendered with the tokenizer's chat template (the generation prompt opened), or, for a
              tokenizer without one, as `role: content` lines and `assistant:`; greedy decoding (the request's
              temperature is not honoured) of up to max_tokens tokens on the hf engine, one request at a time;
              a prompt longer than the model's positions allow keeps its last tokens
  tiny:ARCH   megappo.models.hf_reference's tiny random ARCH model with the built-in digits tokenizer: a
              server that runs end to end, whose answers no score pattern parses
  exact       the stand-in: "Score: 1" when the text between the first <reference> tags of the last user message
              occurs in the text between its <response> tags (megappo.rewards.judge's default template has both),
              else "Score: 0"; a message without them is answered without a score. A rule, not a judge: a
              deterministic judge server for tests and demos, since a model small enough for them cannot judge

It listens on 127.0.0.1 unless told otherwise; with `--api-key-env NAME` every request must carry that key
(`reward.judge.api_key_env` on the trainer's side), and without one it listens on loopback only
(megappo.parallel.http_service).

This module does not know about reward functions, config sections or training.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from typing import Callable

import torch

from megappo.parallel.http_service import JsonHandler, JsonService, ServiceError, api_key_from_env
from megappo.rollout.hf.engine import HFEngine
from megappo.types import SamplingParams

MAX_REQUEST_BYTES = 16 << 20

#: a judge: (the request's messages, its max_tokens) -> (the answer's text, its finish_reason)
Answer = Callable[[list[dict], int], tuple[str, str]]

_REFERENCE = re.compile(r"<reference>\s*(.*?)\s*</reference>", re.DOTALL)
_RESPONSE = re.compile(r"<response>\s*(.*)\s*</response>", re.DOTALL)


def stand_in_exact(messages: list[dict], max_tokens: int) -> tuple[str, str]:
    """The deterministic stand-in (module docstring)."""
    text = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")
    reference, response = _REFERENCE.search(text), _RESPONSE.search(text)
    if reference is None or response is None:
        return "The message has no <reference> and <response> tags to compare.", "stop"
    correct = bool(reference.group(1)) and reference.group(1) in response.group(1)
    return f"Score: {int(correct)}", "stop"


STAND_INS: dict[str, Answer] = {"exact": stand_in_exact}


class EngineJudge:
    """Answers with a causal LM on the hf engine, greedily, one request at a time."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: str = "cpu"):
        self.tokenizer = tokenizer
        self.engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, device=device, log=lambda line: None)
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.eos = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
        self._lock = threading.Lock()  # the engine runs one generation at a time

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            from megappo.data.tokenizer import chat_template_ids

            return chat_template_ids(self.tokenizer, messages, generation_prompt=True)
        text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages) + "assistant: "
        return self.tokenizer.encode(text, add_special_tokens=False)

    def __call__(self, messages: list[dict], max_tokens: int) -> tuple[str, str]:
        max_tokens = max(1, min(max_tokens, self.max_positions - 1))
        ids = self.prompt_ids(messages)[-(self.max_positions - max_tokens):]  # its last tokens, when too long
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_tokens, eos_token_ids=self.eos)
        with self._lock:
            out = self.engine.generate([ids], params)
        tokens = out.response_ids[0][out.response_mask[0].bool()].tolist()
        return self.tokenizer.decode(tokens, skip_special_tokens=True), out.finish_reasons[0]


def load_judge(model: str, device: str = "cpu") -> EngineJudge:
    """`tiny:ARCH` (a tiny random model, the digits tokenizer) or an HF model directory."""
    if model.startswith("tiny:"):
        from megappo.data.tokenizer import load_tokenizer
        from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model

        arch = model.split(":", 1)[1]
        if arch not in TINY_CONFIGS:
            raise ValueError(f"unknown tiny model {model!r}. Fix: one of {['tiny:' + a for a in TINY_CONFIGS]}, "
                             "or an HF model directory.")
        return EngineJudge(build_hf_model(TINY_CONFIGS[arch]), load_tokenizer("builtin:digits"), device)
    from transformers import AutoModelForCausalLM

    from megappo.data.tokenizer import load_tokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, use_safetensors=True)
    return EngineJudge(hf_model, load_tokenizer(model), device)


class JudgeServer(JsonService):
    """The service: `answer` writes each reply; `name` is the model name its answers carry."""

    def __init__(self, address: tuple[str, int], answer: Answer, name: str = "judge", *, api_key: str | None = None):
        super().__init__(address, _Handler, api_key=api_key)
        self.answer, self.name = answer, name


class _Handler(JsonHandler):
    server: JudgeServer

    def error_body(self, message: str) -> dict:
        return _error(message)

    def do_POST(self) -> None:
        if not self.authorized():
            return
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            return self.send_json(404, _error(f"no such endpoint {self.path}"))
        size = int(self.headers.get("Content-Length") or 0)
        if not 0 < size <= MAX_REQUEST_BYTES:
            return self.send_json(413, _error(f"a request of {size} bytes"))
        try:
            request = json.loads(self.rfile.read(size))
            messages = request["messages"]
            assert isinstance(messages, list) and all(isinstance(m, dict) for m in messages)
        except (ValueError, KeyError, TypeError, AssertionError) as e:
            return self.send_json(400, _error(f"not a chat-completions request: {type(e).__name__} {e}"))
        try:
            text, finish = self.server.answer(messages, int(request.get("max_tokens") or 512))
        except Exception as e:  # the client retries a 5xx
            return self.send_json(500, _error(f"the judge failed: {type(e).__name__}: {e}"))
        self.send_json(200, {"id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion",
                             "created": int(time.time()), "model": request.get("model") or self.server.name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                          "finish_reason": finish}]})


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def serve(answer: Answer, port: int = 0, host: str = "127.0.0.1", name: str = "judge",
          api_key: str | None = None) -> JudgeServer:
    """A started-up server (not yet serving: call `run`); port 0 picks a free one (`.url`)."""
    return JudgeServer((host, port), answer, name, api_key=api_key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megappo.rollout.judge_server", description=__doc__.split("\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="an HF model directory, or tiny:ARCH (a tiny random model)")
    which.add_argument("--stand-in", choices=sorted(STAND_INS), help="a deterministic rule instead of a model")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--api-key-env", help="the environment variable holding the key every request must carry")
    args = p.parse_args(argv)
    try:
        key = api_key_from_env(args.api_key_env)
        answer = STAND_INS[args.stand_in] if args.stand_in else load_judge(args.model, args.device)
        server = serve(answer, args.port, args.host, name=args.model or f"stand-in:{args.stand_in}", api_key=key)
    except ServiceError as e:
        print(f"megappo judge server: error: {e}", file=sys.stderr)
        return 2
    print(f"megappo judge server: {server.url}/v1/chat/completions "
          f"({args.model or 'stand-in ' + args.stand_in})", flush=True)
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
