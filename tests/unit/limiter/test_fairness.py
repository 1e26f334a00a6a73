"""Virtual-counter fairness (start-time fair queueing by priced tokens, bands between tenants
within a bounded lag), in memory.

The simulations run on virtual time (no sleeping): every round is one capacity event per
replica, each dispatching one request through ``FairQueue.candidates`` → ``choose`` →
``take``. The helpers here are shared with ``tests/integration/test_redis_fairness.py``,
which runs the same scenarios against Redis.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from limiter import FairQueue, QueuedRequest
from limiter.fairness import DEFAULT_LAG, MAX_CHARGE, SCALE, charge_of
from limiter.fairqueue import Offer
from limiter.stores import Fairness, MemoryFairness
from tests.limiter_support import fair_offers, fairness_step, fairness_steps

WEIGHTS = {"A": 5.0, "B": 3.0, "C": 1.0}
NEVER = 10**15


def req(rid: str, tenant: str, cost: int = 100, at: int = 0, weight: float | None = None,
        band: int = 0) -> QueuedRequest:
    weight = WEIGHTS.get(tenant, 1.0) if weight is None else weight
    return QueuedRequest(rid, tenant, band, cost, weight, at, NEVER)


def offers(*items: QueuedRequest, unfit: tuple[str, ...] = ()) -> list[Offer]:
    """Each item offered in its own band; those whose id is in ``unfit`` do not fit."""
    return [Offer(item, item.band, item.id not in unfit) for item in items]


@dataclass
class Replica:
    """One kvgate replica: its own queue, fed by its own tenant mix, and a selector."""

    fairness: Fairness
    mix: dict[str, int]
    queue: FairQueue = field(default_factory=lambda: FairQueue(max_size=10**6, aging_ms=None))

    async def arrive(self, tenant: str, cost: int, now: int, rid: str, band: int = 0) -> None:
        if self.queue.queued(tenant) == 0:
            await self.fairness.activate(tenant)
        assert self.queue.push(req(rid, tenant, cost, now, band=band), now) == []

    async def dispatch(self, now: int) -> QueuedRequest | None:
        chosen = await self.fairness.choose(self.queue.candidates(now))
        return None if chosen is None else self.queue.take(chosen.id)


def deviation(tokens: dict[str, int]) -> dict[str, float]:
    """Each tenant's token share relative to its weight share (1.0 = exactly fair)."""
    total, weights = sum(tokens.values()), sum(WEIGHTS.values())
    return {t: tokens[t] / total / (WEIGHTS[t] / weights) for t in WEIGHTS}


def worst(tokens: dict[str, int]) -> float:
    """The largest relative miss of any tenant's weighted share."""
    return max(abs(share - 1) for share in deviation(tokens).values())


INTERACTIVE = {"A": 0.1, "B": 0.5, "C": 0.9}
"""A mixed load: the share of each tenant's requests that are interactive (band 0)."""


async def all_backlogged(fairness: Fairness, events: int, seed: int,
                         interactive: dict[str, float] | None = None,
                         spread: list[float] | None = None) -> dict[str, int]:
    """3 tenants always queued (two requests each, 50–2000 tokens; with ``interactive``, that
    share of a tenant's requests band 0, the rest band 1); one dispatch per event. With
    ``spread``, after every dispatch, the largest gap between two tenants' tokens per unit
    of weight is appended to it."""
    rng, replica = random.Random(seed), Replica(fairness, {})
    tokens = dict.fromkeys(WEIGHTS, 0)

    def band(tenant: str) -> int:
        return 0 if interactive is None or rng.random() < interactive[tenant] else 1

    for n, tenant in enumerate(list(WEIGHTS) * 2):
        await replica.arrive(tenant, rng.randint(50, 2000), 0, f"init{n}", band(tenant))
    for now in range(1, events + 1):
        chosen = await replica.dispatch(now)
        assert chosen is not None
        tokens[chosen.tenant] += chosen.cost
        await replica.arrive(chosen.tenant, rng.randint(50, 2000), now, f"r{now}",
                             band(chosen.tenant))
        if spread is not None:
            served = [tokens[t] / WEIGHTS[t] for t in WEIGHTS]
            spread.append(max(served) - min(served))
    return tokens


SKEWED_MIXES = ({"A": 80, "B": 15, "C": 5}, {"A": 20, "B": 30, "C": 50})
"""Replica 1 sees mostly A, replica 2 mostly C: each sees some of everyone."""


async def two_replicas(first: Fairness, second: Fairness, rounds: int, seed: int) -> dict:
    """Two replicas, each receiving two requests per dispatch from its own mix (overload:
    queues grow), dispatching alternately. Returns tokens dispatched per tenant."""
    rng = random.Random(seed)
    replicas = [Replica(first, SKEWED_MIXES[0]), Replica(second, SKEWED_MIXES[1])]
    tokens, n = dict.fromkeys(WEIGHTS, 0), 0
    for now in range(rounds):
        for replica in replicas:
            for _ in range(2):
                tenant = rng.choices(list(replica.mix), weights=list(replica.mix.values()))[0]
                n += 1
                await replica.arrive(tenant, rng.randint(50, 2000), now, f"r{n}")
            chosen = await replica.dispatch(now)
            assert chosen is not None
            tokens[chosen.tenant] += chosen.cost
    return tokens


# --- the simulations --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_backlogged_tenants_get_tokens_in_proportion_to_weight(seed: int) -> None:
    tokens = await all_backlogged(MemoryFairness(), 20_000, seed)
    assert worst(tokens) <= 0.05, deviation(tokens)


async def test_local_fairness_misses_the_weights_when_replicas_see_different_mixes() -> None:
    """Two independent in-memory selectors are each fair to what *they* see; globally the
    minority tenants of each replica get far more than their weight. Shared counters
    (``test_fairness_redis.py``) fix this; one shared MemoryFairness stands in for them."""
    local = await two_replicas(MemoryFairness(), MemoryFairness(), 1500, seed=11)
    shared = MemoryFairness()
    global_ = await two_replicas(shared, shared, 1500, seed=11)
    assert worst(global_) <= 0.02, deviation(global_)
    assert worst(local) >= 0.08, deviation(local)


@pytest.mark.parametrize("seed", [1, 2])
async def test_mixed_bands_get_weighted_shares_within_a_bound(seed: int) -> None:
    """Hierarchical shares: A sends mostly batch, C mostly interactive, B half and half, all
    always backlogged. Tokens still follow the weights over all their work: at every moment
    no tenant is more than 3 lags plus 2 requests (tokens per unit of weight) ahead of
    another — a lag and one request by its whole counter, 2 lags and one more by its band-0
    counter, which starts a lag below the least-served tenant's counter."""
    spread: list[float] = []
    tokens = await all_backlogged(MemoryFairness(), 6000, seed, INTERACTIVE, spread)
    assert max(spread) <= 3 * DEFAULT_LAG + 2 * 2000 / min(WEIGHTS.values())
    assert worst(tokens) <= 0.02, deviation(tokens)


async def test_interactive_only_work_beyond_its_share_is_held_to_it() -> None:
    """X sends only interactive work, Y only batch, both always queued: X's better band does
    not buy it more than its weight (1:3) beyond the bound."""
    fair, lag = MemoryFairness(lag_tokens=500), 500
    served = {"X": 0, "Y": 0}
    for n in range(3000):
        chosen = await fair.choose(offers(req(f"x{n}", "X", 300, weight=1.0, at=n),
                                          req(f"y{n}", "Y", 300, weight=3.0, band=1, at=n)))
        served[chosen.tenant] += chosen.cost
        assert abs(served["X"] / 1 - served["Y"] / 3) <= 3 * lag + 2 * 300
    assert served["Y"] / served["X"] == pytest.approx(3, rel=0.02)


# --- the rules ------------------------------------------------------------------------------


async def test_smallest_counter_goes_and_is_charged_cost_over_weight() -> None:
    fair = MemoryFairness()
    a, c = req("a", "A", cost=500), req("c", "C", cost=100)
    assert await fair.choose(offers(c, a)) is c  # both new: equal counters, tie → first
    assert await fair.counters() == {"C": 100.0}
    assert await fair.choose(offers(c, a)) is a  # A starts at V = 0 < C's 100
    assert await fair.counters() == {"C": 100.0, "A": 100.0}
    assert fair.virtual_time == 0


async def test_ties_go_to_the_earliest_enqueued() -> None:
    fair = MemoryFairness()
    late, early = req("late", "A", at=50), req("early", "B", at=10)
    assert await fair.choose(offers(late, early)) is early
    assert await fair.choose([]) is None


async def test_idle_time_is_not_banked_as_credit() -> None:
    """C idles while A and B run; back, C gets its weight's share, not a monopoly."""
    fair = MemoryFairness()
    for n in range(300):
        await fair.choose(offers(req(f"a{n}", "A"), req(f"b{n}", "B")))
    await fair.activate("C")
    chosen = [(await fair.choose(offers(req("a", "A"), req("b", "B"), req("c", "C")))).tenant
              for _ in range(90)]
    assert abs(chosen.count("C") - 10) <= 1 and abs(chosen.count("A") - 50) <= 1


async def test_activation_keeps_a_debt() -> None:
    """A tenant ahead of V stays ahead after going idle and coming back."""
    fair = MemoryFairness()
    await fair.choose(offers(req("big", "A", cost=50_000)))  # A at 10 000, V 0
    await fair.activate("A")
    assert (await fair.counters())["A"] == 10_000


huge = st.integers(5 * 10**8, 10**9)  # tokens per unit of weight: charges near MAX_CHARGE


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(huge, huge, huge, huge, st.sampled_from("ABCD"),
                          st.lists(st.integers(0, 1), min_size=4, max_size=4)),
                min_size=30, max_size=60))
async def test_rebasing_changes_no_decision(rounds: list[tuple]) -> None:
    """Huge costs in mixed bands force rebases (at the smallest allowed threshold); every
    choice equals that of counters that never rebase (Python ints are exact at any size).
    Each round one tenant sits out; it is activated when it comes back, as a tenant whose
    queue goes from empty to non-empty is (a counter activated while its tenant is not
    offered can fall further behind ``V`` than a rebase keeps: see ``VirtualCounters``)."""
    rebased, exact = MemoryFairness(rebase_at=2 * MAX_CHARGE), MemoryFairness(rebase_at=2**200)
    away = None
    for n, (*costs, idle, bands) in enumerate(rounds):
        offer = offers(*(req(f"{n}{t}", t, cost * int(WEIGHTS.get(t, 1)), at=n, band=band)
                         for t, cost, band in zip("ABCD", costs, bands, strict=True)
                         if t != idle))
        if away is not None and away != idle:  # back
            await rebased.activate(away)
            await exact.activate(away)
        away = idle
        assert (await rebased.choose(offer)).id == (await exact.choose(offer)).id
    assert rebased.virtual_time < exact.virtual_time  # it did rebase


async def test_a_tenant_without_a_counter_starts_at_virtual_time() -> None:
    fair = MemoryFairness()
    for n in range(3):
        await fair.choose(offers(req(f"a{n}", "A", cost=1000)))  # A at 600, V 400
    assert fair.virtual_time == 400
    assert (await fair.choose(offers(req("a", "A", at=0), req("b", "B", at=9)))).tenant == "B"
    assert (await fair.counters())["B"] == 433.333  # 400 + round(100 · 1000 / 3) / 1000


async def test_a_better_band_goes_first_between_tenants_within_the_lag() -> None:
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("y0", "Y", 50, weight=1, band=1)))  # Y at 50, V 0
    await fair.activate("X")  # X at 0
    chat, batch = req("chat", "Y", 10, weight=1), req("batch", "X", 10, weight=1, band=1)
    assert await fair.choose(offers(batch, chat)) is chat  # Y is ahead, but within the lag


async def test_interactive_work_within_its_share_goes_before_batch_when_ahead_by_more() -> None:
    """X's batch work put its whole counter far beyond the lag; its interactive work alone is
    within its share (no band-0 counter yet): that still goes before Y's batch, until the
    band-0 counter, started a lag below the least-served counter (Y's 0), passes a lag
    above it: (100 + 100) / 10 + 1 = 21 requests of 10 tokens."""
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("big", "X", 1000, weight=1, band=1)))  # X at 1000, V 0
    await fair.activate("Y")  # Y at 0
    order = []
    for n in range(30):
        chat, batch = req(f"x{n}", "X", 10, weight=1), req(f"y{n}", "Y", 10, weight=1, band=1)
        order.append((await fair.choose(offers(batch, chat))).tenant)
        if n == 21:
            assert await fair.counters() == {"X": 1210, "Y": 10}  # X's batch could not go
    assert order[:22] == ["X"] * 21 + ["Y"]
    assert order[22:] == ["X", "Y"] * 4  # then X's chat only as Y's counter moves on


async def test_a_tenant_waiting_for_room_holds_others_batch_work_at_its_counter() -> None:
    """X, the least served, waits for room (its head does not fit): the others' batch work
    may not go ahead of X's counter, even within the lag (it would take the KV X's head
    waits for); a tenant level with X may. Once X fits, the lag applies again."""
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("y0", "Y", 50, weight=1, band=1)))  # Y at 50, V 0
    await fair.activate("X")  # X at 0: the least served
    await fair.activate("Z")  # Z at 0
    before = await fair.counters()
    x, y = req("x", "X", 10, weight=1, band=1), req("y", "Y", 10, weight=1, band=1)
    z = req("z", "Z", 10, weight=1, band=1)
    assert await fair.choose(offers(x, y, unfit=("x",))) is None  # 50 > X's 0: wait
    assert await fair.counters() == before and fair.virtual_time == 0  # nothing charged
    assert await fair.choose(offers(x, y, z, unfit=("x",))) is z  # level with X: may go
    assert await fair.choose(offers(x, y, unfit=("x", "y"))) is None  # nothing fits
    assert await fair.choose(offers(y, req("x2", "X", 10, weight=1, band=1))) is not y
    assert await fair.choose(offers(y)) is y  # X fits, nothing waits: within the lag


async def test_others_interactive_work_may_run_up_to_an_unfit_heads_finish() -> None:
    """The least-served tenant X's head (1,000 tokens) does not fit: Y's batch work is held at
    X's counter (it would take the KV X waits for), Y's interactive work a lag past X's
    finish — where X's counter is once its head goes, no further. Once X's head fits it
    goes (it is the least served), and Y's interactive work goes again."""
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("y0", "Y", 300, weight=1, band=1)))  # Y at 300, V 0
    await fair.activate("X")  # X at 0: the least served
    head = req("head", "X", 1000, weight=1, band=1)
    batch = req("batch", "Y", 10, weight=1, band=1)
    assert await fair.choose(offers(head, batch, unfit=("head",))) is None  # 300 > 0
    chats = []
    while (chosen := await fair.choose(offers(
            head, req(f"c{len(chats)}", "Y", 100, weight=1), unfit=("head",)))) is not None:
        chats.append(chosen)
    # Y's band-0 counter starts a lag below X's start (-100) and may go while it is at most
    # X's finish plus a lag (1,100): 13 chats of 100 (the last at 1,100 brings it to 1,200)
    assert len(chats) == 13 and (await fair.counters())["X"] == 0
    assert await fair.choose(offers(head, req("c", "Y", 100, weight=1))) is head  # X first
    assert (await fair.counters())["X"] == 1000
    assert await fair.choose(offers(req("c", "Y", 100, weight=1))) is not None


async def test_an_unfit_head_holds_others_interactive_work_when_its_tenant_has_one_that_fits(
) -> None:
    """A tenant with an offer that fits is not waiting for room: the others' interactive work
    is measured against its start, as before."""
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("y0", "Y", 300, weight=1)))  # Y at 300, its band 0 at 200
    await fair.activate("X")  # X at 0
    head, chat = req("head", "X", 1000, weight=1, band=1), req("chat", "Y", 10, weight=1)
    assert await fair.choose(offers(head, chat, unfit=("head",))) is chat  # 200 <= 1000 + 100
    small = req("small", "X", 10, weight=1, band=1)  # fits: X is not waiting for room
    assert await fair.choose(offers(head, small, req("c2", "Y", 10, weight=1),
                                    unfit=("head",))) is small  # Y's chat: 210 > 0 + 100


async def test_correct_charges_the_difference_and_refunds_down_to_zero() -> None:
    fair = MemoryFairness()
    await fair.choose(offers(req("y", "Y", 500, weight=2, band=1)))  # Y at 250
    await fair.correct("Y", -300, 2.0)  # answered shorter than reserved
    assert await fair.counters() == {"Y": 100.0}
    await fair.correct("Y", 90, 0.5)
    assert await fair.counters() == {"Y": 280.0}
    await fair.correct("Y", -10**6, 2.0)
    assert await fair.counters() == {"Y": 0.0}  # never below 0
    await fair.correct("nobody", -5, 1.0)  # no counter: nothing to correct
    assert await fair.counters() == {"Y": 0.0}


async def test_a_refund_puts_the_tenant_back_in_line() -> None:
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("x0", "X", 1000, weight=1, band=1)))  # X at 1000
    await fair.activate("Y")
    await fair.choose(offers(req("y0", "Y", 500, weight=1, band=1)))  # Y at 500, V 0
    x, y = req("x", "X", 10, weight=1, band=1), req("y", "Y", 10, weight=1, band=1)
    assert await fair.choose(offers(x, y)) is y
    await fair.correct("X", -950, 1.0)  # X at 50: behind Y now
    assert await fair.choose(offers(x, y)) is x


async def test_a_refund_is_not_banked_past_a_lag_behind_the_others() -> None:
    """An estimate far above the usage let the others go ahead while the request ran; the
    whole refund afterwards left the tenant so far behind that its batch work went ahead
    of every other tenant's interactive work until it was spent."""
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("x0", "X", 5000, weight=1, band=1)))  # X at 5000
    await fair.activate("Y")
    for n in range(4):  # Y at 4000, V 3000
        await fair.choose(offers(req(f"y{n}", "Y", 1000, weight=1, band=1)))
    assert fair.virtual_time == 3000
    await fair.correct("X", -4900, 1.0)  # it used 100: down to V - lag, not to 100
    assert (await fair.counters())["X"] == 2900
    await fair.correct("X", -500, 1.0)  # already there: no lower
    assert (await fair.counters())["X"] == 2900
    await fair.correct("X", 700, 1.0)  # a charge is never floored
    assert (await fair.counters())["X"] == 3600


@pytest.mark.parametrize("band0", [True, False])
async def test_a_band0_refund_lowers_the_band0_counter_too(band0: bool) -> None:
    """A tenant's interactive requests charged their estimate and answered shorter: its
    interactive work is held by what they used, not by the estimate (``--asks ceiling``)."""
    fair = MemoryFairness(lag_tokens=1000)
    await fair.activate("X")
    await fair.activate("Y")
    for n in range(2):  # X at 3000, its band-0 counter at 2000; Y at 0 (V)
        x = await fair.choose(offers(req(f"x{n}", "X", 1500), req(f"y{n}", "Y", 10, band=1)))
        assert x is not None and x.tenant == "X"
    x, y = req("x", "X", 10), req("y", "Y", 10, band=1)
    assert await fair.choose(offers(x, y)) is y  # X's band-0 counter past V + lag: held
    await fair.correct("X", -1200, 1.0, band0=band0)  # x0 used 300 of 1500
    assert (await fair.counters())["X"] == 1800
    assert fair.core._firsts["X"] == (800 if band0 else 1800) * SCALE
    y2 = req("y2", "Y", 10, band=1)
    assert await fair.choose(offers(x, y2)) is (x if band0 else y2)


async def test_a_refund_never_stalls_dispatch_while_everything_fits() -> None:
    fair = MemoryFairness(lag_tokens=100)
    await fair.choose(offers(req("x0", "X", 1000, weight=1)))  # X at 1000, band-0 at 900
    await fair.activate("Y")
    await fair.choose(offers(req("y0", "Y", 150, weight=1, band=1)))  # Y at 150
    await fair.correct("X", -1000, 1.0)  # X at 0, its band-0 counter still at 900
    x, y = req("x", "X", 10, weight=1), req("y", "Y", 10, weight=1, band=1)
    assert await fair.choose(offers(x, y)) is not None


@settings(max_examples=200, deadline=None)
@given(fairness_steps(), st.sampled_from([0, 100, DEFAULT_LAG]))
async def test_waiting_changes_nothing_and_counters_stay_non_negative(
    steps: list[tuple], lag: int
) -> None:
    fair = MemoryFairness(lag_tokens=lag, rebase_at=2 * MAX_CHARGE)
    for n, step in enumerate(steps):
        before = (dict(fair.core._counters), dict(fair.core._firsts), fair.virtual_time)
        chosen = await fairness_step(fair, n, step)
        if step[0] == "choose" and chosen is None:
            assert (fair.core._counters, fair.core._firsts, fair.virtual_time) == before
        assert all(value >= 0 for value in fair.core._counters.values())


@settings(max_examples=200, deadline=None)
@given(fairness_steps(unfit=False), st.sampled_from([0, 100, DEFAULT_LAG]))
async def test_someone_goes_whenever_everything_fits(steps: list[tuple], lag: int) -> None:
    """The least-served tenant's offer is always eligible (its band-0 counter never exceeds
    its total): work conserving."""
    fair = MemoryFairness(lag_tokens=lag, rebase_at=2 * MAX_CHARGE)
    for n, step in enumerate(steps):
        chosen = await fairness_step(fair, n, step)
        assert step[0] != "choose" or chosen in {o.item.id for o in fair_offers(n, step[1])}


def test_charge_is_scaled_rounded_and_bounded() -> None:
    assert charge_of(req("x", "A", cost=1000)) == 1000 * SCALE // 5
    priced = QueuedRequest("p", "A", 0, 1000, 5.0, 0, NEVER, price=3000)
    assert charge_of(priced) == 3000 * SCALE // 5  # the price, not the KV cost
    assert charge_of(req("x", "A", cost=1, weight=3)) == 333
    assert charge_of(req("x", "A", cost=0)) == 1  # free requests still take turns
    with pytest.raises(ValueError, match="too large"):
        charge_of(req("x", "A", cost=10**12, weight=0.5))


def test_memory_fairness_is_a_fairness() -> None:
    assert isinstance(MemoryFairness(), Fairness)


async def test_a_forgotten_tenant_has_no_counter_and_starts_afresh() -> None:
    """A tenant removed from the configuration with nothing queued: its counters go, and
    configured again it starts at V as a new tenant does."""
    fair = MemoryFairness()
    queue = FairQueue()
    for tenant in ("a", "b"):
        queue.push(QueuedRequest(f"{tenant}1", tenant, 0, 500, 1.0, 0, 10_000), 0)
        await fair.activate(tenant)
    for _ in range(2):
        chosen = await fair.choose(queue.candidates(0))
        assert chosen is not None
        queue.take(chosen.id)
    assert set(await fair.counters()) == {"a", "b"}
    fair.forget(["a", "gone-already"])
    assert set(await fair.counters()) == {"b"} and "a" not in fair.core._firsts
    await fair.activate("a")
    assert (await fair.counters())["a"] == fair.virtual_time
