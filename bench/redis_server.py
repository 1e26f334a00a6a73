"""A real ``redis-server`` on a free port for tests: start, stop, SIGKILL, restart, and
SIGSTOP/SIGCONT (a Redis that hangs mid-call).

Tests call :func:`require_redis_server` first: with no binary they are skipped locally, but
fail when ``CI`` is set (``.ci/run`` installs redis-server, so a missing one is a CI bug).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from extproc.ports import free_port

REDIS_SERVER = shutil.which("redis-server") or (
    "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
)


class RedisNotInstalled(RuntimeError):
    """No redis-server binary: install it (``apt-get install redis-server``)."""


def _command(port: int, *args: str, timeout_s: float = 0.2) -> bytes:
    """One raw RESP command, no client library (sync helpers must not need an event loop)."""
    payload = f"*{len(args)}\r\n".encode()
    for arg in args:
        payload += f"${len(arg.encode())}\r\n{arg}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        return sock.recv(256)


def _ping(port: int) -> bool:
    """Is the server accepting commands yet?"""
    try:
        return _command(port, "PING").startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """``redis-server`` without persistence on ``127.0.0.1:port`` (a free port by default).

    A sync context manager; :meth:`stop`/:meth:`kill` then :meth:`start` reuse the same port,
    so clients configured with :attr:`url` reconnect to the restarted server.
    """

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        binary = binary or REDIS_SERVER
        if binary is None:
            raise RedisNotInstalled("redis-server not found; apt-get install redis-server")
        self.binary = binary
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start (or restart) and wait until PING answers."""
        if self.running:
            return self
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no",
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited on port {self.port}: {err}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server did not answer PING on port {self.port}")
            time.sleep(0.02)
        return self

    def flushall(self) -> None:
        """Empty every database (between tests sharing one server)."""
        reply = _command(self.port, "FLUSHALL", timeout_s=5.0)
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"FLUSHALL failed: {reply!r}")

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM), waiting for the process to exit."""
        self._end(kill=False)

    def kill(self) -> None:
        """SIGKILL: what a crashed Redis looks like to its clients."""
        self._end(kill=True)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and commands queue unanswered (a hung Redis)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: the paused server runs the commands queued meanwhile."""
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("redis-server is not running")
        self._proc.send_signal(sig)

    def _end(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill() if kill else proc.terminate()
        proc.send_signal(signal.SIGCONT)  # a paused server must see the signal to exit
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
