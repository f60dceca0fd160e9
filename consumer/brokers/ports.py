"""A free local port, for each local broker's listeners (``broker``, ``apache_kafka``): a module of its own, so that
the two brokers need nothing of each other."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
