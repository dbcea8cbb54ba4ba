"""A SandboxFusion-compatible `/run_code` service backed by megappo's local executor, started by one command:

    python -m megappo.rewards.sandbox_server --port 8080 [--host 127.0.0.1] [--isolation bwrap]
                                             [--max-concurrent 64]

then `reward.sandbox.url=http://127.0.0.1:8080` (or verl's `reward_model.sandbox_fusion.url`). Each request
runs on a thread (stdlib ThreadingHTTPServer); at most --max-concurrent programs run at once, the rest wait.
The request and answer shapes are megappo.rewards.sandbox_fusion's; the sandbox is megappo.rewards.sandbox's.
It listens on 127.0.0.1 unless told otherwise: it has no authentication.

This module does not know about reward functions, test cases or config sections.
"""

from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading

from megappo.rewards.sandbox import ISOLATIONS, LocalExecutor, SandboxUnavailable, resolve_isolation
from megappo.rewards.sandbox_fusion import answer_request

MAX_REQUEST_BYTES = 16 << 20


class SandboxServer(http.server.ThreadingHTTPServer):
    """The service: `executor` runs the programs, at most `max_concurrent` at once."""

    daemon_threads = True
    request_queue_size = 1024  # listen()'s backlog: a trainer opens max_concurrent connections at once (default 5)

    def __init__(self, address: tuple[str, int], executor: LocalExecutor, max_concurrent: int = 64):
        super().__init__(address, _Handler)
        self.executor, self.slots = executor, threading.BoundedSemaphore(max_concurrent)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: SandboxServer

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/run_code":
            return self._send(404, {"status": "SandboxError", "message": f"no such endpoint {self.path}"})
        size = int(self.headers.get("Content-Length") or 0)
        if not 0 < size <= MAX_REQUEST_BYTES:
            return self._send(413, {"status": "SandboxError", "message": f"a request of {size} bytes"})
        try:
            request = json.loads(self.rfile.read(size))
        except ValueError as e:
            return self._send(400, {"status": "SandboxError", "message": f"the request is not JSON: {e}"})
        try:
            with self.server.slots:
                answer = answer_request(self.server.executor, request)
        except SandboxUnavailable as e:
            answer = {"status": "SandboxError", "message": str(e), "compile_result": None, "run_result": None}
        self._send(200, answer)

    def _send(self, code: int, answer: dict) -> None:
        body = json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # one line per request is noise at thousands a step
        pass


def serve(port: int = 0, host: str = "127.0.0.1", isolation: str = "bwrap", allow_weaker: bool = False,
          max_concurrent: int = 64) -> SandboxServer:
    """A started-up server (not yet serving: call serve_forever); port 0 picks a free one (`.url`)."""
    return SandboxServer((host, port), LocalExecutor(resolve_isolation(isolation, allow_weaker)), max_concurrent)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megappo.rewards.sandbox_server", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--isolation", choices=ISOLATIONS, default="bwrap")
    p.add_argument("--allow-weaker", action="store_true", help="fall back to a weaker isolation, with a warning")
    p.add_argument("--max-concurrent", type=int, default=64)
    args = p.parse_args(argv)
    try:
        server = serve(args.port, args.host, args.isolation, args.allow_weaker, args.max_concurrent)
    except SandboxUnavailable as e:
        print(f"megappo sandbox server: error: {e}", file=sys.stderr)
        return 2
    print(f"megappo sandbox server: {server.url}/run_code ({server.executor.isolation})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
