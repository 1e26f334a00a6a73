"""Virtual-counter fairness (start-time fair queueing by tokens), in memory.

The simulations run on virtual time (no sleeping): every round is one capacity event per
replica, each dispatching one request through ``FairQueue.candidates`` → ``choose`` →
``take``. The helpers here are shared with ``test_fairness_redis.py``, which runs the same
scenarios against Redis.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from limiter import FairQueue, QueuedRequest
from limiter.fairness import MAX_CHARGE, SCALE, charge_of
from limiter.stores import Fairness, MemoryFairness

WEIGHTS = {"A": 5.0, "B": 3.0, "C": 1.0}
NEVER = 10**15


def req(rid: str, tenant: str, cost: int = 100, at: int = 0, weight: float | None = None,
        band: int = 0) -> QueuedRequest:
    weight = WEIGHTS.get(tenant, 1.0) if weight is None else weight
    return QueuedRequest(rid, tenant, band, cost, weight, at, NEVER)


@dataclass
class Replica:
    """One kvgate replica: its own queue, fed by its own tenant mix, and a selector."""

    fairness: Fairness
    mix: dict[str, int]
    queue: FairQueue = field(default_factory=lambda: FairQueue(max_size=10**6, aging_ms=None))

    async def arrive(self, tenant: str, cost: int, now: int, rid: str) -> None:
        if self.queue.queued(tenant) == 0:
            await self.fairness.activate(tenant)
        assert self.queue.push(req(rid, tenant, cost, now), now) == []

    async def dispatch(self, now: int) -> QueuedRequest | None:
        chosen = await self.fairness.choose(self.queue.candidates(now), now)
        return None if chosen is None else self.queue.take(chosen.id)


def deviation(tokens: dict[str, int]) -> dict[str, float]:
    """Each tenant's token share relative to its weight share (1.0 = exactly fair)."""
    total, weights = sum(tokens.values()), sum(WEIGHTS.values())
    return {t: tokens[t] / total / (WEIGHTS[t] / weights) for t in WEIGHTS}


def worst(tokens: dict[str, int]) -> float:
    """The largest relative miss of any tenant's weighted share."""
    return max(abs(share - 1) for share in deviation(tokens).values())


async def all_backlogged(fairness: Fairness, events: int, seed: int) -> dict[str, int]:
    """3 tenants always queued (two requests each, 50–2000 tokens); one dispatch per event."""
    rng, replica = random.Random(seed), Replica(fairness, {})
    tokens = dict.fromkeys(WEIGHTS, 0)
    for n, tenant in enumerate(list(WEIGHTS) * 2):
        await replica.arrive(tenant, rng.randint(50, 2000), 0, f"init{n}")
    for now in range(1, events + 1):
        chosen = await replica.dispatch(now)
        assert chosen is not None
        tokens[chosen.tenant] += chosen.cost
        await replica.arrive(chosen.tenant, rng.randint(50, 2000), now, f"r{now}")
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


# --- the rules ------------------------------------------------------------------------------


async def test_smallest_counter_goes_and_is_charged_cost_over_weight() -> None:
    fair = MemoryFairness()
    a, c = req("a", "A", cost=500), req("c", "C", cost=100)
    assert await fair.choose([c, a], 0) is c  # both new: equal counters, tie → earlier/first
    assert await fair.counters() == {"C": 100.0}
    assert await fair.choose([c, a], 0) is a  # A starts at V = 0 < C's 100
    assert await fair.counters() == {"C": 100.0, "A": 100.0}
    assert fair.virtual_time == 0


async def test_ties_go_to_the_earliest_enqueued() -> None:
    fair = MemoryFairness()
    late, early = req("late", "A", at=50), req("early", "B", at=10)
    assert await fair.choose([late, early], 100) is early
    assert await fair.choose([], 100) is None


async def test_idle_time_is_not_banked_as_credit() -> None:
    """C idles while A and B run; back, C gets its weight's share, not a monopoly."""
    fair = MemoryFairness()
    for n in range(300):
        await fair.choose([req(f"a{n}", "A"), req(f"b{n}", "B")], n)
    await fair.activate("C")
    chosen = [(await fair.choose([req("a", "A"), req("b", "B"), req("c", "C")], 0)).tenant
              for _ in range(90)]
    assert abs(chosen.count("C") - 10) <= 1 and abs(chosen.count("A") - 50) <= 1


async def test_activation_keeps_a_debt() -> None:
    """A tenant ahead of V stays ahead after going idle and coming back."""
    fair = MemoryFairness()
    await fair.choose([req("big", "A", cost=50_000)], 0)  # A at 10 000, V 0
    await fair.activate("A")
    assert (await fair.counters())["A"] == 10_000


huge = st.integers(5 * 10**8, 10**9)  # tokens per unit of weight: charges near MAX_CHARGE


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(huge, huge, huge, huge, st.sampled_from("ABCD")), min_size=30,
                max_size=60))
async def test_rebasing_changes_no_decision(rounds: list[tuple]) -> None:
    """Huge costs force rebases (at the smallest allowed threshold); every choice equals
    that of counters that never rebase (Python ints are exact at any size)."""
    rebased, exact = MemoryFairness(rebase_at=2 * MAX_CHARGE), MemoryFairness(rebase_at=2**200)
    for n, (*costs, idle) in enumerate(rounds):
        offer = [req(f"{n}{t}", t, cost * int(WEIGHTS.get(t, 1)), at=n)
                 for t, cost in zip("ABCD", costs, strict=True) if t != idle]
        await rebased.activate(idle)
        await exact.activate(idle)
        assert (await rebased.choose(offer, n)).id == (await exact.choose(offer, n)).id
    assert rebased.virtual_time < exact.virtual_time  # it did rebase


async def test_a_tenant_without_a_counter_starts_at_virtual_time() -> None:
    fair = MemoryFairness()
    for n in range(3):
        await fair.choose([req(f"a{n}", "A", cost=1000)], n)  # A at 600, V 400
    assert fair.virtual_time == 400
    assert (await fair.choose([req("a", "A", at=0), req("b", "B", at=9)], 9)).tenant == "B"
    assert (await fair.counters())["B"] == 433.333  # 400 + round(100 · 1000 / 3) / 1000


def test_charge_is_scaled_rounded_and_bounded() -> None:
    assert charge_of(req("x", "A", cost=1000)) == 1000 * SCALE // 5
    assert charge_of(req("x", "A", cost=1, weight=3)) == 333
    assert charge_of(req("x", "A", cost=0)) == 1  # free requests still take turns
    with pytest.raises(ValueError, match="too large"):
        charge_of(req("x", "A", cost=10**12, weight=0.5))


def test_memory_fairness_is_a_fairness() -> None:
    assert isinstance(MemoryFairness(), Fairness)
