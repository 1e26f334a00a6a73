"""The Redis store's Lua scripts: the in-memory core's integer math, re-done atomically.

Each script mirrors :mod:`limiter.buckets`, :mod:`limiter.quota` and
:class:`~limiter.decision.TenantLimiter` line for line, so a decision through Redis equals
the in-memory one. Python builds every message and view from the raw numbers returned
(:mod:`limiter.outcome`); the scripts only decide and count.

**Numbers.** Lua numbers are doubles, exact for integers below 2^53. The bounds (checked in
Python before a policy is sent, see ``redis_codec.policy_fields``):

- a bucket's full level ``capacity × period_ms ≤ 2^51``, ``amount ≤ 2^51``,
  ``period_ms ≤ 2^26``; debt is saturated at ``-2^51`` scaled units. So every level, deficit
  and ``full − level`` stays ≤ 2^52, and a rescale's ``r × new_period < 2^52``;
- refill never multiplies a raw elapsed time: elapsed is compared with the exact
  ms-to-full first (an epoch-sized elapsed × amount would overflow);
- divisions are ``fdiv``/``cdiv``: a float quotient corrected by exact integer steps;
- epoch ms (~1.8e12), quota counts (≤ 2^50) and window costs are far below 2^53;
- numbers go to Redis through ``string.format('%.0f')`` (``tostring`` would print
  ``1.8e+12``), and come back as integer replies (exact: they are whole doubles < 2^53).

**Keys** (``KEYS[1..13]``, one hash tag per tenant, every key with a PEXPIRE to when it would
be back to its default state, plus ``SLACK`` ms): ``tb:req`` and ``tb:tok`` hashes
``{l, t, a, p, c}`` (scaled level, last ms, and the rate/capacity it was computed with, to
rescale on a policy change; a full bucket is deleted: missing = full); ``win`` a ZSET of
``"ts:cost"`` scored by ts (same-ms entries merged) and ``win:meta`` ``{n, w}`` (its total
and window length); ``leases`` a ZSET lease_id → expiry ms and ``leases:meta`` lease_id →
``"tokens:tb:day:month"`` (the reservation and which dimensions it was charged to);
``q:day`` and ``q:month`` hashes ``{s, u}`` (the period start the count belongs to, used);
``cancelled`` a ZSET lease_id → expiry ms of admissions kvgate gave up on (below);
``herd`` a hash of the retry slots last promised per dimension (``limiter.herd``), when
the last client promised a slot of the request or token bucket or the shaper is back
(``b:requests``, ``b:tokens``, ``b:shaping_backlog_full``: past it, that promise is over), the
window entries the promised clients will log (``wp``, ``"ms:requests,…"``), the policy they
were promised under (``pol``) and the observed mean request duration (``d``, ``n``
samples; a lease's meta ends with its start ms, field 13).
``shape`` a hash ``{m, f, a, p, h}``: the shaper's tail as ``m`` ms plus ``f``/``a`` of a ms
(``0 ≤ f < a``: the scaled time ``m × a + f`` of :class:`~limiter.buckets.Shaper`, never
formed from an epoch), the rate it was computed with, and its holes as ``"m:f,…"``; a lease
charged a slot keeps it in its meta (``…:m:f:a:p``), so a release before the slot starts
gives it back.
``gone`` and ``gone:meta`` (a ZSET lease_id → when its record goes, and lease_id → meta):
the records of leases that expired, kept one lease TTL. A holder that could not renew (Redis
unreachable past the TTL) re-asserts its lease with its record, and a release that finds
the lease expired settles the reservation all the same: neither the whole reservation
nor the usage on top of it stays charged.

**Calls whose answer is lost.** kvgate stops waiting for Redis after its budget (20 ms), but
a command already sent still runs when Redis gets to it (a paused or overloaded server).
Lease ids make that safe: ``release`` with mode ``c`` (*cancel*) frees the lease if the
admission ran and refunds everything it charged (request bucket, window, tokens, quotas),
and if it has not run yet leaves a tombstone in ``cancelled`` for ``lease TTL`` ms, so a
late ``admit`` of that id charges nothing. An ``admit`` sent again after a broken connection
(ARGV resend flag) finds its own lease if the first attempt ran, and charges nothing twice.
``renew`` with the re-assert flag puts back leases Redis lost (a restart without
persistence), except cancelled ones. ``admit`` also carries how many leases this replica
holds for the tenant: fewer in Redis means Redis forgot some, and it answers ``lost``
(charging nothing) so they are re-asserted before anything is admitted on top of them.
"""

from __future__ import annotations

# ARGV: [1] now ms ('' = Redis TIME), [2] lease TTL ms, [3] TTL slack ms.
_CORE = r"""
local KREQ, KTOK, KWIN, KWMETA = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local KLEASES, KLMETA, KCANCEL, KHERD = KEYS[5], KEYS[6], KEYS[9], KEYS[10]
local KSHAPE = KEYS[11]
local KGONE, KGMETA = KEYS[12], KEYS[13]
local LEASE_TTL, SLACK = tonumber(ARGV[2]), tonumber(ARGV[3])
local LMAX = 2251799813685248  -- 2^51: saturation bound for a bucket's debt

-- exact floor(a / b) for integers a and b > 0 (|a|, |q * b| < 2^53)
local function fdiv(a, b)
  local q = math.floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

local function cdiv(a, b) return 0 - fdiv(0 - a, b) end

local function str(x) return string.format('%.0f', x) end

local NOW
if ARGV[1] == '' then
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  NOW = tonumber(ARGV[1])
end

-- an expired lease that was never sent upstream (admitted, then queued or paced by its
-- shaper: its meta ends in ':u' until kvgate says it went, _SENT) gives its reservation back
-- to the quotas of the period it was charged in: its holder died with it waiting (or cannot
-- renew), and a quota charge lasts the day or month. Its record keeps 'r' for each quota
-- so refunded: a release that comes after all (a live holder, Redis unreachable past the
-- TTL) charges what it used
local function unsent_refund(meta)
  if string.sub(meta, -2) ~= ':u' then return meta end
  local f = {}
  for field in string.gmatch(meta, '[^:]+') do table.insert(f, field) end
  local tokens, start = tonumber(f[1]), tonumber(f[13])
  for i, key in ipairs({KEYS[7], KEYS[8]}) do
    if f[i + 2] == '1' then
      local h = redis.call('HMGET', key, 's', 'u')
      if h[1] and start and tonumber(h[1]) <= start then
        local left = math.max(0, tonumber(h[2]) - tokens)
        if left > 0 then redis.call('HSET', key, 'u', str(left))
        else redis.call('DEL', key) end
      end
      f[i + 2] = 'r'
    end
  end
  table.remove(f)
  return table.concat(f, ':')
end

-- a lease admitted unsent was sent upstream (RedisStore.mark_sent): its expiry keeps its
-- quota charge from now on, as any request's that ran
local function mark_sent(lease)
  local meta = redis.call('HGET', KLMETA, lease)
  if meta and string.sub(meta, -2) == ':u' then
    redis.call('HSET', KLMETA, lease, string.sub(meta, 1, -3))
  end
end

-- leases: expired means expiry <= now (TenantLimiter.expire_leases)
local function leases_purge(t)
  local cutoff = str(t)
  local dead = redis.call('ZRANGEBYSCORE', KLEASES, '-inf', cutoff)
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', KLEASES, '-inf', cutoff)
    for i = 1, #dead, 1000 do
      local ids = {unpack(dead, i, math.min(i + 999, #dead))}
      -- an expired lease's record is kept a lease TTL ("gone"): if its holder is alive (it
      -- could not renew: Redis was unreachable) its re-assert puts the record back, so its
      -- release settles the reservation rather than charging its usage on top of it
      local metas = redis.call('HMGET', KLMETA, unpack(ids))
      for j, id in ipairs(ids) do
        if metas[j] then
          redis.call('ZADD', KGONE, str(t + LEASE_TTL), id)
          redis.call('HSET', KGMETA, id, unsent_refund(metas[j]))
        end
      end
      redis.call('HDEL', KLMETA, unpack(ids))
    end
    if redis.call('EXISTS', KGONE) == 1 then
      redis.call('PEXPIRE', KGONE, str(LEASE_TTL + SLACK))
      redis.call('PEXPIRE', KGMETA, str(LEASE_TTL + SLACK))
    end
  end
  return redis.call('ZCARD', KLEASES)
end

-- the record of an expired lease (see leases_purge), taken back (nil: none kept)
local function gone_take(lease, t)
  local old = redis.call('ZRANGEBYSCORE', KGONE, '-inf', str(t))
  if #old > 0 then
    redis.call('ZREMRANGEBYSCORE', KGONE, '-inf', str(t))
    for i = 1, #old, 1000 do
      redis.call('HDEL', KGMETA, unpack(old, i, math.min(i + 999, #old)))
    end
  end
  if not redis.call('ZSCORE', KGONE, lease) then return nil end
  local meta = redis.call('HGET', KGMETA, lease)
  redis.call('ZREM', KGONE, lease)
  redis.call('HDEL', KGMETA, lease)
  return meta
end

-- tombstones of cancelled admissions (see the module docstring)
local function cancelled(lease, t)
  redis.call('ZREMRANGEBYSCORE', KCANCEL, '-inf', str(t))
  return redis.call('ZSCORE', KCANCEL, lease)
end

-- how long a usage charge's id is remembered (ms): a resend after an applied charge whose
-- answer was lost counts once, however long Redis stayed unreachable in between (up to it)
local USAGE_MARK = 3600000

local function cancel_mark(lease, t, ttl)
  ttl = ttl or LEASE_TTL
  redis.call('ZADD', KCANCEL, str(t + ttl), lease)
  if redis.call('PTTL', KCANCEL) < ttl + SLACK then  -- never shortened (a usage mark's hour)
    redis.call('PEXPIRE', KCANCEL, str(ttl + SLACK))
  end
end

local function leases_save(t)
  local last = redis.call('ZRANGE', KLEASES, -1, -1, 'WITHSCORES')
  if not last[2] then
    redis.call('DEL', KLEASES, KLMETA)
    return
  end
  local ttl = str(math.max(1, tonumber(last[2]) - t) + SLACK)
  redis.call('PEXPIRE', KLEASES, ttl)
  redis.call('PEXPIRE', KLMETA, ttl)
end
"""

# ARGV[4]: the policy as 15 comma-separated integers, 0 = not configured (one argument:
# packing/unpacking 15 separate ones costs the Python client more than the Lua split).
_POLICY = r"""
local function arg(i) return tonumber(ARGV[i]) end
local POL = {}
for field in string.gmatch(ARGV[4], '[^,]+') do table.insert(POL, tonumber(field)) end
local REQ = {a = POL[1], p = POL[2], c = POL[3], key = KREQ}
local TOK = {a = POL[4], p = POL[5], c = POL[6], key = KTOK}
local WIN_LIMIT, WIN_MS = POL[7], POL[8]
local MAX_CONC, CONC_RETRY = POL[9], POL[10]
local QUOTAS = {{kind = 'd', limit = POL[11], key = KEYS[7]},
                {kind = 'm', limit = POL[12], key = KEYS[8]}}
local SHAPE = {a = POL[13], p = POL[14], b = POL[15]}
local OP = 5
local DROP = {}  -- keys of dimensions the policy does not configure: one DEL for all

-- token bucket (limiter.buckets.TokenBucket) ------------------------------------------
local function tb_level(b, t)
  local elapsed = t - b.t
  if elapsed <= 0 or b.l >= b.full then return b.l end
  -- never elapsed * amount on a raw elapsed: compare with the exact ms-to-full first
  if elapsed >= cdiv(b.full - b.l, b.a) then return b.full end
  return b.l + elapsed * b.a
end

local function tb_advance(b, t)
  b.l = tb_level(b, t)
  if t > b.t then b.t = t end
end

local function tb_reset(b, t) return cdiv(math.max(0, b.full - tb_level(b, t)), b.a) end

local function tb_save(b, t)
  if b.l >= b.full then
    redis.call('DEL', b.key)  -- full is the default state: nothing to keep
    return
  end
  redis.call('HSET', b.key, 'l', str(b.l), 't', str(b.t), 'a', str(b.a), 'p', str(b.p),
             'c', str(b.c))
  redis.call('PEXPIRE', b.key, str(tb_reset(b, b.t) + (b.t - t) + SLACK))
end

local function tb_rescale(b, old, t)
  -- TokenBucket.reconfigure: a full bucket stays full, else floor(level * p' / p), clamped
  tb_advance(old, t)
  b.t = old.t
  if old.l >= old.full then
    b.l = b.full
    return
  end
  local q = fdiv(old.l, old.p)
  b.l = math.max(-LMAX, math.min(b.full, q * b.p + fdiv((old.l - q * old.p) * b.p, old.p)))
end

local function tb_open(spec, t)
  if spec.a == 0 then
    table.insert(DROP, spec.key)  -- a dropped dimension starts afresh if it comes back
    return nil
  end
  local b = {a = spec.a, p = spec.p, c = spec.c, full = spec.c * spec.p, key = spec.key}
  local h = redis.call('HMGET', spec.key, 'l', 't', 'a', 'p', 'c')
  if not h[1] then
    b.l, b.t = b.full, t
    return b
  end
  b.l, b.t = tonumber(h[1]), tonumber(h[2])
  local old = {a = tonumber(h[3]), p = tonumber(h[4]), c = tonumber(h[5]), l = b.l, t = b.t}
  if old.a ~= b.a or old.p ~= b.p or old.c ~= b.c then
    old.full = old.c * old.p
    tb_rescale(b, old, t)
    tb_save(b, t)
  end
  return b
end

local function tb_wait(b, cost, t)
  local deficit = cost * b.p - tb_level(b, t)
  if deficit > 0 then return cdiv(deficit, b.a) end
  return 0
end

local function tb_take(b, n, t)  -- consume (after a zero wait) or charge into debt
  tb_advance(b, t)
  b.l = math.max(-LMAX, b.l - n * b.p)
end

local function tb_refund(b, n, t)
  tb_advance(b, t)
  b.l = math.min(b.full, b.l + n * b.p)
end

-- sliding window (limiter.buckets.SlidingWindow) ----------------------------------------
local function win_cost(member) return tonumber(string.match(member, ':(%d+)$')) end

local function win_evict(w, window_ms)
  local horizon = str(w.now - window_ms)
  local gone = redis.call('ZRANGEBYSCORE', KWIN, '-inf', horizon)
  if #gone == 0 then return end
  for _, member in ipairs(gone) do w.n = w.n - win_cost(member) end
  redis.call('ZREMRANGEBYSCORE', KWIN, '-inf', horizon)
  if w.last and w.last[1] <= w.now - window_ms then w.last = nil end
  w.dirty = true
end

local function win_open(t)
  if WIN_MS == 0 then
    table.insert(DROP, KWIN)
    table.insert(DROP, KWMETA)
    return nil
  end
  local meta = redis.call('HMGET', KWMETA, 'n', 'w')
  local w = {n = tonumber(meta[1]) or 0, ms = WIN_MS, limit = WIN_LIMIT, now = t}
  local newest = redis.call('ZRANGE', KWIN, -1, -1, 'WITHSCORES')
  if newest[2] then  -- w.last: the newest entry {ts, member}, kept current by this script
    w.last = {tonumber(newest[2]), newest[1]}
    w.now = math.max(t, w.last[1])  -- a step back in time is no elapsed time
  end
  local old_ms = tonumber(meta[2])
  if old_ms and old_ms ~= WIN_MS then
    win_evict(w, old_ms)  -- SlidingWindow.reconfigure: expire under the old length first
    w.dirty = true
  end
  win_evict(w, WIN_MS)
  return w
end

local function win_expiry_of(w, units)  -- SlidingWindow._expiry_of; nil past the log
  local freed, first = 0, 0
  while true do
    local chunk = redis.call('ZRANGE', KWIN, first, first + 63, 'WITHSCORES')
    if #chunk == 0 then return nil end
    for i = 1, #chunk, 2 do
      freed = freed + win_cost(chunk[i])
      if freed >= units then return tonumber(chunk[i + 1]) + w.ms end
    end
    first = first + 64
  end
end

local function win_wait(w, cost)
  local excess = w.n + cost - w.limit
  if excess <= 0 then return 0 end
  local expiry = win_expiry_of(w, excess)
  if not expiry then error('kvgate: window log shorter than its count') end
  return expiry - w.now
end

-- SlidingWindow.herd_wait_ms: after the last promised entry, once the log and the promised
-- entries (``{ts, cost}``, ascending, none before now) leave room for ``cost``
local function win_herd_wait(w, cost, promised)
  if #promised == 0 then return win_wait(w, cost) end
  local base = math.max(w.now, promised[#promised][1])
  local horizon = base - w.ms
  local counted, total = {}, 0
  local log = redis.call('ZRANGEBYSCORE', KWIN, '(' .. str(horizon), '+inf', 'WITHSCORES')
  for i = 1, #log, 2 do table.insert(counted, {tonumber(log[i + 1]), win_cost(log[i])}) end
  for _, p in ipairs(promised) do
    if p[1] > horizon then table.insert(counted, p) end
  end
  for _, e in ipairs(counted) do total = total + e[2] end
  local excess, freed = total + cost - w.limit, 0
  for _, e in ipairs(counted) do
    if freed >= excess then break end
    freed = freed + e[2]
    base = e[1] + w.ms
  end
  return base - w.now
end

local function win_consume(w, cost)
  if cost == 0 then return end
  w.n = w.n + cost
  if w.last and w.last[1] == w.now then  -- same ms: merge into one entry
    redis.call('ZREM', KWIN, w.last[2])
    cost = cost + win_cost(w.last[2])
  end
  w.last = {w.now, str(w.now) .. ':' .. str(cost)}
  redis.call('ZADD', KWIN, str(w.now), w.last[2])
  w.dirty = true
end

local function win_refund(w, ts, n)  -- take n back out of the entry written at ts
  local found = redis.call('ZRANGEBYSCORE', KWIN, str(ts), str(ts))
  if #found == 0 then return end  -- already out of the window
  local left = win_cost(found[1]) - n
  redis.call('ZREM', KWIN, found[1])
  w.n = w.n - math.min(n, win_cost(found[1]))
  if left > 0 then redis.call('ZADD', KWIN, str(ts), str(ts) .. ':' .. str(left)) end
  local newest = redis.call('ZRANGE', KWIN, -1, -1, 'WITHSCORES')
  w.last = newest[2] and {tonumber(newest[2]), newest[1]} or nil
  w.dirty = true
end

local function win_reset(w)
  if w.last then return w.last[1] + w.ms - w.now end
  return 0
end

local function win_save(w, t)
  if not w or not w.dirty then return end
  if w.n <= 0 or not w.last then
    redis.call('DEL', KWIN, KWMETA)
    return
  end
  redis.call('HSET', KWMETA, 'n', str(w.n), 'w', str(w.ms))
  local ttl = str(math.max(1, w.last[1] + w.ms - t) + SLACK)
  redis.call('PEXPIRE', KWIN, ttl)
  redis.call('PEXPIRE', KWMETA, ttl)
end

-- UTC calendar (limiter.calendar.period_bounds; H. Hinnant's civil-date algorithms) ------
local DAY = 86400000

local function civil_from_days(z)
  z = z + 719468
  local era = fdiv(z, 146097)
  local doe = z - era * 146097
  local yoe = fdiv(doe - fdiv(doe, 1460) + fdiv(doe, 36524) - fdiv(doe, 146096), 365)
  local doy = doe - (365 * yoe + fdiv(yoe, 4) - fdiv(yoe, 100))
  local mp = fdiv(5 * doy + 2, 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function days_from_civil(y, m)  -- the 1st of month m
  if m <= 2 then y = y - 1 end
  local era = fdiv(y, 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = fdiv(153 * mp + 2, 5)
  return era * 146097 + yoe * 365 + fdiv(yoe, 4) - fdiv(yoe, 100) + doy - 719468
end

local function period_bounds(kind, t)
  local day = fdiv(t, DAY)
  if kind == 'd' then return day * DAY, (day + 1) * DAY end
  local y, m = civil_from_days(day)
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return days_from_civil(y, m) * DAY, days_from_civil(ny, nm) * DAY
end

-- token quotas (limiter.quota.QuotaCounter) ---------------------------------------------
local function q_open(spec, t)
  local start = period_bounds(spec.kind, t)
  local q = {kind = spec.kind, limit = spec.limit, key = spec.key, s = start, used = 0}
  local h = redis.call('HMGET', spec.key, 's', 'u')
  local stored = tonumber(h[1])
  if stored and stored >= start then q.s, q.used = stored, tonumber(h[2]) end
  local _, stop = period_bounds(spec.kind, q.s)
  q.e = stop
  return q
end

local function q_save(q, t)
  if q.used <= 0 then
    redis.call('DEL', q.key)
    return
  end
  redis.call('HSET', q.key, 's', str(q.s), 'u', str(q.used))
  redis.call('PEXPIRE', q.key, str(math.max(1, q.e - t) + SLACK))
end

-- shaper (limiter.buckets.Shaper); a slot is {m, f}: m ms plus f/a of a ms ---------------
local function sh_ahead(m, f, a, t)  -- scaled time from t to {m, f}; only its sign if < 0
  if m < t then return -1 end
  return (m - t) * a + f
end

local function sh_open(t)
  if SHAPE.a == 0 then
    table.insert(DROP, KSHAPE)  -- a dropped shaper starts afresh if it comes back
    return nil
  end
  local s = {a = SHAPE.a, p = SHAPE.p, b = SHAPE.b, m = t, f = 0, holes = {}}
  local h = redis.call('HMGET', KSHAPE, 'm', 'f', 'a', 'p', 'h')
  if not h[1] then return s end
  s.m, s.f = tonumber(h[1]), tonumber(h[2])
  local old_a = tonumber(h[3])
  if old_a ~= s.a or tonumber(h[4]) ~= s.p then  -- reconfigure: keep the tail's time
    s.f, s.dirty = cdiv(s.f * s.a, old_a), true
    if s.f >= s.a then s.m, s.f = s.m + 1, s.f - s.a end
    return s  -- holes are dropped
  end
  for hm, hf in string.gmatch(h[5] or '', '(%d+):(%d+)') do
    if tonumber(hm) >= t then table.insert(s.holes, {tonumber(hm), tonumber(hf)})
    else s.dirty = true end  -- started before now: forgotten
  end
  return s
end

local function sh_held(s, t)
  local ahead, n = sh_ahead(s.m, s.f, s.a, t), 0
  if ahead > 0 then n = cdiv(ahead, s.p) - 1 end
  for _, hole in ipairs(s.holes) do
    if sh_ahead(hole[1], hole[2], s.a, t) > 0 then n = n - 1 end
  end
  return n
end

local function sh_wait(s, t)
  local ahead = sh_ahead(s.m, s.f, s.a, t)
  if #s.holes > 0 or ahead <= 0 then return 0 end
  local over = ahead - s.b * s.p
  if over > 0 then return cdiv(over, s.a) end
  return 0
end

local function sh_drain(s, t)
  local ahead = sh_ahead(s.m, s.f, s.a, t)
  if ahead > 0 then return cdiv(ahead, s.a) end
  return 0
end

local function sh_take(s, t)  -- after a zero wait: a hole first, else the tail (or now)
  s.dirty = true
  if #s.holes > 0 then return table.remove(s.holes, 1) end
  local slot = {t, 0}
  if sh_ahead(s.m, s.f, s.a, t) > 0 then slot = {s.m, s.f} end
  local f = slot[2] + s.p
  local carry = fdiv(f, s.a)
  s.m, s.f = slot[1] + carry, f - carry * s.a
  return slot
end

local function sh_delay(slot, t)  -- sent at the first whole ms of its slot
  local d = slot[1] - t
  if slot[2] > 0 then d = d + 1 end
  return math.max(0, d)
end

local function sh_give_back(s, slot, t)
  if sh_ahead(slot[1], slot[2], s.a, t) <= 0 then return end  -- sent already: it counts
  local at = #s.holes + 1
  for i, hole in ipairs(s.holes) do
    if slot[1] < hole[1] or (slot[1] == hole[1] and slot[2] < hole[2]) then
      at = i
      break
    end
  end
  table.insert(s.holes, at, slot)
  s.dirty = true
end

local function sh_save(s, t)
  if not s or not s.dirty then return end
  if sh_ahead(s.m, s.f, s.a, t) <= 0 and #s.holes == 0 then
    redis.call('DEL', KSHAPE)  -- idle is the default state
    return
  end
  local holes = {}
  for _, hole in ipairs(s.holes) do table.insert(holes, str(hole[1]) .. ':' .. str(hole[2])) end
  redis.call('HSET', KSHAPE, 'm', str(s.m), 'f', str(s.f), 'a', str(s.a), 'p', str(s.p),
             'h', table.concat(holes, ','))
  redis.call('PEXPIRE', KSHAPE, str(math.max(1, s.m + 1 - t) + SLACK))
end

-- retry slots for a herd (limiter.herd) -------------------------------------------------
local HERD_FIELDS = {'requests', 'tokens', 'concurrency', 'shaping_backlog_full'}
-- when the last client promised a slot of these schedules is back (TenantLimiter._back)
local BACK_FIELDS = {'b:requests', 'b:tokens', 'b:shaping_backlog_full'}
local HERD

local MAX_HERD_WAIT = 60000  -- limiter.herd.MAX_HERD_WAIT_MS

local function herd()  -- read once per call
  if HERD then return HERD end
  local read = {'d', 'n', 'wp', unpack(HERD_FIELDS)}
  for _, f in ipairs(BACK_FIELDS) do table.insert(read, f) end
  local h = redis.call('HMGET', KHERD, unpack(read))
  HERD = {d = tonumber(h[1]) or 0, n = tonumber(h[2]) or 0, tat = {}, wp = {}, back = {}}
  for i, f in ipairs(HERD_FIELDS) do HERD.tat[f] = tonumber(h[i + 3]) end
  for i, f in ipairs(BACK_FIELDS) do
    HERD.back[string.sub(f, 3)] = tonumber(h[i + 3 + #HERD_FIELDS])
  end
  -- the window entries promised clients will log: "ms:requests,..." (TenantLimiter's
  -- _window_promised)
  for ts, n in string.gmatch(h[3] or '', '(%d+):(%d+)') do
    table.insert(HERD.wp, {tonumber(ts), tonumber(n)})
  end
  return HERD
end

local function herd_save(H, t)
  local args, last = {'pol', ARGV[4], 'd', str(H.d), 'n', str(H.n)}, t
  for _, f in ipairs(HERD_FIELDS) do
    local v = H.tat[f]
    if v then
      table.insert(args, f)
      table.insert(args, str(v))
      if v > last then last = v end
    end
  end
  for _, f in ipairs(BACK_FIELDS) do
    local v = H.back[string.sub(f, 3)]
    if v then
      table.insert(args, f)
      table.insert(args, str(v))
    end
  end
  local wp = {}
  for _, p in ipairs(H.wp) do table.insert(wp, str(p[1]) .. ':' .. str(p[2])) end
  table.insert(args, 'wp')
  table.insert(args, table.concat(wp, ','))
  if #H.wp > 0 and H.wp[#H.wp][1] > last then last = H.wp[#H.wp][1] end
  redis.call('HSET', KHERD, unpack(args))
  redis.call('PEXPIRE', KHERD, str(last - t + LEASE_TTL + SLACK))
end

local function herd_policy()  -- TenantLimiter.update_policy: new limits forget old promises
  local pol = redis.call('HGET', KHERD, 'pol')
  if pol and pol ~= ARGV[4] then
    redis.call('HDEL', KHERD, 'wp', unpack(HERD_FIELDS))
    redis.call('HDEL', KHERD, unpack(BACK_FIELDS))
    redis.call('HSET', KHERD, 'pol', ARGV[4])
  end
end

local function mean_ms(H)
  if H.n > 0 then return H.d end
  return CONC_RETRY
end

local function completion(mean) return mean + cdiv(mean, 2) + 10 end  -- herd.completion_ms

local function herd_observe(H, duration)  -- limiter.herd.observe
  H.n = math.min(H.n + 1, 8)
  H.d = H.d + fdiv(math.max(0, duration) - H.d, H.n)
end

-- limiter.herd.live_promise: a schedule's promise while a client it was made to may still
-- come back; past the last one's return it is over (nil, so it is written afresh). Returns it
local function herd_live(H, reason, t)
  local back = H.back[reason]
  if back and back < t then H.tat[reason] = nil end
  return H.tat[reason]
end

-- limiter.herd.promise_back: when the last client of a schedule is back once one more is
-- promised a slot at ``at`` (live: the schedule's live promise before it; nil or false: none)
local function herd_back(H, reason, live, at)
  local back = H.back[reason]
  if not live or not back or back < at then H.back[reason] = at end
end

-- limiter.herd.reconcile_promise: a refund or a charge moved bucket b's level from before;
-- the live promise H.tat[reason] moves with it (also the RLS cancel's, on its own schedule
-- hash). Returns whether it was changed
local function herd_reconcile_promise(H, reason, b, before, t)
  local after = tb_level(b, t)
  local promised, back = H.tat[reason], H.back[reason]
  if after == before or not promised or (back and back < t) then return false end
  if after < before then  -- charged
    H.tat[reason] = promised + cdiv(before - after, b.a)
    return true
  end
  if not back then return false end
  local headroom, refill = b.full - before, math.max(0, back - t)
  if refill >= cdiv(headroom, b.a) then return false end
  H.tat[reason] = promised - fdiv(math.min(after - before, headroom - refill * b.a), b.a)
  return true
end

-- TenantLimiter._reconciled: a release moved a bucket's level from before; its live promise
-- moves with it (the herd hash is read only then). Returns whether it was changed
local function herd_reconcile(reason, b, before, t)
  if tb_level(b, t) == before then return false end
  return herd_reconcile_promise(herd(), reason, b, before, t)
end

-- limiter.herd.bucket_slot: the slot in a token bucket's schedule (GCRA; its promise is
-- when it would be full again once every promised client took its cost)
local function herd_bucket_slot(H, reason, b, cost, exact, t)
  local promised = H.tat[reason]
  if not promised or promised <= t + tb_reset(b, t) then return exact end
  local spare = fdiv((b.c - cost) * b.p, b.a)
  return math.max(exact, math.min(promised - spare - t, MAX_HERD_WAIT))
end

-- limiter.herd.promise_bucket
local function herd_promise_bucket(H, reason, b, cost, final, t)
  local full = t + math.max(tb_reset(b, t), final)
  local base = math.max(H.tat[reason] or full, full)
  local bound = math.max(full, t + MAX_HERD_WAIT) + cdiv(b.c * b.p, b.a)
  H.tat[reason] = math.min(base + cdiv(cost * b.p, b.a), bound)
end

-- limiter.herd.promise_window: the entry this client logs when it comes back
local function herd_promise_window(H, at, requests)
  local wp = H.wp
  if #wp > 0 and wp[#wp][1] == at then requests = requests + table.remove(wp)[2] end
  table.insert(wp, {at, requests})
  local kept = {}
  for _, p in ipairs(wp) do
    if p[1] > at - WIN_MS then table.insert(kept, p) end
  end
  H.wp = kept
end

-- TenantLimiter._shaper_slot (its promise: the backlog's virtual tail in ms)
local function herd_shaper_slot(H, s, exact, t)
  local promised = H.tat['shaping_backlog_full']
  if not promised or promised <= t + sh_drain(s, t) then return exact end
  local room = fdiv(s.b * s.p, s.a)
  return math.max(exact, math.min(promised - room - t, MAX_HERD_WAIT))
end

-- TenantLimiter._promise_shaper
local function herd_promise_shaper(H, s, final, t)
  local tail = math.max(t + sh_drain(s, t), t + final)
  local base = math.max(H.tat['shaping_backlog_full'] or tail, tail)
  local bound = t + MAX_HERD_WAIT + cdiv((s.b + 1) * s.p, s.a)
  H.tat['shaping_backlog_full'] = math.min(base + cdiv(s.p, s.a), bound)
end

-- waits: the flat {reason, exact wait, ...} list; each wait becomes this client's slot.
-- Every dimension the client takes from when it comes back is scheduled, refusing or not
-- (TenantLimiter._schedule). tokens nil: the headers-phase check
local function herd_schedule(waits, requests, tokens, t, st)
  local H = herd()
  local exact, slots, paced, live = {}, {}, {}, {}
  for i = 1, #waits, 2 do exact[waits[i]] = waits[i + 1] end
  local buckets = {{'requests', st.req, requests}, {'tokens', tokens and st.tok, tokens or 0}}
  for _, p in ipairs(buckets) do
    if p[2] and (p[3] > 0 or exact[p[1]]) then
      table.insert(paced, p)
      live[p[1]] = herd_live(H, p[1], t) or false
      slots[p[1]] = herd_bucket_slot(H, p[1], p[2], p[3], exact[p[1]] or 0, t)
    end
  end
  local win = requests > 0 and st.win
  local win_slot
  if win then
    local kept = {}
    for _, p in ipairs(H.wp) do
      if p[1] >= t then table.insert(kept, p) end
    end
    H.wp = kept
    win_slot = win_herd_wait(win, requests, kept)
    slots['requests_window'] = math.max(exact['requests_window'] or 0,
                                        math.min(win_slot, MAX_HERD_WAIT))
  end
  local sh = requests > 0 and st.sh
  if sh then
    live['shaping_backlog_full'] = herd_live(H, 'shaping_backlog_full', t) or false
    slots['shaping_backlog_full'] = herd_shaper_slot(H, sh, exact['shaping_backlog_full'] or 0, t)
  end
  for i = 1, #waits, 2 do
    local reason, wait = waits[i], waits[i + 1]
    if not slots[reason] then  -- concurrency: a slot frees as requests end
      local tat = H.tat[reason]
      if tat then
        wait = math.max(wait, tat + cdiv(completion(mean_ms(H)), math.max(MAX_CONC, 1)) - t)
      end
      wait = math.max(exact[reason], math.min(wait, MAX_HERD_WAIT))  -- herd.MAX_HERD_WAIT_MS
      H.tat[reason] = t + wait
      slots[reason] = wait
    end
  end
  local final, top = 0, nil
  for _, slot in pairs(slots) do final = math.max(final, slot) end
  for _, p in ipairs(paced) do herd_promise_bucket(H, p[1], p[2], p[3], final, t) end
  if win and win_slot <= final then herd_promise_window(H, t + final, requests) end
  if sh then herd_promise_shaper(H, sh, final, t) end
  for reason, promise in pairs(live) do  -- this client is back at t + final too
    herd_back(H, reason, promise, t + final)
  end
  for i = 1, #waits, 2 do
    waits[i + 1] = slots[waits[i]]
    if not top or waits[i + 1] > waits[top + 1] then top = i end
  end
  waits[top + 1] = final  -- one that did not refuse may set it
  herd_save(H, t)
end

local function lease_start(meta)  -- the 13th field of a lease's meta, if it has one
  local i = 0
  for field in string.gmatch(meta, '[^:]+') do
    i = i + 1
    if i == 13 then return tonumber(field) end
  end
  return nil
end

local function lease_slot(meta)  -- the slot a lease's meta records (fields 9-12), if any
  local f = {}
  for field in string.gmatch(meta or '', '[^:]+') do table.insert(f, field) end
  if #f < 12 or f[9] == 'n' then return nil end
  return {tonumber(f[9]), tonumber(f[10])}, tonumber(f[11]), tonumber(f[12])
end

-- the whole tenant ----------------------------------------------------------------------
-- Opening applies a changed policy (TenantLimiter.update_policy) and expires leases, as
-- MemoryStore does on every call that carries a policy.
local function open_all(t)
  local in_flight = leases_purge(t)  -- first: it may give quotas back (unsent_refund)
  herd_policy()
  local st = {req = tb_open(REQ, t), tok = tb_open(TOK, t), win = win_open(t), quotas = {},
              sh = sh_open(t), in_flight = in_flight}
  for _, spec in ipairs(QUOTAS) do
    if spec.limit > 0 then st.quotas[spec.kind] = q_open(spec, t) end
  end
  if #DROP > 0 then redis.call('DEL', unpack(DROP)) end
  return st
end

local function push(out, values, count)  -- '' stands for a dimension not configured
  for i = 1, count do
    if values then table.insert(out, str(values[i])) else table.insert(out, '') end
  end
end

-- reply: {code, "19 comma-separated view fields", extra...}; one string, because the
-- Python client parses each array element separately. Saves the window and the shaper on
-- every path.
local function finish(st, t, code, extra)
  win_save(st.win, t)
  local views = {}
  for _, b in ipairs({st.req or false, st.tok or false}) do
    push(views, b and {b.c, fdiv(tb_level(b, t), b.p), tb_reset(b, t)}, 3)
  end
  push(views, st.win and {st.win.n, win_reset(st.win)}, 2)
  for _, kind in ipairs({'d', 'm'}) do
    local q = st.quotas[kind]
    push(views, q and {q.limit, q.used, q.e - t, q.s}, 4)
  end
  push(views, {st.in_flight}, 1)
  push(views, st.sh and {sh_held(st.sh, t), sh_drain(st.sh, t)}, 2)
  sh_save(st.sh, t)
  local out = {code, table.concat(views, ',')}
  for _, v in ipairs(extra) do table.insert(out, v) end
  return out
end

local function request_waits(st, requests, t, waits)
  if st.req then
    local wait = tb_wait(st.req, requests, t)
    if wait > 0 then table.insert(waits, 'requests'); table.insert(waits, wait) end
  end
  if st.win then
    local wait = win_wait(st.win, requests)
    if wait > 0 then table.insert(waits, 'requests_window'); table.insert(waits, wait) end
  end
end

local function concurrency_wait(st, waits, t)  -- limiter.herd.concurrency_wait
  if MAX_CONC > 0 and st.in_flight >= MAX_CONC then
    local oldest
    for _, meta in ipairs(redis.call('HVALS', KLMETA)) do
      local start = lease_start(meta)
      if start and (not oldest or start < oldest) then oldest = start end
    end
    local expected = completion(mean_ms(herd()))
    table.insert(waits, 'concurrency')
    if oldest then
      local due = oldest + expected - t
      if due <= 0 then  -- late: as long as it is late, up to one slot's interval
        due = math.max(1, math.min(0 - due, cdiv(expected, MAX_CONC)))
      end
      table.insert(waits, due)
    else
      table.insert(waits, expected)
    end
  end
end

local function shaping_wait(st, requests, t, waits)
  if st.sh and requests > 0 then
    local wait = sh_wait(st.sh, t)
    if wait > 0 then table.insert(waits, 'shaping_backlog_full'); table.insert(waits, wait) end
  end
end
"""

# ARGV[5..11]: tokens, requests, lease id, '1' if the request can never fit (Python knows),
# leases this replica holds for the tenant, '1' if it may wait before it is sent upstream
# (queued, or paced by its shaper: its meta then ends in ':u' until _SENT, see
# unsent_refund), '1' if this is a resend after a broken connection.
_ADMIT = r"""
local tokens, requests, lease = arg(OP), arg(OP + 1), ARGV[OP + 2]
local st = open_all(NOW)
if cancelled(lease, NOW) then return finish(st, NOW, 'cancelled', {}) end
if redis.call('ZSCORE', KLEASES, lease) then
  if ARGV[OP + 6] == '1' then  -- the first try ran: the same answer again
    local slot = lease_slot(redis.call('HGET', KLMETA, lease))
    return finish(st, NOW, 'ok', {slot and sh_delay(slot, NOW) or 0})
  end
  return finish(st, NOW, 'dup', {})
end
if st.in_flight < arg(OP + 4) then return finish(st, NOW, 'lost', {}) end
if ARGV[OP + 3] == '1' then return finish(st, NOW, 'static', {}) end
local failing = {}
for _, kind in ipairs({'d', 'm'}) do
  local q = st.quotas[kind]
  if q and q.used + tokens > q.limit then table.insert(failing, kind) end
end
if #failing > 0 then return finish(st, NOW, 'quota', failing) end
local waits = {}
request_waits(st, requests, NOW, waits)
if st.tok then
  local wait = tb_wait(st.tok, tokens, NOW)
  if wait > 0 then table.insert(waits, 'tokens'); table.insert(waits, wait) end
end
concurrency_wait(st, waits, NOW)
shaping_wait(st, requests, NOW, waits)
if #waits > 0 then
  herd_schedule(waits, requests, tokens, NOW, st)
  return finish(st, NOW, 'wait', waits)
end

local flags = {'0', '0', '0'}
local charged = {str(requests), '0', '0', '0'}  -- requests, req bucket, window, window ts
if st.req then tb_take(st.req, requests, NOW); tb_save(st.req, NOW); charged[2] = '1' end
if st.win and requests > 0 then
  win_consume(st.win, requests)
  charged[3], charged[4] = '1', str(st.win.now)
end
if st.tok then tb_take(st.tok, tokens, NOW); tb_save(st.tok, NOW); flags[1] = '1' end
for i, kind in ipairs({'d', 'm'}) do
  local q = st.quotas[kind]
  if q then
    q.used = q.used + tokens
    q_save(q, NOW)
    flags[i + 1] = '1'
  end
end
local shaped, hold = 'n:0:0:0', 0
if st.sh and requests > 0 then
  local slot = sh_take(st.sh, NOW)
  shaped = str(slot[1]) .. ':' .. str(slot[2]) .. ':' .. str(st.sh.a) .. ':' .. str(st.sh.p)
  hold = sh_delay(slot, NOW)
end
redis.call('ZADD', KLEASES, str(NOW + LEASE_TTL), lease)
redis.call('HSET', KLMETA, lease, str(tokens) .. ':' .. table.concat(flags, ':') .. ':'
           .. table.concat(charged, ':') .. ':' .. shaped .. ':' .. str(NOW)
           .. (ARGV[OP + 5] == '1' and ':u' or ''))
leases_save(NOW)
st.in_flight = st.in_flight + 1
return finish(st, NOW, 'ok', {hold})
"""

# ARGV[5]: mode ('c' = cancel: refund everything each admission charged, and refuse it if it
# comes later; '' = release; 'u' = usage: tokens admissions Redis never saw used, served while
# it was unreachable, charged to the quotas once per id however often it is resent within
# an hour), then
# (lease id, used tokens) pairs: used '' = unknown, the reservation counts as used; 'n' =
# never served (it left the queue, or kvgate refused it after admitting it): everything its
# admission charged comes back, as for a cancel (TenantLimiter.release served=False). Several
# leases of one tenant in one call (the store coalesces the releases of concurrent
# requests): the tenant is opened and saved once, each lease is settled exactly as a call of
# its own would. A lease re-asserted without its admission's record (Redis lost it, or never
# had it: the fallback admitted it) charges what it used to the quotas at its release.
# Returns 1 (released, or charged) or 0 (unknown, expired, released or charged already) per
# lease, in order.
_RELEASE = r"""
local cancel = ARGV[OP] == 'c'
local st = open_all(NOW)
local out, H, any, req_dirty, tok_dirty = {}, nil, false, false, false
local function quota_charge(n)
  for _, kind in ipairs({'d', 'm'}) do
    local q = st.quotas[kind]
    if q and n > 0 then q.used = q.used + n; q.dirty = true end
  end
end
if ARGV[OP] == 'u' then
  for i = OP + 1, #ARGV, 2 do
    if cancelled(ARGV[i], NOW) then table.insert(out, 0) else
      cancel_mark(ARGV[i], NOW, USAGE_MARK)
      quota_charge(tonumber(ARGV[i + 1]))
      table.insert(out, 1)
    end
  end
end
local last = ARGV[OP] == 'u' and 0 or #ARGV  -- usage: charged above, no lease to release
for i = OP + 1, last, 2 do
  local lease, used_arg = ARGV[i], ARGV[i + 1]
  if used_arg == 's' then  -- not a release: dispatched from the queue (RedisStore.mark_sent)
    mark_sent(lease)
    table.insert(out, 1)
  else
    if cancel then cancel_mark(lease, NOW) end
    local held = redis.call('ZREM', KLEASES, lease) == 1
    -- expired while its holder could not renew it (Redis unreachable longer than the lease
    -- TTL): no slot to free, but its reservation is still settled against what it used
    local meta = nil
    if held then
      meta = redis.call('HGET', KLMETA, lease)
      redis.call('HDEL', KLMETA, lease)
    else
      meta = gone_take(lease, NOW)
    end
    if not held and not meta then
      table.insert(out, 0)
    else
      table.insert(out, held and 1 or 0)
      any = any or held
      local started = meta and lease_start(meta)
      local unserved = cancel or used_arg == 'n'
      -- a cancelled admission's time, or a request that used nothing (it left the queue, or
      -- it was a GET), says nothing of durations (TenantLimiter.release)
      if held and started and not unserved and used_arg ~= '0' then
        H = herd()
        herd_observe(H, NOW - started)
      end
      local slot, slot_a, slot_p = lease_slot(meta)
      if held and slot and st.sh and slot_a == st.sh.a and slot_p == st.sh.p then
        sh_give_back(st.sh, slot, NOW)  -- not sent yet (its client left): a hole
      end
      -- tokens:tb:day:month[:requests:req:win:ts:slot m:f:a:p:start]; a re-asserted lease
      -- has none
      local f = {}
      for field in string.gmatch(meta or '0:0:0:0', '[^:]+') do table.insert(f, field) end
      local reserved, tb, day, month = tonumber(f[1]), f[2], f[3], f[4]
      local used = reserved
      if unserved then used = 0
      elseif used_arg ~= '' then used = math.max(0, tonumber(used_arg)) end
      if unserved and f[5] then
        local requests = tonumber(f[5])
        if f[6] == '1' and st.req then
          local before = tb_level(st.req, NOW)
          tb_refund(st.req, requests, NOW)
          req_dirty = true
          if herd_reconcile('requests', st.req, before, NOW) then H = herd() end
        end
        if f[7] == '1' and st.win then win_refund(st.win, tonumber(f[8]), requests) end
      end
      if tb == '1' and st.tok then
        local before = tb_level(st.tok, NOW)
        if used < reserved then tb_refund(st.tok, reserved - used, NOW)
        elseif used > reserved then tb_take(st.tok, used - reserved, NOW) end
        if herd_reconcile('tokens', st.tok, before, NOW) then H = herd() end
        tok_dirty = true
      end
      for kind, charged in pairs({d = day, m = month}) do
        local q = st.quotas[kind]
        if charged == '1' and q then
          q.used = math.max(0, q.used - (reserved - used))
          q.dirty = true
        elseif charged == 'r' and q and used > 0 then  -- refunded at its expiry: the usage
          q.used = q.used + used
          q.dirty = true
        end
      end
    end
  end
end
if H then herd_save(H, NOW) end
if req_dirty then tb_save(st.req, NOW) end
if tok_dirty then tb_save(st.tok, NOW) end
for _, kind in ipairs({'d', 'm'}) do
  local q = st.quotas[kind]
  if q and q.dirty then q_save(q, NOW) end
end
if any then leases_save(NOW) end
finish(st, NOW, 'released', {})
return out
"""

_CHECK = r"""
local st = open_all(NOW)
local waits = {}
request_waits(st, 1, NOW, waits)
concurrency_wait(st, waits, NOW)
shaping_wait(st, 1, NOW, waits)
if #waits > 0 then
  herd_schedule(waits, 1, nil, NOW, st)
  return finish(st, NOW, 'wait', waits)
end
return finish(st, NOW, 'ok', {})
"""

_USAGE = r"""
return finish(open_all(NOW), NOW, 'ok', {})
"""

# ARGV[4]: '1' = re-assert (put back leases Redis lost, unless cancelled); ARGV[5..]: lease
# ids. Needs no policy: only the lease ZSETs are touched.
_RENEW = r"""
leases_purge(NOW)
local reassert = ARGV[4] == '1'
local renewed = 0
for i = 5, #ARGV do
  local held = redis.call('ZSCORE', KLEASES, ARGV[i])
  if held or (reassert and not cancelled(ARGV[i], NOW)) then
    redis.call('ZADD', KLEASES, str(NOW + LEASE_TTL), ARGV[i])
    if not held then  -- expired while its holder could not renew it: its record back
      local meta = gone_take(ARGV[i], NOW)
      if meta then redis.call('HSET', KLMETA, ARGV[i], meta) end
    end
    renewed = renewed + 1
  end
end
if renewed > 0 then leases_save(NOW) end
return renewed
"""

_IN_FLIGHT = r"""
return leases_purge(NOW)
"""

# ARGV[4..]: lease ids sent upstream (dispatched from the queue, or routed once their
# shaper's slot came): their meta loses the ':u' that would give their reservation back to
# the quotas should they expire unreleased.
_SENT = r"""
for i = 4, #ARGV do mark_sent(ARGV[i]) end
return 1
"""

SCRIPTS: dict[str, str] = {
    "admit": _CORE + _POLICY + _ADMIT,
    "release": _CORE + _POLICY + _RELEASE,
    "check": _CORE + _POLICY + _CHECK,
    "usage": _CORE + _POLICY + _USAGE,
    "renew": _CORE + _RENEW,
    "in_flight": _CORE + _IN_FLIGHT,
    "sent": _CORE + _SENT,
}
