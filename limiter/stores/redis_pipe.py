"""One pipelined connection to a standalone Redis, for the store's hot calls.

redis-py spends most of a call's CPU outside Redis: a pooled connection checked out and back,
every argument encoded one by one, one socket write and one read per command. The request
path needs none of that: its commands are ``EVALSHA`` with a tenant's fixed keys, so the
store packs them itself (the keys once per tenant, see ``redis_store``) and this pipe writes
every command packed during one event-loop tick in one ``write``, and parses the replies in
C (``hiredis``), matching them to their callers in order. Concurrent requests share the one
connection, so no pool is needed.

Failures are redis-py's exceptions, so the store handles both paths alike: a lost
connection fails every call waiting on it with ``ConnectionError`` (the next call
reconnects); a call with no answer within ``timeout_s`` raises ``TimeoutError`` and leaves
the connection open (a paused Redis answers later, in order, and the late reply is dropped)
— until Redis has answered nothing for :data:`SILENT_DROP_S`: then it is dropped.
Only a plain TCP connection is handled (host, port, db, username/password): the store uses
redis-py's own client for anything else (TLS, unix sockets, Redis Cluster).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter.stores.redis_codec import bulk, pack, packed_keys, script_command

try:
    import hiredis
except ImportError:  # (a dependency: redis[hiredis]) without it, redis-py does every call
    hiredis = None


RIDE_LINGER_S = 0.005
"""How long a call sent to ride (:meth:`RedisPipe.ride`: a release) waits at most for another
call's write to go with. Under load an admission writes well within it, so a release costs
no write and no wake-up of its own — the benchmark's releases took 0.55 round trips a request
of their own before; at low rates a release reaches Redis this much later, which other
replicas see as a lease held as much longer."""

SILENT_DROP_S = 5.0
"""A connection on which Redis has answered nothing since a command's deadline passed, this
long, is dropped (its calls fail as timed out; the next call opens a new one). Kept open,
every call made meanwhile stayed in ``waiting`` with its exception and traceback, and its
bytes in the write buffer: a Redis paused (or a network blackholed) with the failover
store's repair loop retrying every 50 ms grew an idle kvgate by ~25 MB a minute."""

FAILURES: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
"""What a call to Redis raises when Redis cannot answer it, for the stores to turn into
:class:`~limiter.stores.StoreUnavailable`. redis-py's cluster client raises some that are
no ``RedisError``: ``RedisClusterUnreachableError`` (no node answers: the node ``url`` names
is down when the process starts, or every node is gone) and ``SlotNotCoveredError``."""


async def eval_script(client: Any, sha: bytes, source: bytes, keys: Sequence[str],
                      args: Sequence[int | str | bytes]) -> Any:
    """Run a script through redis-py's ``client``: ``EVALSHA``, and ``EVAL`` (which loads
    it) on ``NOSCRIPT`` — both routed by the keys, so to the one node that holds them.

    Not redis-py's script objects: on ``NOSCRIPT`` they send ``SCRIPT LOAD``, which a
    cluster client sends to *every* primary, so one node down or hung failed (or timed
    out) a call to a healthy node that merely lacked the script: a replica just promoted
    (Redis does not replicate scripts), a restarted node, a new process's first calls."""
    try:
        return await client.evalsha(sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(source, len(keys), *keys, *args)


def _noscript(error: ResponseError) -> bool:
    """Redis does not have the script (restarted, ``SCRIPT FLUSH``, a promoted replica)."""
    return str(error).startswith("NOSCRIPT")


def ignore_failure(done: asyncio.Future[Any]) -> None:
    """A reply nobody waits for: its error, if any, is dropped (no "never retrieved")."""
    if not done.cancelled():
        done.exception()


def _expire(futures: list[asyncio.Future[Any]]) -> bool:
    """The timeout of one write's commands: those still without a reply fail (their late
    replies are dropped when they come). Whether any did."""
    expired = False
    for future in futures:
        if not future.done():
            future.set_exception(RedisTimeoutError("redis did not answer in time"))
            expired = True
    return expired


class _Protocol(asyncio.Protocol):
    """Replies in order to the futures of the commands written, one per command."""

    def __init__(self, timeout_s: float | None = None,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()  # (made by ``create_connection``, on the loop)
        self.on_lost = on_lost  # Redis ended the connection (not this side)
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.timeout_s = timeout_s
        self.out: list[bytes] = []  # packed this tick, written at its end
        self.out_futures: list[asyncio.Future[Any]] = []  # their replies
        self.flush_scheduled = False
        # each write's deadline and its commands' futures, oldest first, under one timer
        # (set for the oldest): not a timer per write
        self.deadlines: deque[tuple[float, list[asyncio.Future[Any]]]] = deque()
        self.timer: asyncio.TimerHandle | None = None
        # when a command first went unanswered past its deadline, with no reply since
        self.silent_since: float | None = None
        # packers of the calls riding with the next write (see ``ride``), and their timer
        self.riders: list[Callable[[], None]] = []
        self.linger: asyncio.TimerHandle | None = None

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Queue ``command`` for this tick's write; the future gets its reply."""
        future = self.loop.create_future()
        self.waiting.append(future)
        self.out.append(command)
        self.out_futures.append(future)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)
        return future

    def ride(self, packer: Callable[[], None]) -> None:
        """Call ``packer`` just before the next write: the next tick that sends anything,
        or :data:`RIDE_LINGER_S` from now at the latest. What it sends goes in that write,
        ahead of the tick's own commands (a release is in Redis before the admission that
        follows it)."""
        self.riders.append(packer)
        if self.linger is None and not self.flush_scheduled:
            self.linger = self.loop.call_later(RIDE_LINGER_S, self.flush)

    def flush(self) -> None:
        """Write the tick's commands, due to be answered within ``timeout_s``."""
        self.flush_scheduled = False
        if self.riders:
            self._board()
        out, self.out = self.out, []
        futures, self.out_futures = self.out_futures, []
        if self.transport is None or not out:  # (lost since: its calls have failed)
            return
        self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self.timeout_s is not None:
            self.deadlines.append((self.loop.time() + self.timeout_s, futures))
            if self.timer is None:
                self.timer = self.loop.call_at(self.deadlines[0][0], self._expire_due)

    def _board(self) -> None:
        """Let the riders send, ahead of this tick's commands (whose futures are the last
        in ``waiting``: each reply goes to the future of the command written in its place)."""
        riders, self.riders = self.riders, []
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        if self.transport is None:  # lost: each sends on the next connection, or fails
            for packer in riders:
                packer()
            return
        tick, futures = self.out, self.out_futures
        self.out, self.out_futures = [], []
        for _ in futures:
            self.waiting.pop()
        self.flush_scheduled = True  # what a rider sends joins this write
        try:
            for packer in riders:
                packer()
        finally:
            self.flush_scheduled = False
            self.out += tick
            self.out_futures += futures
            self.waiting.extend(futures)

    def _expire_due(self) -> None:
        """Fail the commands whose deadline has passed without a reply; wait for the next."""
        self.timer = None
        deadlines, now = self.deadlines, self.loop.time()
        while deadlines and deadlines[0][0] <= now:
            if _expire(deadlines.popleft()[1]) and self.silent_since is None:
                self.silent_since = now
        if self.silent_since is not None and now - self.silent_since >= SILENT_DROP_S:
            deadlines.clear()
            self._fail(RedisTimeoutError(
                f"redis answered nothing for {now - self.silent_since:.1f} s: connection dropped"))
            return
        if deadlines:
            self.timer = self.loop.call_at(deadlines[0][0], self._expire_due)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        reader, waiting = self.reader, self.waiting
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RedisConnectionError(f"redis sent garbage: {exc}"))
                return
            if reply is False:
                return
            self.silent_since = None
            if not waiting:  # a reply to nothing: the stream is out of step
                self._fail(RedisConnectionError("redis sent a reply nobody asked for"))
                return
            future = waiting.popleft()
            if future.done():  # its caller gave up (timeout, cancellation)
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(ResponseError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        ended_by_redis = self.transport is not None  # (``_fail`` clears it: ours)
        self.transport = None
        self._fail(RedisConnectionError(f"redis connection lost: {exc or 'closed by server'}"))
        if ended_by_redis and self.on_lost is not None:
            self.on_lost()

    def _fail(self, error: BaseException) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.riders:  # (on the next connection, or failed: none waits for a dead one)
            self._board()


class RedisPipe:
    """A lazily opened pipelined connection; :meth:`call` sends one packed command."""

    def __init__(
        self, host: str, port: int, *, db: int = 0, username: str | None = None,
        password: str | None = None, timeout_s: float | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self._address = (host, port)
        self._setup: list[bytes] = []  # sent first on every new connection
        if password is not None:
            auth = (username.encode(), password.encode()) if username else (password.encode(),)
            self._setup.append(pack(b"AUTH", *auth))
        if db:
            self._setup.append(pack(b"SELECT", str(db).encode()))
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        # called when Redis ends an open connection (a restart ends every one), also with
        # no call waiting on it: the next call reconnects without an error, so nothing
        # else would tell its owner that Redis may have lost what it held
        self.on_lost: Callable[[], None] | None = None

    @classmethod
    def from_client(cls, client: Any) -> RedisPipe | None:
        """A pipe to where redis-py's standalone ``client`` connects, or None when it
        connects some other way (TLS, a unix socket, a cluster, a custom class)."""
        from redis.asyncio.connection import Connection

        pool = getattr(client, "connection_pool", None)
        if hiredis is None or pool is None or pool.connection_class is not Connection:
            return None
        kw = pool.connection_kwargs
        if kw.get("credential_provider") is not None or kw.get("protocol") not in (None, 2, "2"):
            return None
        return cls(kw.get("host", "localhost"), int(kw.get("port", 6379)), db=int(kw.get("db", 0)),
                   username=kw.get("username"), password=kw.get("password"),
                   timeout_s=kw.get("socket_timeout"),
                   connect_timeout_s=kw.get("socket_connect_timeout"))

    @property
    def timeout_s(self) -> float | None:
        """How long a call waits for its reply before it fails with ``TimeoutError``."""
        return self._timeout_s

    async def call(self, command: bytes) -> Any:
        """Send one packed command (written with the rest of this tick's) and wait for its
        reply; a Redis error reply is raised as ``ResponseError``, no reply within the
        timeout as redis-py's ``TimeoutError``."""
        protocol = self._protocol
        if protocol is None or protocol.transport is None:
            protocol = await self._connect()
        return await protocol.send(command)

    def send(self, command: bytes) -> asyncio.Future[Any] | None:
        """Queue one packed command now, behind every command sent before it, without
        waiting for its reply; None when there is no open connection (then use
        :meth:`call`)."""
        protocol = self._protocol
        if protocol is None or protocol.transport is None:
            return None
        return protocol.send(command)

    def ride(self, packer: Callable[[], None]) -> bool:
        """Have ``packer`` send its calls (with :meth:`send`) with the open connection's
        next write (:meth:`_Protocol.ride`); False when there is none (then it is not
        called)."""
        protocol = self._protocol
        if protocol is None or protocol.transport is None:
            return False
        protocol.ride(packer)
        return True

    def hurry(self) -> None:
        """Write the riding calls now (at a shutdown, not to wait out the linger)."""
        protocol = self._protocol
        if protocol is not None and protocol.riders and not protocol.flush_scheduled:
            protocol.flush()

    async def _connect(self) -> _Protocol:
        """Open the connection (one attempt shared by every caller that needs it)."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._opened)
        return await asyncio.shield(self._connecting)

    def _opened(self, attempt: asyncio.Future[_Protocol]) -> None:
        """The attempt is over (even if every caller gave up on it): the next call that
        finds no connection makes a new one."""
        if self._connecting is attempt:
            self._connecting = None
        if not attempt.cancelled():
            attempt.exception()  # retrieved: no "never retrieved" warning

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                transport, protocol = await loop.create_connection(
                    lambda: _Protocol(self._timeout_s, self._lost), *self._address)
                try:
                    await asyncio.gather(*(protocol.send(command) for command in self._setup))
                except BaseException:
                    transport.close()
                    raise
        except TimeoutError:
            raise RedisTimeoutError(f"connecting to redis at {self._address} timed out") from None
        except OSError as exc:
            raise RedisConnectionError(f"connecting to redis at {self._address}: {exc}") from exc
        self._protocol = protocol
        return protocol

    def _lost(self) -> None:
        if self.on_lost is not None:
            self.on_lost()

    def drop(self) -> None:
        """Close the connection (the next call opens a new one)."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol._fail(RedisConnectionError("redis connection dropped"))

    async def close(self) -> None:
        self.drop()


class Scripts:
    """Lua scripts by name, run with ``EVALSHA`` (``EVAL`` on ``NOSCRIPT``, which loads the
    script again) through a :class:`RedisPipe` when the client allows one, else through
    redis-py's client (:func:`eval_script`)."""

    def __init__(self, client: Any, sources: Mapping[str, str]) -> None:
        self.pipe = RedisPipe.from_client(client)
        self._client = client
        self._sources = {name: src.encode() for name, src in sources.items()}
        self._shas = {name: hashlib.sha1(src).hexdigest().encode()
                      for name, src in self._sources.items()}
        # each command's start, RESP-encoded once: (EVALSHA sha, EVAL source)
        self._commands = {name: (b"$7\r\nEVALSHA\r\n" + bulk(self._shas[name]),
                                 b"$4\r\nEVAL\r\n" + bulk(src))
                          for name, src in self._sources.items()}
        self._packed_keys: dict[tuple[str, ...], bytes] = {}

    @property
    def timed(self) -> bool:
        """Whether :meth:`run` ends within the pipe's timeout (or twice it, see there) on
        its own, so that a caller needs no timer of its own: an ``asyncio.timeout`` costs
        more CPU than the call it bounds."""
        return self.pipe is not None and self.pipe.timeout_s is not None

    async def run(self, name: str, keys: tuple[str, ...], args: Sequence[int | str | bytes]) -> Any:
        """The script's reply. Through the pipe, the common case (connected, the script
        loaded) is one command that the pipe's timer fails with ``TimeoutError`` when
        Redis does not answer; connecting first, or loading the script again after
        ``NOSCRIPT``, runs within a timeout of its own (after a quick ``NOSCRIPT``, so
        within twice the pipe's timeout in all)."""
        pipe = self.pipe
        if pipe is None:
            return await eval_script(self._client, self._shas[name], self._sources[name],
                                     keys, args)
        loaded = True
        sent = pipe.send(self._pack(name, keys, args, sha=True))
        if sent is not None:
            try:
                return await sent
            except ResponseError as exc:
                if not _noscript(exc):
                    raise
            loaded = False
        async with asyncio.timeout(pipe.timeout_s):
            if loaded:
                try:
                    return await pipe.call(self._pack(name, keys, args, sha=True))
                except ResponseError as exc:
                    if not _noscript(exc):
                        raise
            return await pipe.call(self._pack(name, keys, args, sha=False))

    def send(self, name: str, keys: tuple[str, ...], args: Sequence[int | str | bytes]
             ) -> asyncio.Future[Any] | None:
        """Queue a call without waiting (:meth:`RedisPipe.send`): it runs in Redis after
        every call sent before it. None without an open pipe. A NOSCRIPT answer resends it
        with ``EVAL`` (then after whatever was sent meanwhile)."""
        pipe = self.pipe
        sent = None if pipe is None else pipe.send(self._pack(name, keys, args, sha=True))
        if sent is not None:
            sent.add_done_callback(lambda done: self._sent(done, name, keys, args))
        return sent

    def ride(self, packer: Callable[[], None]) -> bool:
        """:meth:`RedisPipe.ride`; False without a pipe."""
        return self.pipe is not None and self.pipe.ride(packer)

    def hurry(self) -> None:
        if self.pipe is not None:
            self.pipe.hurry()

    def post(self, name: str, keys: tuple[str, ...], args: Sequence[int | str | bytes]
             ) -> asyncio.Future[Any] | None:
        """``EVALSHA`` queued without waiting (:meth:`RedisPipe.send`) and nothing else: the
        caller handles ``NOSCRIPT`` and a lost connection. None without an open pipe."""
        pipe = self.pipe
        return None if pipe is None else pipe.send(self._pack(name, keys, args, sha=True))

    def _sent(self, done: asyncio.Future[Any], name: str, keys: tuple[str, ...],
              args: Sequence[int | str | bytes]) -> None:
        error = None if done.cancelled() else done.exception()
        if isinstance(error, ResponseError) and _noscript(error) and self.pipe is not None:
            again = self.pipe.send(self._pack(name, keys, args, sha=False))
            if again is not None:
                again.add_done_callback(ignore_failure)

    def _pack(self, name: str, keys: tuple[str, ...], args: Sequence[int | str | bytes],
              sha: bool) -> bytes:
        """``EVALSHA sha numkeys keys… args…`` (``EVAL source …``), the keys packed once."""
        packed = self._packed_keys.get(keys)
        if packed is None:
            if len(self._packed_keys) >= 65_536:  # keys name tenants or pools: a bound anyway
                self._packed_keys.clear()
            packed = self._packed_keys[keys] = packed_keys(keys)
        return script_command(self._commands[name][0 if sha else 1], packed, len(keys), args)

    def forget(self, keys: tuple[str, ...]) -> None:
        """Drop the packed form of ``keys`` (a tenant no longer configured)."""
        self._packed_keys.pop(keys, None)

    async def close(self) -> None:
        if self.pipe is not None:
            await self.pipe.close()
