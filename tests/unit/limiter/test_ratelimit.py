"""limiter.ratelimit's sans-IO parts: the descriptor tree's matching rules, counter keys, the
fixed window, the all-or-nothing decision over in-process counters, and a refused herd's
retry slots through cancels."""

from __future__ import annotations

import dataclasses
import heapq

import pytest
from hypothesis import assume, event, given, settings
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
    wait_of,
)
from tests.rls_support import InProcess


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
    # an '=' in an entry's key: ("a=b", "c") and ("a", "b=c") were one counter
    assert counter_key("d", [("a=b", "c")]) != counter_key("d", [("a", "b=c")])
    assert counter_key("d", [("a", "b=c")]) == "d|a=b=c"  # keys Redis holds stay as they were


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


def test_a_fixed_window_refunds_only_within_the_window_that_counted_it():
    window = FixedWindow(3, 1000)
    window.charge(2, 10_250)
    window.refund(1, 10_250, 10_900)
    assert window.remaining(10_900) == 2
    window.refund(5, 10_250, 10_950)  # never below zero
    assert window.remaining(10_950) == 3
    window.charge(3, 11_100)
    window.refund(2, 10_250, 11_200)  # counted by the window before: nothing here
    assert window.remaining(11_200) == 0


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


# -- a token bucket's promise is over once its last client is back (limiter.herd) -----------


def told(herd: Herd, hit: Hit) -> int | None:
    """The retry-after-ms a refused one-descriptor call is told; None when admitted."""
    verdict, = herd.call(hit)
    return None if verdict.fits else verdict.wait_ms


def test_a_client_alone_is_not_spaced_behind_a_client_that_did_not_come_back():
    """B, refused, was told 5,000 ms and never came back (its request went elsewhere, or
    its client gave up). C, alone at 5,100 ms (no refused client still out), was told
    9,900 ms for a 4,900 ms wait: the bucket's promise, its virtual full time once B had
    taken its 50, outlived B's slot. kvgate's own limits end a bucket's promise once its
    last client is back (limiter.herd.live_promise): so do the RLS counters."""
    herd = Herd(1_700_000_040_000)
    start = herd.now
    hit = Hit("d|k=v", Limit(10, "second", burst=100), 100)
    assert told(herd, hit) is None
    assert told(herd, dataclasses.replace(hit, cost=50)) == 5000
    herd.now = start + 5100
    assert told(herd, hit) == 4900
    herd.now = start + 9999
    assert told(herd, hit) is not None
    herd.now = start + 10_000
    assert told(herd, hit) is None


def test_a_client_alone_is_not_spaced_by_the_schedule_s_rounding():
    """Every promised slot is rounded up to a whole ms (38,304 a minute is 399 per 625 ms):
    the promise ended 1 ms past the bucket's full time once its client was back, and the
    next client alone was told 3 ms for a 2 ms wait."""
    herd = Herd(1_700_000_040_000)
    start = herd.now
    limit = Limit(38_304, "minute", burst=141)
    assert told(herd, Hit("d|k=v", limit, 3)) is None
    assert told(herd, Hit("d|k=v", limit, 140)) == 4
    herd.now = start + 4
    assert told(herd, Hit("d|k=v", limit, 140)) is None
    herd.now = start + 5
    assert told(herd, Hit("d|k=v", limit, 2)) == 2
    herd.now = start + 7
    assert told(herd, Hit("d|k=v", limit, 2)) is None


def test_a_herd_still_out_keeps_its_schedule():
    """B and D refused (5 s, 10 s); B came back. C, refused while D is out, is still spaced
    behind D: it is told 14,900 ms, when the bucket holds its 100 once B and D have taken
    their 50 each."""
    herd = Herd(1_700_000_040_000)
    start = herd.now
    hit = Hit("d|k=v", Limit(10, "second", burst=100), 100)
    half = dataclasses.replace(hit, cost=50)
    assert told(herd, hit) is None
    assert [told(herd, half), told(herd, half)] == [5000, 10_000]
    herd.now = start + 5000
    assert told(herd, half) is None
    herd.now = start + 5100
    assert told(herd, hit) == 14_900
    herd.now = start + 10_000
    assert told(herd, half) is None
    herd.now = start + 19_999
    assert told(herd, hit) is not None
    herd.now = start + 20_000
    assert told(herd, hit) is None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50), st.sampled_from(["second", "minute"]), st.integers(0, 3),
       st.data())
def test_a_client_alone_gets_the_exact_wait_whatever_the_herd_did(per_unit, unit, extra,
                                                                  data):
    """Clients refused by one token bucket come back when told, late, or never, and
    newcomers come and go; a client refused while no refused client is still out (each was
    told a time already past) is admitted at its retry-after-ms and refused 1 ms before."""
    limit = Limit(per_unit, unit, burst=per_unit + extra)
    start = 1_700_000_000_000 + data.draw(st.integers(0, 59_999))
    herd = Herd(start)
    calls: list[tuple[int, int]] = []  # (ms, cost) of every call: a probe replays them
    due: list[tuple[int, int]] = []  # (ms a refused client is told to come back, its cost)
    out_until = -1

    def replayed(at: int) -> Herd:
        probe = Herd(start)
        for probe.now, cost in calls:
            told(probe, Hit("d|k=v", limit, cost))
        probe.now = at
        return probe

    def attempt(cost: int) -> None:
        nonlocal out_until
        alone = out_until < herd.now
        calls.append((herd.now, cost))
        wait = told(herd, Hit("d|k=v", limit, cost))
        if wait is None:
            return
        if alone:
            for at, fits in ((herd.now + wait - 1, False), (herd.now + wait, True)):
                probe = replayed(at)
                assert (told(probe, Hit("d|k=v", limit, cost)) is None) is fits, (at, wait)
        out_until = max(out_until, herd.now + wait)
        due.append((herd.now + wait, cost))

    for _ in range(data.draw(st.integers(1, 30))):
        if due and data.draw(st.booleans()):  # the next one due comes back, late, or never
            due.sort()
            at, cost = due.pop(0)
            herd.now = max(herd.now, at + data.draw(st.sampled_from([0, 0, 1, 100])))
            if data.draw(st.integers(0, 3)):
                attempt(cost)
            continue
        herd.now += data.draw(st.one_of(st.just(0), st.integers(0, 50),
                                         st.integers(0, 2 * limit.unit_ms)))
        attempt(data.draw(st.integers(0, limit.capacity)))


# -- a cancelled call's charge moves a token bucket's schedule back (limiter.ratelimit.refund) --


def test_a_cancel_while_the_herd_is_out_moves_its_schedule_back():
    """A's call (60) was cancelled at 100 ms while B, refused, was out (5,000 ms). The
    schedule did not move: C was told 14,900 ms, though the bucket holds C's 100 from 10 s
    (full at 4 s, B takes its 50 at 5 s: 10 of the 60 overflow). It now moves back by what
    B's schedule is sure to keep of the refund, as a kvgate release's refund does
    (tests/unit/limiter/test_herd.py): 9,900 ms, and C is refused 1 ms before."""
    herd = InProcess(1_700_000_040_000)
    start = herd.now
    limit = Limit(10, "second", burst=100)
    hit = Hit("d|k=v", limit, 100)
    assert herd.call("a", dataclasses.replace(hit, cost=60))[0].fits
    assert herd.call("a2", dataclasses.replace(hit, cost=40))[0].fits
    assert herd.call("b", dataclasses.replace(hit, cost=50))[0].wait_ms == 5000
    herd.now = start + 100
    herd.cancel("a")
    assert herd.call("c", hit)[0].wait_ms == 9900
    herd.now = start + 5000
    assert herd.call("b2", dataclasses.replace(hit, cost=50))[0].fits
    herd.now = start + 9999
    assert not herd.call("early", hit)[0].fits
    herd.now = start + 10_000
    assert herd.call("c2", hit)[0].fits


def test_a_cancel_the_bucket_may_lose_before_the_herd_is_back_moves_nothing():
    """A's call (30) cancelled at 100 ms while B and D are out (5 s, 10 s): the bucket had
    room for 99 then and refills 99 before D is back, so none of the 30 is sure to stay
    (the schedule cannot count on B and D taking in between): C, refused, is told what it
    was without the cancel (19,900 ms; 16,900 would do: later, never early)."""
    told = []
    for cancel in (False, True):
        herd = InProcess(1_700_000_040_000)
        start = herd.now
        hit = Hit("d|k=v", Limit(10, "second", burst=100), 100)
        assert herd.call("a", dataclasses.replace(hit, cost=30))[0].fits
        assert herd.call("a2", dataclasses.replace(hit, cost=70))[0].fits
        half = dataclasses.replace(hit, cost=50)
        assert [herd.call(c, half)[0].wait_ms for c in "bd"] == [5000, 10_000]
        herd.now = start + 100
        if cancel:
            herd.cancel("a")
        told.append(herd.call("c", hit)[0].wait_ms)
    assert told == [19_900, 19_900]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50), st.sampled_from(["second", "minute"]), st.integers(0, 3),
       st.data())
def test_retry_after_stays_exact_through_cancels(per_unit, unit, extra, data):
    """Clients refused by one token bucket come back when told (up to three times) or
    never, newcomers come and go, and admitted calls are cancelled (their answer lost, their
    charge given back), checked as each answer comes:

    - a client refused while no refused client is still out (each was told a time already
      past) is admitted at its retry-after-ms and refused 1 ms before (a probe replays every
      call and cancel);
    - a refused client back at its slot is admitted, unless a newcomer took from the bucket
      while its herd was out or the schedule reached its bound: the cancels move the
      schedule back, never so far that a slot is early."""
    limit = Limit(per_unit, unit, burst=per_unit + extra)
    start = 1_700_000_000_000 + data.draw(st.integers(0, 59_999))
    herd = InProcess(start)
    steps: list[tuple[int, str, int | None]] = []  # (ms, call id, cost; None: a cancel)
    due: list[tuple[int, int, int, int]] = []  # (ms told, n, cost, tries)
    done: list[str] = []  # admitted calls that may still be cancelled
    world = {"out_until": -1, "newcomers": 0, "herd_start": 0, "unbounded": False, "n": 0}

    def replayed(at: int) -> InProcess:
        probe = InProcess(start)
        for probe.now, call_id, cost in steps:
            if cost is None:
                probe.cancel(call_id)
            else:
                probe.call(call_id, Hit("d|k=v", limit, cost))
        probe.now = at
        return probe

    def attempt(cost: int, tries: int = 0) -> None:
        world["n"] += 1
        call_id, now = f"c{world['n']}", herd.now
        alone = world["out_until"] < now
        if alone:
            world["herd_start"] = world["newcomers"]
        steps.append((now, call_id, cost))
        verdict, = herd.call(call_id, Hit("d|k=v", limit, cost))
        if verdict.fits:
            done.append(call_id)
            world["newcomers"] += tries == 0 and not alone and cost > 0
            return
        assert tries == 0 or world["unbounded"] \
            or world["herd_start"] != world["newcomers"], (now, cost, steps)
        wait = verdict.wait_ms
        if wait is None:
            return
        world["unbounded"] |= wait >= MAX_HERD_WAIT_MS
        if alone:
            for at, fits in ((now + wait - 1, False), (now + wait, True)):
                verdict, = replayed(at).call("probe", Hit("d|k=v", limit, cost))
                assert verdict.fits is fits, (at, wait, steps)
        world["out_until"] = max(world["out_until"], now + wait)
        if tries < 3:
            heapq.heappush(due, (now + wait, world["n"], cost, tries + 1))

    def come_back(until: int) -> None:
        while due and due[0][0] <= until:
            at, _, cost, tries = heapq.heappop(due)
            herd.now = max(herd.now, at)
            if data.draw(st.integers(0, 5)):  # else: it never comes back
                attempt(cost, tries)
        herd.now = max(herd.now, until)

    cap, moved = limit.capacity, 0
    for _ in range(data.draw(st.integers(1, 30))):
        come_back(herd.now + data.draw(st.one_of(
            st.just(0), st.integers(0, limit.unit_ms // 10), st.integers(0, limit.unit_ms // 2),
            st.integers(0, 2 * limit.unit_ms))))
        if done and data.draw(st.booleans()):
            call_id = done.pop(data.draw(st.integers(0, len(done) - 1)))
            steps.append((herd.now, call_id, None))
            promise = herd.held["d|k=v"][1]
            before = promise.at
            herd.cancel(call_id)
            moved += promise.at != before
            continue
        attempt(data.draw(st.one_of(st.integers(0, cap), st.integers(cap // 2, cap))))
    come_back(herd.now + 10**9)
    event(f"a cancel moved the schedule: {moved > 0}")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.sampled_from(["second", "minute"]), st.integers(0, 20),
       st.data())
def test_a_herd_refused_around_cancels_is_admitted_on_its_first_retry(per_unit, unit, extra,
                                                                     data):
    """Calls fill a token bucket and a herd is refused; while it is out, some of the calls
    are cancelled, and each cancel is followed by more refused clients (a client the bucket
    has room for is not sent: a newcomer taking what the schedule counted on is no fault of
    the schedule). Every client back at its slot is admitted: a cancel moves the schedule
    back, never so far that a slot is early (moved by the whole refund, one was)."""
    limit = Limit(per_unit, unit, burst=per_unit + extra)
    cap, key = limit.capacity, "d|k=v"
    herd = InProcess(1_700_000_000_000 + data.draw(st.integers(0, 59_999)))
    due: list[tuple[int, int, int]] = []  # (ms told, n, cost)
    fills: list[str] = []
    costs = st.one_of(st.integers(1, cap), st.integers(max(1, cap // 2), cap))

    def refuse(n: int, cost: int) -> None:
        """Send a client the bucket has no room for now; its slot joins ``due``."""
        counter, _ = herd.state(Hit(key, limit, cost))
        if not wait_of(counter, cost, herd.now):
            return
        verdict, = herd.call(f"r{n}", Hit(key, limit, cost))
        assert not verdict.fits and verdict.wait_ms is not None
        assume(verdict.wait_ms < MAX_HERD_WAIT_MS)  # past it, the herd shares its end
        heapq.heappush(due, (herd.now + verdict.wait_ms, n, cost))

    def come_back(until: int) -> None:
        while due and due[0][0] <= until:
            herd.now, n, cost = heapq.heappop(due)
            verdict, = herd.call(f"b{n}", Hit(key, limit, cost))
            assert verdict.fits, (herd.now, n, cost, verdict)
        herd.now = max(herd.now, until)

    while not due:  # fill the bucket until a client is refused
        cost = data.draw(costs)
        refuse(0, cost)
        if not due:
            fills.append(f"f{len(fills)}")
            assert herd.call(fills[-1], Hit(key, limit, cost))[0].fits
    for n in range(1, data.draw(st.integers(2, 9))):
        refuse(n, data.draw(costs))
        come_back(herd.now + data.draw(st.one_of(st.just(0),
                                                 st.integers(0, limit.unit_ms // 4))))
        if fills and data.draw(st.booleans()):
            herd.cancel(fills.pop(data.draw(st.integers(0, len(fills) - 1))))
    come_back(herd.now + 10**9)
