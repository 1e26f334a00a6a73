"""Free TCP ports for the processes that benchmarks, the demo and tests start."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()  # ports this process already gave to something it starts


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; bind soon to keep it), and
    never one this process handed out before: a config asks for several ports before any
    is bound, and the OS may offer the same free port twice (a CI run failed that way)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
