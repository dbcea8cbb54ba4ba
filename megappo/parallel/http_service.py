"""megappo's small JSON-over-HTTP services (the sandbox's `/run_code`, the judge's chat completions), on the
standard library: a thread per request, a listen backlog that a trainer's burst of connections fits in, an
optional API key, JSON answers, and a serve loop that ends on Ctrl-C.

The key: started with `--api-key-env NAME`, a service answers only requests that carry
`Authorization: Bearer <the value of $NAME>` (compared in constant time; any other request gets 401). The key
comes from the environment, not the command line, where `ps` would show it. A service refuses to listen on
an address other than loopback without a key: anyone who can reach it could run programs on it, or spend
its model's time.

Owns: `JsonService`, `JsonHandler`, `api_key_from_env`. Does not know what an endpoint computes.
"""

from __future__ import annotations

import hmac
import http.server
import json
import os

from megappo.parallel.listen import is_loopback


class ServiceError(ValueError):
    """A service that cannot start as asked; the message names the fix."""


def api_key_from_env(name: str | None) -> str | None:
    """The value of environment variable `name` (None: no key asked for); ServiceError when it is unset or empty."""
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise ServiceError(f"--api-key-env {name} names an environment variable that is not set. Fix: export "
                           f"{name}=<a long random key> before starting the service (and give the clients the same).")
    return key


class JsonService(http.server.ThreadingHTTPServer):
    """A started-up service on `address` (port 0: a free one, see `.url`) whose requests `handler` answers;
    `api_key`: the bearer key every request must carry (None: none, only on loopback)."""

    daemon_threads = True
    request_queue_size = 1024  # listen()'s backlog: a trainer opens max_concurrent connections at once (default 5)

    def __init__(self, address: tuple[str, int], handler: type[JsonHandler], *, api_key: str | None = None):
        if api_key is None and not is_loopback(address[0]):
            raise ServiceError(f"listening on {address[0]} without an API key would let anyone who reaches it use "
                               f"it. Fix: export a key in an environment variable and pass --api-key-env NAME (the "
                               f"clients send it: reward.sandbox.api_key_env / reward.judge.api_key_env), or "
                               f"listen on 127.0.0.1.")
        super().__init__(address, handler)
        self.api_key = api_key

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def run(self) -> int:
        """Serve until Ctrl-C; 0."""
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.server_close()
        return 0


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A request of a `JsonService`: `do_POST` answers with `send_json` after `authorized()` (which has answered
    401 when it returns False)."""

    server: JsonService

    def authorized(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        got = self.headers.get("Authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            return True
        self.send_json(401, self.error_body("no or a wrong API key: send Authorization: Bearer <key>"))
        return False

    def error_body(self, message: str) -> dict:
        """The service's error answer for `message` (each service has its own shape)."""
        return {"error": {"message": message}}

    def send_json(self, code: int, answer: dict) -> None:
        body = json.dumps(answer).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # one line per request is noise at thousands a step
        pass
