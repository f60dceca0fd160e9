"""HTTP endpoints for operators: ``/metrics`` (Prometheus), ``/healthz`` (alive) and ``/readyz`` (serving).

``/healthz`` answers 200 while every service thread runs, no handler call ran over ``handler_timeout_s``
(one check per model, named after it) and the producer has no fatal error (a liveness probe restarts the pod
otherwise). ``/readyz`` answers 200 once the model is loaded and warmed, the member has joined the group and a
broker connection is up. A member with no partitions is ready (a standby that takes partitions over when another
member leaves), and a rebalance does not make it unready. Both return a JSON body saying why.

The server is bounded whoever connects (2,000 idle connections once made 2,022 threads, held for good): one thread
accepts connections and waits for their first bytes in a selector, holding no thread for an idle one; a
connection that sends nothing for ``timeout_s`` is closed; at most ``max_connections`` are open, the oldest idle
one closed to make room for a new one (a scraper sends its request at once, so it is not the one closed); a
request that has started arriving is read and answered by one of ``_WORKERS`` threads, each read and write bounded
by ``timeout_s``. One request per connection (HTTP/1.0), as Prometheus and Kubernetes probes expect.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kinference.consumer.config import ServiceConfig

Checks = Callable[[], dict[str, bool]]
_WORKERS = 4
"""Threads that read and answer requests: scrapes and probes are small and few."""


@dataclass(frozen=True, slots=True)
class EndpointSettings:
    host: str = "0.0.0.0"
    port: int = 9400
    max_connections: int = 64
    timeout_s: float = 10.0

    @classmethod
    def of(cls, config: ServiceConfig) -> EndpointSettings:
        return cls(config.metrics_host, config.metrics_port, config.metrics_max_connections,
                   config.metrics_timeout_s)


class Endpoints:
    def __init__(self, settings: EndpointSettings, registry: CollectorRegistry, health: Checks, readiness: Checks,
                 problems: Callable[[], dict[str, str]] | None = None) -> None:
        """``problems``: why each failing check fails, in words, added to a failing answer's body (the supervisor of
        several workers says which worker, and why)."""
        explain = problems or dict
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: _check(health(), explain),
            "/readyz": lambda: _check(readiness(), explain),
        }

        class Handler(BaseHTTPRequestHandler):
            timeout = settings.timeout_s  # each read and write of the connection

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

        self._handler = Handler
        self._settings = settings
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        self._listener = socket.create_server((settings.host, settings.port), family=family, backlog=128)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._idle: dict[socket.socket, float] = {}
        """Connections waiting for their first bytes, with when each was accepted (oldest first)."""
        self._busy = 0
        """Connections handed to the workers and not yet closed."""
        self._lock = threading.Lock()
        self._workers = ThreadPoolExecutor(_WORKERS, thread_name_prefix="kinference-http-worker")
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kinference-http", daemon=True)

    @property
    def port(self) -> int:
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._idle) + self._busy

    def start(self) -> Endpoints:
        self._thread.start()
        log.info("metrics and health on http://%s:%d/metrics", *self._listener.getsockname()[:2])
        return self

    def close(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(5)  # it closes the listener and what waits on the way out
        elif self._thread.ident is None:  # never started
            self._selector.close()
            self._listener.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(timeout=min(0.5, self._settings.timeout_s)):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._hand_over(key.fileobj)  # type: ignore[arg-type]  # only sockets are registered
                self._close_idle(time.monotonic() - self._settings.timeout_s)
        finally:
            for connection in list(self._idle):
                self._drop(connection)
            self._selector.close()
            self._listener.close()

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of file descriptors, say: the next turn tries again
            log.warning("the metrics endpoint could not accept a connection: %s", exc)
            return
        with self._lock:
            full = len(self._idle) + self._busy >= self._settings.max_connections
        if full and self._idle:
            self._drop(next(iter(self._idle)))
        elif full:  # every slot is a request being answered: this one waits for none
            connection.close()
            return
        with self._lock:
            self._idle[connection] = time.monotonic()
        self._selector.register(connection, selectors.EVENT_READ)

    def _hand_over(self, connection: socket.socket) -> None:
        """Its first bytes came: a worker reads the request and answers it."""
        self._selector.unregister(connection)
        with self._lock:
            del self._idle[connection]
            self._busy += 1
        connection.setblocking(True)
        self._workers.submit(self._answer, connection)

    def _answer(self, connection: socket.socket) -> None:
        try:
            self._handler(connection, connection.getpeername(), self)  # type: ignore[arg-type]  # kept, never read
        except OSError:  # the peer went away, or a read or write timed out
            pass
        except Exception:
            log.exception("the metrics endpoint failed to answer a request")
        finally:
            connection.close()
            with self._lock:
                self._busy -= 1

    def _close_idle(self, accepted_before: float) -> None:
        with self._lock:
            expired = [connection for connection, accepted in self._idle.items() if accepted < accepted_before]
        for connection in expired:
            self._drop(connection)

    def _drop(self, connection: socket.socket) -> None:
        self._selector.unregister(connection)
        with self._lock:
            del self._idle[connection]
        connection.close()


def _check(checks: dict[str, bool], explain: Callable[[], dict[str, str]]) -> tuple[int, str, bytes]:
    ok = all(checks.values())
    body = {"ok": ok, "checks": checks}
    problems = {} if ok else {name: why for name, why in explain().items() if not checks.get(name, True)}
    if problems:
        body["problems"] = problems
    return (200 if ok else 503), "application/json", orjson.dumps(body) + b"\n"
