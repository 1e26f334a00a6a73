"""The endpoint store (extproc.datalayer.endpoints): health rules, endpoint sets, snapshots."""

from __future__ import annotations

import asyncio

import pytest

from extproc.datalayer.endpoints import (
    EndpointChange,
    EndpointState,
    EndpointStore,
    ScrapeResult,
    advance,
)
from extproc.datalayer.metrics import EngineMetrics
from extproc.datalayer.nvml import GpuReading

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
GOOD = EngineMetrics(kv_cache_usage=0.5, num_requests_running=1, kv_capacity_tokens=1600,
                     engines=("0",))
NO_CAPACITY = EngineMetrics(kv_cache_usage=0.5, engines=("0",))
GPU = GpuReading(0, "GPU-0", "H200", 30, 100, 50.0)


def ok(address: str, at: float, metrics: EngineMetrics = GOOD) -> ScrapeResult:
    return ScrapeResult(address, at, metrics)


def failed(address: str, at: float) -> ScrapeResult:
    return ScrapeResult(address, at, error="connection refused")


# -- the health rules ----------------------------------------------------------------------


def test_a_new_endpoint_is_unscraped_unhealthy_and_stale() -> None:
    state = EndpointState(A, "p")
    assert (state.healthy, state.scraped_at, state.is_fresh(now=0.0)) == (False, None, False)


def test_success_makes_healthy_and_fresh_until_the_staleness_bound() -> None:
    state = advance(EndpointState(A, "p"), ok(A, at=10.0), unhealthy_after=3)
    assert state.healthy and state.scraped_at == 10.0 and state.kv_capacity_tokens == 1600
    assert state.is_fresh(now=12.0) and not state.is_fresh(now=12.01)
    assert state.is_fresh(now=10.5, staleness_s=0.5) and not state.is_fresh(10.6, 0.5)
    assert state.is_usable(now=11.0)


def test_a_slow_or_garbled_scrape_keeps_health_and_the_last_reading_until_stale() -> None:
    state = advance(EndpointState(A, "p"), ok(A, 1.0), unhealthy_after=3)
    for at in (2.0, 3.0, 4.0, 5.0):  # the engine answered late, or not with metrics
        state = advance(state, ScrapeResult(A, at, error="timed out", reached=True), 3)
    assert state.healthy and state.consecutive_failures == 0
    assert state.metrics == GOOD and state.scraped_at == 1.0 and state.last_error == "timed out"
    assert state.is_usable(2.9, staleness_s=2.0) and not state.is_usable(3.1, staleness_s=2.0)


def test_unhealthy_after_n_consecutive_failures_and_healthy_on_the_next_success() -> None:
    state = advance(EndpointState(A, "p"), ok(A, 1.0), unhealthy_after=3)
    for at, still_healthy in ((2.0, True), (3.0, True), (4.0, False), (5.0, False)):
        state = advance(state, failed(A, at), unhealthy_after=3)
        assert state.healthy is still_healthy
    assert state.consecutive_failures == 4 and state.last_error == "connection refused"
    assert state.metrics == GOOD and state.scraped_at == 1.0  # last good data kept, aging
    state = advance(state, ok(A, 6.0), unhealthy_after=3)
    assert state.healthy and state.consecutive_failures == 0 and state.last_error is None


def test_an_answer_that_is_not_metrics_ends_a_run_of_unreachable_scrapes() -> None:
    """Unreachable, then late (an engine that was there), then unreachable again: never
    ``unhealthy_after`` in a row. Counted as a run, an overloaded engine whose scrapes were
    now refused, now timed out turned unhealthy, and its requests got 503s at once instead
    of waiting for a fresh scrape."""
    state = advance(EndpointState(A, "p"), ok(A, 1.0), unhealthy_after=3)
    for at in (2.0, 3.0, 4.0, 5.0, 6.0, 7.0):
        result = failed(A, at) if at % 2 == 0 else ScrapeResult(A, at, error="timed out",
                                                                   reached=True)
        state = advance(state, result, unhealthy_after=3)
        assert state.healthy
    assert state.consecutive_failures == 0 and state.last_error == "timed out"
    for at in (8.0, 9.0, 10.0):
        state = advance(state, failed(A, at), unhealthy_after=3)
    assert not state.healthy and state.consecutive_failures == 3


def test_capacity_falls_back_to_the_configured_value() -> None:
    state = advance(EndpointState(A, "p"), ok(A, 1.0, NO_CAPACITY), 3, kv_capacity_fallback=999)
    assert state.kv_capacity_tokens == 999


def test_gpu_readings_are_kept_when_a_round_has_none() -> None:
    state = advance(EndpointState(A, "p"), ScrapeResult(A, 1.0, GOOD, gpus=(GPU,)), 3)
    state = advance(state, ScrapeResult(A, 2.0, GOOD, gpus=None), 3)
    assert state.gpus == (GPU,) and state.gpus_read_at == 1.0
    assert state.gpu_memory_used_ratio == 0.3


# -- the store -----------------------------------------------------------------------------


async def test_set_endpoints_adds_keeps_and_removes() -> None:
    store = EndpointStore()
    assert await store.set_endpoints("p", [A, B]) == EndpointChange(added=(A, B))
    await store.apply([ok(A, 1.0)])
    change = await store.set_endpoints("p", [A, C])
    assert change == EndpointChange(added=(C,), removed=(B,))
    snap = store.snapshot()
    assert [s.address for s in snap.endpoints("p")] == [A, C]
    assert snap.get("p", A).healthy  # kept its state across the change
    assert snap.get("p", C).scraped_at is None  # new: unscraped
    assert not await store.set_endpoints("p", [C, A])  # same set: no change, no swap


async def test_results_for_removed_endpoints_are_dropped_and_shared_across_pools() -> None:
    store = EndpointStore()
    await store.set_endpoints("chat", [A, B])
    await store.set_endpoints("embed", [A])
    await store.set_endpoints("chat", [A])
    await store.apply([ok(A, 1.0), ok(B, 1.0)])
    snap = store.snapshot()
    assert snap.addresses() == {A}
    assert snap.get("chat", A).healthy and snap.get("embed", A).healthy


async def test_apply_reports_health_transitions() -> None:
    store = EndpointStore()
    await store.set_endpoints("p", [A, B])
    [(before, after)] = await store.apply([ok(A, 1.0), failed(B, 1.0)], unhealthy_after=1)
    assert (before.address, before.healthy, after.healthy) == (A, False, True)
    assert await store.apply([ok(A, 2.0)]) == []
    [(_, after)] = await store.apply([failed(A, 3.0)], unhealthy_after=1)
    assert not after.healthy


async def test_pool_fallback_capacity_applies_to_new_and_scraped_endpoints() -> None:
    store = EndpointStore(kv_capacity_fallback={"p": 4096})
    await store.set_endpoints("p", [A])
    assert store.snapshot().get("p", A).kv_capacity_tokens == 4096
    await store.apply([ok(A, 1.0, NO_CAPACITY)])
    assert store.snapshot().get("p", A).kv_capacity_tokens == 4096


async def test_a_snapshot_is_immutable_and_unaffected_by_later_swaps() -> None:
    store = EndpointStore()
    await store.set_endpoints("p", [A])
    old = store.snapshot()
    await store.apply([ok(A, 1.0)])
    new = store.snapshot()
    assert new.version == old.version + 1
    assert old.get("p", A).scraped_at is None and new.get("p", A).scraped_at == 1.0
    with pytest.raises(TypeError):
        new.pools["p"][B] = EndpointState(B, "p")  # type: ignore[index]
    with pytest.raises(AttributeError):
        new.get("p", A).healthy = False  # type: ignore[misc]


async def test_concurrent_writers_do_not_lose_each_others_updates() -> None:
    store = EndpointStore()
    await store.set_endpoints("a", [A])
    await asyncio.gather(store.set_endpoints("b", [B]), store.apply([ok(A, 1.0)]),
                         store.set_endpoints("c", [C]), store.apply([ok(A, 2.0)]))
    snap = store.snapshot()
    assert set(snap.pools) == {"a", "b", "c"}
    assert snap.get("a", A).scraped_at == 2.0 and snap.version == 5


async def test_snapshot_reads_never_wait_for_a_writer() -> None:
    store = EndpointStore()
    await store.set_endpoints("p", [A])
    before = store.snapshot()
    async with store._lock.writer:  # a writer mid-swap (or stuck): readers still read
        assert store.snapshot() is before
        pending = asyncio.create_task(store.apply([ok(A, 1.0)]))
        await asyncio.sleep(0.01)
        assert not pending.done() and store.snapshot() is before  # the second writer waits
    await pending
    assert store.snapshot().get("p", A).healthy
