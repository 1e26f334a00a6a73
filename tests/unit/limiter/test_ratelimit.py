"""limiter.ratelimit's sans-IO parts: the descriptor tree's matching rules, counter keys, the
fixed window, and the all-or-nothing decision over in-process counters."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from limiter.buckets import FixedWindow
from limiter.herd import MAX_HERD_WAIT_MS
from limiter.ratelimit import (
    MAX_PERIOD_MS,
    Algorithm,
    Hit,
    Limit,
    Node,
    Promise,
    Rule,
    counter_key,
    decide,
    match,
    new_counter,
)


def tree(*specs: tuple[tuple[tuple[str, str | None], ...], str]) -> Node:
    """A tree from (path of (key, value) pairs, rule name) specs, in config order."""
    root = Node()
    for path, name in specs:
        node = root
        for key, value in path:
            node = node.child(key, value)
        node.rule = Rule(None, name)
    return root


def name(root: Node, *entries: tuple[str, str]) -> str | None:
    rule = match(root, entries)
    return None if rule is None else rule.name


def test_patterns_match_in_config_order_after_exact_values():
    root = tree(((("p", "/v1/*"),), "v1"), ((("p", "/v1/chat*"),), "chat"),
                ((("p", "/v1/chat/completions"),), "exact"), ((("p", None),), "any"))
    assert name(root, ("p", "/v1/chat/completions")) == "exact"
    assert name(root, ("p", "/v1/chat/x")) == "v1"  # the first pattern that matches
    assert name(root, ("p", "/v2")) == "any"


def test_a_star_anywhere_and_nothing_else_is_special():
    root = tree(((("h", "a*b*c"),), "mid"), ((("h", "x.y[1]?"),), "literal"))
    assert name(root, ("h", "aXXbYYc")) == "mid"
    assert name(root, ("h", "abc")) == "mid"
    assert name(root, ("h", "abcd")) is None
    assert name(root, ("h", "x.y[1]?")) == "literal"
    assert name(root, ("h", "xzy1")) is None


def test_only_the_last_entry_level_carries_the_limit():
    root = tree(((("a", "1"),), "top"), ((("a", "1"), ("b", None)), "nested"))
    assert name(root, ("a", "1")) == "top"
    assert name(root, ("a", "1"), ("b", "z")) == "nested"
    assert name(root, ("a", "1"), ("b", "z"), ("c", "q")) is None
    assert name(root, ("b", "z")) is None
    assert name(root) is None


def test_a_key_only_dead_end_does_not_fall_back():
    # the exact node wins at its level even when the key-only sibling has the deeper rule
    root = tree(((("a", "1"),), "one"), ((("a", None), ("b", None)), "deep"))
    assert name(root, ("a", "1"), ("b", "x")) is None
    assert name(root, ("a", "2"), ("b", "x")) == "deep"


def test_counter_keys_cannot_collide_through_separators():
    assert counter_key("d", [("a", "x|b=y")]) != counter_key("d", [("a", "x"), ("b", "y")])


def test_fixed_window_resets_on_epoch_boundaries_and_may_overshoot():
    window = FixedWindow(2, 1000)
    assert window.wait_ms(2, 10_250) == 0
    window.charge(2, 10_250)
    assert window.wait_ms(1, 10_900) == 100 and window.reset_ms(10_900) == 100
    window.charge(5, 10_900)  # usage charged after the fact
    assert window.remaining(10_999) == 0
    assert window.remaining(11_000) == 2
    with pytest.raises(ValueError):
        window.wait_ms(3, 11_000)


def test_a_refused_call_leaves_every_counter_as_it_was():
    a, b = Limit(5, "second"), Limit(1, "second")
    counters: dict[str, object] = {}

    def counter(hit: Hit):
        return counters.setdefault(hit.key, (new_counter(hit.limit, 0), Promise()))

    hits = [Hit("a", a, 1), Hit("b", b, 1)]
    assert [v.fits for v in decide(hits, counter, 0)] == [True, True]
    assert [v.fits for v in decide(hits, counter, 0)] == [True, False]
    assert decide([Hit("a", a, 0)], counter, 0)[0].remaining == 4  # only the first charged


def test_limits_build_exact_rates_and_capacities():
    assert Limit(90, "minute").rate().per_ms() * 60_000 == 90
    assert Limit(10, "second", burst=25).capacity == 25
    assert Limit(10, "second", Algorithm.SLIDING_WINDOW).capacity == 10


def test_slow_rates_stay_within_exact_lua_bounds():
    exact = Limit(1000, "day").rate()
    assert (exact.amount, exact.period_ms) == (1, 86_400)
    seven = Limit(7, "day").rate()  # 7 / 86.4M ms: no exact period under 2^26 ms
    assert seven.period_ms <= MAX_PERIOD_MS
    assert abs(seven.per_ms() * 86_400_000 - 7) < 1e-6
    big = Limit(2**32 - 1, "day").rate()
    assert big.period_ms * (2**32 - 1) <= 2**51
    with pytest.raises(ValueError, match="too slow for a token bucket"):
        Limit(1, "day").rate()


# -- a refused herd is scheduled (limiter.herd), as kvgate's own admission limits are -------

ALGORITHMS = [Algorithm.TOKEN_BUCKET, Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW]


class Herd:
    """In-process counters (a dict) at a clock the test moves."""

    def __init__(self, now_ms: int) -> None:
        self.now = now_ms
        self.held: dict[str, tuple[object, Promise]] = {}

    def state(self, hit: Hit):
        return self.held.setdefault(hit.key, (new_counter(hit.limit, self.now), Promise()))

    def call(self, *hits: Hit) -> list:
        return decide(hits, self.state, self.now)


def refuse_herd(herd: Herd, hits: list[Hit], clients: int) -> list[int]:
    """Fill the counters, then refuse ``clients`` at once: the wait each is told (the
    ``retry-after-ms``: the longest of its refusing hits')."""
    while all(v.fits for v in herd.call(*hits)):
        pass
    waits = []
    for _ in range(clients):
        verdicts = herd.call(*hits)
        assert not all(v.fits for v in verdicts)
        waits.append(max(v.wait_ms for v in verdicts if not v.fits))
    return waits


def back_at_their_slots(herd: Herd, hits: list[Hit], waits: list[int]) -> int:
    """Each client back when it was told: how many are refused again."""
    start = herd.now
    again = 0
    for wait in sorted(waits):
        herd.now = start + wait
        again += not all(v.fits for v in herd.call(*hits))
    return again


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_herd_refused_by_a_rule_is_not_refused_again_after_its_retry_after(algorithm):
    """2 a second, 10 clients refused in the same ms and back exactly when told: each was
    told the same wait (500 ms for a bucket, 1 s for a window) and 8 or 9 were refused again;
    scheduled, each is told its own slot and none is."""
    herd = Herd(1_700_000_040_100)
    hits = [Hit("d|k=v", Limit(2, "second", algorithm), 1)]
    waits = refuse_herd(herd, hits, 10)
    assert len(set(waits)) > 1, waits
    assert back_at_their_slots(herd, hits, waits) == 0, waits


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ALGORITHMS), st.integers(1, 20), st.sampled_from(["second", "minute"]),
       st.integers(1, 3), st.integers(0, 59_999), st.data())
def test_every_client_of_a_herd_is_admitted_on_its_first_retry(
    algorithm, per_unit, unit, cost, offset, data
):
    """Any rule, any herd of up to a few hundred whose schedule fits within a minute
    (MAX_HERD_WAIT_MS: past it, clients share the schedule's end)."""
    assume(cost <= per_unit)
    limit = Limit(per_unit, unit, algorithm)
    per_window = per_unit // cost  # clients a window (or a bucket's period) takes
    most = min(300, (MAX_HERD_WAIT_MS // limit.unit_ms - 1) * per_window)
    assume(most >= 1)
    clients = data.draw(st.integers(1, most))
    herd = Herd(1_700_000_000_000 + offset)
    hits = [Hit("d|k=v", limit, cost)]
    waits = refuse_herd(herd, hits, clients)
    assert back_at_their_slots(herd, hits, waits) == 0, waits


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_herd_refused_by_one_rule_is_spaced_by_every_rule_it_takes_from(algorithm):
    """Two descriptors per call: a herd refused by a per-user rule is also spaced by the
    route's rule, which still had room, since each client takes from both when back."""
    herd = Herd(1_700_000_040_100)
    user = Hit("d|user=u", Limit(2, "second", algorithm), 1)
    route = Hit("d|route=r", Limit(3, "second", Algorithm.TOKEN_BUCKET, burst=6), 1)
    waits = refuse_herd(herd, [user, route], 12)
    assert back_at_their_slots(herd, [user, route], waits) == 0, waits


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_hostile_herd_keeps_a_bounded_promise_per_counter(algorithm):
    """A client refused in a loop (never honouring its wait) moves the schedule at most a
    minute ahead, and a counter's promise stays a window's limit of entries at most."""
    herd = Herd(1_700_000_040_100)
    limit = Limit(5, "second", algorithm)
    hit = Hit("d|k=v", limit, 1)
    waits = refuse_herd(herd, [hit], 5000)
    assert max(waits) <= MAX_HERD_WAIT_MS + limit.unit_ms
    _, promise = herd.held[hit.key]
    assert len(promise.entries) <= limit.requests_per_unit
    assert promise.at is None or promise.at <= herd.now + MAX_HERD_WAIT_MS + limit.unit_ms
    assert promise.used <= limit.requests_per_unit
