"""Envoy Rate Limit Service rules: descriptor matching and the decision over its counters.

Rules are shaped like envoyproxy/ratelimit's: per domain, a tree of descriptors (``key``,
optional ``value``) whose nodes may carry a limit. A request descriptor (a list of
``key=value`` entries) is walked down the tree one entry per level; at each level the most
specific node wins — the exact ``key``/``value``, else the first value pattern with ``*``
that matches, else the ``key`` alone (any value) — and the limit applies only if the node
reached by the *last* entry has one. Counters are per descriptor (domain plus every
``key=value`` the request sent), so a key-only rule counts each value apart.

What kvgate adds: a token bucket (with ``burst``) or an exact sliding window besides the
fixed window, an exact wait for ``Retry-After``, all-or-nothing charging (a refused request
costs nothing), and ``debt`` rules that are always charged (usage reported after the
response, which nobody can refuse any more).

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


def counter_key(domain: str, entries: Entries, override: Limit | None = None) -> str:
    """One counter per domain and descriptor, whatever rule node matched it; a limit Envoy
    sends with the descriptor counts apart (``%limit=…``: no escaped part holds a bare
    ``%``), so a call carrying one never resets — or spends — the rule's own counter."""
    parts = [domain, *(f"{k}={v}" for k, v in entries)]
    key = "|".join(p.replace("%", "%25").replace("|", "%7C") for p in parts)
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


def decide(
    hits: Sequence[Hit], counter: Callable[[Hit], Counter], now_ms: int
) -> list[Verdict]:
    """One call against counters held in this process (the Redis script mirrors it)."""
    counters = [counter(hit) for hit in hits]
    waits = [wait_of(c, hit.need, now_ms) for c, hit in zip(counters, hits, strict=True)]
    fits = [w == 0 for w in waits]
    passed = admitted(hits, fits)
    out = []
    for c, hit, ok, wait in zip(counters, hits, fits, waits, strict=True):
        if charged(hit, ok, passed):
            take(c, hit.cost, ok, now_ms)
        out.append(Verdict(ok, *view_of(c, now_ms), wait))
    return out
