"""Bucket math with exact integer state and an injected clock (``now_ms`` on every call).

Why integers: the promise "retry after ``wait_ms`` and you are admitted, 1 ms earlier and you
are not" only holds if no rounding happens anywhere. Levels are therefore stored *scaled* by
the rate's period (``level_scaled = tokens × period_ms``), so one elapsed millisecond adds
exactly ``rate.amount`` and every wait is an exact ceiling division.

Why tolerate time going backwards: the clock is injected and may come from several sources
(replicas, Redis ``TIME``); a step back is treated as no elapsed time, never as negative refill.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from limiter.rates import Rate, require_int


def ceil_div(a: int, b: int) -> int:
    """Exact ceiling of ``a / b`` for ``b > 0`` (no float on the way)."""
    return -(-a // b)


MAX_DEBT_SCALED = 2**51
"""The deepest a bucket's debt goes, in scaled units: the Redis scripts saturate there
(``LMAX``, to stay exact in Lua doubles), so the in-memory bucket does too, or the two
stores answer a huge charge on a slow rate with waits years apart."""


def bucket_view(capacity: int, rate: Rate, level_scaled: int) -> tuple[int, int, int]:
    """``(capacity, available, reset_ms)`` of a bucket at a known scaled level (a pure
    function, so the numbers can be taken later from a level remembered now)."""
    reset = ceil_div(max(0, capacity * rate.period_ms - level_scaled), rate.amount)
    return capacity, level_scaled // rate.period_ms, reset


class TokenBucket:
    """Classic token bucket: refills at ``rate`` up to ``capacity``; starts full.

    The state is just ``(level_scaled, last_ms)`` so a Redis Lua script can mirror it.
    ``level_scaled`` may go negative after :meth:`charge` (debt from an output overshoot).
    """

    __slots__ = ("capacity", "last_ms", "level_scaled", "rate")

    def __init__(self, rate: Rate, capacity: int, now_ms: int) -> None:
        self.rate = rate
        self.capacity = require_int("capacity", capacity, 1)
        self.level_scaled = capacity * rate.period_ms
        self.last_ms = now_ms

    @property
    def full_scaled(self) -> int:
        """The capacity in scaled units (tokens × period_ms)."""
        return self.capacity * self.rate.period_ms

    def level_at(self, now_ms: int) -> int:
        """Scaled level at ``now_ms`` without mutating anything (peeks stay peeks)."""
        level, elapsed = self.level_scaled, now_ms - self.last_ms
        if elapsed <= 0:
            return level
        full = self.capacity * self.rate.period_ms
        return level if level >= full else min(full, level + elapsed * self.rate.amount)

    def _advance(self, now_ms: int) -> None:
        self.level_scaled = self.level_at(now_ms)
        self.last_ms = max(self.last_ms, now_ms)

    def _reject_cost(self, cost: int) -> None:
        """Raise for a cost that is not an int in 0..capacity (callers test that inline:
        the admission path runs it several times per request)."""
        require_int("cost", cost, 0)
        raise ValueError(f"cost {cost} exceeds capacity {self.capacity}: it can never fit")

    def available(self, now_ms: int) -> int:
        """Whole tokens available now (floor); negative while in debt."""
        return self.view(now_ms)[1]

    def view(self, now_ms: int) -> tuple[int, int, int]:
        """``(capacity, available, reset_ms)`` at ``now_ms`` — the ``x-ratelimit-*`` numbers."""
        return bucket_view(self.capacity, self.rate, self.level_at(now_ms))

    def wait_ms(self, cost: int, now_ms: int) -> int:
        """Exact ms until ``cost`` fits (0 if it fits now). Raises ValueError if cost > capacity."""
        if type(cost) is not int or not 0 <= cost <= self.capacity:
            self._reject_cost(cost)
        deficit = cost * self.rate.period_ms - self.level_at(now_ms)
        return ceil_div(deficit, self.rate.amount) if deficit > 0 else 0

    def consume(self, cost: int, now_ms: int) -> None:
        """Take ``cost`` tokens; only legal when :meth:`wait_ms` is 0 (else ValueError)."""
        if type(cost) is not int or not 0 <= cost <= self.capacity:
            self._reject_cost(cost)
        level = self.level_at(now_ms)
        needed = cost * self.rate.period_ms
        if needed > level:
            raise ValueError(f"cost {cost} does not fit at {now_ms} ms; check wait_ms first")
        self.level_scaled = level - needed
        if now_ms > self.last_ms:
            self.last_ms = now_ms

    def refund(self, amount: int, now_ms: int) -> None:
        """Give back unused tokens; never above capacity (a refund is not a bonus)."""
        if type(amount) is not int or amount < 0:
            require_int("amount", amount, 0)
        level = self.level_at(now_ms) + amount * self.rate.period_ms
        self.level_scaled = min(self.capacity * self.rate.period_ms, level)
        self.last_ms = max(self.last_ms, now_ms)

    def charge(self, amount: int, now_ms: int) -> None:
        """Unconditional debit, possibly into debt: the output overshot its reservation."""
        if type(amount) is not int or amount < 0:
            require_int("amount", amount, 0)
        self._advance(now_ms)
        self.level_scaled = max(-MAX_DEBT_SCALED,
                                self.level_scaled - amount * self.rate.period_ms)

    def reset_ms(self, now_ms: int) -> int:
        """Ms until the bucket is full again (``x-ratelimit-reset-*``)."""
        return self.view(now_ms)[2]

    def reconfigure(self, rate: Rate, capacity: int, now_ms: int) -> None:
        """Swap rate/capacity on a config reload, keeping the current level (floored, clamped).

        A *full* bucket stays full (at the new capacity): an idle tenant gets its new burst
        at once, and a shared store that lets full buckets expire (Redis TTLs) cannot
        remember the old level anyway, so both stores agree.
        """
        require_int("capacity", capacity, 1)
        self._advance(now_ms)
        was_full = self.level_scaled >= self.full_scaled
        # Floor division rounds debt further down: a reload never hands out free tokens.
        level = self.level_scaled * rate.period_ms // self.rate.period_ms
        self.rate, self.capacity = rate, capacity
        self.level_scaled = (self.full_scaled if was_full
                             else max(-MAX_DEBT_SCALED, min(level, self.full_scaled)))


class SlidingWindow:
    """Exact sliding log at ms granularity: at most ``limit`` cost in any ``window_ms``.

    An entry stamped ``ts`` counts while ``ts > now - window_ms``. Unlike a fixed window it
    never lets 2× through at a boundary. Entries have cost ≥ 1 and same-ms entries are merged,
    so memory is bounded by ``limit`` entries.
    """

    __slots__ = ("_log", "_now_ms", "_used", "limit", "window_ms")

    def __init__(self, limit: int, window_ms: int) -> None:
        self.limit = require_int("limit", limit, 1)
        self.window_ms = require_int("window_ms", window_ms, 1)
        self._log: deque[tuple[int, int]] = deque()
        self._used = 0
        self._now_ms: int | None = None

    def __len__(self) -> int:
        """Number of log entries held (for memory-bound checks)."""
        return len(self._log)

    def _advance(self, now_ms: int) -> int:
        """Clamp to the latest time seen (a step back is no elapsed time) and evict expired."""
        if self._now_ms is not None:
            now_ms = max(now_ms, self._now_ms)
        self._now_ms = now_ms
        horizon = now_ms - self.window_ms
        while self._log and self._log[0][0] <= horizon:
            self._used -= self._log.popleft()[1]
        return now_ms

    def used(self, now_ms: int) -> int:
        """Cost counted in the window ending at ``now_ms``."""
        self._advance(now_ms)
        return self._used

    def remaining(self, now_ms: int) -> int:
        """Cost that would fit right now."""
        return max(0, self.limit - self.used(now_ms))

    def wait_ms(self, cost: int, now_ms: int) -> int:
        """Exact ms until ``cost`` fits: when enough of the oldest entries have expired."""
        require_int("cost", cost, 0)
        if cost > self.limit:
            raise ValueError(f"cost {cost} exceeds window limit {self.limit}: it can never fit")
        now_ms = self._advance(now_ms)
        excess = self._used + cost - self.limit
        if excess <= 0:
            return 0
        expiry = self._expiry_of(excess)
        assert expiry is not None, "the log holds more than the excess"
        return expiry - now_ms

    def herd_wait_ms(self, cost: int, now_ms: int, promised: Sequence[tuple[int, int]]) -> int:
        """The wait of the next client of a refused herd, given the entries the clients
        promised a retry will log when they come back (``(ts, cost)``, ascending, none
        before now): it comes back after the last of them (a herd retries in order), once
        the log and those entries leave room for ``cost``. A client taking its place in the
        window at its own retry time, whatever dimension chose that time, is what keeps the
        slots exact when another limit spaces the herd: read from the log alone (each
        client assumed back when an entry left) they came too early for the window."""
        now_ms = self._advance(now_ms)
        if not promised:
            return self.wait_ms(cost, now_ms)
        base = max(now_ms, promised[-1][0])
        horizon = base - self.window_ms
        counted = [(ts, c) for ts, c in self._log if ts > horizon]
        counted += [(ts, c) for ts, c in promised if ts > horizon]
        excess = sum(c for _, c in counted) + cost - self.limit
        freed = 0
        for ts, entry_cost in counted:
            if freed >= excess:
                break
            freed += entry_cost
            base = ts + self.window_ms
        return base - now_ms

    def _expiry_of(self, units: int) -> int | None:
        """When the oldest ``units`` of cost in the log have all left the window."""
        freed = 0
        for ts, entry_cost in self._log:
            freed += entry_cost
            if freed >= units:
                return ts + self.window_ms
        return None

    def consume(self, cost: int, now_ms: int) -> int:
        """Log ``cost`` at ``now_ms``; only legal when :meth:`wait_ms` is 0 (else ValueError).
        Returns the time it is logged at (``now_ms``, or the latest seen after a step back)."""
        if self.wait_ms(cost, now_ms):
            raise ValueError(f"cost {cost} does not fit at {now_ms} ms; check wait_ms first")
        now_ms = self._advance(now_ms)
        if cost == 0:
            return now_ms
        self._used += cost
        if self._log and self._log[-1][0] == now_ms:
            cost += self._log.pop()[1]
        self._log.append((now_ms, cost))
        return now_ms

    def refund(self, cost: int, now_ms: int) -> None:
        """Un-count ``cost`` from the newest entries (a later dimension said no)."""
        require_int("cost", cost, 0)
        self._advance(now_ms)
        while cost > 0 and self._log:
            ts, entry_cost = self._log.pop()
            take = min(cost, entry_cost)
            cost -= take
            self._used -= take
            if entry_cost > take:
                self._log.append((ts, entry_cost - take))

    def refund_at(self, ts: int, cost: int, now_ms: int) -> None:
        """Un-count ``cost`` from the entry logged at ``ts`` (an admission undone: its own
        entry, not a newer one, which would leave the window later); nothing once it left."""
        require_int("cost", cost, 0)
        self._advance(now_ms)
        for i, (entry_ts, entry_cost) in enumerate(self._log):
            if entry_ts == ts:
                take = min(cost, entry_cost)
                self._used -= take
                if entry_cost > take:
                    self._log[i] = (ts, entry_cost - take)
                else:
                    del self._log[i]
                return

    def reset_ms(self, now_ms: int) -> int:
        """Ms until the window is empty again (the newest entry expires)."""
        now_ms = self._advance(now_ms)
        return self._log[-1][0] + self.window_ms - now_ms if self._log else 0

    def reconfigure(self, limit: int, window_ms: int, now_ms: int) -> None:
        """Swap the limit on a config reload; logged usage keeps counting.

        Entries already expired under the *old* window are evicted first: a longer new
        window must not resurrect them (a TTL-based store has dropped them already).
        """
        require_int("limit", limit, 1)
        require_int("window_ms", window_ms, 1)
        self._advance(now_ms)
        self.limit, self.window_ms = limit, window_ms
        self._advance(now_ms)


class Shaper:
    """A leaky bucket used as a *shaper*: requests leave at ``rate``, evenly spaced, and up
    to ``backlog`` of them wait for their turn instead of being refused.

    Each admitted request gets a departure *slot*. Time is scaled by ``rate.amount`` (a slot
    lasts exactly ``rate.period_ms`` scaled units, so nothing rounds) and a request is sent
    at the first whole ms of its slot: consecutive sends are never closer than ``1/rate``.
    A request arriving at an idle shaper leaves at once; later ones queue behind the *tail*
    (the start of the slot after the last one handed out). A slot given back before it
    starts (its client left) is a *hole* that the next arrival takes, so the spacing holds
    whatever leaves. Slots are all the state: one hash in Redis mirrors it.
    """

    __slots__ = ("backlog", "holes", "rate", "tail")

    def __init__(self, rate: Rate, backlog: int) -> None:
        self.rate = rate
        self.backlog = require_int("backlog", backlog, 0)
        self.tail = 0  # scaled: the next slot at the end starts here (or now, if earlier)
        self.holes: list[int] = []  # slots given back, ascending; none starts before now

    def _now(self, now_ms: int) -> int:
        """Now in scaled units, after forgetting holes that started before it."""
        now = now_ms * self.rate.amount
        while self.holes and self.holes[0] < now:
            del self.holes[0]
        return now

    def held(self, now_ms: int) -> int:
        """Requests whose slot has not started: the backlog in use."""
        now = self._now(now_ms)
        ahead = self.tail - now
        slots = ceil_div(ahead, self.rate.period_ms) - 1 if ahead > 0 else 0
        return slots - sum(1 for hole in self.holes if hole > now)

    def wait_ms(self, now_ms: int) -> int:
        """Exact ms until one more request fits in the backlog (0: it fits now)."""
        ahead = self.tail - self._now(now_ms)
        if self.holes or ahead <= 0:
            return 0
        over = ahead - self.backlog * self.rate.period_ms
        return ceil_div(over, self.rate.amount) if over > 0 else 0

    def take(self, now_ms: int) -> int:
        """A slot for one request (a hole first); only legal when :meth:`wait_ms` is 0."""
        if self.wait_ms(now_ms):
            raise ValueError(f"the backlog is full at {now_ms} ms; check wait_ms first")
        if self.holes:
            return self.holes.pop(0)
        slot = max(self.tail, now_ms * self.rate.amount)
        self.tail = slot + self.rate.period_ms
        return slot

    def delay_ms(self, slot: int, now_ms: int) -> int:
        """How long the request holding ``slot`` waits before it is sent."""
        return max(0, ceil_div(slot, self.rate.amount) - now_ms)

    def give_back(self, slot: int, now_ms: int) -> None:
        """Its request ended: if it was never sent (its send ms is still ahead), the slot
        becomes a hole. One sent already (even this ms) keeps its slot: the spacing counts it."""
        if slot > now_ms * self.rate.amount:
            bisect.insort(self.holes, slot)

    def drain_ms(self, now_ms: int) -> int:
        """Ms until every slot handed out has started."""
        return max(0, ceil_div(self.tail - self._now(now_ms), self.rate.amount))

    def reconfigure(self, rate: Rate, backlog: int) -> None:
        """A config reload: a new rate spaces the slots handed out from now on (the tail
        keeps its time, rounded up; holes are dropped); a new backlog applies at once."""
        require_int("backlog", backlog, 0)
        if rate != self.rate:
            self.tail = ceil_div(self.tail * rate.amount, self.rate.amount)
            self.holes = []
        self.rate, self.backlog = rate, backlog


class FixedWindow:
    """At most ``limit`` cost per window of ``window_ms``, windows aligned on the epoch
    (envoyproxy/ratelimit's counters: the same instants reset for every replica and store).

    Lets up to 2× ``limit`` through around a boundary; offered for configurations carried
    over from that service, not for protection. :meth:`charge` may overshoot the limit
    (usage charged after the fact).
    """

    __slots__ = ("limit", "start_ms", "used", "window_ms")

    def __init__(self, limit: int, window_ms: int) -> None:
        self.limit = require_int("limit", limit, 0)
        self.window_ms = require_int("window_ms", window_ms, 1)
        self.start_ms = 0
        self.used = 0

    def _advance(self, now_ms: int) -> None:
        start = now_ms - now_ms % self.window_ms
        if start > self.start_ms:
            self.start_ms, self.used = start, 0

    def remaining(self, now_ms: int) -> int:
        self._advance(now_ms)
        return max(0, self.limit - self.used)

    def reset_ms(self, now_ms: int) -> int:
        """Ms until the current window ends (its count goes back to 0)."""
        self._advance(now_ms)
        return self.start_ms + self.window_ms - now_ms

    def wait_ms(self, cost: int, now_ms: int) -> int:
        """0 if ``cost`` fits now, else the ms until the next window; ValueError if it can
        never fit."""
        require_int("cost", cost, 0)
        if cost > self.limit:
            raise ValueError(f"cost {cost} exceeds window limit {self.limit}: it can never fit")
        self._advance(now_ms)
        return 0 if self.used + cost <= self.limit else self.reset_ms(now_ms)

    def charge(self, cost: int, now_ms: int) -> None:
        """Count ``cost``, over the limit if need be (check :meth:`wait_ms` first to stay
        within it)."""
        require_int("cost", cost, 0)
        self._advance(now_ms)
        self.used += cost

    def refund(self, cost: int, at_ms: int, now_ms: int) -> None:
        """Un-count ``cost`` counted at ``at_ms`` (a call undone) while its window lasts: a
        later window never counted it."""
        require_int("cost", cost, 0)
        self._advance(now_ms)
        if at_ms - at_ms % self.window_ms == self.start_ms:
            self.used = max(0, self.used - cost)
