"""A SandboxFusion-compatible `/run_code` service backed by megappo's local executor, started by one command:

    python -m megappo.rewards.sandbox_server --port 8080 [--host 127.0.0.1] [--isolation bwrap]
                                             [--max-concurrent 64] [--api-key-env NAME]

then `reward.sandbox.url=http://127.0.0.1:8080` (or verl's `reward_model.sandbox_fusion.url`). Each request
runs on a thread (stdlib ThreadingHTTPServer); at most --max-concurrent programs run at once, the rest wait.
The request and answer shapes are megappo.rewards.sandbox_fusion's; the sandbox is megappo.rewards.sandbox's.
It listens on 127.0.0.1 unless told otherwise; with `--api-key-env NAME` every request must carry that key
(`reward.sandbox.api_key_env` on the trainer's side), and without one it listens on loopback only
(megappo.parallel.http_service).

This module does not know about reward functions, test cases or config sections.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from megappo.parallel.http_service import JsonHandler, JsonService, ServiceError, api_key_from_env
from megappo.rewards.sandbox import ISOLATIONS, LocalExecutor, SandboxUnavailable, resolve_isolation
from megappo.rewards.sandbox_fusion import answer_request

MAX_REQUEST_BYTES = 16 << 20


class SandboxServer(JsonService):
    """The service: `executor` runs the programs, at most `max_concurrent` at once."""

    def __init__(self, address: tuple[str, int], executor: LocalExecutor, max_concurrent: int = 64, *,
                 api_key: str | None = None):
        super().__init__(address, _Handler, api_key=api_key)
        self.executor, self.slots = executor, threading.BoundedSemaphore(max_concurrent)


class _Handler(JsonHandler):
    server: SandboxServer

    def error_body(self, message: str) -> dict:
        return {"status": "SandboxError", "message": message}

    def do_POST(self) -> None:
        if not self.authorized():
            return
        if self.path.rstrip("/") != "/run_code":
            return self.send_json(404, self.error_body(f"no such endpoint {self.path}"))
        size = int(self.headers.get("Content-Length") or 0)
        if not 0 < size <= MAX_REQUEST_BYTES:
            return self.send_json(413, self.error_body(f"a request of {size} bytes"))
        try:
            request = json.loads(self.rfile.read(size))
        except ValueError as e:
            return self.send_json(400, self.error_body(f"the request is not JSON: {e}"))
        try:
            with self.server.slots:
                answer = answer_request(self.server.executor, request)
        except SandboxUnavailable as e:
            answer = {"status": "SandboxError", "message": str(e), "compile_result": None, "run_result": None}
        self.send_json(200, answer)


def serve(port: int = 0, host: str = "127.0.0.1", isolation: str = "bwrap", allow_weaker: bool = False,
          max_concurrent: int = 64, api_key: str | None = None) -> SandboxServer:
    """A started-up server (not yet serving: call `run`); port 0 picks a free one (`.url`)."""
    return SandboxServer((host, port), LocalExecutor(resolve_isolation(isolation, allow_weaker)), max_concurrent,
                         api_key=api_key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megappo.rewards.sandbox_server", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--isolation", choices=ISOLATIONS, default="bwrap")
    p.add_argument("--allow-weaker", action="store_true", help="fall back to a weaker isolation, with a warning")
    p.add_argument("--max-concurrent", type=int, default=64)
    p.add_argument("--api-key-env", help="the environment variable holding the key every request must carry")
    args = p.parse_args(argv)
    try:
        server = serve(args.port, args.host, args.isolation, args.allow_weaker, args.max_concurrent,
                       api_key_from_env(args.api_key_env))
    except (SandboxUnavailable, ServiceError) as e:
        print(f"megappo sandbox server: error: {e}", file=sys.stderr)
        return 2
    print(f"megappo sandbox server: {server.url}/run_code ({server.executor.isolation})", flush=True)
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
