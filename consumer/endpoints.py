"""HTTP endpoints for operators: ``/metrics`` (Prometheus), ``/healthz`` (alive) and ``/readyz`` (serving).

``/healthz`` answers 200 while every service thread runs, no handler call ran over ``handler_timeout_s``
(one check per model, named after it) and the producer has no fatal error (a liveness probe restarts the pod
otherwise). ``/readyz`` answers 200 once the model is loaded and warmed, the member has joined the group and a
broker connection is up. A member with no partitions is ready (a standby that takes partitions over when another
member leaves), and a rebalance does not make it unready. Both return a JSON body saying why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

Checks = Callable[[], dict[str, bool]]


class Endpoints:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: Checks, readiness: Checks,
                 problems: Callable[[], dict[str, str]] | None = None) -> None:
        """``problems``: why each failing check fails, in words, added to a failing answer's body (the supervisor of
        several workers says which worker, and why)."""
        explain = problems or dict
        routes = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: _check(health(), explain),
            "/readyz": lambda: _check(readiness(), explain),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's naming
                route = routes.get(self.path.split("?", 1)[0])
                status, content_type, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kinference-http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> Endpoints:
        self._thread.start()
        log.info("metrics and health on http://%s:%d/metrics", *self._server.server_address[:2])
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def _check(checks: dict[str, bool], explain: Callable[[], dict[str, str]]) -> tuple[int, str, bytes]:
    ok = all(checks.values())
    body = {"ok": ok, "checks": checks}
    problems = {} if ok else {name: why for name, why in explain().items() if not checks.get(name, True)}
    if problems:
        body["problems"] = problems
    return (200 if ok else 503), "application/json", orjson.dumps(body) + b"\n"
