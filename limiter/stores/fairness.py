"""Fair-queue counters shared by every replica, in Redis: ``RedisFairness``.

The counting rules are the pure core's (:mod:`limiter.fairness`); Lua re-does its integer
math, so every replica serves a pool's tenants in one global weighted order. ``choose`` and
``activate`` are one atomic Lua round trip each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from limiter.fairness import REBASE_AT, SCALE, charge_of, check_rebase
from limiter.fairqueue import QueuedRequest
from limiter.rates import require_int
from limiter.stores.base import StoreUnavailable

if TYPE_CHECKING:
    import redis.asyncio as aioredis


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
    :mod:`limiter.stores.redis_store`); every Redis or socket error is raised as
    :class:`~limiter.stores.base.StoreUnavailable`. With ``owns_client`` (the default, as for
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
        self._rebase_at = check_rebase(rebase_at)
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
