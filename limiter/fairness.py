"""Who goes next among a band's candidates: start-time fair queueing by tokens.

Each tenant has a **virtual counter** (its next start tag). Dispatching a request of ``cost``
tokens advances its tenant's counter by ``cost / weight``; among the candidates the smallest
counter goes next (ties: earliest ``enqueued_ms``, then candidate order). Over any busy
period each backlogged tenant therefore gets tokens in proportion to its weight, within one
request's cost ("busy: share by weight"). The system virtual time ``V`` is the start counter
of the most recently dispatched request. A tenant whose queue goes from empty to non-empty
is **activated**: ``counter = max(counter, V)``, so time spent idle is not banked as credit
("idle: borrow" carries no debt either way). A tenant with no counter at all starts at ``V``.

``V`` is deliberately *not* forced monotone (``max(V, start)``): with several replicas, one
replica dispatching a tenant that is ahead would drag ``V`` up, and every local activation
of a tenant that is globally backlogged but behind would then throw its credit away. In the
two-replica skewed-mix simulation (``tests/test_fairness_redis.py``) the monotone variant
missed the 5:3:1 target by up to 4%, this one by 0.2%.

**Exact integers.** Counters are integers in ``SCALE`` (1000) units per token per unit of
weight: a request's *charge* is ``max(1, round(cost · 1000 / weight))``, computed once in
Python, so the memory and Redis implementations add the same integers and reach the same
decisions (Lua numbers are doubles, exact below 2^53). A charge is at most ``MAX_CHARGE``
(2^40); when ``V`` reaches ``REBASE_AT`` (2^50) every counter and ``V`` are shifted down by
half of it (floored at 0), which changes no comparison between active tenants, so counters
stay exact however long a pool stays busy.

Two implementations of one :class:`Fairness` protocol:

- :class:`MemoryFairness`: in-process; the embedded default and the fallback when Redis
  fails. It also implements the **dynamic** order (``α·wait/SLA + β·progress + γ·tier``,
  :meth:`limiter.fairqueue.FairQueue.dynamic_score`): pass ``score=`` or build it with
  :meth:`MemoryFairness.for_queue`.
- :class:`RedisFairness`: counters and ``V`` in Redis, so every replica serves the pool's
  tenants in **one global weighted order**; ``choose`` and ``activate`` are one atomic Lua
  round trip each. It always uses WFQ counters (a dynamic score depends on each replica's
  local wait times, which a shared order cannot rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from limiter.fairqueue import FairQueue, QueuedRequest
from limiter.rates import require_int
from limiter.store import StoreUnavailable

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = [
    "MAX_CHARGE",
    "REBASE_AT",
    "SCALE",
    "Fairness",
    "MemoryFairness",
    "RedisFairness",
    "charge_of",
]

SCALE = 1000
"""Counter units per token per unit of weight."""
MAX_CHARGE = 2**40
"""The largest charge one request may add (cost · SCALE / weight), to keep Lua exact."""
REBASE_AT = 2**50
"""When ``V`` reaches this, counters and ``V`` shift down by ``REBASE_AT // 2``."""

Score = Callable[[QueuedRequest, int], float]


@runtime_checkable
class Fairness(Protocol):
    """Picks the next request of a band and charges its tenant, atomically.

    Async because the shared implementation does I/O; every method of a shared one may raise
    :class:`~limiter.store.StoreUnavailable` (the caller then falls back to a
    :class:`MemoryFairness`).
    """

    async def activate(self, tenant: str) -> None:
        """``tenant``'s queue went from empty to non-empty (on this replica)."""
        ...

    async def choose(
        self, candidates: list[QueuedRequest], now_ms: int
    ) -> QueuedRequest | None:
        """Pick one of ``candidates`` (None if empty) and charge it, in one step."""
        ...

    async def counters(self) -> dict[str, float]:
        """Tenant → virtual counter in tokens per unit of weight (``/debug/queues``)."""
        ...

    async def close(self) -> None:
        """Release resources (connections)."""
        ...


def charge_of(item: QueuedRequest) -> int:
    """The counter units dispatching ``item`` costs its tenant: ``cost · SCALE / weight``.

    At least 1, so even free requests take turns instead of letting one tenant run forever.
    """
    charge = max(1, round(item.cost * SCALE / item.weight))
    if charge > MAX_CHARGE:
        raise ValueError(
            f"request {item.id!r}: cost/weight {item.cost}/{item.weight} is too large for "
            f"exact virtual counters (at most {MAX_CHARGE // SCALE} tokens per unit weight)"
        )
    return charge


def _pick_wfq(starts: Sequence[int], candidates: Sequence[QueuedRequest]) -> int:
    """WFQ's choice: the smallest start counter, then the earliest enqueued, then first."""
    return min(range(len(candidates)),
               key=lambda i: (starts[i], candidates[i].enqueued_ms, i))


def _check_rebase(rebase_at: int) -> int:
    return require_int("rebase_at", rebase_at, 2 * MAX_CHARGE)


class MemoryFairness:
    """In-process virtual counters (see the module docstring for the rules).

    With ``score`` (the dynamic order), the highest score goes first (ties: WFQ order); the
    chosen tenant is still charged, so counters stay meaningful if the order is switched.
    """

    def __init__(self, *, score: Score | None = None, rebase_at: int = REBASE_AT) -> None:
        self._score = score
        self._rebase_at = _check_rebase(rebase_at)
        self._counters: dict[str, int] = {}
        self._vtime = 0

    @classmethod
    def for_queue(cls, queue: FairQueue) -> MemoryFairness:
        """The selector ``queue.order`` asks for: WFQ, or ``queue.dynamic_score``."""
        return cls(score=queue.dynamic_score if queue.order == "dynamic" else None)

    @property
    def virtual_time(self) -> float:
        """``V`` in tokens per unit of weight."""
        return self._vtime / SCALE

    async def activate(self, tenant: str) -> None:
        self._counters[tenant] = max(self._counters.get(tenant, 0), self._vtime)

    async def choose(
        self, candidates: list[QueuedRequest], now_ms: int
    ) -> QueuedRequest | None:
        return self.choose_now(candidates, now_ms)

    def choose_now(self, candidates: list[QueuedRequest], now_ms: int) -> QueuedRequest | None:
        """:meth:`choose` without the coroutine (simulations, sync callers)."""
        if not candidates:
            return None
        charges = [charge_of(item) for item in candidates]
        starts = [self._counters.get(item.tenant, self._vtime) for item in candidates]
        index = self._pick(starts, candidates, now_ms)
        self._charge(candidates[index].tenant, starts[index], charges[index])
        return candidates[index]

    def _pick(self, starts: list[int], candidates: list[QueuedRequest], now_ms: int) -> int:
        if self._score is None:
            return _pick_wfq(starts, candidates)
        scores = [self._score(item, now_ms) for item in candidates]
        return min(range(len(candidates)),
                   key=lambda i: (-scores[i], starts[i], candidates[i].enqueued_ms, i))

    def _charge(self, tenant: str, start: int, charge: int) -> None:
        self._counters[tenant] = start + charge
        self._vtime = start
        if self._vtime >= self._rebase_at:
            shift = self._rebase_at // 2
            self._vtime -= shift
            self._counters = {t: max(0, c - shift) for t, c in self._counters.items()}

    async def counters(self) -> dict[str, float]:
        return {tenant: value / SCALE for tenant, value in self._counters.items()}

    async def close(self) -> None:
        """Nothing to release."""


# --- Redis ----------------------------------------------------------------------------------

_LUA_HEAD = r"""
local KC, KV, KSEEN = KEYS[1], KEYS[2], KEYS[3]
local TTL = tonumber(ARGV[1])
local function str(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local V = tonumber(redis.call('GET', KV) or '0')

-- refresh TTLs; forget tenants unseen for TTL ms (an absent counter reads as V)
local function touch(tenant)
  redis.call('ZADD', KSEEN, str(NOW), tenant)
  local stale = redis.call('ZRANGEBYSCORE', KSEEN, '-inf', str(NOW - TTL), 'LIMIT', 0, 100)
  if #stale > 0 then
    redis.call('ZREM', KSEEN, unpack(stale))
    redis.call('HDEL', KC, unpack(stale))
  end
  redis.call('SET', KV, str(V), 'PX', str(TTL))
  redis.call('PEXPIRE', KSEEN, str(TTL))
  if redis.call('EXISTS', KC) == 1 then redis.call('PEXPIRE', KC, str(TTL)) end
end
"""

# ARGV: [1] ttl ms, [2] tenant. Returns the tenant's counter after activation.
_ACTIVATE = _LUA_HEAD + r"""
local c = tonumber(redis.call('HGET', KC, ARGV[2]) or '0')
if c < V then c = V end
redis.call('HSET', KC, ARGV[2], str(c))
touch(ARGV[2])
return str(c)
"""

# ARGV: [1] ttl ms, [2] rebase_at, then (tenant, charge, enqueued_ms) per candidate.
# Returns {0-based index of the chosen candidate, its start counter}.
_CHOOSE = _LUA_HEAD + r"""
local REBASE = tonumber(ARGV[2])
local n = (#ARGV - 2) / 3
local tenants = {}
for i = 1, n do tenants[i] = ARGV[3 * i] end
local stored = redis.call('HMGET', KC, unpack(tenants))
local best, bs, be
for i = 1, n do
  local s = tonumber(stored[i] or '') or V  -- no counter yet: starts at V
  local e = tonumber(ARGV[3 * i + 2])
  if best == nil or s < bs or (s == bs and e < be) then best, bs, be = i, s, e end
end
redis.call('HSET', KC, tenants[best], str(bs + tonumber(ARGV[3 * best + 1])))
V = bs
if V >= REBASE then
  local shift = math.floor(REBASE / 2)
  V = V - shift
  local all = redis.call('HGETALL', KC)
  for i = 1, #all, 2 do
    redis.call('HSET', KC, all[i], str(math.max(0, tonumber(all[i + 1]) - shift)))
  end
end
touch(tenants[best])
return {best - 1, str(bs)}
"""


def _hash_tag(prefix: str, pool: str) -> str:
    """``{prefix:fair:pool}`` with braces escaped: all of a pool's keys in one cluster slot."""
    safe = pool.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{{{prefix}:fair:{safe}}}"


class RedisFairness:
    """WFQ counters shared by every replica of a pool, in Redis.

    Keys (one hash tag per pool, Redis Cluster safe): ``…:c`` hash tenant → counter,
    ``…:v`` the virtual time, ``…:seen`` zset tenant → last use (ms). Each use refreshes
    every key's TTL (``ttl_ms``); a tenant unused for ``ttl_ms`` is forgotten, which is the
    same as activating it afresh (any debt it still had is forgiven). Times for the TTL come
    from Redis ``TIME``; ``now_ms`` is not needed by WFQ.

    The client should have short timeouts and few retries (see
    :mod:`limiter.redis_store`); every Redis or socket error is raised as
    :class:`~limiter.store.StoreUnavailable`. With ``owns_client`` (the default, as for
    ``RedisStore``) :meth:`close` closes the client; pass False when it is shared.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        pool: str = "default",
        prefix: str = "kvgate",
        ttl_ms: int = 600_000,
        owns_client: bool = True,
        rebase_at: int = REBASE_AT,
    ) -> None:
        from redis.exceptions import RedisError  # lazily: the memory path needs no client

        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError)
        self._client = client
        self._ttl_ms = require_int("ttl_ms", ttl_ms, 1)
        self._rebase_at = _check_rebase(rebase_at)
        self._owns_client = owns_client
        base = f"{prefix}:{_hash_tag(prefix, pool)}"
        self._keys = [f"{base}:c", f"{base}:v", f"{base}:seen"]
        self._activate = client.register_script(_ACTIVATE)
        self._choose = client.register_script(_CHOOSE)

    def keys(self) -> list[str]:
        """The pool's keys: counters hash, virtual time, last-seen zset."""
        return list(self._keys)

    async def _call(self, what: str, script: Any, args: Sequence[int | str]) -> Any:
        try:
            return await script(keys=self._keys, args=args)
        except self._errors as exc:
            raise StoreUnavailable(f"redis fairness {what} failed: {exc}") from exc

    async def activate(self, tenant: str) -> None:
        await self._call("activate", self._activate, [self._ttl_ms, tenant])

    async def choose(
        self, candidates: list[QueuedRequest], now_ms: int
    ) -> QueuedRequest | None:
        if not candidates:
            return None
        args: list[int | str] = [self._ttl_ms, self._rebase_at]
        for item in candidates:
            args += [item.tenant, charge_of(item), item.enqueued_ms]
        reply = await self._call("choose", self._choose, args)
        return candidates[int(reply[0])]

    async def counters(self) -> dict[str, float]:
        try:
            raw = await self._client.hgetall(self._keys[0])
        except self._errors as exc:
            raise StoreUnavailable(f"redis fairness counters failed: {exc}") from exc
        return {_text(tenant): int(value) / SCALE for tenant, value in raw.items()}

    async def virtual_time(self) -> float:
        """``V`` in tokens per unit of weight (0 when the pool has no state)."""
        try:
            raw = await self._client.get(self._keys[1])
        except self._errors as exc:
            raise StoreUnavailable(f"redis fairness virtual_time failed: {exc}") from exc
        return 0.0 if raw is None else int(raw) / SCALE

    async def close(self) -> None:
        if not self._owns_client:
            return
        try:
            await self._client.aclose()
        except self._errors as exc:
            raise StoreUnavailable(f"redis close failed: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
