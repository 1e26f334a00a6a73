"""Flow control in-process: the director queues saturated requests and the dispatcher hands
capacity out in band order as it frees, with deadlines and disconnects leaving nothing."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.datalayer.endpoints import EndpointStore, ScrapeResult
from extproc.datalayer.metrics import EngineMetrics
from extproc.director import Admission
from extproc.openai import parse_body
from extproc.wiring import build_director
from limiter import Reject
from limiter.fairness import SCALE
from limiter.stores import MemoryStore

ENDPOINT = "127.0.0.1:1"


def config(deadline_s=5.0, more_pools=(), limits=None):
    return parse_config({
        "tiers": {"gold": {"weight": 3, **({"limits": limits} if limits else {})},
                  "free": {"weight": 1}},
        "classes": {name: {"priority": p, "deadline_s": deadline_s}
                    for p, name in enumerate(["interactive", "batch", "offline"])},
        "queue": {"aging_s": None},
        "classification": {"long_prompt_tokens": None},
        "tenants": [
            {"name": "a", "tier": "gold", "api_keys": [hash_api_key("ka")]},
            {"name": "b", "tier": "free", "api_keys": [hash_api_key("kb")]},
        ],
        "pools": [{"name": "p", "models": ["m"], "endpoints": [ENDPOINT],
                   "priority_scheduling": True}, *more_pools],
    })


class Harness:
    def __init__(self, cfg):
        self.endpoints = EndpointStore()
        self.director = build_director(cfg, MemoryStore(), self.endpoints)
        self.flow = self.director.flows["p"]

    async def start(self, usage: float) -> Harness:
        await self.endpoints.set_endpoints("p", [ENDPOINT])
        await self.set_usage(usage)
        self.flow.start()
        return self

    async def set_usage(self, usage: float) -> None:
        metrics = EngineMetrics(kv_cache_usage=usage, kv_capacity_tokens=1000)
        await self.endpoints.apply([ScrapeResult(ENDPOINT, time.monotonic(), metrics)])
        self.director.kick()

    def admit(self, tenant="a", klass=None, model="m"):
        body = {"model": model, "max_tokens": 100,
                "messages": [{"role": "user", "content": "x" * 40}]}  # ~113 tokens
        request = parse_body("/v1/chat/completions", orjson.dumps(body))
        who = self.director.authenticate(f"Bearer k{tenant}")
        return asyncio.create_task(self.director.admit(who, request, klass))

    async def nothing_held(self) -> bool:
        scheduler = self.director.schedulers["p"]
        return (not scheduler.reservations and not len(self.flow.queue)
                and await self.director.store.in_flight("a") == 0
                and await self.director.store.in_flight("b") == 0)


@pytest.fixture
async def harness():
    h = Harness(config())
    yield h
    await h.flow.stop()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0.01)


async def test_interactive_goes_before_earlier_queued_batch(harness):
    await harness.start(usage=0.99)
    tasks = [harness.admit(klass="batch"), harness.admit(klass="batch")]
    await settle()
    tasks.append(harness.admit(klass="interactive"))
    await settle()
    assert len(harness.flow.queue) == 3
    await harness.set_usage(0.8)  # room for exactly one ~113-token request at a time
    order = []
    while len(order) < 3:
        done, _ = await asyncio.wait(tasks, timeout=2, return_when=asyncio.FIRST_COMPLETED)
        assert done, "nothing was dispatched"
        (task,) = done
        tasks.remove(task)
        admission = task.result()
        assert isinstance(admission, Admission)
        order.append(admission.request_class)
        await harness.director.release(admission, 50)  # completion: a capacity event
    assert order == ["interactive", "batch", "batch"]
    assert await harness.nothing_held()


async def test_dispatched_request_carries_its_class_priority(harness):
    await harness.start(usage=0.99)
    task = harness.admit(klass="offline")
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    assert (admission.request_class, admission.priority) == ("offline", 2)
    await harness.director.release(admission, 10)


async def test_deadline_passes_503_and_nothing_is_held():
    h = Harness(config(deadline_s=0.2))
    await h.start(usage=0.99)
    outcome = await asyncio.wait_for(h.admit(), 2)
    assert isinstance(outcome, Reject)
    assert (outcome.status, outcome.reason) == (503, "pool_saturated")
    assert outcome.retry_after_ms >= 1000
    assert await h.nothing_held()
    await h.flow.stop()


async def test_a_request_refused_at_its_deadline_gives_back_its_request_charge():
    """Its request-rate and sliding-window charges as well as its tokens: it was never
    served, and its client's retry after the 503 was refused by the request rate (429,
    retry after 10 s) for the request kvgate itself had refused."""
    limits = {"requests_per_second": 0.1, "request_burst": 1,
              "sliding_window": {"requests": 1, "window_ms": 60_000}}
    h = Harness(config(deadline_s=0.2, limits=limits))
    await h.start(usage=0.99)
    outcome = await asyncio.wait_for(h.admit(), 2)
    assert isinstance(outcome, Reject) and outcome.reason == "pool_saturated"
    await h.set_usage(0.1)
    retry = await asyncio.wait_for(h.admit(), 2)
    assert isinstance(retry, Admission), retry
    await h.director.release(retry, 10)
    assert await h.nothing_held()
    await h.flow.stop()


async def test_tenant_over_its_share_gets_429_at_its_deadline():
    h = Harness(config(deadline_s=0.2))
    scheduler = h.director.schedulers["p"]
    before_the_scrape = time.monotonic()
    scheduler.reserve("a-held", "a", ENDPOINT, 100, before_the_scrape)
    scheduler.reserve("b-held", "b", ENDPOINT, 200, before_the_scrape)
    await h.start(usage=0.80)  # busy: one more request lands between the watermarks
    outcome = await asyncio.wait_for(h.admit("b", "batch"), 2)  # b (weight 1) holds 2/3
    assert isinstance(outcome, Reject) and (outcome.status, outcome.reason) == (429,
                                                                              "kv_share_exceeded")
    assert await h.director.store.in_flight("b") == 0
    await h.flow.stop()


async def test_client_disconnect_while_queued_leaves_nothing(harness):
    await harness.start(usage=0.99)
    task = harness.admit()
    await settle()
    assert len(harness.flow.queue) == 1
    assert await harness.director.store.in_flight("a") == 1  # its concurrency slot, held
    # … and renewed in a shared store while it waits: a lease left to lapse (the TTL is
    # shorter than a batch deadline) freed the slot for another replica
    assert list(harness.director.leases.open.values()) == ["a"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await harness.nothing_held() and not harness.director.leases.open


async def test_a_wait_its_client_ended_is_counted_in_the_queue_wait_histogram(harness):
    """``kvgate_queue_wait_seconds`` is the time spent queued whatever the outcome: the waits
    clients gave up on (the longest, often) were left out, so it read only the others."""
    await harness.start(usage=0.99)
    task = harness.admit(klass="batch")
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    registry = harness.flow.metrics.registry
    labels = {"pool": "p", "class": "batch"}
    assert registry.get_sample_value("kvgate_queue_events_total",
                                     {"pool": "p", "event": "cancelled"}) == 1
    assert registry.get_sample_value("kvgate_queue_wait_seconds_count", labels) == 1
    assert 0.09 <= registry.get_sample_value("kvgate_queue_wait_seconds_sum", labels) < 1


async def test_a_request_refused_at_its_deadline_stops_being_renewed():
    h = Harness(config(deadline_s=0.2))
    await h.start(usage=0.99)
    task = h.admit()
    await settle()
    assert h.director.leases.open
    assert isinstance(await asyncio.wait_for(task, 2), Reject)
    assert await h.nothing_held() and not h.director.leases.open
    await h.flow.stop()


async def test_a_client_leaving_while_the_order_is_asked_is_refunded(harness, caplog):
    """The shared order's answer is a Redis round trip: a client that left meanwhile broke
    that dispatch round (KeyError, logged) and its tenant kept the charge for work that
    never ran; the other queued request waited for the next capacity event."""
    await harness.start(usage=0.99)
    leaver, stayer = harness.admit("a"), harness.admit("b")
    await settle()
    choose = harness.flow.fairness.choose

    async def slow_choose(offers):
        chosen = await choose(offers)
        if chosen is not None and chosen.tenant == "a":
            leaver.cancel()  # the client goes while the answer is on its way
            await settle()
        return chosen

    harness.flow.fairness.choose = slow_choose
    await harness.set_usage(0.1)
    assert isinstance(await asyncio.wait_for(stayer, 2), Admission)
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert (await harness.flow.fairness.counters()).get("a", 0) == 0
    assert "dispatch failed" not in caplog.text


def queue_depth(director) -> dict[tuple[str, str], float]:
    """kvgate_queue_depth's samples, (pool, tenant) → requests waiting."""
    (family,) = director.flows["p"].metrics.queue_depth.collect()
    return {(s.labels["pool"], s.labels["tenant"]): s.value for s in family.samples}


async def test_each_pools_queue_depth_stays_when_another_pools_changes():
    """Every pool's controller writes the one shared gauge: a change in one pool's queue
    must leave the other pools' series alone."""
    second = "127.0.0.1:2"
    h = Harness(config(more_pools=[{"name": "q", "models": ["n"], "endpoints": [second]}]))
    await h.endpoints.set_endpoints("q", [second])
    full = EngineMetrics(kv_cache_usage=0.99, kv_capacity_tokens=1000)
    await h.endpoints.apply([ScrapeResult(second, time.monotonic(), full)])
    await h.start(usage=0.99)
    h.director.flows["q"].start()
    in_p = h.admit("a")
    await settle()
    in_q = h.admit("b", model="n")
    await settle()
    assert queue_depth(h.director) == {("p", "a"): 1, ("q", "b"): 1}
    in_q.cancel()
    await settle()
    assert queue_depth(h.director) == {("p", "a"): 1}
    in_p.cancel()
    await settle()
    assert queue_depth(h.director) == {}
    await asyncio.gather(in_p, in_q, return_exceptions=True)
    await h.director.flows["q"].stop()
    await h.flow.stop()


async def test_full_queue_evicts_the_least_important_newest():
    cfg = config()
    cfg = cfg.model_copy(update={"queue": cfg.queue.model_copy(update={"max_size": 2})})
    h = Harness(cfg)
    await h.start(usage=0.99)
    first, second = h.admit(klass="batch"), h.admit(klass="offline")
    await settle()
    third = h.admit(klass="interactive")
    evicted = await asyncio.wait_for(second, 2)
    assert isinstance(evicted, Reject) and evicted.status == 503
    await h.set_usage(0.1)
    for task in (first, third):
        await h.director.release(await asyncio.wait_for(task, 2), 10)
    assert await h.nothing_held()
    await h.flow.stop()


def test_auto_aging_is_half_each_class_deadline():
    data = config(deadline_s=20.0).model_dump(exclude_unset=True)
    data["queue"]["aging_s"] = "auto"
    h = Harness(parse_config(data))
    assert [h.flow.queue.aging_for(b) for b in (1, 2)] == [10_000, 10_000]


def test_classes_may_set_their_own_aging():
    cfg = config()
    data = cfg.model_dump(exclude_unset=True)
    data["queue"] = {"aging_s": 5}
    data["classes"]["batch"]["aging_s"] = 30
    data["classes"]["offline"]["aging_s"] = None
    h = Harness(parse_config(data))
    assert (h.flow.queue.aging_for(0), h.flow.queue.aging_for(1),
            h.flow.queue.aging_for(2)) == (5000, 30_000, None)


async def test_a_queued_request_is_charged_its_price_and_refunded_what_it_did_not_use(harness):
    await harness.start(usage=0.99)
    task = harness.admit("b")  # weight 1: counter units are tokens
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    prompt = admission.cost.prompt_tokens
    assert admission.charged == prompt + 2 * 100  # prompt 1, output 2 per token (max_tokens)
    counters = await harness.flow.fairness.counters()
    assert counters["b"] == admission.charged
    await harness.director.release(admission, prompt + 10, 10)  # 10 of 100 output tokens
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 10


async def test_a_queued_request_is_charged_the_output_its_tenant_is_expected_to_use(harness):
    """Charged every reserved output token, a tenant whose answers use a tenth of its
    max_tokens swung its counter by the rest at every dispatch and refund. The charge is
    the share of max_tokens the tenant's answers have lately used (another tenant's habit
    does not count), corrected to the real usage when the request ends."""
    await harness.start(usage=0.99)
    harness.flow.scheduler.output_ratios.update({"b": 0.25, "a": 0.05})
    task = harness.admit("b")
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    prompt = admission.cost.prompt_tokens
    assert admission.charged == prompt + 2 * 25  # a quarter of its 100 output tokens
    assert (await harness.flow.fairness.counters())["b"] == admission.charged
    await harness.director.release(admission, prompt + 30, 30)
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 30


async def test_a_queued_request_is_priced_as_of_its_dispatch_not_its_arrival(harness):
    """Under contention a request waits minutes while its tenant's answers teach the
    scheduler what they use: priced when it was queued, it was charged an estimate long out
    of date (all of max_tokens, before any answer had ended), and the shares drifted."""
    await harness.start(usage=0.99)
    task = harness.admit("b")  # nothing learned yet: all 100 output tokens
    await settle()
    harness.flow.scheduler.output_ratios["b"] = 0.25  # answers ended meanwhile
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    prompt = admission.cost.prompt_tokens
    assert admission.charged == prompt + 2 * 25
    assert (await harness.flow.fairness.counters())["b"] == admission.charged
    await harness.director.release(admission, prompt + 30, 30)
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 30


@pytest.mark.parametrize("klass", ["interactive", "batch"])
async def test_an_interactive_request_corrects_its_tenants_band0_counter_too(harness, klass):
    """Charged as band-0 work at dispatch, an interactive request's end moves its tenant's
    band-0 counter by the same correction as its whole counter: else a tenant whose
    interactive answers ran short was held as if they had used all of max_tokens."""
    await harness.start(usage=0.99)
    task = harness.admit("b", klass)
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    assert admission.charged_band0 is (klass == "interactive")
    core = harness.flow.fairness.core
    before = core._firsts.get("b")
    prompt = admission.cost.prompt_tokens
    await harness.director.release(admission, prompt + 10, 10)  # 90 of 100 output unused
    if klass == "interactive":
        assert core._firsts["b"] == before - 2 * 90 * SCALE
    else:
        assert core._firsts.get("b") == before


async def test_a_request_running_past_its_estimate_is_charged_its_max_tokens_at_once(harness):
    """Charged its tenant's expected share until it ended, a tenant whose short answers
    turned long got ahead of the others with every long request sent before the first
    ended. Found running past its estimate (a scrape round), it is charged all of its
    max_tokens; its end corrects that to the real usage, as ever."""
    await harness.start(usage=0.99)
    harness.flow.scheduler.output_ratios["b"] = 0.25
    task = harness.admit("b")
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    prompt = admission.cost.prompt_tokens
    assert admission.charged == prompt + 2 * 25
    reservation = harness.flow.scheduler.reservations[admission.lease_id]
    reservation.peak = reservation.tokens  # as _overrunning finds it: counted whole,
    harness.flow.scheduler.overran.append(admission.lease_id)  # and told to the director
    harness.director.scraped(harness.director.endpoints.snapshot())
    await settle()
    assert admission.charged == prompt + 2 * 100
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 100
    await harness.director.release(admission, prompt + 90, 90)
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 90


async def test_a_correction_after_a_weight_change_uses_the_weight_charged(harness):
    """A reload between dispatch and release changed the tenant's weight: the correction
    was converted at the new weight, the charge had been at the old, and the counter
    drifted by the difference."""
    await harness.start(usage=0.99)
    task = harness.admit("b")  # weight 1 when queued and charged
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    prompt = admission.cost.prompt_tokens
    heavier = config()
    heavier = heavier.model_copy(update={"tiers": {**heavier.tiers, "free": heavier.tiers[
        "free"].model_copy(update={"weight": 4})}})
    harness.director.reconfigure(heavier)
    await harness.director.release(admission, prompt + 10, 10)  # 10 of 100 output tokens
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 10


async def test_a_request_placed_at_once_is_not_charged(harness):
    await harness.start(usage=0.1)
    admission = await asyncio.wait_for(harness.admit("b"), 2)
    assert admission.charged is None  # nothing waited: there is no order to keep
    await harness.director.release(admission, 10, 5)
    assert await harness.flow.fairness.counters() == {}


async def test_debug_shows_the_queue_and_what_the_gate_knows(harness):
    await harness.start(usage=0.99)
    task = harness.admit("b", "batch")
    await settle()
    view = await harness.flow.debug()
    assert view["queued"] == 1 and view["items"][0]["tenant"] == "b"
    assert view["unstarted"] == {} and view["seq_limits"] == {}
    assert view["prefill_tokens_per_s"] == 0 and view["prefill_ahead_tokens"] == {}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task



async def test_a_free_tenants_pdf_does_not_hold_up_a_paying_tenants_chat():
    """README's worked example (per-tier ``long_prompt_tokens``): a ~6,500-token PDF from a
    free tenant (tier rule 2,048) becomes batch work; a gold tenant's chat that arrives after
    it, with the pool busy, is dispatched first, and each engine is sent its class priority."""
    data = config().model_dump(exclude_unset=True)
    data["classification"]["long_prompt_tokens"] = 8192
    data["tiers"]["free"]["long_prompt_tokens"] = 2048
    h = Harness(parse_config(data))

    async def usage(ratio: float) -> None:
        metrics = EngineMetrics(kv_cache_usage=ratio, kv_capacity_tokens=100_000)
        await h.endpoints.apply([ScrapeResult(ENDPOINT, time.monotonic(), metrics)])
        h.director.kick()

    await h.endpoints.set_endpoints("p", [ENDPOINT])
    await usage(0.99)
    h.flow.start()
    order: list[str] = []

    async def ask(tenant: str, text: str) -> Admission | Reject:
        body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": text}]}
        request = parse_body("/v1/chat/completions", orjson.dumps(body))
        outcome = await h.director.admit(h.director.authenticate(f"Bearer k{tenant}"), request)
        order.append(tenant)
        return outcome

    pdf = asyncio.create_task(ask("b", "Quarterly report, page after page. " * 750))
    await settle()
    chat = asyncio.create_task(ask("a", "What is on my calendar today?"))
    await settle()
    assert len(h.flow.queue) == 2 and not order
    await usage(0.1)  # room for both: the dispatcher hands it out in band order
    admitted = [await asyncio.wait_for(task, 2) for task in (pdf, chat)]
    assert order == ["a", "b"]
    assert [(a.request_class, a.priority) for a in admitted] == [("batch", 1),
                                                                ("interactive", 0)]
    for admission in admitted:
        await h.director.release(admission, 10)
    assert await h.nothing_held()
    await h.flow.stop()

# --- per-tenant overflow mode -------------------------------------------------------------


def overflow_config(overflow: str, degradation: dict | None = None, on: str = "tenant"):
    """Tenant b (free, weight 1) with its overflow mode set on itself or on its tier."""
    data = config().model_dump(exclude_unset=True)
    if on == "tenant":
        data["tenants"][1]["overflow"] = overflow
    else:
        data["tiers"]["free"]["overflow"] = overflow
    if degradation:
        data["pools"][0]["degradation"] = degradation
    return parse_config(data)


@pytest.mark.parametrize(("overflow", "plan"), [
    (None, None), ("queue", None), ("degrade", {"classes": [], "max_tokens_cap": 20}),
])
async def test_overflow_modes_that_wait(overflow, plan):
    """``queue`` (the default) waits in the fair queue; so does ``degrade`` when no degraded
    form fits."""
    h = Harness(config() if overflow is None else overflow_config(overflow, plan))
    await h.start(usage=0.99)
    task = h.admit("b")
    await settle()
    assert len(h.flow.queue) == 1 and not task.done()
    await h.set_usage(0.1)
    await h.director.release(await asyncio.wait_for(task, 2), 10)
    assert await h.nothing_held()
    await h.flow.stop()


@pytest.mark.parametrize("on", ["tenant", "tier"])
async def test_overflow_reject_refuses_at_once_with_retry_after(on):
    h = Harness(overflow_config("reject", on=on))
    await h.start(usage=0.99)
    queued = h.admit("a")  # a keeps today's behaviour: it waits
    outcome = await asyncio.wait_for(h.admit("b"), 0.5)
    assert isinstance(outcome, Reject) and (outcome.status, outcome.reason) == (
        503, "pool_saturated")
    assert outcome.retry_after_ms is not None and outcome.retry_after_ms >= 1000
    assert await h.director.store.in_flight("b") == 0
    await settle()
    assert len(h.flow.queue) == 1 and not queued.done()
    await h.set_usage(0.1)
    await h.director.release(await asyncio.wait_for(queued, 2), 10)
    assert await h.nothing_held()
    await h.flow.stop()


async def test_overflow_reject_over_its_share_is_429_at_once():
    h = Harness(overflow_config("reject"))
    scheduler = h.director.schedulers["p"]
    before_the_scrape = time.monotonic()
    scheduler.reserve("a-held", "a", ENDPOINT, 100, before_the_scrape)
    scheduler.reserve("b-held", "b", ENDPOINT, 200, before_the_scrape)
    await h.start(usage=0.80)
    outcome = await asyncio.wait_for(h.admit("b", "batch"), 0.5)
    assert isinstance(outcome, Reject) and (outcome.status, outcome.reason) == (
        429, "kv_share_exceeded")
    assert outcome.retry_after_ms is not None
    assert await h.director.store.in_flight("b") == 0 and not len(h.flow.queue)
    await h.flow.stop()


async def test_overflow_degrade_applies_the_pools_plan_to_every_class():
    plan = {"classes": ["batch"], "max_tokens_cap": 20}
    h = Harness(overflow_config("degrade", plan))
    await h.start(usage=0.90)  # a ~113-token request no longer fits; a ~33-token one does
    degraded = await asyncio.wait_for(h.admit("b", "interactive"), 0.5)
    assert isinstance(degraded, Admission)
    assert degraded.body_overrides == {"max_tokens": 20}
    assert degraded.request_class == "interactive"
    waiting = h.admit("a", "interactive")  # a (queue mode): interactive is not in the plan
    await settle()
    assert len(h.flow.queue) == 1 and not waiting.done()
    await h.director.release(degraded, 10)
    await h.set_usage(0.1)
    await h.director.release(await asyncio.wait_for(waiting, 2), 10)
    assert await h.nothing_held()
    await h.flow.stop()


def test_overflow_degrade_needs_a_degradation_plan():
    from extproc.config import ConfigError

    with pytest.raises(ConfigError, match=r"tenants\[1\]\.overflow"):
        overflow_config("degrade")


# --- the shaping stage ----------------------------------------------------------------------


def shaping_config(rps: float = 10, backlog: int = 2):
    data = config().model_dump(exclude_unset=True)
    data["tenants"][1]["limits"] = {"shaping": {"requests_per_second": rps, "backlog": backlog}}
    return parse_config(data)


async def test_shaping_paces_a_burst_and_refuses_past_its_backlog():
    h = Harness(shaping_config(rps=10, backlog=2))
    await h.start(usage=0.1)
    started = time.monotonic()

    async def admitted() -> tuple[Admission | Reject, float]:
        outcome = await h.admit("b")
        return outcome, time.monotonic() - started

    tasks = [asyncio.create_task(admitted()) for _ in range(4)]
    results = [await asyncio.wait_for(task, 2) for task in tasks]
    outcomes = [outcome for outcome, _ in results]
    refused = [o for o in outcomes if isinstance(o, Reject)]  # the backlog holds two
    assert len(refused) == 1
    assert (refused[0].status, refused[0].reason) == (429, "shaping_backlog_full")
    assert 0 < refused[0].retry_after_ms <= 100
    holds = sorted(o.admit.hold_ms for o in outcomes if isinstance(o, Admission))
    # each hold runs from its request's arrival to its slot (0, 100, 200 ms after the first);
    # on a loaded machine the later ones arrive a few ms late and wait that much less
    assert holds[0] == 0 and 85 <= holds[1] <= 100 and 185 <= holds[2] <= 200
    # released no faster than 10 per second: the k-th admitted leaves no earlier than its
    # slot, k × 100 ms after the first arrived (at or after ``started``; 2 ms for the
    # limiter's whole-ms clock). A loaded machine may wake a held request late, never early,
    # so the gaps between wake-ups are not checked (one woken late shortens the next gap).
    released = sorted(at for outcome, at in results if isinstance(outcome, Admission))
    assert all(at >= k * 0.1 - 0.002 for k, at in enumerate(released)), released
    for outcome in outcomes:
        if isinstance(outcome, Admission):
            await h.director.release(outcome, 10)
    assert await h.nothing_held()
    await h.flow.stop()


async def test_a_held_client_that_leaves_gives_its_slot_back():
    h = Harness(shaping_config(rps=5, backlog=1))
    await h.start(usage=0.1)
    first = await asyncio.wait_for(h.admit("b"), 0.5)
    held = h.admit("b")
    await settle()
    assert not held.done() and await h.director.store.in_flight("b") == 2
    assert isinstance(await asyncio.wait_for(h.admit("b"), 0.5), Reject)  # backlog full
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert await h.director.store.in_flight("b") == 1
    assert not h.director.active.keys() - {first.lease_id}
    again = h.admit("b")  # takes the slot the one that left gave back
    admission = await asyncio.wait_for(again, 0.5)
    assert isinstance(admission, Admission)
    for done in (first, admission):
        await h.director.release(done, 10)
    assert await h.nothing_held() and not h.director.active
    await h.flow.stop()


async def test_a_shaped_request_still_queues_when_the_pool_is_full():
    h = Harness(shaping_config(rps=10, backlog=2))
    await h.start(usage=0.99)
    first, second = h.admit("b"), h.admit("b")
    await asyncio.sleep(0.3)  # both slots have passed: they wait for KV now
    assert len(h.flow.queue) == 2
    await h.set_usage(0.1)
    for task in (first, second):
        await h.director.release(await asyncio.wait_for(task, 2), 10)
    assert await h.nothing_held()
    await h.flow.stop()


async def test_requests_without_a_body_are_paced_too():
    h = Harness(shaping_config(rps=10, backlog=2))
    await h.start(usage=0.1)
    who = h.director.authenticate("Bearer kb")
    started = time.monotonic()
    for _ in range(2):
        admission = await h.director.admit_request_only(who, "/v1/models")
        assert isinstance(admission, Admission)
        await h.director.release(admission, 0)
    assert time.monotonic() - started >= 0.09
    assert await h.nothing_held()
    await h.flow.stop()


async def test_the_model_list_kvgate_answers_is_paced_too():
    # GET /v1/models never reaches admit_request_only: kvgate answers it (list_models), which
    # gave a future slot back unused and answered at once, so a burst of them was not paced
    h = Harness(shaping_config(rps=10, backlog=2))
    await h.start(usage=0.1)
    who = h.director.authenticate("Bearer kb")
    started = time.monotonic()
    listed = await asyncio.gather(*(h.director.list_models(who) for _ in range(4)))
    took = time.monotonic() - started
    refused = [r for r in listed if isinstance(r, Reject)]
    assert [(r.status, r.reason) for r in refused] == [(429, "shaping_backlog_full")]
    assert all(models == [("m", "p")] for models, _ in
               (r for r in listed if not isinstance(r, Reject)))
    assert took >= 0.19  # slots at 0, 100 and 200 ms
    assert await h.nothing_held() and not h.director.leases.open
    # a client that leaves while held gives its slot back and holds nothing
    first = await h.director.list_models(who)
    assert not isinstance(first, Reject)
    held = asyncio.create_task(h.director.list_models(who))
    await settle()
    assert not held.done() and h.director.leases.open
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert await h.nothing_held() and not h.director.leases.open
    await h.flow.stop()


async def test_a_queued_request_no_endpoint_left_would_take_is_answered_at_once():
    """The pool shrank while it waited (its larger endpoint left DNS): the request fits no
    endpoint it has now, even empty, and it queued until its deadline — its tenant, behind
    with a head that fits nowhere, holding the others back meanwhile. Answered as at
    admission (400 ``kv_exceeds_capacity``) at the next dispatch round, nothing held."""
    small = "127.0.0.1:2"
    h = Harness(config(deadline_s=30.0))
    await h.endpoints.set_endpoints("p", [ENDPOINT, small])
    await h.endpoints.apply([
        ScrapeResult(ENDPOINT, time.monotonic(),
                     EngineMetrics(kv_cache_usage=0.99, kv_capacity_tokens=1000)),
        ScrapeResult(small, time.monotonic(),
                     EngineMetrics(kv_cache_usage=0.0, kv_capacity_tokens=300)),
    ])
    h.flow.start()
    body = {"model": "m", "max_tokens": 600, "messages": [{"role": "user", "content": "x"}]}
    big = asyncio.create_task(h.director.admit(
        h.director.authenticate("Bearer ka"),
        parse_body("/v1/chat/completions", orjson.dumps(body))))
    await settle()
    assert len(h.flow.queue) == 1  # only the full endpoint could take it
    await h.endpoints.set_endpoints("p", [small])
    h.director.kick()
    outcome = await asyncio.wait_for(big, 2)
    assert isinstance(outcome, Reject)
    assert (outcome.status, outcome.reason) == (400, "kv_exceeds_capacity")
    assert await h.nothing_held() and not h.director.leases.open
    assert h.flow.metrics.registry.get_sample_value(
        "kvgate_queue_events_total", {"pool": "p", "event": "too_large"}) == 1
    await h.flow.stop()


async def test_a_queued_request_is_priced_at_its_tenants_mean_answer_and_again_as_it_runs(
        harness):
    """The fair order charges a dispatched request its tenant's mean answer, not the upper
    envelope the KV estimate uses, and each scrape round prices it again at the mean of the
    answers longer than what it has made: the requests running at any moment are the long
    ones, and priced once at dispatch a tenant running many was over-charged (the envelope)
    or under-charged (the mean) until they ended (``bench.policy_sim --asks ceiling``)."""
    await harness.start(usage=0.99)
    scheduler = harness.flow.scheduler
    for i, output in enumerate([20, 40, 60, 80] * 2):  # shares of 100: mean 0.5
        scheduler.reserve(f"s{i}", "b", "elsewhere", 200, time.monotonic(), prompt_tokens=100)
        scheduler.release(f"s{i}", time.monotonic(), output_tokens=output)
    assert scheduler.output_ratio("b") > 0.75
    task = harness.admit("b")
    await settle()
    await harness.set_usage(0.1)
    admission = await asyncio.wait_for(task, 2)
    prompt = admission.cost.prompt_tokens
    assert admission.charged == prompt + 2 * 50  # the mean, not the envelope
    harness.director.first_token(admission)
    scheduler.decode_rate = 100.0  # tokens a second: a second on, all it reserved is made
    scheduler.reservations[admission.lease_id].started_at -= 1.0
    harness.director._repriced_at = float("-inf")
    harness.director.scraped(harness.director.endpoints.snapshot())
    await settle()
    assert admission.charged == prompt + 2 * 100  # longer than every answer: all of it
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 100
    await harness.director.release(admission, prompt + 90, 90)
    assert (await harness.flow.fairness.counters())["b"] == prompt + 2 * 90
