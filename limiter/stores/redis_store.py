"""Shared limits on Redis: one atomic Lua round trip per admission; releases coalesced.

The decisions are the in-memory :class:`~limiter.decision.TenantLimiter`'s, exactly: the
scripts (:mod:`limiter.redis_scripts`) re-do its integer math and return raw numbers, and
Python builds every ``Admit``/``Reject``/``Remaining`` with the same functions as the memory
store (:mod:`limiter.outcome`). The policy travels in ARGV on every call, so a config change
needs no migration; it is applied at the first call that carries it, as in memory.

Time: with ``clock=None`` the scripts read Redis ``TIME`` (one clock for every replica, no
skew); with a clock (tests) its epoch ms are passed in, so both stores can be driven by the
same fake clock. Key TTLs are always real Redis time; ``TTL_SLACK_MS`` covers the gap.

Errors: every Redis or socket failure surfaces as :class:`~limiter.stores.StoreUnavailable`.
Build the client with short ``socket_timeout``/``socket_connect_timeout`` and no retries of
its own (redis-py's default retries ten times with backoff), or a dead Redis stalls
admissions. This store retries a call once itself, on a fresh connection, when its
connection turns out dead (a restarted Redis leaves every pooled connection dead): safe,
because every script is idempotent per lease id (an ``admit`` resent finds its own lease).

CPU: on a standalone Redis the calls go through :class:`~limiter.stores.redis_pipe.RedisPipe`
(one pipelined connection, commands packed with each tenant's keys packed once, replies
parsed in C) rather than redis-py's pool; a cluster, TLS or a unix socket use redis-py. The
releases of one tenant go to Redis together, in one script call, which rides with the pipe's
next write (see :meth:`RedisStore.queue_release`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from limiter.calendar import Period
from limiter.decision import TenantPolicy, never_fits
from limiter.outcome import Admit, Cost, Reject, Snapshot, quota_reject, wait_reject
from limiter.rates import require_int
from limiter.stores.base import LeasesLost, StoreUnavailable
from limiter.stores.redis_codec import MAX_COUNT, policy_arg, small, snapshot, text, waits
from limiter.stores.redis_pipe import FAILURES, Scripts, ignore_failure
from limiter.stores.redis_scripts import SCRIPTS
from limiter.stores.slots import SlotMap, parse_nodes

TTL_SLACK_MS = 60_000
"""How long a key outlives the moment it would be back to its default state: covers the
ms between reading TIME and setting the TTL, and fake clocks (tests) running slower than
Redis's own clock."""

_KEY_SUFFIXES = (
    "tb:req", "tb:tok", "win", "win:meta", "leases", "leases:meta", "q:day", "q:month",
    "cancelled", "herd", "shape", "gone", "gone:meta",
)
_PERIOD_CODES = {"d": Period.DAY, "m": Period.MONTH}
RELEASE_BATCH = 256
SENT_MARK = "s"  # in a batch of releases: this lease was dispatched, not released (mark_sent)
"""Most releases sent in one script call."""
SLOT_MAP_TRIES = 3
"""Cluster nodes asked at most, one after the other, for one slot map (see ``slot_map``)."""


_Release = tuple[str, int | str, asyncio.Future[Any]]
"""A queued release: lease id, tokens used (``""`` unknown, ``"n"`` never served), its
future."""


def _settle(batch: list[_Release], replies: Any) -> None:
    """One reply per release, in order (anything else fails them all: never left waiting)."""
    if not isinstance(replies, list) or len(replies) != len(batch):
        _fail(batch, StoreUnavailable(f"redis release answered {replies!r:.200}"))
        return
    for (_lease, _used, future), reply in zip(batch, replies, strict=True):
        if not future.done():
            future.set_result(reply)


def _fail(batch: list[_Release], error: BaseException) -> None:
    for _lease, _used, future in batch:
        if not future.done():
            future.set_exception(error)


def _tenant_tag(prefix: str, tenant: str) -> str:
    """``{prefix:tenant}`` with braces escaped, so a tenant name cannot break the hash tag."""
    safe = tenant.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{{{prefix}:{safe}}}"


class RedisStore:
    """A :class:`~limiter.stores.LimiterStore` whose state lives in Redis, shared by replicas.

    Every key of a tenant shares the hash tag ``{prefix:tenant}`` (Redis Cluster safe) and
    has a TTL, so idle tenants leave nothing behind; a lease not released or renewed within
    ``lease_ttl_ms`` frees its concurrency slot (a crashed replica leaks nothing for long).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = "kvgate",
        lease_ttl_ms: int = 60_000,
        clock: Callable[[], int] | None = None,
        ttl_slack_ms: int = TTL_SLACK_MS,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._lease_ttl_ms = require_int("lease_ttl_ms", lease_ttl_ms, 1)
        self._clock = clock
        self._slack_ms = require_int("ttl_slack_ms", ttl_slack_ms, 0)
        # EVALSHA, reloading a script on NOSCRIPT (restart, SCRIPT FLUSH)
        self._scripts = Scripts(client, SCRIPTS)
        self._on_lost: Callable[[], None] = lambda: None  # see on_connection_lost
        # a Redis Cluster client's node lookup (None for a single Redis: one failure domain)
        self._node_of = getattr(client, "get_node_from_key", None)
        self._asked: str | None = None  # the node whose slot map came last (asked first)
        self._shunned: str | None = None  # the node that failed to answer last (asked last)
        self._keys: dict[str, tuple[str, ...]] = {}  # tenant → its keys
        # release calls under way (a task, or a call riding the pipe) → the tenant's
        self._calls: dict[asyncio.Future[Any], str] = {}
        # (tenant, policy) → releases waiting for their call (see queue_release)
        self._releases: dict[tuple[str, TenantPolicy], list[_Release]] = {}

    def on_connection_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a connection to Redis turns out dead: Redis may have
        restarted, empty. The pipe tells at once, with no call waiting (a call would then
        reconnect without an error); redis-py's pooled connections, at the next call."""
        self._on_lost = callback
        if self._scripts.pipe is not None:
            self._scripts.pipe.on_lost = callback

    def keys(self, tenant: str) -> list[str]:
        """The tenant's keys in the scripts' KEYS order (e.g. ``kvgate:{kvgate:acme}:tb:req``)."""
        base = f"{self._prefix}:{_tenant_tag(self._prefix, tenant)}"
        return [f"{base}:{suffix}" for suffix in _KEY_SUFFIXES]

    def domain(self, tenant: str) -> str:
        """The cluster node serving the tenant's slot ("" without a cluster, or while the
        client has not read the slot table yet)."""
        if self._node_of is None:
            return ""
        try:
            node = self._node_of(self._tenant_keys(tenant)[0])
        except Exception:  # no slot table yet (or a slot not covered)
            return ""
        return "" if node is None else str(node.name)

    @property
    def cluster(self) -> bool:
        """Whether the client is a Redis Cluster's (tenants spread over its shards)."""
        return self._node_of is not None

    def slot(self, tenant: str) -> int:
        """The hash slot of the tenant's keys (one hash tag: one slot)."""
        return key_slot(self._tenant_keys(tenant)[0].encode())

    async def slot_map(self) -> SlotMap | None:
        """Which node serves each slot as primary, as one node of the cluster sees it now
        (one ``CLUSTER NODES`` call); None without a cluster. The node that answered last
        time is asked first (one node per process, a random one among the primaries the
        client knows), then others, and one that failed last, last: a node down or hung
        does not stop the watch."""
        if self._node_of is None:
            return None
        client: Any = self._client  # (a RedisCluster)
        nodes = list(client.get_primaries())
        random.shuffle(nodes)
        nodes.sort(key=lambda node: (node.name != self._asked, node.name == self._shunned))
        failure: BaseException = StoreUnavailable("no cluster node known yet")
        for node in nodes[:SLOT_MAP_TRIES]:
            self._asked, self._shunned = None, node.name  # (stays so if cut short)
            try:
                reply = await client.execute_command("CLUSTER", "NODES", target_nodes=node)
            except FAILURES as exc:
                failure = exc
                continue
            self._asked, self._shunned = node.name, None
            return parse_nodes(reply)
        raise StoreUnavailable(f"redis CLUSTER NODES failed: {failure}") from failure

    async def reread_slots(self) -> None:
        """Make the cluster client read the slot table now (a failover was seen): its own
        refresh, after a call failed, comes at most once a second, and may have just read
        the table from before the promotion."""
        manager = getattr(self._client, "nodes_manager", None)
        if manager is not None:
            try:
                await manager.initialize()
            except FAILURES as exc:
                raise StoreUnavailable(f"redis slot table refresh failed: {exc}") from exc

    def _head(self) -> list[int | str | bytes]:
        now: int | str = "" if self._clock is None else self._clock()
        return [now, self._lease_ttl_ms, self._slack_ms]

    def _tenant_keys(self, tenant: str) -> tuple[str, ...]:
        keys = self._keys.get(tenant)
        if keys is None:
            if len(self._keys) >= 65_536:  # tenant names come from config: a bound anyway
                self._keys.clear()
            keys = self._keys[tenant] = tuple(self.keys(tenant))
        return keys

    @property
    def times_its_calls(self) -> bool:
        """Whether every call fails by itself when Redis does not answer in time (through
        the pipe: see :meth:`Scripts.run`); else the caller bounds it (``FailoverStore``)."""
        return self._scripts.timed

    async def _run(
        self, name: str, tenant: str, args: Sequence[int | str | bytes], resent: bool = False,
    ) -> Any:
        """Run a script; on a dead connection, once more on a fresh one (``resent``: with a
        last argument 1 added, which tells the script so), after dropping the idle pooled
        connections: they died with it."""
        run, keys = self._scripts.run, self._tenant_keys(tenant)
        try:
            try:
                return await run(name, keys, args)
            except RedisConnectionError:  # (the pipe reconnects by itself)
                self._on_lost()
                pool = getattr(self._client, "connection_pool", None)  # a cluster has many
                if pool is not None:
                    await pool.disconnect(inuse_connections=False)
                return await run(name, keys, [*args, 1] if resent else args)
        except FAILURES as exc:
            raise StoreUnavailable(f"redis {name} failed: {exc}") from exc

    async def _run_policy(
        self, name: str, tenant: str, policy: TenantPolicy, extra: Sequence[int | str | bytes] = ()
    ) -> tuple[str, Snapshot, list[Any]]:
        args = [*self._head(), policy_arg(policy), *extra]
        reply = await self._run(name, tenant, args, resent=True)
        return text(reply[0]), snapshot(reply[1], policy), reply[2:]

    async def check_requests(self, tenant: str, policy: TenantPolicy) -> Reject | None:
        code, snap, extra = await self._run_policy("check", tenant, policy)
        return wait_reject(waits(extra), snap.remaining()) if code == "wait" else None

    async def admit(
        self, tenant: str, policy: TenantPolicy, cost: Cost, lease_id: str, *, held: int = 0,
        unsent: bool = False,
    ) -> Admit | Reject:
        problem = never_fits(policy, cost)
        extra: list[int | str | bytes] = [
            small("tokens", cost.tokens), cost.requests, lease_id, int(problem is not None), held,
            int(unsent),
        ]
        code, snap, rest = await self._run_policy("admit", tenant, policy, extra)
        if code == "dup":
            raise ValueError(f"lease {lease_id!r} is already held")
        if code == "lost":
            raise LeasesLost(f"redis holds fewer than the {held} leases of {tenant!r} held here")
        if code == "cancelled":
            raise StoreUnavailable(f"lease {lease_id!r} was cancelled")
        if code == "static" and problem is not None:
            return Reject(problem[0], None, snap.remaining(), problem[1])
        if code == "quota":
            failing = {_PERIOD_CODES[text(kind)] for kind in rest}
            views = [view for view in snap.quotas if view.period in failing]
            return quota_reject(views, cost.tokens, snap.remaining())
        if code == "wait":
            return wait_reject(waits(rest), snap.remaining())
        return Admit(lease_id, cost, snap.remaining(), int(rest[0]) if rest else 0)

    async def release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> bool:
        return bool(await self.queue_release(tenant, policy, lease_id, used_tokens,
                                             served=served))

    def release_soon(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> None:
        """Unconfirmed: a failure is dropped (``FailoverStore.release_soon`` owes it)."""
        self.queue_release(tenant, policy, lease_id, used_tokens,
                           served=served).add_done_callback(ignore_failure)

    def queue_release(
        self, tenant: str, policy: TenantPolicy, lease_id: str, used_tokens: int | None, *,
        served: bool = True,
    ) -> asyncio.Future[Any]:
        """The release, sent without waiting; the future gets whether Redis held the lease,
        or the call's failure. Coalesced: the releases of a tenant (and policy) go to Redis
        together, in one script call — through the pipe, with its next write (``ride``:
        an admission's, usually), else on the next loop tick and then as the call under way
        returns (at most ``RELEASE_BATCH`` a call). Each lease is still released exactly
        once (the script drops a lease it no longer has), and a failed call fails each of
        its releases (the failover store then owes each one to Redis, as for a single
        call)."""
        used: int | str = ("n" if not served else "" if used_tokens is None
                           else min(max(0, used_tokens), MAX_COUNT))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        key = (tenant, policy)
        waiting = self._releases.get(key)
        if waiting is None:
            waiting = self._releases[key] = []
            if not self._scripts.ride(lambda: self._board(key, waiting)):
                self._spawn(tenant, self._send_releases(key, waiting))
        waiting.append((lease_id, used, future))
        return future

    def _spawn(self, tenant: str, sending: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(sending)
        self._calls[task] = tenant
        task.add_done_callback(self._calls.pop)

    def _release_args(self, policy: TenantPolicy, batch: list[_Release]) -> list[int | str | bytes]:
        args: list[int | str | bytes] = [*self._head(), policy_arg(policy), ""]
        for lease_id, used, _future in batch:
            args += [lease_id, used]
        return args

    def _board(self, key: tuple[str, TenantPolicy], waiting: list[_Release]) -> None:
        """Send ``key``'s waiting releases with the pipe's write under way (later ones make
        a new batch); any the pipe cannot take go the way that reconnects."""
        tenant, policy = key
        if self._releases.get(key) is waiting:
            del self._releases[key]
        while waiting:
            batch = waiting[:RELEASE_BATCH]
            del waiting[:RELEASE_BATCH]
            sent = self._scripts.post("release", self._tenant_keys(tenant),
                                      self._release_args(policy, batch))
            if sent is None:
                self._spawn(tenant, self._send_batch(tenant, policy, batch))
                continue
            self._calls[sent] = tenant
            sent.add_done_callback(lambda done, batch=batch: self._answered(key, batch, done))

    def _answered(self, key: tuple[str, TenantPolicy], batch: list[_Release],
                  done: asyncio.Future[Any]) -> None:
        """A boarded batch's answer; sent again the way that reconnects (or loads the
        script) when the connection died or Redis lost the script."""
        self._calls.pop(done, None)
        error = (StoreUnavailable("redis release was cancelled") if done.cancelled()
                 else done.exception())
        if error is None:
            _settle(batch, done.result())
        elif isinstance(error, RedisConnectionError) or (
                isinstance(error, ResponseError) and str(error).startswith("NOSCRIPT")):
            self._spawn(key[0], self._send_batch(key[0], key[1], batch))
        else:
            _fail(batch, StoreUnavailable(f"redis release failed: {error}")
                  if isinstance(error, FAILURES) else error)

    async def _send_batch(self, tenant: str, policy: TenantPolicy, batch: list[_Release]
                          ) -> None:
        try:
            replies = await self._run("release", tenant, self._release_args(policy, batch))
        except BaseException as exc:
            _fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        _settle(batch, replies)

    async def _send_releases(self, key: tuple[str, TenantPolicy], waiting: list[_Release]
                             ) -> None:
        """Without the pipe: ``key``'s waiting releases, batch after batch, until none is
        left."""
        tenant, policy = key
        try:
            while waiting:
                batch = waiting[:RELEASE_BATCH]
                del waiting[:RELEASE_BATCH]
                await self._send_batch(tenant, policy, batch)
        finally:
            if self._releases.get(key) is waiting:
                del self._releases[key]
            _fail(waiting, StoreUnavailable("redis release was cancelled"))  # never sent

    def mark_sent(self, tenant: str, lease_id: str) -> None:
        """Tell Redis an ``unsent`` admission was dispatched (its expiry then keeps its quota
        charge): in the tenant's batch of releases when one waits for the next write (a
        request leaves the queue as another's release frees its room, so the mark usually
        costs no call of its own), else through the pipe behind the admission, else in a
        task of its own; a failure is dropped (the lease is released as usual; only if its
        holder then died would its quota charge be given back)."""
        for (name, _policy), waiting in self._releases.items():
            if name == tenant:  # a release of the tenant's waits for the next write: ride it
                marked: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                marked.add_done_callback(ignore_failure)
                waiting.append((lease_id, SENT_MARK, marked))
                return
        args = [*self._head(), lease_id]
        sent = self._scripts.send("sent", self._tenant_keys(tenant), args)
        if sent is not None:
            sent.add_done_callback(ignore_failure)
            return
        self._spawn(tenant, self._mark_sent(tenant, args))

    async def _mark_sent(self, tenant: str, args: list[int | str | bytes]) -> None:
        with contextlib.suppress(StoreUnavailable):  # (see mark_sent)
            await self._run("sent", tenant, args)

    async def charge_usage(self, tenant: str, policy: TenantPolicy, usage_id: str,
                           used_tokens: int) -> None:
        """Charge ``used_tokens`` to the tenant's quotas for an admission Redis never saw
        (served while it was unreachable): once per ``usage_id``, however often it is sent
        within an hour (the lease TTL would be too short: the answer to an applied charge
        lost, and Redis unreachable again past it, and the resend counted twice)."""
        used = min(max(0, used_tokens), MAX_COUNT)
        await self._run("release", tenant, [*self._head(), policy_arg(policy), "u", usage_id,
                                            used])

    async def cancel(self, tenant: str, policy: TenantPolicy, lease_id: str) -> None:
        args = [*self._head(), policy_arg(policy), "c", lease_id, 0]
        await self._run("release", tenant, args)

    async def renew(self, tenant: str, lease_ids: list[str], *, reassert: bool = False) -> None:
        if lease_ids:
            await self._run("renew", tenant, [*self._head(), int(reassert), *lease_ids])

    async def in_flight(self, tenant: str) -> int:
        return int(await self._run("in_flight", tenant, self._head()))

    async def usage(self, tenant: str, policy: TenantPolicy) -> dict[str, Any]:
        return (await self._run_policy("usage", tenant, policy))[1].usage()

    def forget(self, tenants: Iterable[str]) -> list[str]:
        """Drop the key names kept for ``tenants`` (but one whose releases are still on their
        way: asked again later); their keys in Redis expire by themselves."""
        sending = {tenant for tenant, _policy in self._releases} | set(self._calls.values())
        forgotten = [tenant for tenant in tenants if tenant not in sending]
        for tenant in forgotten:
            self._keys.pop(tenant, None)
            self._scripts.forget(tuple(self.keys(tenant)))
        return forgotten

    async def settle_releases(self) -> None:
        """Wait until every release queued so far has its answer (or its failure)."""
        while True:
            self._scripts.hurry()
            if self._calls:
                await asyncio.gather(*self._calls, return_exceptions=True)
            elif self._releases:  # (riding on a connection being replaced)
                await asyncio.sleep(0)
            else:
                return

    async def close(self) -> None:
        """Close the client this store was given (the store owns it from then on), once
        the release calls under way have their answers."""
        await self.settle_releases()
        await self._scripts.close()
        try:
            await self._client.aclose()
        except FAILURES as exc:
            raise StoreUnavailable(f"redis close failed: {exc}") from exc
