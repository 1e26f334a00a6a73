"""limiter.ratelimit's sans-IO parts: the descriptor tree's matching rules, counter keys, the
fixed window, and the all-or-nothing decision over in-process counters."""

from __future__ import annotations

import pytest

from limiter.buckets import FixedWindow
from limiter.ratelimit import (
    MAX_PERIOD_MS,
    Algorithm,
    Hit,
    Limit,
    Node,
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
        return counters.setdefault(hit.key, new_counter(hit.limit, 0))

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
