"""Free TCP ports for the processes that benchmarks, the demo and tests start."""

from __future__ import annotations

import errno
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


class PortInUse(Exception):
    """A port kvgate (or something the demo starts) must listen on is taken: one line says
    which, instead of a traceback from deep inside a server library."""


def ensure_free(host: str, port: int, what: str) -> None:
    """Raise :class:`PortInUse` if nothing could listen on ``host:port`` now (port 0 means
    any free port: always fine). ``what`` names the setting the port came from."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise PortInUse(f"{what}: cannot listen on {host}:{port}: {exc.strerror}") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"{what}: {host}:{port} is already in use") from None
            raise PortInUse(f"{what}: cannot listen on {host}:{port}: {exc.strerror}") from None
