"""A real ``redis-server`` on a free port for tests: start, stop, SIGKILL, restart, and
SIGSTOP/SIGCONT (a Redis that hangs mid-call); and a real 3-shard Redis Cluster of them.

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

    def __init__(self, port: int | None = None, binary: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        binary = binary or REDIS_SERVER
        if binary is None:
            raise RedisNotInstalled("redis-server not found; apt-get install redis-server")
        self.binary = binary
        self.port = port or free_port()
        self._dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        self._proc: subprocess.Popen[bytes] | None = None
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("redis-server is not running")
        return self._proc.pid

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
            *self.extra_args,
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

    def command(self, *args: str, timeout_s: float = 1.0) -> bytes:
        """One raw command; the start of its RESP reply (up to 256 bytes)."""
        return _command(self.port, *args, timeout_s=timeout_s)

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


_CLIENT_BOOKKEEPING = ("info", "hello", "client|setinfo")  # the benchmarks' own and redis-py's


def command_calls(commandstats: dict[str, dict[str, int]]) -> dict[str, int]:
    """``INFO commandstats`` as command → calls (those inside scripts included), less the
    calls a client makes to read it or to connect."""
    calls = {name.removeprefix("cmdstat_"): fields["calls"]
             for name, fields in commandstats.items()}
    return {name: n for name, n in calls.items() if name not in _CLIENT_BOOKKEEPING}


SLOTS = 16384


class RedisCluster:
    """A Redis Cluster of ``shards`` primaries on free ports, slots split evenly, each with
    ``replicas`` replicas: started with plain ``CLUSTER ADDSLOTSRANGE`` / ``CLUSTER MEET`` /
    ``CLUSTER REPLICATE`` (no redis-cli). ``url`` names the first node; a cluster client
    discovers the rest. ``nodes`` are the primaries as started, ``replicas[i]`` those of
    ``nodes[i]``; after a failover (a primary killed or hung past ``node_timeout_ms``) a
    replica serves its slots, which :meth:`primary_of` tells."""

    def __init__(self, shards: int = 3, replicas: int = 0, node_timeout_ms: int = 2000,
                 extra_args: tuple[str, ...] = ()) -> None:
        def server(bus: int) -> RedisServer:
            # the bus port is given (by default it is port + 10000: maybe taken, or past 65535)
            return RedisServer(extra_args=(
                "--cluster-enabled", "yes", "--cluster-port", str(bus),
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms),
                "--repl-diskless-sync-delay", "0",  # a replica syncs at once
                *extra_args))

        self.bus_ports = [free_port() for _ in range(shards * (1 + replicas))]
        servers = [server(bus) for bus in self.bus_ports]
        self.nodes = servers[:shards]
        self.replicas = [servers[shards + i * replicas:shards + (i + 1) * replicas]
                         for i in range(shards)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def servers(self) -> list[RedisServer]:
        return [*self.nodes, *(r for shard in self.replicas for r in shard)]

    def start(self, timeout_s: float = 20.0) -> RedisCluster:
        servers = self.servers
        for node in servers:
            node.start()
        per = SLOTS // len(self.nodes)
        for i, node in enumerate(self.nodes):
            last = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * per - 1
            _expect_ok(_command(node.port, "CLUSTER", "ADDSLOTSRANGE", str(i * per), str(last)))
            # distinct config epochs, as redis-cli sets them (a failover then wins cleanly)
            _expect_ok(_command(node.port, "CLUSTER", "SET-CONFIG-EPOCH", str(i + 1)))
        for node, bus in zip(servers[1:], self.bus_ports[1:], strict=True):
            _expect_ok(_command(self.nodes[0].port, "CLUSTER", "MEET", "127.0.0.1",
                                str(node.port), str(bus)))
        deadline = time.monotonic() + timeout_s
        if any(self.replicas):
            ids = [node_id(node.port) for node in self.nodes]
            for primary, replicas in zip(ids, self.replicas, strict=True):
                for replica in replicas:
                    # (refused until the replica has heard of its primary through the bus)
                    while not _command(replica.port, "CLUSTER", "REPLICATE", primary,
                                       timeout_s=1.0).startswith(b"+OK"):
                        if time.monotonic() > deadline:
                            raise TimeoutError("a replica did not take its primary")
                        time.sleep(0.05)
        while not all(self._ready(n) for n in servers):
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        return self

    def _ready(self, node: RedisServer) -> bool:
        """The node sees every slot served, and a replica has its primary's data."""
        if _command(node.port, "CLUSTER", "INFO", timeout_s=1.0).find(b"cluster_state:ok") < 0:
            return False
        if any(node in replicas for replicas in self.replicas):
            return b"master_link_status:up" in info(node.port, "replication")
        return True

    def primary_of(self, shard: int) -> RedisServer | None:
        """The server that serves ``shard``'s slots as a primary now, if one answers."""
        for server in (self.nodes[shard], *self.replicas[shard]):
            if server.running and role(server.port) == b"master":
                return server
        return None

    def synced(self, shard: int) -> bool:
        """Every running replica of ``shard`` has all its primary wrote so far."""
        primary = self.primary_of(shard)
        if primary is None:
            return False
        want = _field(info(primary.port, "replication"), b"master_repl_offset")
        return all(_field(info(r.port, "replication"), b"slave_repl_offset") == want
                   for r in (self.nodes[shard], *self.replicas[shard])
                   if r is not primary and r.running and role(r.port) == b"slave")

    def stop(self) -> None:
        for node in self.servers:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        for node in self.servers:
            node.__exit__(None, None, None)


def node_id(port: int) -> str:
    """A cluster node's id (``CLUSTER MYID``)."""
    reply = _command(port, "CLUSTER", "MYID", timeout_s=1.0)
    return reply.split(b"\r\n")[1].decode()


def info(port: int, section: str, timeout_s: float = 1.0) -> bytes:
    """``INFO section``, whole (it can be longer than one read)."""
    payload = f"*2\r\n$4\r\nINFO\r\n${len(section)}\r\n{section}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(payload)
        data = sock.recv(65536)
        header, _, body = data.partition(b"\r\n")
        size = int(header[1:])
        while len(body) < size + 2:
            more = sock.recv(65536)
            if not more:
                break
            body += more
        return body[:size]


def role(port: int) -> bytes | None:
    """``master`` or ``slave`` (INFO replication), None from a server that does not answer
    (hung)."""
    try:
        return _field(info(port, "replication", timeout_s=0.5), b"role")
    except OSError:
        return None


def _field(text: bytes, name: bytes) -> bytes | None:
    for line in text.splitlines():
        if line.startswith(name + b":"):
            return line.split(b":", 1)[1].strip()
    return None


def _expect_ok(reply: bytes) -> None:
    if not reply.startswith(b"+OK"):
        raise RuntimeError(f"redis cluster setup failed: {reply!r}")
