"""Counters for the Envoy Rate Limit Service, in this process or in Redis (global across
replicas), with one atomic call per ``ShouldRateLimit``.

The rules are :mod:`limiter.ratelimit`'s; these classes only keep the counters. Both answer
a call with one :class:`~limiter.ratelimit.Verdict` per hit, and neither charges anything
for a refused call (``debt`` rules excepted).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from limiter.clock import wall_ms
from limiter.ratelimit import (
    Counter,
    Hit,
    Limit,
    Promise,
    Verdict,
    decide,
    idle,
    new_counter,
    promised_until,
)


@runtime_checkable
class RateCounters(Protocol):
    async def hit(self, domain: str, hits: Sequence[Hit], call_id: str) -> list[Verdict]:
        """Check and charge ``hits`` (of one domain) at once. ``call_id`` names the call so
        that :meth:`cancel` can undo it."""
        ...

    async def cancel(self, domain: str, hits: Sequence[Hit], call_id: str) -> None:
        """Undo a call (the same ``hits``) whose answer never came back: refund what it
        charged if it ran, and make it charge nothing if it runs later."""
        ...

    async def close(self) -> None: ...


# A counter key longer than this is kept as its SHA-256 digest (bytes: never equal to a
# kept str key). Keys carry descriptor values, which a client may choose whole (a header up
# to Envoy's 60 KB): at the 100,000-counter bound, 16 KB values held ~1.6 GB, 60 KB ~6 GB.
MAX_KEPT_KEY = 256


def _kept_key(key: str) -> str | bytes:
    if len(key) <= MAX_KEPT_KEY:
        return key
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass
class _Slot:
    limit: Limit
    counter: Counter
    promise: Promise = field(default_factory=Promise)

    def idle(self, now_ms: int) -> bool:
        """Back to a new counter's state, every retry slot it promised past."""
        until = promised_until(self.promise)
        return idle(self.counter, now_ms) and (until is None or until < now_ms)


class MemoryRateCounters:
    """Counters in a dict; each call is atomic on the event loop (nothing awaits).

    A counter is rebuilt when its rule's limit changes (a config reload): RLS limits are
    coarse, and carrying a level across algorithms would mean nothing (its retry slots are
    forgotten with it). Counters back to their starting state, every slot they promised
    past, are dropped every ``sweep_every`` calls, so one per client address
    or user id does not pile up; and at most ``max_counters`` are kept: a descriptor whose
    value the client chooses (an address, a header) with a day-long window would otherwise
    keep one per value all day. Past it the least recently used goes first (its client
    starts afresh: lenient, never wrong the other way).
    """

    def __init__(self, clock: Callable[[], int] = wall_ms, *, sweep_every: int = 4096,
                 max_counters: int = 100_000) -> None:
        self._clock = clock
        self._slots: dict[str | bytes, _Slot] = {}  # least recently used first
        self._sweep_every = sweep_every
        self._max_counters = max_counters
        self._calls = 0

    def __len__(self) -> int:
        """Counters held."""
        return len(self._slots)

    def _sweep(self, now_ms: int) -> None:
        for key in [k for k, slot in self._slots.items() if slot.idle(now_ms)]:
            del self._slots[key]

    def _state(self, hit: Hit, now_ms: int) -> tuple[Counter, Promise]:
        key = _kept_key(hit.key)
        slot = self._slots.pop(key, None)  # and back at the end: the most recent
        if slot is None or slot.limit != hit.limit:
            while len(self._slots) >= self._max_counters:  # O(1): the sweep stays periodic
                del self._slots[next(iter(self._slots))]
            slot = _Slot(hit.limit, new_counter(hit.limit, now_ms))
        self._slots[key] = slot
        return slot.counter, slot.promise

    async def hit(self, domain: str, hits: Sequence[Hit], call_id: str) -> list[Verdict]:
        now_ms = self._clock()
        self._calls += 1
        if self._calls % self._sweep_every == 0:
            self._sweep(now_ms)
        return decide(hits, lambda h: self._state(h, now_ms), now_ms)

    async def cancel(self, domain: str, hits: Sequence[Hit], call_id: str) -> None:
        """A call in this process always completes: nothing to undo (what the Redis store's
        cancel does is :func:`limiter.ratelimit.refund`)."""

    async def close(self) -> None:
        """Nothing to release."""


# Appended to the limiter's own Lua (redis_scripts._CORE + _POLICY, whose token bucket,
# sliding window and herd functions it calls, pointing their key upvalues at each counter in
# turn).
# ARGV[4] is a policy of zeros (unused), ARGV[5] the mode ('h' hit, 'c' cancel), ARGV[6]
# how long a call's record lives (ms); then 7 fields per hit: algorithm ('t' token bucket,
# 's' sliding window, 'f' fixed window), amount, period ms, capacity (the window's limit
# for windows), window ms, cost, flags ('s' shadow, 'd' debt). KEYS: three per hit (counter,
# its meta, its retry slots), then the call's record: absent (never ran), 'x' (cancelled) or
# what it charged. The retry slots (limiter.ratelimit.Promise) are a hash {sig, at, n, wp, b}:
# the limit they were promised under, the bucket's virtual full time or the fixed window's
# start, what the clients count there, a sliding window's promised entries "ms:cost,...",
# when the bucket's last promised client is back (absent, written by an older kvgate: the
# promise stands until ``at``).
_RLS = r"""
local MODE, CALL_TTL = ARGV[5], ARGV[6]
local N = (#KEYS - 1) / 3
local KCALL = KEYS[#KEYS]
local F = 7

local function field(i, k) return ARGV[6 + (i - 1) * F + k] end

local function point(c)  -- the sliding window functions' keys and limits: this counter's
  KWIN, KWMETA, WIN_MS, WIN_LIMIT = c.key, c.meta, c.wms, c.cap
end

local function open(i, t)
  local c = {algo = field(i, 1), a = tonumber(field(i, 2)), p = tonumber(field(i, 3)),
             cap = tonumber(field(i, 4)), wms = tonumber(field(i, 5)),
             cost = tonumber(field(i, 6)), flags = field(i, 7), key = KEYS[3 * i - 2],
             meta = KEYS[3 * i - 1], hkey = KEYS[3 * i],
             sig = table.concat({field(i, 1), field(i, 2), field(i, 3), field(i, 4),
                                 field(i, 5)}, ':')}
  if c.algo == 't' then
    c.b = tb_open({a = c.a, p = c.p, c = c.cap, key = c.key}, t)
  elseif c.algo == 's' then
    point(c)
    c.w = win_open(t)
  else
    c.start = t - t % c.wms
    local h = redis.call('HMGET', c.key, 's', 'n')
    c.n = 0
    if tonumber(h[1]) == c.start then c.n = tonumber(h[2]) end
  end
  return c
end

local function wait(c, t)  -- -1: never fits
  local need = math.max(1, c.cost)
  if need > c.cap then return -1 end
  if c.algo == 't' then return tb_wait(c.b, need, t) end
  if c.algo == 's' then point(c); return win_wait(c.w, need) end
  if c.n + need <= c.cap then return 0 end
  return c.start + c.wms - t
end

local function fixed_save(c, t)
  if c.n <= 0 then redis.call('DEL', c.key); return end
  redis.call('HSET', c.key, 's', str(c.start), 'n', str(c.n))
  redis.call('PEXPIRE', c.key, str(c.start + c.wms - t + SLACK))
end

local function take(c, fits, t)  -- returns the record of what was charged
  if c.cost == 0 then return nil end
  if c.algo == 't' then
    tb_take(c.b, c.cost, t); tb_save(c.b, t)
    return 't:' .. str(c.cost) .. ':0'
  elseif c.algo == 's' then
    point(c)
    win_consume(c.w, c.cost)  -- saved by the caller, with its evictions
    return 's:' .. str(c.cost) .. ':' .. str(c.w.now)
  end
  c.n = c.n + c.cost
  fixed_save(c, t)
  return 'f:' .. str(c.cost) .. ':' .. str(c.start)
end

local function view(c, t)  -- remaining, ms until full / reset
  if c.algo == 't' then
    return math.max(0, fdiv(tb_level(c.b, t), c.b.p)), tb_reset(c.b, t)
  elseif c.algo == 's' then
    return math.max(0, c.cap - c.w.n), win_reset(c.w)
  end
  return math.max(0, c.cap - c.n), c.start + c.wms - t
end

-- the retry slots of a refused herd (limiter.ratelimit.schedule) -------------------------
local function promise_open(c)  -- read only when a call is refused, or a cancel refunds
  c.h = {tat = {}, wp = {}, n = 0, back = {}}
  local h = redis.call('HMGET', c.hkey, 'sig', 'at', 'n', 'wp', 'b')
  if h[1] ~= c.sig then return end  -- none, or promised under another limit
  c.h.tat.at, c.h.n, c.h.back.at = tonumber(h[2]), tonumber(h[3]) or 0, tonumber(h[5])
  for ts, n in string.gmatch(h[4] or '', '(%d+):(%d+)') do
    table.insert(c.h.wp, {tonumber(ts), tonumber(n)})
  end
end

local function slot(c, need, exact, t)  -- limiter.ratelimit._slot
  if c.algo == 't' then
    herd_live(c.h, 'at', t)
    return herd_bucket_slot(c.h, 'at', c.b, need, exact, t)
  end
  if c.algo == 's' then
    point(c)
    local kept = {}
    for _, p in ipairs(c.h.wp) do
      if p[1] >= t then table.insert(kept, p) end
    end
    c.h.wp = kept
    return math.max(exact, win_herd_wait(c.w, need, kept))
  end
  local at, ps = t + exact, c.h.tat.at  -- limiter.herd.fixed_slot
  if not ps or ps < at - at % c.wms then return exact end
  if c.h.n + need > c.cap then ps = ps + c.wms end
  return math.max(exact, ps - t)
end

local function promise(c, s, final, t)  -- limiter.ratelimit._promise
  if c.algo == 't' then
    herd_back(c.h, 'at', c.h.tat.at, t + final)
    return herd_promise_bucket(c.h, 'at', c.b, c.cost, final, t)
  end
  if s > final or c.cost == 0 then return end
  if c.algo == 's' then
    point(c)
    return herd_promise_window(c.h, t + final, c.cost)
  end
  local at, ps = t + final, c.h.tat.at  -- limiter.herd.promise_fixed
  local start = at - at % c.wms
  if not ps or start > ps then
    c.h.tat.at, c.h.n = start, c.cost
  elseif start == ps then
    c.h.n = c.h.n + c.cost
  end
end

local function promise_save(c, t)  -- kept until its last slot (promised_until) is past
  redis.call('DEL', c.hkey)
  local last = c.h.back.at or c.h.tat.at
  if #c.h.wp > 0 then last = c.h.wp[#c.h.wp][1] end
  if not last or last < t then return end
  local wp = {}
  for _, p in ipairs(c.h.wp) do table.insert(wp, str(p[1]) .. ':' .. str(p[2])) end
  redis.call('HSET', c.hkey, 'sig', c.sig, 'n', str(c.h.n), 'wp', table.concat(wp, ','))
  if c.h.tat.at then redis.call('HSET', c.hkey, 'at', str(c.h.tat.at)) end
  if c.h.back.at then redis.call('HSET', c.hkey, 'b', str(c.h.back.at)) end
  redis.call('PEXPIRE', c.hkey, str(last - t + SLACK))
end

-- limiter.ratelimit.schedule: every counter but shadow ones is scheduled, refusing or not;
-- the longest refusing wait becomes the latest slot. Nothing for a call that never fits.
local function schedule(cs, waits, t)
  local paced = {}
  for i = 1, N do
    if not string.find(cs[i].flags, 's', 1, true) then
      if waits[i] < 0 then return end
      table.insert(paced, i)
    end
  end
  local slots, bounded, final = {}, {}, 0
  for _, i in ipairs(paced) do
    promise_open(cs[i])
    slots[i] = slot(cs[i], math.max(1, cs[i].cost), waits[i], t)
    bounded[i] = math.max(waits[i], math.min(slots[i], MAX_HERD_WAIT))
    final = math.max(final, bounded[i])
  end
  local top
  for _, i in ipairs(paced) do
    promise(cs[i], slots[i], final, t)
    promise_save(cs[i], t)
    if waits[i] > 0 then
      if not top or bounded[i] > bounded[top] then top = i end
      waits[i] = bounded[i]
    end
  end
  waits[top] = final  -- one that did not refuse may set it
end

-- limiter.ratelimit.refund: a cancelled call's charge given back; a token bucket's live
-- promise moves back with it (its retry slots read only when the level moved)
local function refund(i, rec, t)
  local kind, n, ts = string.match(rec, '^(%a):(%d+):(%d+)$')
  local c = open(i, t)
  n, ts = tonumber(n), tonumber(ts)
  if c.algo == 's' then point(c) end
  if c.algo ~= kind then
  elseif kind == 't' then
    local before = tb_level(c.b, t)
    tb_refund(c.b, n, t); tb_save(c.b, t)
    if tb_level(c.b, t) ~= before then
      promise_open(c)
      if herd_reconcile_promise(c.h, 'at', c.b, before, t) then promise_save(c, t) end
    end
  elseif kind == 's' then
    win_refund(c.w, ts, n)
  elseif c.start == ts then
    c.n = math.max(0, c.n - n); fixed_save(c, t)
  end
  if c.algo == 's' then win_save(c.w, t) end  -- its evictions, at least
end

local record = redis.call('GET', KCALL)
if MODE == 'c' then
  if record and record ~= 'x' then
    for part in string.gmatch(record, '[^,]+') do
      local i, rec = string.match(part, '^(%d+)=(.+)$')
      refund(tonumber(i), rec, NOW)
    end
  end
  redis.call('SET', KCALL, 'x', 'PX', CALL_TTL)
  return 'cancelled'
end
-- a cancelled call charges nothing; one resent after a broken connection, nothing twice
local charge_ok = record == false
local cs, waits, fits = {}, {}, {}
local passed = true
for i = 1, N do
  cs[i] = open(i, NOW)
  waits[i] = wait(cs[i], NOW)
  fits[i] = waits[i] == 0
  if not fits[i] and not string.find(cs[i].flags, 's', 1, true) then passed = false end
end
if not passed then schedule(cs, waits, NOW) end
local out, charged = {}, {}
local debt_wait = 0  -- limiter.ratelimit.decide: a refused call's debt, waited for after
for i = 1, N do
  local c = cs[i]
  if charge_ok and (string.find(c.flags, 'd', 1, true) or (fits[i] and passed)) then
    local rec = take(c, fits[i], NOW)
    if rec then table.insert(charged, str(i) .. '=' .. rec) end
    if not passed and c.cost > 0 and not string.find(c.flags, 's', 1, true) then
      debt_wait = math.max(debt_wait, wait(c, NOW))
    end
  end
end
if debt_wait > 0 then  -- limiter.ratelimit._after_debt
  local top, never = nil, false
  for i = 1, N do
    if not fits[i] and not string.find(cs[i].flags, 's', 1, true) then
      if waits[i] < 0 then never = true end
      if not top or waits[i] > waits[top] then top = i end
    end
  end
  if not never then waits[top] = math.max(waits[top], debt_wait) end
end
for i = 1, N do
  local c = cs[i]
  if c.algo == 's' then point(c); win_save(c.w, NOW) end
  local remaining, reset = view(c, NOW)
  table.insert(out, (fits[i] and '1' or '0') .. ',' .. str(remaining) .. ',' .. str(reset)
               .. ',' .. str(waits[i]))
end
if #charged > 0 then redis.call('SET', KCALL, table.concat(charged, ','), 'PX', CALL_TTL) end
if record == 'x' then return 'cancelled' end
return out
"""

CALL_TTL_MS = 10_000
"""How long a call's record (what it charged) is kept for a cancel to undo."""
_ZERO_POLICY = ",".join(["0"] * 12)
_ALGO_CODES = {"token_bucket": "t", "sliding_window": "s", "fixed_window": "f"}


def _hit_args(hit: Hit) -> list[int | str]:
    from limiter.stores.redis_codec import check_bucket

    limit = hit.limit
    if limit.algorithm == "token_bucket":
        amount, period, capacity = check_bucket(hit.key, limit.rate(), limit.capacity)
    else:
        amount, period, capacity = 0, 0, limit.capacity
    flags = ("s" if hit.shadow else "") + ("d" if limit.debt else "") or "-"
    return [_ALGO_CODES[limit.algorithm], amount, period, capacity, limit.unit_ms, hit.cost,
            flags]


def _verdict(packed: bytes | str) -> Verdict:
    text = packed.decode() if isinstance(packed, bytes) else packed
    fits, remaining, reset, wait = (int(f) for f in text.split(","))
    return Verdict(bool(fits), remaining, reset, None if wait < 0 else wait)


class RedisRateCounters:
    """Counters in Redis, shared by every replica: one script call per ``ShouldRateLimit``.

    All of a domain's keys share the hash tag ``{prefix:rls:domain}`` (one Redis Cluster
    shard per domain, so a call stays atomic), and each has a TTL to when it is back to its
    default state. ``clock=None`` uses Redis ``TIME``: one clock for every replica.
    """

    def __init__(
        self, client: Any, *, prefix: str = "kvgate", clock: Callable[[], int] | None = None
    ) -> None:
        from limiter.stores.redis_scripts import _CORE, _POLICY

        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._source = (_CORE + _POLICY + _RLS).encode()
        self._sha = hashlib.sha1(self._source).hexdigest().encode()

    def _keys(self, domain: str, hits: Sequence[Hit], call_id: str) -> list[str]:
        from limiter.stores.redis_store import _tenant_tag

        base = f"{self._prefix}:{_tenant_tag(self._prefix + ':rls', domain)}"
        keys = []
        for hit in hits:
            code = _ALGO_CODES[hit.limit.algorithm]
            keys += [f"{base}:{code}:{hit.key}", f"{base}:{code}m:{hit.key}",
                     f"{base}:{code}h:{hit.key}"]
        return [*keys, f"{base}:call:{call_id}"]

    async def _run(self, mode: str, domain: str, hits: Sequence[Hit], call_id: str) -> Any:
        from limiter.stores.base import StoreUnavailable
        from limiter.stores.redis_pipe import FAILURES, eval_script

        now: int | str = "" if self._clock is None else self._clock()
        args: list[int | str] = [now, 1, 60_000, _ZERO_POLICY, mode, CALL_TTL_MS]
        for hit in hits:
            args += _hit_args(hit)
        try:
            return await eval_script(self._client, self._sha, self._source,
                                     self._keys(domain, hits, call_id), args)
        except FAILURES as exc:
            raise StoreUnavailable(f"redis ratelimit failed: {exc}") from exc

    async def hit(self, domain: str, hits: Sequence[Hit], call_id: str) -> list[Verdict]:
        from limiter.stores.base import StoreUnavailable

        reply = await self._run("h", domain, hits, call_id)
        if not isinstance(reply, list):
            raise StoreUnavailable(f"ratelimit call {call_id} was cancelled")
        return [_verdict(packed) for packed in reply]

    async def cancel(self, domain: str, hits: Sequence[Hit], call_id: str) -> None:
        await self._run("c", domain, hits, call_id)

    async def close(self) -> None:
        await self._client.aclose()
