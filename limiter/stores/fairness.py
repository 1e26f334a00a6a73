"""Fair-queue counters shared by every replica, in Redis: ``RedisFairness``.

The rules are the pure core's (:mod:`limiter.fairness`, :class:`~limiter.fairness.
VirtualCounters`): per tenant a counter over all its work and a band-0 counter over its
interactive work alone; :func:`~limiter.fairness.pick`'s bounded-lag eligibility among the
offers (``V`` = the smallest offered start); charges computed once in Python
(:func:`~limiter.fairness.charge_of`) and added in Lua, which re-does the integer math, so
Redis and memory make the same decisions from the same integers (Lua's doubles are exact
below 2^53; rebasing keeps every value far below that) and every replica serves a pool's
tenants in one global weighted order. ``activate``, ``choose`` and ``correct`` are one atomic
Lua script each; a ``choose`` that says "wait" writes nothing. A ``choose`` among a single
fitting offer has only one answer, so on a standalone Redis (the pipe of
:mod:`limiter.stores.redis_pipe`) its charge is queued without waiting for the reply: the
dispatcher of a queue that holds one tenant's requests makes no round trip. A ``choose``
given a decision id is recorded (the pool's last ``DECISIONS``) so that ``undo`` can take it
back when its answer came too late (the caller dispatched something else meanwhile).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from limiter.fairness import (
    DEFAULT_LAG,
    MAX_CHARGE,
    REBASE_AT,
    SCALE,
    charge_of,
    check_rebase,
    units,
)
from limiter.fairqueue import Offer, QueuedRequest
from limiter.rates import require_int
from limiter.stores.base import Correction, StoreUnavailable

if TYPE_CHECKING:
    import asyncio

    import redis.asyncio as aioredis

DECISIONS = 256
"""Decisions of a pool Redis keeps a record of, for an undo (one comes right after its
choose on the same connection, behind at most what other replicas sent meanwhile)."""

_LUA_HEAD = r"""
local KC, KV, KSEEN, KF = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local KD, KU = KEYS[5], KEYS[6]  -- recent decisions (a list), undone decisions (a hash)
local TTL = tonumber(ARGV[1])
local DECISIONS = """ + str(DECISIONS) + r"""
local function str(x) return string.format('%.0f', x) end
local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local V = tonumber(redis.call('GET', KV) or '0')

-- refresh TTLs; forget tenants unseen for TTL ms (an absent counter reads as V, an absent
-- band-0 counter as "none yet")
local function touch(tenant)
  redis.call('ZADD', KSEEN, str(NOW), tenant)
  local stale = redis.call('ZRANGEBYSCORE', KSEEN, '-inf', str(NOW - TTL), 'LIMIT', 0, 100)
  if #stale > 0 then
    redis.call('ZREM', KSEEN, unpack(stale))
    redis.call('HDEL', KC, unpack(stale))
    redis.call('HDEL', KF, unpack(stale))
  end
  redis.call('SET', KV, str(V), 'PX', str(TTL))
  redis.call('PEXPIRE', KSEEN, str(TTL))
  if redis.call('EXISTS', KC) == 1 then redis.call('PEXPIRE', KC, str(TTL)) end
  if redis.call('EXISTS', KF) == 1 then redis.call('PEXPIRE', KF, str(TTL)) end
  if redis.call('EXISTS', KD) == 1 then redis.call('PEXPIRE', KD, str(TTL)) end
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

# ARGV: [1] ttl ms, [2] rebase_at, [3] lag (counter units), then per offer (tenant, charge,
# enqueued rank, band, fits 0/1), last the decision's id ('': none). Returns the 0-based index
# of the chosen offer, or -1 (wait, or a decision already undone: nothing is written). The
# rule is limiter.fairness.pick, the charge VirtualCounters._charge. A decision with an id is
# recorded (the last DECISIONS of the pool), for _UNDO.
_CHOOSE = _LUA_HEAD + r"""
local REBASE, LAG = tonumber(ARGV[2]), tonumber(ARGV[3])
local D = ARGV[#ARGV]
if D ~= '' and redis.call('HEXISTS', KU, D) == 1 then return -1 end
local n = (#ARGV - 4) / 5
local tenants = {}
for i = 1, n do tenants[i] = ARGV[5 * i - 1] end
local counters = redis.call('HMGET', KC, unpack(tenants))
local firsts = redis.call('HMGET', KF, unpack(tenants))
local starts, m, fitting = {}, nil, {}
for i = 1, n do
  starts[i] = tonumber(counters[i] or '') or V  -- no counter yet: starts at V
  if m == nil or starts[i] < m then m = starts[i] end
  if ARGV[5 * i + 3] == '1' then fitting[tenants[i]] = true end
end
-- floors (limiter.fairness.floors): a lag past each tenant's start; for a tenant none of
-- whose offers fits, its start for batch work and a lag past its finish (start + charge)
-- for band-0 work
local limit, limit0 = nil, nil
for i = 1, n do
  local b, z = starts[i] + LAG, starts[i] + LAG
  if not fitting[tenants[i]] then b, z = starts[i], z + tonumber(ARGV[5 * i]) end
  if limit == nil or b < limit then limit = b end
  if limit0 == nil or z < limit0 then limit0 = z end
end
local best, bb, bs, be
for i = 1, n do
  local o = 5 * i - 1
  if ARGV[o + 4] == '1' then
    local band, s, e = tonumber(ARGV[o + 3]), starts[i], tonumber(ARGV[o + 2])
    local eligible
    if band == 0 then  -- by its band-0 counter; none yet: always
      local f = tonumber(firsts[i] or '')
      eligible = f == nil or f <= limit0
    else
      eligible = s <= limit
    end
    if eligible and (best == nil or band < bb or (band == bb and (s < bs
        or (s == bs and e < be)))) then
      best, bb, bs, be = i, band, s, e
    end
  end
end
if best == nil then return -1 end
local tenant, charge = tenants[best], tonumber(ARGV[5 * best])
redis.call('HSET', KC, tenant, str(bs + charge))
if bb == 0 then
  local low = m - LAG
  local f = tonumber(firsts[best] or '') or low
  if f < low then f = low end
  redis.call('HSET', KF, tenant, str(f + charge))
end
if D ~= '' then
  redis.call('LPUSH', KD, D .. ' ' .. str(charge) .. ' ' .. (bb == 0 and '1' or '0') .. ' '
             .. tenant)
  redis.call('LTRIM', KD, 0, DECISIONS - 1)
end
V = m
if V >= REBASE then
  local shift = math.floor(REBASE / 2)
  V = V - shift
  local all = redis.call('HGETALL', KC)
  for i = 1, #all, 2 do
    redis.call('HSET', KC, all[i], str(math.max(0, tonumber(all[i + 1]) - shift)))
  end
  all = redis.call('HGETALL', KF)
  for i = 1, #all, 2 do
    redis.call('HSET', KF, all[i], str(tonumber(all[i + 1]) - shift))
  end
end
touch(tenant)
return best - 1
"""

# ARGV: [1] ttl ms, [2] lag (counter units), then per correction: tenant, counter units to add
# (may be negative), '1' when the request was charged as band-0 work (its band-0 counter
# moves too). A tenant without a counter is left alone; a refund stops at LAG below V (or
# where the counter is, if lower: VirtualCounters.correct); the counter never goes below 0.
# Returns how many counters it changed.
_CORRECT = _LUA_HEAD + r"""
local LAG = tonumber(ARGV[2])
local function moved(before, d)
  local after = before + d
  if d < 0 then
    local low = math.min(before, V - LAG)
    if after < low then after = low end
  end
  return after
end
local changed = 0
for i = 3, #ARGV, 3 do
  local tenant, d = ARGV[i], tonumber(ARGV[i + 1])
  local c = redis.call('HGET', KC, tenant)
  if c then
    c = moved(tonumber(c), d)
    if c < 0 then c = 0 end
    redis.call('HSET', KC, tenant, str(c))
    -- band-0 work is part of all work: its counter never exceeds the total (so the
    -- least-served tenant always stays eligible)
    local f = redis.call('HGET', KF, tenant)
    if f then
      f = tonumber(f)
      if ARGV[i + 2] == '1' then f = moved(f, d) end
      if f > c then f = c end
      redis.call('HSET', KF, tenant, str(f))
    end
    touch(tenant)
    changed = changed + 1
  end
end
return changed
"""


# ARGV: [1] ttl ms, [2] decision id, [3] the tenant served instead ('': none), [4] its charge
# (counter units). A choose that timed out: its charge is taken back if it ran (its record is
# among the recent decisions), else its id is tombstoned for TTL so that it writes nothing
# when it runs; the tenant served instead is charged as _CORRECT would. Once per id: a
# repeated undo changes nothing. Returns 1 if the choose had run.
_UNDO = _LUA_HEAD + r"""
local D = ARGV[2]
if redis.call('HEXISTS', KU, D) == 1 then return 0 end
redis.call('HSET', KU, D, '1')
redis.call('PEXPIRE', KU, str(TTL))
local ran = 0
for _, entry in ipairs(redis.call('LRANGE', KD, 0, -1)) do
  local id, charge, first, tenant = string.match(entry, '^(%S+) (%d+) ([01]) (.*)$')
  if id == D then
    ran = 1
    redis.call('LREM', KD, 1, entry)
    local c = redis.call('HGET', KC, tenant)
    if c then
      c = math.max(0, tonumber(c) - tonumber(charge))
      redis.call('HSET', KC, tenant, str(c))
      local f = redis.call('HGET', KF, tenant)
      if f then  -- (never above the total, as in _CORRECT)
        f = tonumber(f) - (first == '1' and tonumber(charge) or 0)
        redis.call('HSET', KF, tenant, str(math.min(f, c)))
      end
    end
    break
  end
end
local tenant = ARGV[3]
if tenant ~= '' then
  local c = redis.call('HGET', KC, tenant)
  if c then redis.call('HSET', KC, tenant, str(tonumber(c) + tonumber(ARGV[4]))) end
  touch(tenant)
end
return ran
"""

def _hash_tag(prefix: str, pool: str) -> str:
    """``{prefix:fair:pool}`` with braces escaped: all of a pool's keys in one cluster slot."""
    safe = pool.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{{{prefix}:fair:{safe}}}"


class RedisFairness:
    """Virtual counters shared by every replica of a pool, in Redis.

    Keys (one hash tag per pool, Redis Cluster safe): ``…:c`` hash tenant → counter (all its
    work), ``…:v`` the virtual time, ``…:seen`` zset tenant → last use (ms), ``…:f`` hash
    tenant → band-0 counter; for :meth:`undo`, ``…:d`` a list of the recent decisions and
    ``…:u`` a hash of the undone decision ids (its own TTL, from the latest undo). Each use
    refreshes every key's TTL (``ttl_ms``); a tenant unused
    for ``ttl_ms`` is forgotten (both counters), which is the same as activating it afresh
    (any debt it still had is forgiven). Times for the TTL come from Redis ``TIME``.

    ``lag_tokens`` as for :class:`~limiter.fairness.VirtualCounters` (every replica of a pool
    must use the same), at most ``MAX_CHARGE // SCALE`` so the Lua math stays exact.

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
        lag_tokens: int = DEFAULT_LAG,
        rebase_at: int = REBASE_AT,
    ) -> None:
        # lazily: the memory path needs no client
        from limiter.stores.redis_pipe import FAILURES, Scripts

        self._errors = FAILURES
        self._client = client
        self._ttl_ms = require_int("ttl_ms", ttl_ms, 1)
        self._rebase_at = check_rebase(rebase_at)
        if require_int("lag_tokens", lag_tokens, 0) > MAX_CHARGE // SCALE:
            raise ValueError(f"lag_tokens must be <= {MAX_CHARGE // SCALE}, got {lag_tokens}")
        self._lag = lag_tokens * SCALE
        self._owns_client = owns_client
        base = f"{prefix}:{_hash_tag(prefix, pool)}"
        self._keys = (f"{base}:c", f"{base}:v", f"{base}:seen", f"{base}:f")
        # the scripts' keys: the pool's, then its recent decisions and undone ones (_UNDO)
        self._all_keys = (*self._keys, f"{base}:d", f"{base}:u")
        # one pipelined connection on a standalone Redis (see limiter.stores.redis_pipe)
        self._scripts = Scripts(client, {"activate": _ACTIVATE, "choose": _CHOOSE,
                                         "correct": _CORRECT, "undo": _UNDO})

    def keys(self) -> list[str]:
        """The pool's keys: counters hash, virtual time, last-seen zset, band-0 counters."""
        return list(self._keys)

    async def _call(self, what: str, args: Sequence[int | str]) -> Any:
        try:
            return await self._scripts.run(what, self._all_keys, args)
        except self._errors as exc:
            raise StoreUnavailable(f"redis fairness {what} failed: {exc}") from exc

    async def activate(self, tenant: str) -> None:
        await self._call("activate", [self._ttl_ms, tenant])

    async def choose(self, offers: Sequence[Offer], decision: str = "") -> QueuedRequest | None:
        """Pick one of ``offers`` and charge its tenant (:func:`limiter.fairness.pick`); None
        when none may go now, and then nothing changes. A ``decision`` id makes the choice
        undoable (:meth:`undo`) should its answer not come in time."""
        if not offers:
            return None
        index = int(await self._call("choose", self._choose_args(offers, decision)))
        return None if index < 0 else offers[index].item

    def queue_choice(self, offer: Offer) -> asyncio.Future[Any] | None:
        """The choice of one offer that fits, queued on the pipe without waiting: the script
        always picks it (nothing to compare it with: it is eligible by its own counter), so
        only its charge is sent, ahead of any later call, and the dispatcher goes on without
        a round trip. The future gets Redis's answer (or the failure), for the caller's
        breaker; a charge lost to an outage is like a lost correction: convergence is
        slower (never undone, so no decision id). None without an open pipe."""
        return self._scripts.send("choose", self._all_keys, self._choose_args([offer], ""))

    def is_failure(self, error: BaseException) -> bool:
        """Whether ``error`` (a queued call's) is Redis failing, as :meth:`_call` maps it."""
        return isinstance(error, self._errors)

    def _choose_args(self, offers: Sequence[Offer], decision: str) -> list[int | str]:
        # enqueue times only break ties: their ranks compare the same and stay exact in Lua
        rank = {ms: n for n, ms in enumerate(sorted({o.item.enqueued_ms for o in offers}))}
        args: list[int | str] = [self._ttl_ms, self._rebase_at, self._lag]
        for offer in offers:
            args += [offer.item.tenant, charge_of(offer.item), rank[offer.item.enqueued_ms],
                     require_int("band", offer.band, 0), int(bool(offer.fits))]
        args.append(decision)
        return args

    async def correct(self, tenant: str, tokens: int, weight: float, *, band0: bool = False
                      ) -> None:
        """Add ``tokens`` (negative: a refund, which stops at ``lag`` below ``V``) to
        ``tenant``'s counter, floored at 0, and with ``band0`` to its band-0 counter; nothing
        when it has no counter."""
        await self.correct_many([(tenant, tokens, weight, band0)])

    async def correct_many(self, corrections: Sequence[Correction]) -> None:
        args: list[int | str] = [self._ttl_ms, self._lag]
        for tenant, tokens, weight, band0 in corrections:
            args += [tenant, units(tokens, weight), int(band0)]
        if corrections:
            await self._call("correct", args)

    async def undo(self, decision: str, instead: QueuedRequest | None) -> bool:
        """The choice ``decision`` got no answer in time and the caller chose ``instead``
        without Redis: take back the charge it made if it ran, else make sure it writes
        nothing when it runs, and charge ``instead``'s tenant. Idempotent per ``decision``.
        True when the choice had run."""
        tenant, charge = ("", 0) if instead is None else (instead.tenant, charge_of(instead))
        return bool(await self._call("undo", [self._ttl_ms, decision, tenant, charge]))

    async def counters(self) -> dict[str, float]:
        try:
            raw = await self._client.hgetall(self._keys[0])
        except self._errors as exc:
            raise StoreUnavailable(f"redis fairness counters failed: {exc}") from exc
        return {_text(tenant): int(value) / SCALE for tenant, value in raw.items()}

    def forget(self, tenants: Iterable[str]) -> None:
        """Nothing to drop here: Redis forgets a tenant unseen for ``ttl_ms`` by itself."""

    async def virtual_time(self) -> float:
        """``V`` in tokens per unit of weight (0 when the pool has no state)."""
        try:
            raw = await self._client.get(self._keys[1])
        except self._errors as exc:
            raise StoreUnavailable(f"redis fairness virtual_time failed: {exc}") from exc
        return 0.0 if raw is None else int(raw) / SCALE

    async def close(self) -> None:
        await self._scripts.close()
        if not self._owns_client:
            return
        try:
            await self._client.aclose()
        except self._errors as exc:
            raise StoreUnavailable(f"redis close failed: {exc}") from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
