"""Envoy Rate Limit Service rules: descriptor matching and the decision over its counters.

Rules are shaped like envoyproxy/ratelimit's: per domain, a tree of descriptors (``key``,
optional ``value``) whose nodes may carry a limit. A request descriptor (a list of
``key=value`` entries) is walked down the tree one entry per level; at each level the most
specific node wins — the exact ``key``/``value``, else the first value pattern with ``*``
that matches, else the ``key`` alone (any value) — and the limit applies only if the node
reached by the *last* entry has one. Counters are per descriptor (domain plus every
``key=value`` the request sent), so a key-only rule counts each value apart.

What kvgate adds: a token bucket (with ``burst``) or an exact sliding window besides the
fixed window, a wait for ``Retry-After`` that schedules a refused herd (each client its own
slot, as :mod:`limiter.herd` does for kvgate's own limits: one exact wait told to a herd
brought it back in the same ms, and all but the limit's worth were refused again),
all-or-nothing charging (a refused request costs nothing), and ``debt`` rules that are
always charged (usage reported after the response, which nobody can refuse any more). A
call whose answer was lost is given back (:func:`refund`), and a token bucket's schedule
moves back with it.

Sans-IO: the stores (:mod:`limiter.stores.ratelimit`) keep the counters.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction

from limiter.buckets import FixedWindow, SlidingWindow, TokenBucket
from limiter.herd import (
    MAX_HERD_WAIT_MS,
    Promised,
    bucket_slot,
    fixed_slot,
    live_promise,
    promise_back,
    promise_bucket,
    promise_fixed,
    promise_window,
    reconcile_promise,
    window_slot,
)
from limiter.rates import Rate

UNIT_MS = {
    "second": 1000,
    "minute": 60_000,
    "hour": 3_600_000,
    "day": 86_400_000,
    "week": 7 * 86_400_000,
    "month": 30 * 86_400_000,  # envoyproxy/ratelimit's: 30 days, not a calendar month
    "year": 365 * 86_400_000,
}


MAX_PERIOD_MS = 2**26  # the Redis store's bounds for exact integer math in Lua doubles
MAX_SCALED = 2**51


class Algorithm(StrEnum):
    TOKEN_BUCKET = "token_bucket"
    SLIDING_WINDOW = "sliding_window"
    FIXED_WINDOW = "fixed_window"


@dataclass(frozen=True)
class Limit:
    """``requests_per_unit`` hits per ``unit``, counted by ``algorithm``. ``burst`` is a
    token bucket's capacity (default: one unit's worth). 0 per unit refuses every hit."""

    requests_per_unit: int
    unit: str
    algorithm: Algorithm = Algorithm.TOKEN_BUCKET
    burst: int | None = None
    debt: bool = False

    @property
    def unit_ms(self) -> int:
        return UNIT_MS[self.unit]

    @property
    def capacity(self) -> int:
        """The most one counter holds: the bucket's burst or the window's limit."""
        if self.algorithm is Algorithm.TOKEN_BUCKET and self.burst is not None:
            return self.burst
        return self.requests_per_unit

    def rate(self) -> Rate:
        """The token bucket's refill rate, in lowest terms: exact when its period fits the
        bounds of exact Lua arithmetic (``MAX_PERIOD_MS``, and capacity × period ≤ 2^51),
        else the nearest rate that does, if within 1e-4 of it (7 a day: off by 1e-8).
        ValueError for slower rates (about one unit per ``MAX_PERIOD_MS``, ~18.6 h)."""
        exact = Fraction(self.requests_per_unit, self.unit_ms)
        longest = min(MAX_PERIOD_MS, MAX_SCALED // max(1, self.capacity))
        frac = exact if exact.denominator <= longest else exact.limit_denominator(longest)
        if abs(frac - exact) * 10_000 > exact:
            raise ValueError(f"{self.requests_per_unit} per {self.unit} is too slow for a "
                             "token bucket (about one per 18.6 h at the least): use a "
                             "fixed_window or sliding_window")
        return Rate(frac.numerator, frac.denominator)


@dataclass(frozen=True)
class Rule:
    """A node's limit and how it is applied. ``limit`` is None for ``unlimited`` rules."""

    limit: Limit | None
    name: str = ""
    replaces: tuple[str, ...] = ()
    shadow_mode: bool = False
    path: str = ""  # where it sits in the config, for messages and metrics


@dataclass
class Node:
    """One level of a domain's descriptor tree."""

    rule: Rule | None = None
    exact: dict[tuple[str, str], Node] = field(default_factory=dict)
    patterns: list[tuple[str, re.Pattern[str], Node]] = field(default_factory=list)
    any_value: dict[str, Node] = field(default_factory=dict)

    def child(self, key: str, value: str | None) -> Node:
        """The child for a config entry, created on first use (``value`` with ``*``: a
        pattern, kept in config order)."""
        if value is None:
            return self.any_value.setdefault(key, Node())
        if "*" in value:
            for known_key, pattern, node in self.patterns:
                if known_key == key and pattern.pattern == _glob(value).pattern:
                    return node
            node = Node()
            self.patterns.append((key, _glob(value), node))
            return node
        return self.exact.setdefault((key, value), Node())

    def step(self, key: str, value: str) -> Node | None:
        """The most specific child for one request entry."""
        node = self.exact.get((key, value))
        if node is not None:
            return node
        for known_key, pattern, candidate in self.patterns:
            if known_key == key and pattern.fullmatch(value):
                return candidate
        return self.any_value.get(key)


def _glob(value: str) -> re.Pattern[str]:
    """``*`` matches any run of characters (nothing else is special)."""
    return re.compile(fnmatch.translate(value.replace("[", "[[]").replace("?", "[?]")))


Entries = Sequence[tuple[str, str]]


def match(root: Node, entries: Entries) -> Rule | None:
    """The rule for one request descriptor, envoyproxy/ratelimit's way: walk one level per
    entry; a limit counts only at the level of the last entry."""
    node = root
    for i, (key, value) in enumerate(entries):
        nxt = node.step(key, value)
        if nxt is None:
            return None
        if i == len(entries) - 1:
            return nxt.rule
        node = nxt
    return None


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("|", "%7C")


def counter_key(domain: str, entries: Entries, override: Limit | None = None) -> str:
    """One counter per domain and descriptor, whatever rule node matched it; a limit Envoy
    sends with the descriptor counts apart (``%limit=…``: no escaped part holds a bare
    ``%``), so a call carrying one never resets — or spends — the rule's own counter. An
    entry's key has its ``=`` escaped too: ``a=b`` → ``c`` and ``a`` → ``b=c`` were one
    counter, so two rules' clients spent each other's limit."""
    parts = [_escape(domain),
             *(f"{_escape(k).replace('=', '%3D')}={_escape(v)}" for k, v in entries)]
    key = "|".join(parts)
    if override is None:
        return key
    return f"{key}|%limit={override.requests_per_unit}/{override.unit}/{override.algorithm.value}"


@dataclass(frozen=True)
class Hit:
    """One descriptor's charge against one counter."""

    key: str
    limit: Limit
    cost: int
    shadow: bool = False

    @property
    def need(self) -> int:
        """What must fit: the cost, and at least one unit for a check-only hit (cost 0)."""
        return max(1, self.cost)


@dataclass(frozen=True)
class Verdict:
    """A counter's answer to one hit: whether it fitted, what is left after the call, ms
    until it is full (or its window resets), and ms until the hit would fit (None: never,
    it exceeds the capacity)."""

    fits: bool
    remaining: int
    reset_ms: int
    wait_ms: int | None


def admitted(hits: Sequence[Hit], fits: Sequence[bool]) -> bool:
    """All or nothing: the call passes when every hit not in shadow mode fits."""
    return all(ok or hit.shadow for hit, ok in zip(hits, fits, strict=True))


def charged(hit: Hit, fits: bool, passed: bool) -> bool:
    """Whether a hit is counted: when it fits and the call passed — a refused call costs
    nothing — and always for ``debt`` rules (usage already spent)."""
    return hit.limit.debt or (fits and passed)


Counter = TokenBucket | SlidingWindow | FixedWindow


def new_counter(limit: Limit, now_ms: int) -> Counter:
    if limit.algorithm is Algorithm.TOKEN_BUCKET:
        return TokenBucket(limit.rate(), limit.capacity, now_ms)
    if limit.algorithm is Algorithm.SLIDING_WINDOW:
        return SlidingWindow(limit.requests_per_unit, limit.unit_ms)
    return FixedWindow(limit.requests_per_unit, limit.unit_ms)


def wait_of(counter: Counter, need: int, now_ms: int) -> int | None:
    """Ms until ``need`` fits in ``counter`` (0: now; None: never)."""
    try:
        return counter.wait_ms(need, now_ms)
    except ValueError:
        return None


def view_of(counter: Counter, now_ms: int) -> tuple[int, int]:
    """``(remaining, reset_ms)`` of a counter now."""
    if isinstance(counter, TokenBucket):
        _, available, reset = counter.view(now_ms)
        return max(0, available), reset
    return counter.remaining(now_ms), counter.reset_ms(now_ms)


def idle(counter: Counter, now_ms: int) -> bool:
    """Back to its starting state (full, or nothing counted): forgetting it changes nothing."""
    if isinstance(counter, TokenBucket):
        return counter.level_at(now_ms) >= counter.full_scaled
    if isinstance(counter, SlidingWindow):
        return counter.used(now_ms) == 0
    return counter.remaining(now_ms) == counter.limit


def take(counter: Counter, cost: int, fits: bool, now_ms: int) -> None:
    """Count ``cost``: within the limit when it fits, into debt (a debt rule) when not."""
    if cost == 0:
        return
    if isinstance(counter, SlidingWindow):
        counter.consume(cost, now_ms)  # debt is refused for sliding windows by the config
    elif isinstance(counter, TokenBucket):
        if fits:
            counter.consume(cost, now_ms)
        else:
            counter.charge(cost, now_ms)
    else:
        counter.charge(cost, now_ms)


@dataclass
class Promise:
    """The retry slots a counter promised refused clients (:mod:`limiter.herd`): a token
    bucket's virtual full time and when the last client promised a slot is back (``at``,
    ``back``), a fixed window's last promised window and what the clients will count there
    (``at``, ``used``), a sliding window's promised entries. Bounded (two integers; at most
    a window's limit of entries) and over once its last slot is past
    (:func:`promised_until`)."""

    at: int | None = None
    used: int = 0
    entries: Promised = field(default_factory=list)
    back: int | None = None  # a token bucket's (None: not known, ``at`` stands)


def promised_until(promise: Promise) -> int | None:
    """The last slot promised (None: none): once past, the promise changes no answer. A
    token bucket's virtual full time lies beyond it: once its last client is back, each
    promised client has taken its cost or is not coming, and the bucket itself says the
    rest (:func:`~limiter.herd.live_promise`)."""
    if promise.entries:
        return promise.entries[-1][0]
    if promise.back is not None:
        return promise.back
    return promise.at


def _slot(counter: Counter, promise: Promise, need: int, wait: int, now_ms: int) -> int:
    """This client's slot in one counter's schedule (unbounded for the windows)."""
    if isinstance(counter, TokenBucket):
        promise.at = live_promise(promise.at, promise.back, now_ms)
        return bucket_slot(promise.at, counter, need, wait, now_ms)
    if isinstance(counter, SlidingWindow):
        slot, promise.entries = window_slot(counter, need, now_ms, promise.entries)
        return max(wait, slot)
    return fixed_slot(promise.at, promise.used, counter.limit, counter.window_ms, need, wait,
                      now_ms)


def _promise(counter: Counter, promise: Promise, cost: int, slot: int, final: int,
             now_ms: int) -> None:
    """What this client, back at ``now + final``, will take from the counter. A window's
    slot past the bound has no place to keep (a client refused in a loop would count its
    promises over the limit)."""
    if isinstance(counter, TokenBucket):
        promise.back = promise_back(promise.at, promise.back, now_ms + final)
        promise.at = promise_bucket(promise.at, counter, cost, final, now_ms)
    elif slot > final or cost == 0:
        return
    elif isinstance(counter, SlidingWindow):
        promise.entries = promise_window(promise.entries, counter.window_ms, now_ms + final,
                                         cost)
    else:
        promise.at, promise.used = promise_fixed(promise.at, promise.used, counter.window_ms,
                                                 cost, now_ms + final)


def refund(counter: Counter, promise: Promise, cost: int, at_ms: int, now_ms: int) -> None:
    """Give back ``cost`` that a call charged at ``at_ms`` and that was cancelled (its answer
    was lost; the Redis store's cancel mirrors this). A token bucket's live promise moves
    back with the tokens by what its promised clients are sure to keep of them until the
    last of them is back (:func:`~limiter.herd.reconcile_promise`, as a kvgate release's
    refund): left where it was, a client refused after the cancel while the herd is out was
    told a slot later than the bucket needs; moved by the whole refund, a slot may be early
    (the bucket may fill, and lose the rest, before the herd is back). A window's schedule is
    counted from the window itself (a sliding window's log; a fixed window's later
    windows), so the refund alone moves it."""
    if isinstance(counter, TokenBucket):
        promised = live_promise(promise.at, promise.back, now_ms)
        before = counter.level_at(now_ms) if promised is not None else 0
        counter.refund(cost, now_ms)
        if promised is not None:
            promise.at = reconcile_promise(promised, promise.back, counter, before, now_ms)
    elif isinstance(counter, SlidingWindow):
        counter.refund_at(at_ms, cost, now_ms)
    else:
        counter.refund(cost, at_ms, now_ms)


def schedule(hits: Sequence[Hit], held: Sequence[tuple[Counter, Promise]],
             waits: Sequence[int | None], now_ms: int) -> list[int | None]:
    """A refused call's exact waits → this client's slots (:mod:`limiter.herd`). Every
    counter it takes from when it comes back is scheduled, refusing or not (shadow ones
    refuse nothing), and the longest refusing wait becomes the latest slot: the
    ``retry-after-ms``. Nothing is scheduled for a call that can never fit."""
    paced = [i for i, hit in enumerate(hits) if not hit.shadow]
    if any(waits[i] is None for i in paced):
        return list(waits)
    slots = {i: _slot(*held[i], hits[i].need, waits[i] or 0, now_ms) for i in paced}
    bounded = {i: max(waits[i] or 0, min(slot, MAX_HERD_WAIT_MS)) for i, slot in slots.items()}
    final = max(bounded.values())
    for i in paced:
        _promise(*held[i], hits[i].cost, slots[i], final, now_ms)
    out: list[int | None] = list(waits)
    refusing = [i for i in paced if waits[i]]
    for i in refusing:
        out[i] = bounded[i]
    out[max(refusing, key=lambda i: bounded[i])] = final  # one that did not refuse may set it
    return out


def decide(
    hits: Sequence[Hit], state: Callable[[Hit], tuple[Counter, Promise]], now_ms: int
) -> list[Verdict]:
    """One call against counters held in this process (the Redis script mirrors it)."""
    held = [state(hit) for hit in hits]
    counters = [c for c, _ in held]
    waits = [wait_of(c, hit.need, now_ms) for c, hit in zip(counters, hits, strict=True)]
    fits = [w == 0 for w in waits]
    passed = admitted(hits, fits)
    if not passed:
        waits = schedule(hits, held, waits, now_ms)
    debt_wait = 0  # a refused call's debt rules: the longest wait after their charge
    for c, hit, ok in zip(counters, hits, fits, strict=True):
        if charged(hit, ok, passed):
            take(c, hit.cost, ok, now_ms)
            if not passed and hit.cost and not hit.shadow:
                debt_wait = max(debt_wait, wait_of(c, hit.need, now_ms) or 0)
    if debt_wait:
        _after_debt(hits, fits, waits, debt_wait)
    return [Verdict(ok, *view_of(c, now_ms), wait)
            for c, ok, wait in zip(counters, fits, waits, strict=True)]


def _after_debt(hits: Sequence[Hit], fits: Sequence[bool], waits: list[int | None],
                debt_wait: int) -> None:
    """A refused call charges its ``debt`` rules all the same, after its slots were taken:
    its ``retry-after`` (the longest refusing wait) must also cover that charge, or a
    client that honoured it found its own call's debt and was refused again, at every
    retry. The herd's promises stay as scheduled (a stream-done charge, which Envoy never
    retries, must not push the next client back)."""
    refusing = [i for i, hit in enumerate(hits) if not fits[i] and not hit.shadow]
    if any(waits[i] is None for i in refusing):
        return  # it never fits: no retry-after
    top = max(refusing, key=lambda i: waits[i] or 0)
    waits[top] = max(waits[top] or 0, debt_wait)
