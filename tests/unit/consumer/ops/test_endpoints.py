"""The metrics and health endpoint is bounded whoever connects (issue 29, item 6): 2,000 idle connections once
made 2,022 threads, still held after 60 s."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kinference.consumer.ops.endpoints import Endpoints, EndpointSettings


@contextlib.contextmanager
def endpoints(**limits: float) -> Iterator[Endpoints]:
    served = Endpoints(EndpointSettings("127.0.0.1", 0, **limits), CollectorRegistry(), lambda: {"alive": True},
                       lambda: {"ready": True}).start()
    try:
        yield served
    finally:
        served.close()


def connect(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]


def closed_by_server(connection: socket.socket) -> bool:
    """The server closed it (a read sees the end, or a reset): waits up to the socket's timeout."""
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True


def healthz(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
        return answer.read()


def wait_for(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_idle_connections_take_no_thread_and_the_endpoint_still_answers():
    with endpoints(max_connections=1000, timeout_s=30) as served:
        before = threading.active_count()
        idle = connect(served.port, 200)
        try:
            assert wait_for(lambda: served.open_connections == 200)
            assert threading.active_count() - before <= 4, f"{threading.active_count() - before} threads for 200"
            assert b'"ok":true' in healthz(served.port)
            assert threading.active_count() - before <= 4
        finally:
            for connection in idle:
                connection.close()


def test_idle_connections_are_closed_after_the_timeout():
    with endpoints(timeout_s=1) as served:
        idle = connect(served.port, 20)
        partial = connect(served.port, 1)[0]
        partial.sendall(b"GET /healthz HTTP/1.1\r\n")  # a request that never ends: its reads time out
        started = time.monotonic()
        try:
            assert all(closed_by_server(connection) for connection in [*idle, partial])
            assert time.monotonic() - started < 8
            assert wait_for(lambda: served.open_connections == 0)
            assert b'"ok":true' in healthz(served.port)
        finally:
            for connection in [*idle, partial]:
                connection.close()


def test_past_the_limit_the_oldest_idle_connection_makes_room():
    with endpoints(max_connections=10, timeout_s=30) as served:
        idle = connect(served.port, 25)
        try:
            assert wait_for(lambda: served.open_connections <= 10 and served.open_connections > 0)
            time.sleep(0.3)
            assert served.open_connections <= 10
            assert all(closed_by_server(connection) for connection in idle[:15])
            assert b'"ok":true' in healthz(served.port)  # a scrape is answered: the idle ones make room for it
        finally:
            for connection in idle:
                connection.close()


@pytest.mark.parametrize("path", ["/metrics", "/readyz", "/nowhere"])
def test_every_route_answers(path):
    with endpoints() as served:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{served.port}{path}", timeout=10) as answer:
                assert answer.status == 200
        except urllib.error.HTTPError as refused:
            assert path == "/nowhere" and refused.code == 404
