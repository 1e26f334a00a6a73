"""Free TCP ports for the processes that benchmarks, the demo and tests start."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

_handed_out: set[int] = set()  # ports this process already gave to something it starts
_share = (0, 1)  # (this process's index, processes sharing the machine's ports): share_ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind soon to keep it), never one this process
    handed out before (a config asks for several ports before any is bound), and outside
    the kernel's ephemeral range when it can be: a port picked from that range can be taken
    by any outgoing connection before its server binds it (CI runs failed both ways)."""
    low = _ephemeral_low()
    index, count = _share
    span = (low - PRIVATE_PORTS_FROM) // count
    first = PRIVATE_PORTS_FROM + index * span
    for _ in range(200):
        wanted = random.randrange(first, first + span) if span > 0 else 0
        port = _bindable(host, wanted)
        if port and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(errno.EADDRINUSE, "no free port found")


PRIVATE_PORTS_FROM = 20000  # below the ephemeral range, above most well-known services


def connect_host(host: str) -> str:
    """Where to connect to reach a listener bound to ``host``: a wildcard's loopback (``::``
    listens on IPv6 alone: asyncio sets IPV6_V6ONLY, so 127.0.0.1 is refused there)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def share_ports(index: int, count: int) -> None:
    """This process is the ``index``-th of ``count`` that pick free ports on one machine at
    once (parallel test workers): it picks from its own ``1/count`` of the range. Each
    remembers only what it handed out itself, and a port one picked and had not bound yet
    was picked by another (a CI run's Envoy failed to bind)."""
    global _share
    if not 0 <= index < count:
        raise ValueError(f"process {index} of {count}")
    _share = (index, count)


def _ephemeral_low() -> int:
    """Where the ports the kernel gives outgoing connections start."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # the IANA dynamic range (macOS, BSD)


def _bindable(host: str, port: int) -> int:
    """``port`` if it can be bound now (0: the one the OS picks), else 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return 0
        return sock.getsockname()[1]


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
