"""The scheduler's filters, scorers and picker over hand-made endpoint snapshots."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from extproc.config import Pool
from extproc.datalayer.endpoints import EndpointState, StoreSnapshot
from extproc.datalayer.metrics import EngineMetrics
from extproc.datalayer.nvml import GpuReading
from extproc.scheduler import (
    HOLD_REASONS,
    MIN_RETRY_MS,
    SEQ_LEND_SHARE,
    SEQ_LEND_WAIT_S,
    TOP_IDLE_S,
    Placement,
    PoolScheduler,
    future_peak,
)
from limiter import Reject
from limiter.outcome import QUEUEABLE

CAPACITY = 1000
NOW = 100.0


def state(address, usage, *, waiting=0, running=0, scraped_at=NOW - 0.05, healthy=True,
          capacity=CAPACITY, gpu_used=None):
    metrics = EngineMetrics(kv_cache_usage=usage, num_requests_waiting=waiting,
                            num_requests_running=running, kv_capacity_tokens=capacity)
    gpus = () if gpu_used is None else (
        GpuReading(0, "GPU-0", "H200", int(gpu_used * 100), 100),)
    return EndpointState(address, "p", metrics, scraped_at, 0, healthy, capacity, gpus,
                         None if gpu_used is None else scraped_at)


def snapshot(*states):
    return StoreSnapshot(1, {"p": {s.address: s for s in states}})


def scheduler(weights=None, **pool):
    config = Pool.model_validate({"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:1"],
                                  **pool})
    return PoolScheduler(config, weights or {"a": 3.0, "b": 1.0})


def place(sched, snap, tokens=100, tenant="a", seed=0):
    return sched.place(tenant, tokens, snap, NOW, random.Random(seed))


def test_least_loaded_endpoint_wins_and_the_rest_are_fallbacks():
    snap = snapshot(state("e1", 0.5), state("e2", 0.1), state("e3", 0.3))
    assert place(scheduler(), snap) == Placement(["e2", "e3", "e1"])


def test_waiting_queue_breaks_kv_ties():
    snap = snapshot(state("e1", 0.2, waiting=5), state("e2", 0.2, waiting=0))
    assert place(scheduler(), snap).endpoints[0] == "e2"


def test_equal_endpoints_share_load_by_random_tie_break():
    snap = snapshot(state("e1", 0.2), state("e2", 0.2))
    firsts = {place(scheduler(), snap, seed=seed).endpoints[0] for seed in range(20)}
    assert firsts == {"e1", "e2"}


def test_saturated_stale_unhealthy_and_gpu_critical_endpoints_take_nothing():
    snap = snapshot(
        state("full", 0.96),
        state("stale", 0.0, scraped_at=NOW - 5),
        state("sick", 0.0, healthy=False),
        state("gpu", 0.0, gpu_used=0.99),
        state("ok", 0.6),
    )
    assert place(scheduler(), snap).endpoints == ["ok"]


def test_reservation_must_fit_under_the_high_watermark():
    sched = scheduler()
    snap = snapshot(state("e1", 0.7), state("e2", 0.75))
    assert place(sched, snap, tokens=100).endpoints[0] == "e1"  # 0.80 fits exactly
    shed = place(sched, snapshot(state("e1", 0.71)), tokens=100, tenant="a")
    assert isinstance(shed, Placement)  # busy zone, but 'a' is alone: borrows


def test_all_saturated_is_503_with_retry_after_from_the_drain_rate():
    sched = scheduler()
    for i in range(10):  # 10 × 500 tokens freed over the last 5 s: 1000 tokens/s
        sched.reserve(f"l{i}", "a", "e1", 500, NOW - 6 + i * 0.5)
        sched.release(f"l{i}", NOW - 5 + i * 0.5)
    full = snapshot(state("e1", 0.97, capacity=10_000), state("e2", 0.96, capacity=10_000))
    shed = place(sched, full, tokens=3000)
    assert isinstance(shed, Reject) and (shed.status, shed.reason) == (503, "pool_saturated")
    assert shed.retry_after_ms == 3000  # 3000 tokens at 1000 tokens/s


def test_refused_clients_get_successive_drain_slots():
    """503s handed to clients (a queue deadline, a full queue) are one drain-time apart."""
    sched = scheduler()
    for i in range(10):  # 1000 tokens/s, as above
        sched.reserve(f"l{i}", "a", "e1", 500, NOW - 6 + i * 0.5)
        sched.release(f"l{i}", NOW - 5 + i * 0.5)
    waits = [sched.retry_ms(2000, NOW, promise=True) for _ in range(3)]
    assert waits == [2000, 4000, 6000]
    assert sched.retry_ms(2000, NOW) == 2000  # a mere estimate promises nothing
    later = NOW + 7  # every slot is past: the plain estimate again
    assert sched.retry_ms(2000, later, promise=True) == sched.retry_ms(2000, later)


def test_no_drain_history_falls_back_to_a_one_second_retry():
    shed = place(scheduler(), snapshot(state("e1", 0.99)))
    assert shed.retry_after_ms == MIN_RETRY_MS


def test_nothing_ready_is_503():
    shed = place(scheduler(), snapshot(state("e1", 0.1, healthy=False)))
    assert (shed.status, shed.reason) == (503, "no_ready_endpoint")


def test_endpoints_whose_numbers_only_aged_make_requests_wait_not_fail():
    """A reachable engine too busy to answer its scrape in time: the request may queue for
    the next scrape (pool_saturated is what the fair queue waits out)."""
    stale = snapshot(state("e1", 0.1, scraped_at=NOW - 10), state("e2", 0.1, healthy=False))
    shed = place(scheduler(), stale)
    assert (shed.status, shed.reason) == (503, "pool_saturated")
    assert shed.reason in QUEUEABLE


def test_larger_than_any_endpoints_kv_is_400_do_not_retry():
    shed = place(scheduler(), snapshot(state("e1", 0.0)), tokens=CAPACITY + 1)
    assert (shed.status, shed.reason, shed.retry_after_ms) == (400, "kv_exceeds_capacity", None)


def test_a_request_no_empty_endpoint_would_take_is_400_not_queued_forever():
    """Exactly the largest endpoint's capacity: not larger, but with the block every request
    may hold beyond its tokens it fits no endpoint even empty, and queued it held every other
    tenant back until its deadline. Refused at once, as a larger one is."""
    blocky = EngineMetrics(kv_cache_usage=0.0, kv_capacity_tokens=CAPACITY, kv_block_tokens=16)
    empty = snapshot(EndpointState("e1", "p", blocky, NOW - 0.05, 0, True, CAPACITY))
    for band in (0, 1):
        shed = scheduler().place("a", CAPACITY, empty, NOW, random.Random(0), band=band,
                                 prompt_tokens=100)
        assert (shed.status, shed.reason) == (400, "kv_exceeds_capacity")
    # a prompt above the critical watermark fits no empty endpoint as batch work either
    shed = scheduler().place("a", 980, empty, NOW, random.Random(0), band=1, prompt_tokens=970)
    assert (shed.status, shed.reason) == (400, "kv_exceeds_capacity")
    # one block to spare: an empty endpoint takes it (interactive work on a priority pool,
    # judged by its whole reservation, also one whose prompt is above the watermark)
    fits = CAPACITY - 16
    assert isinstance(scheduler().place("a", fits, empty, NOW, random.Random(0), band=1,
                                        prompt_tokens=100), Placement)
    assert isinstance(scheduler(priority_scheduling=True).place(
        "a", 940, empty, NOW, random.Random(0), band=0, prompt_tokens=930), Placement)


def test_reservations_since_the_last_scrape_spread_a_burst():
    sched = scheduler()
    snap = snapshot(state("e1", 0.1), state("e2", 0.1), state("e3", 0.1))
    chosen = []
    for i in range(6):
        endpoint = place(sched, snap, tokens=150, seed=i).endpoints[0]
        sched.reserve(f"l{i}", "a", endpoint, 150, NOW)
        chosen.append(endpoint)
    assert sorted(chosen) == ["e1", "e1", "e2", "e2", "e3", "e3"]


def test_a_newer_scrape_absorbs_older_reservations():
    sched = scheduler()
    sched.reserve("old", "a", "e1", 500, NOW - 1)  # admitted before e1's last scrape
    snap = snapshot(state("e1", 0.1), state("e2", 0.2))
    assert place(sched, snap).endpoints[0] == "e1"


def test_busy_pool_makes_lower_band_work_over_its_share_wait():
    sched = scheduler(weights={"a": 3.0, "b": 1.0})
    sched.reserve("a1", "a", "e1", 300, NOW - 1)
    sched.reserve("b1", "b", "e1", 300, NOW - 1)  # b holds half; its share is a quarter
    sched.first_token("a1", NOW - 1)
    sched.first_token("b1", NOW - 1)  # both running: the engine is not short of work
    busy = snapshot(state("e1", 0.85))
    shed = sched.place("b", 100, busy, NOW, random.Random(0), band=1)
    assert (shed.status, shed.reason) == (429, "kv_share_exceeded")
    assert isinstance(sched.place("a", 100, busy, NOW, random.Random(0), band=1),
                      Placement)  # under its share
    # interactive work may use the headroom between the watermarks whatever its share
    assert isinstance(place(sched, busy, tenant="b"), Placement)
    idle = snapshot(state("e1", 0.3))
    assert isinstance(place(sched, idle, tenant="b"), Placement)  # idle: borrow


def test_requests_in_flight_are_expected_to_grow_to_their_committed_kv():
    """The scrape sees a running request at its prompt; it will decode up to its reserved
    output. Two that would outgrow the cache together are not both sent (the engine would
    preempt), however empty the scrape looks; a small one still fits beside."""
    sched = scheduler()
    sched.reserve("long", "a", "e1", 600, NOW - 1, prompt_tokens=50)
    snap = snapshot(state("e1", 0.05))  # scraped after it started: only its prompt shows
    assert isinstance(place(sched, snap, tokens=300), Placement)
    saturated = place(sched, snap, tokens=600)
    assert (saturated.status, saturated.reason) == (503, "pool_saturated")
    sched.release("long", NOW)
    assert isinstance(place(sched, snap, tokens=600), Placement)
    assert sched.committed["e1"] == 0


def stepped_peak(held):
    """What ``future_peak`` computes, by stepping an engine: every request alive makes one
    token per step and frees everything at its last."""
    alive = [[now, remaining] for remaining, now in held]
    peak = sum(now for now, _ in alive)
    alive = [r for r in alive if r[1] > 0]
    while alive:
        for request in alive:
            request[0] += 1
            request[1] -= 1
        peak = max(peak, sum(now for now, _ in alive))
        alive = [r for r in alive if r[1] > 0]
    return peak


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60)), max_size=8))
def test_the_future_peak_is_the_fullest_step_of_the_engine(held):
    assert future_peak(held) == stepped_peak(held)


def test_the_future_peak_counts_a_block_per_request_and_only_what_is_alive():
    # a nearly finished long request and a new one: they never peak together
    assert future_peak([(10, 990), (500, 100)]) == 1000 + 110
    assert future_peak([(10, 990), (500, 100)], block=16) == 1000 + 110 + 32
    assert future_peak([(600, 100), (600, 100)]) == 1400  # together to the end


def test_requests_that_end_at_different_times_share_the_cache():
    """Sent together, two long requests would outgrow the cache; once the first has made
    enough of its answer, the second is sent: the first ends before they would."""
    sched = scheduler()  # 1,000 tokens of KV
    sched.reserve("first", "a", "e1", 600, NOW - 10, prompt_tokens=100)
    sched.first_token("first", NOW - 10)
    snap = snapshot(state("e1", 0.1))

    def second():
        return sched.place("a", 600, snap, NOW, random.Random(0), prompt_tokens=100)

    assert second().reason == "pool_saturated"  # its progress unknown: no decode rate yet
    sched.decode_rate = 10.0  # tokens per second: the first has made 100 of its 500
    assert second().reason == "pool_saturated"  # they would hold 1,200 when it ends
    sched.decode_rate = 35.0  # 350 made, 150 to go: 950 + 250 at most
    assert isinstance(second(), Placement)
    assert isinstance(sched.place("a", 600, snap, NOW, random.Random(0)), Reject)  # no split


def test_kv_the_scrape_shows_but_kvgate_did_not_send_is_held_throughout():
    """Another replica's requests: kvgate cannot tell when they end, so the usage its own
    do not explain counts in full beside their growth."""
    sched = scheduler()  # 1,000 tokens
    sched.reserve("own", "a", "e1", 600, NOW - 1, prompt_tokens=100)  # 500 to make
    sched.first_token("own", NOW - 0.05)  # started as the scrape was taken

    def new(usage):
        return sched.place("a", 300, snapshot(state("e1", usage)), NOW, random.Random(0),
                           prompt_tokens=100)

    # the scrape shows only its prompt: with a new one they peak at 600 together
    assert isinstance(new(0.1), Placement)
    # 500 more that kvgate did not send: 1,100 at the peak, though 900 fits now
    assert new(0.6).reason == "pool_saturated"


def test_the_partial_blocks_the_scrape_shows_are_not_counted_twice():
    """The engine holds whole blocks: a scraped usage that is exactly the started requests'
    tokens rounded up to blocks is all explained; the future peak already counts a block
    per request for that rounding, so the scrape's rounding must not be added again."""
    sched = scheduler()  # 1,000 tokens of KV
    for name in ("r1", "r2", "r3"):
        sched.reserve(name, "a", "e1", 311, NOW - 1, prompt_tokens=101)  # 210 to make
        sched.first_token(name, NOW - 0.5)
    metrics = EngineMetrics(kv_cache_usage=3 * 112 / CAPACITY, kv_capacity_tokens=CAPACITY,
                            kv_block_tokens=16)  # 101 tokens each: 7 blocks of 16
    snap = snapshot(EndpointState("e1", "p", metrics, NOW - 0.05, 0, True, CAPACITY))

    def new(output):
        return sched.place("a", 101 + output, snap, NOW, random.Random(0), prompt_tokens=101)

    # the three peak at 3 × (101 + 16) + 3 × 210 = 981; counting the scrape's rounding
    # (3 × 11) again made it 1,014 and refused a short fourth request
    assert isinstance(new(19), Placement)
    assert isinstance(new(130), Placement)  # all four at the fourth's end: 468 + 4 × 130
    assert new(140).reason == "pool_saturated"  # 1,028


def test_the_decode_rate_is_learned_from_finished_requests():
    sched = scheduler()
    sched.reserve("r", "a", "e1", 600, NOW - 12, prompt_tokens=100)
    sched.first_token("r", NOW - 10)
    sched.release("r", NOW, output_tokens=200)
    assert sched.decode_rate == 20.0
    sched.reserve("unstarted", "a", "e1", 600, NOW, prompt_tokens=100)
    sched.release("unstarted", NOW, output_tokens=200)  # never started: teaches nothing
    assert sched.decode_rate == 20.0


def test_a_non_streamed_answer_whose_start_no_scrape_saw_teaches_no_decode_rate():
    """Its only sign is its end (the meter's report), which once counted as its first token:
    1,500 tokens decoded in no time made the pool's rate 25% faster, and the sequence kept
    for interactive work was then lent before half the running requests' runs."""
    sched = scheduler()
    sched.reserve("r", "a", "127.0.0.1:1", 2000, NOW - 3, prompt_tokens=100)
    sched.first_token("r", NOW - 2)
    sched.release("r", NOW, output_tokens=1500)
    assert sched.decode_rate == 750.0
    sched.reserve("n", "a", "127.0.0.1:1", 2000, NOW, prompt_tokens=100, streamed=False)
    sched.first_token("n", NOW + 2)  # the done report: the end, not a first token
    sched.release("n", NOW + 2.001, output_tokens=1500)  # Envoy ends the stream next
    assert sched.decode_rate == 750.0


def test_a_scrape_marks_requests_started_without_waiting_for_a_placement():
    """The last request of a burst asks for no placement after it: the scrape round itself
    must show it started, at the scrape's time, so its run is timed."""
    sched = scheduler()
    sched.reserve("n", "a", "127.0.0.1:1", 2000, NOW - 3, prompt_tokens=100, streamed=False)
    sched.observe(snapshot(state("127.0.0.1:1", 0.1, waiting=0, scraped_at=NOW - 2)))
    assert sched.unstarted["127.0.0.1:1"] == 0
    sched.first_token("n", NOW)  # its end
    sched.release("n", NOW, output_tokens=1000)
    assert sched.decode_rate == 500.0  # 1,000 tokens since the scrape that saw it admitted


def test_a_short_answer_delivered_at_once_does_not_teach_a_huge_decode_rate():
    """16 tokens whose first and last chunk came 30 µs apart: as a rate, 533,333 tokens per
    second. Tokens and seconds are averaged apart, so it moves the rate a little."""
    sched = scheduler()
    for n in range(5):
        sched.reserve(f"long{n}", "a", "e1", 2000, NOW - 5, prompt_tokens=100)
        sched.first_token(f"long{n}", NOW - 4)
        sched.release(f"long{n}", NOW, output_tokens=1500)  # 375 tokens per second
    for n in range(4):
        sched.reserve(f"short{n}", "a", "e1", 200, NOW, prompt_tokens=20)
        sched.first_token(f"short{n}", NOW)
        sched.release(f"short{n}", NOW + 30e-6, output_tokens=16)
    assert 375 < sched.decode_rate < 375 * 1.5


def test_interactive_work_on_a_priority_engine_does_not_wait_for_committed_kv():
    """The engine would preempt the batch request, not the interactive one."""
    for priority, interactive_fits in ((True, True), (False, False)):
        sched = scheduler(priority_scheduling=priority)
        sched.reserve("batch", "a", "e1", 900, NOW - 1, band=1, prompt_tokens=50)
        sched.first_token("batch", NOW - 1)
        snap = snapshot(state("e1", 0.1))
        placed = sched.place("a", 200, snap, NOW, random.Random(0), band=0)
        assert isinstance(placed, Placement) is interactive_fits
        assert isinstance(sched.place("a", 200, snap, NOW, random.Random(0), band=1), Reject)


def test_short_answers_teach_the_scheduler_to_commit_less_output():
    """Clients that set a generous max_tokens and stop early: the committed KV follows what
    requests really produce; one long answer raises it again at once."""
    sched = scheduler()
    for i in range(200):
        sched.reserve(f"s{i}", "a", "e1", 600, NOW, prompt_tokens=100)
        sched.release(f"s{i}", NOW, output_tokens=50)  # a tenth of its reserved 500
    assert 0.09 < sched.output_ratio("a") < 0.2
    sched.reserve("next", "a", "e1", 600, NOW, prompt_tokens=100)
    assert sched.committed["e1"] < 200
    sched.release("next", NOW, output_tokens=500)
    assert sched.output_ratio("a") > 0.5
    assert sched.committed["e1"] == 0


def test_one_tenants_short_answers_do_not_shrink_another_tenants_requests():
    """Learned over the pool, one client's generous max_tokens made every tenant's long
    answers count as short: their KV was under-committed and the engines filled."""
    sched = scheduler()
    for i in range(200):
        sched.reserve(f"s{i}", "a", "e1", 30_100, NOW, prompt_tokens=100)
        sched.release(f"s{i}", NOW, output_tokens=500)  # a sixtieth of its reserved 30,000
    assert sched.output_ratio("a") < 0.1 and sched.output_ratio("b") == 1.0
    sched.reserve("long", "b", "e1", 600, NOW, prompt_tokens=100)
    assert sched.committed["e1"] == 600  # b's answers use all they reserve
    sched.forget(["a"])
    assert sched.output_ratios == {}


def test_a_request_running_past_its_expected_output_counts_whole_and_teaches_at_once():
    """A tenant whose answers were short for minutes, then long, was expected short until
    its first long answer ended: its KV under-committed (the engines preempted) and its new
    requests charged a twentieth of their output in the fair order meanwhile."""
    sched = scheduler()
    sched.output_ratios["a"] = 0.05
    sched.decode_rate = 20.0  # output tokens per second of one sequence
    sched.reserve("long", "a", "e1", 4_100, NOW - 30, prompt_tokens=100)  # expected 100 + 200
    sched.first_token("long", NOW - 30)
    assert sched.committed["e1"] == 300
    sched.observe(snapshot(state("e1", 0.1, scraped_at=NOW - 25)))  # ~100 made: as expected
    assert sched.committed["e1"] == 300 and sched.output_ratio("a") == 0.05
    sched.observe(StoreSnapshot(2, {"p": {"e1": state("e1", 0.1, scraped_at=NOW)}}))
    assert sched.committed["e1"] == 4_100  # 600 made of the 200 expected: all it reserved
    assert sched.output_ratio("a") > 0.05 and sched.output_ratio("b") == 1.0
    assert sched.take_overran() == ["long"] and sched.take_overran() == []  # for the director
    sched.release("long", NOW, output_tokens=3_900)
    assert sched.committed["e1"] == 0


def test_the_busy_pools_kv_share_counts_what_requests_are_expected_to_hold():
    """Counted by max_tokens, a tenant that asks for thirty times what it uses was over its
    KV share whenever it ran at all, while the fair order, which charges what requests are
    expected to use, had it behind: each held the other back."""
    sched = scheduler()
    sched.output_ratios["a"] = 0.05
    sched.reserve("a0", "a", "e1", 30_100, NOW, prompt_tokens=100)  # expected 100 + 1,500
    sched.reserve("b0", "b", "e1", 3_000, NOW, prompt_tokens=1_000)
    assert not sched._over_share("a", sched.expected_peak("a", 30_100, 100))
    assert sched._over_share("b", sched.expected_peak("b", 3_000, 1_000))


def test_release_frees_the_reservation_once():
    sched = scheduler()
    sched.reserve("l", "a", "e1", 100, NOW)
    sched.release("l", NOW)
    sched.release("l", NOW)
    assert not sched.reservations and sched.in_flight["e1"] == 0


def test_pool_without_kv_awareness_is_least_in_flight():
    sched = scheduler(kv_aware=False, endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    sched.reserve("l", "a", "127.0.0.1:1", 0, NOW)
    assert place(sched, StoreSnapshot()).endpoints[0] == "127.0.0.1:2"


def test_max_in_flight_bounds_each_endpoint():
    sched = scheduler(kv_aware=False, max_in_flight=1,
                      endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    sched.reserve("l1", "a", "127.0.0.1:1", 0, NOW)
    assert place(sched, StoreSnapshot()).endpoints == ["127.0.0.1:2"]
    sched.reserve("l2", "a", "127.0.0.1:2", 0, NOW)
    shed = place(sched, StoreSnapshot())
    assert (shed.status, shed.reason) == (503, "pool_saturated")


def test_requests_without_kv_go_to_a_live_endpoint_even_when_saturated():
    snap = snapshot(state("full", 0.99), state("dead", 0.0, healthy=False))
    assert place(scheduler(), snap).reason == "pool_saturated"
    assert scheduler().place_light(snap, NOW, random.Random(0)).endpoints == ["full"]


def test_requests_without_kv_are_refused_by_a_pool_with_no_endpoint():
    """A DNS pool whose name resolves to nothing (or not yet): an empty placement sent
    ``GET /health`` nowhere, and admission failed on it (an internal error)."""
    config = Pool.model_validate({"name": "p", "models": ["m"],
                                  "dns": {"hostname": "engines.invalid", "port": 8000}})
    refused = PoolScheduler(config, {}).place_light(StoreSnapshot(), NOW, random.Random(0))
    assert isinstance(refused, Reject)
    assert (refused.status, refused.reason) == (503, "no_ready_endpoint")
    assert refused.retry_after_ms == MIN_RETRY_MS


def test_an_engine_already_queueing_takes_nothing_when_max_waiting_is_set():
    snap = snapshot(state("queueing", 0.1, waiting=3), state("calm", 0.5, waiting=0))
    assert place(scheduler(), snap).endpoints[0] == "queueing"  # off by default
    strict = scheduler(watermarks={"max_waiting": 0})
    assert place(strict, snap).endpoints == ["calm"]
    assert place(strict, snapshot(state("queueing", 0.1, waiting=3))).reason == "pool_saturated"


def test_prefill_lasts_from_reservation_to_first_token_or_release():
    sched = scheduler()
    sched.reserve("l1", "a", "e1", 900, NOW, band=1, prompt_tokens=800)
    sched.reserve("l2", "a", "e1", 300, NOW, prompt_tokens=200)
    assert (sched.prefill_tokens["e1"], sched.low_prefills["e1"]) == (1000, 1)
    sched.first_token("l1", NOW + 1)
    sched.first_token("l1", NOW + 1)  # idempotent
    sched.first_token("unknown", NOW + 1)
    assert (sched.prefill_tokens["e1"], sched.low_prefills["e1"]) == (200, 0)
    sched.release("l1", NOW + 2)
    sched.release("l2", NOW + 2)  # never saw a first token (non-streamed): ends here
    assert (sched.prefill_tokens["e1"], sched.low_prefills["e1"]) == (0, 0)


def test_prefill_scoring_sends_work_where_least_prefill_is_ahead():
    snap = snapshot(state("e1", 0.1), state("e2", 0.2))
    sched = scheduler(scoring={"prefill": 2.0})
    assert place(sched, snap).endpoints[0] == "e1"
    sched.reserve("batch", "a", "e1", 60, NOW, band=1, prompt_tokens=50)
    assert place(sched, snap).endpoints[0] == "e2"
    sched.first_token("batch", NOW)
    assert place(sched, snap).endpoints[0] == "e1"
    assert place(scheduler(), snap).endpoints[0] == "e1"  # off by default


def test_the_prefill_rate_is_learned_from_first_tokens_in_admission_order():
    sched = scheduler()
    sched.reserve("solo", "a", "e1", 1100, NOW, prompt_tokens=1000)
    assert sched.prefill_ahead("e1", NOW + 0.2) == 1000  # no rate yet: all of it
    sched.first_token("solo", NOW + 0.5)
    assert sched.prefill_rate == 2000  # 1000 tokens in 0.5 s
    sched.reserve("long", "a", "e1", 4100, NOW + 1, band=1, prompt_tokens=4000)
    sched.reserve("short", "a", "e1", 1100, NOW + 1.5, prompt_tokens=1000)
    # the head began at NOW + 1: 2000 tokens done by NOW + 2, the rest still ahead
    assert sched.prefill_ahead("e1", NOW + 2) == 3000
    sched.first_token("long", NOW + 3)  # the next one in line begins now
    assert sched.prefill_ahead("e1", NOW + 3.25) == 500
    assert sched.prefill_ahead("e1", NOW + 9) == 0
    sched.first_token("short", NOW + 3.5)  # 1000 tokens in 0.5 s once its turn came
    assert sched.prefill_ahead("e1", NOW + 4) == 0 and "e1" not in sched.prefill_marks


def test_prefill_scoring_counts_what_is_left_of_a_prefill_under_way():
    """A long prompt that has prefilled for a while leaves less ahead than a shorter one
    just sent: interactive work goes behind the one about to finish."""
    snap = snapshot(state("e1", 0.1, capacity=100_000), state("e2", 0.1, capacity=100_000))
    sched = scheduler(scoring={"prefill": 2.0, "kv_usage": 0.0})
    sched.reserve("learn", "a", "e2", 1100, NOW - 10, prompt_tokens=1000)
    sched.first_token("learn", NOW - 9.5)  # 2000 tokens per second
    sched.reserve("old", "b", "e1", 6100, NOW - 2.5, band=1, prompt_tokens=6000)
    sched.reserve("new", "b", "e2", 3100, NOW, band=1, prompt_tokens=3000)
    assert sched.prefill_ahead("e1", NOW) == 1000
    assert place(sched, snap).endpoints[0] == "e1"
    # a pool that keeps an endpoint clear counts every prompt token in prefill
    sched.config = sched.config.model_copy(update={"prefill_clear_share": 0.5})
    assert place(sched, snap).endpoints[0] == "e2"


def test_reserved_slots_are_for_band_zero_only():
    sched = scheduler(kv_aware=False, max_in_flight=2, reserved_in_flight=1)
    sched.reserve("l1", "a", "127.0.0.1:1", 0, NOW, band=1)
    shed = sched.place("a", 10, StoreSnapshot(), NOW, random.Random(0), band=1)
    assert (shed.status, shed.reason) == (503, "pool_saturated")
    placed = sched.place("a", 10, StoreSnapshot(), NOW, random.Random(0), band=0)
    assert placed.endpoints == ["127.0.0.1:1"]
    sched.reserve("l2", "a", "127.0.0.1:1", 0, NOW)
    assert sched.place("a", 10, StoreSnapshot(), NOW, random.Random(0)).reason == "pool_saturated"


def test_lower_bands_stack_so_some_endpoints_stay_clear_of_their_prefill():
    snap = snapshot(state("e1", 0.3), state("e2", 0.1), state("e3", 0.2))
    sched = scheduler(prefill_clear_share=0.34, scoring={"prefill": 0})  # KV usage decides
    sched.reserve("b1", "a", "e1", 10, NOW, band=1, prompt_tokens=500)
    # two endpoints are clear, one may still be kept clear: any endpoint takes batch
    assert sched.place("a", 10, snap, NOW, random.Random(0), band=1).endpoints[0] == "e2"
    sched.reserve("b2", "a", "e2", 10, NOW, band=1, prompt_tokens=500)
    # only e3 is left clear: batch stacks on the busy ones, interactive goes anywhere
    assert sched.place("a", 10, snap, NOW, random.Random(0), band=1).endpoints == ["e2", "e1"]
    assert sched.place("a", 10, snap, NOW, random.Random(0)).endpoints[0] == "e2"
    sched.first_token("b1", NOW)
    sched.first_token("b2", NOW)
    assert sched.place("a", 10, snap, NOW, random.Random(0), band=1).endpoints[0] == "e2"


def test_a_lone_endpoint_still_takes_lower_band_work():
    sched = scheduler(prefill_clear_share=0.99)
    assert isinstance(sched.place("a", 10, snapshot(state("e1", 0.1)), NOW, random.Random(0),
                                  band=2), Placement)


def test_an_endpoint_takes_two_unstarted_requests_and_interactive_one_more():
    snap = snapshot(state("e1", 0.1))
    sched = scheduler()
    for lease in ("x1", "x2"):
        sched.reserve(lease, "a", "e1", 10, NOW, band=1, prompt_tokens=5)
    assert place_band(sched, snap, 1).reason == "pool_saturated"  # batch waits in kvgate
    assert isinstance(place_band(sched, snap, 0), Placement)  # interactive: one more
    sched.reserve("i1", "a", "e1", 10, NOW, prompt_tokens=5)
    assert place_band(sched, snap, 0).reason == "pool_saturated"
    sched.first_token("x1", NOW)  # started: the engine has it
    assert place_band(sched, snap, 1).reason == "pool_saturated"  # x2 and i1 have not
    sched.first_token("i1", NOW)
    assert isinstance(place_band(sched, snap, 1), Placement)


def test_the_unstarted_limit_grows_only_while_the_engine_keeps_nothing_waiting():
    """Each scrape that finds nothing waiting in the engine although the limit held work back
    since the one before doubles how far the limit is raised; more than ``max_unstarted``
    waiting halves it; a few waiting (an engine between its steps) leaves it be."""
    sched = scheduler()

    def scraped(waiting=0):  # a new scrape round (taken before the requests below were sent)
        return snapshot(state("e1", 0.1, waiting=waiting))

    for lease in ("x1", "x2"):
        sched.reserve(lease, "a", "e1", 10, NOW, band=1, prompt_tokens=5)
    assert place_band(sched, scraped(), 1).reason == "pool_saturated"  # held back
    assert sched.holds["engine_queue"] == 1
    assert isinstance(place_band(sched, scraped(), 1), Placement)  # nothing waited: +1
    assert sched.gate_growth["e1"] == 1
    sched.reserve("x3", "a", "e1", 10, NOW, band=1, prompt_tokens=5)
    assert place_band(sched, scraped(), 1).reason == "pool_saturated"
    assert isinstance(place_band(sched, scraped(), 1), Placement)
    assert sched.gate_growth["e1"] == 2
    sched.reserve("x4", "a", "e1", 10, NOW, band=1, prompt_tokens=5)
    assert place_band(sched, scraped(waiting=2), 1).reason == "pool_saturated"
    assert place_band(sched, scraped(waiting=2), 1).reason == "pool_saturated"
    assert sched.gate_growth["e1"] == 2  # two waiting: neither grown nor halved
    place_band(sched, scraped(waiting=3), 1)
    assert sched.gate_growth["e1"] == 1  # the engine queues more than the limit allows


def test_the_engines_waiting_count_marks_non_streamed_requests_started():
    sched = scheduler()
    sched.reserve("s", "a", "e1", 10, NOW - 2, band=1, prompt_tokens=5)
    sched.reserve("n", "a", "e1", 10, NOW - 1, band=1, prompt_tokens=7, streamed=False)
    sched.reserve("late", "a", "e1", 10, NOW + 1, band=1, prompt_tokens=9)  # after the scrape
    waiting_one = snapshot(state("e1", 0.1, waiting=1))  # scraped at NOW
    place_band(sched, waiting_one, 1)
    assert sched.unstarted["e1"] == 2  # the oldest was admitted; two are not known to be
    both_admitted = snapshot(state("e1", 0.1, waiting=0))
    place_band(sched, both_admitted, 1)
    assert sched.unstarted["e1"] == 1  # "late" was sent after this scrape
    # the streamed one still counts its prompt as in prefill until its first token
    assert sched.prefill_tokens["e1"] == 5 + 9


def place_band(sched, snap, band):
    return sched.place("a", 10, snap, NOW, random.Random(0), band=band)


def test_an_endpoint_kept_clear_stays_clear_when_the_busy_ones_are_full():
    snap = snapshot(state("e1", 0.1), state("e2", 0.1))
    sched = scheduler(prefill_clear_share=0.5)
    for lease in ("b1", "b2"):  # e1 prefills batch work and has no unstarted slot left
        sched.reserve(lease, "a", "e1", 10, NOW, band=1, prompt_tokens=5000)
    assert place_band(sched, snap, 1).reason == "pool_saturated"  # batch waits: e2 stays clear
    assert place_band(sched, snap, 0).endpoints[0] == "e2"  # for interactive work


def test_batch_work_that_waited_long_may_use_a_clear_endpoint_while_no_interactive_prefills():
    """The clear endpoint's cost to batch throughput is bounded: lower-band work that has
    waited ``prefill_clear_hold_s`` in kvgate's queue goes there, unless band-0 work is
    prefilling somewhere in the pool (then the clear endpoint is what it may need next)."""
    snap = snapshot(state("e1", 0.1), state("e2", 0.1))
    sched = scheduler(prefill_clear_share=0.5, prefill_clear_hold_s=3.0)
    for lease in ("b1", "b2"):
        sched.reserve(lease, "a", "e1", 10, NOW, band=1, prompt_tokens=5000)

    def batch(waited_s):
        return sched.place("a", 10, snap, NOW, random.Random(0), band=1, waited_s=waited_s)

    assert batch(2.9).reason == "pool_saturated"  # not yet: e2 stays clear
    assert batch(3.0).endpoints == ["e2"]
    sched.reserve("i1", "a", "e1", 10, NOW, prompt_tokens=300)  # interactive in prefill
    assert batch(10.0).reason == "pool_saturated"
    sched.first_token("i1", NOW)
    assert batch(10.0).endpoints == ["e2"]


def test_batch_stacks_only_below_a_step_of_prefill_left_where_endpoints_are_kept_clear():
    """Four endpoints keep one clear; the busy ones each take batch work only while what is
    left of their batch prefill is under the engines' step budget: more prompts stacked there
    would not be prefilled sooner, and interactive work sent there would wait behind all of
    them. What is left counts, so the next prompt goes as the last chunk is prefilled."""
    snap = snapshot(*(state(f"e{n}", 0.1) for n in range(1, 5)))
    sched = scheduler(max_unstarted=None, scoring={"prefill": 0})
    sched.reserve("learn", "a", "e4", 1100, NOW - 10, prompt_tokens=1000)
    sched.first_token("learn", NOW - 9.5)  # 2000 prompt tokens per second
    for n in (1, 2, 3):
        sched.reserve(f"b{n}", "a", f"e{n}", 10, NOW, band=1, prompt_tokens=5000)
    assert place_band(sched, snap, 1).reason == "pool_saturated"  # e4 is kept clear
    assert sched.holds["prefill_clear"] == 4
    assert len(place_band(sched, snap, 0).endpoints) == 3  # band 0 is never limited
    later = sched.place("a", 10, snap, NOW + 1.6, random.Random(0), band=1)
    assert sorted(later.endpoints) == ["e1", "e2", "e3"]  # 1,800 of 5,000 left on each
    unlimited = scheduler(max_unstarted=None, max_num_batched_tokens=None)
    for n in (1, 2, 3):
        unlimited.reserve(f"b{n}", "a", f"e{n}", 10, NOW, band=1, prompt_tokens=5000)
    assert len(place_band(unlimited, snap, 1).endpoints) == 3


def test_a_pool_too_small_to_keep_one_clear_holds_each_endpoint_to_one_step_of_batch_prefill():
    """Two endpoints at the default share keep none clear: lower-band work joins an endpoint
    only while the lower-band prompt tokens in prefill there are under the engines' step
    budget, so interactive work waits behind about one step of batch prefill."""
    snap = snapshot(state("e1", 0.1), state("e2", 0.1))
    sched = scheduler(max_unstarted=None)  # prefill_clear_share 0.25 of 2: none kept clear
    assert sched.config.max_num_batched_tokens == 2048
    sched.reserve("b1", "a", "e1", 10, NOW, band=1, prompt_tokens=3000)
    assert place_band(sched, snap, 1).endpoints == ["e2"]
    sched.reserve("b2", "a", "e2", 10, NOW, band=1, prompt_tokens=500)
    assert place_band(sched, snap, 1).endpoints == ["e2"]  # short prompts stack: 500 < 2048
    sched.reserve("b3", "a", "e2", 10, NOW, band=1, prompt_tokens=1600)
    assert place_band(sched, snap, 1).reason == "pool_saturated"  # batch waits in kvgate
    assert sched.holds == {"prefill_clear": 2}
    assert len(place_band(sched, snap, 0).endpoints) == 2  # band 0 is never limited
    sched.first_token("b1", NOW)  # e1's batch prompt is prefilled
    assert place_band(sched, snap, 1).endpoints == ["e1"]
    sched.release("b2", NOW)
    sched.release("b3", NOW)
    assert sched.low_prefill_tokens == {"e1": 0, "e2": 0}


def test_batch_prefill_beyond_one_step_waits_at_most_the_hold_and_null_lifts_the_limit():
    snap = snapshot(state("e1", 0.1), state("e2", 0.1))
    sched = scheduler(max_unstarted=None)
    for lease, endpoint in (("b1", "e1"), ("b2", "e2")):
        sched.reserve(lease, "a", endpoint, 10, NOW, band=1, prompt_tokens=4000)
    assert place_band(sched, snap, 1).reason == "pool_saturated"
    waited = sched.place("a", 10, snap, NOW, random.Random(0), band=1, waited_s=3.0)
    assert isinstance(waited, Placement)  # no band-0 prefill anywhere: the hold ends it
    unlimited = scheduler(max_unstarted=None, max_num_batched_tokens=None)
    for lease, endpoint in (("b1", "e1"), ("b2", "e2")):
        unlimited.reserve(lease, "a", endpoint, 10, NOW, band=1, prompt_tokens=4000)
    assert len(place_band(unlimited, snap, 1).endpoints) == 2


def test_an_engine_stuck_at_one_running_count_has_its_seq_limit_learned():
    """vLLM --max-num-seqs 4: four running and work waiting, scrape after scrape, KV free."""
    sched = scheduler()
    for lease in ("b1", "b2", "b3"):
        sched.reserve(lease, "a", "e1", 10, NOW - 5, band=1)
        sched.first_token(lease, NOW - 5)
    for n in range(5):
        full = snapshot(state("e1", 0.3, running=4, waiting=2, scraped_at=NOW - 1 + n / 10))
        placed = place_band(sched, full, 1)
    assert sched.seq_caps == {"e1": 4}
    assert placed.reason == "pool_saturated"  # 3 in flight: batch leaves the 4th seq free
    assert isinstance(place_band(sched, full, 0), Placement)  # for interactive work
    more = snapshot(state("e1", 0.3, running=5, waiting=0))  # it runs more: unlearned
    assert isinstance(place_band(sched, more, 1), Placement) and not sched.seq_caps


def test_a_configured_seq_limit_holds_from_the_first_request():
    """max_num_seqs: no saturated scrapes needed before batch leaves a sequence free."""
    sched = scheduler(max_num_seqs=2)
    sched.reserve("b1", "a", "e1", 10, NOW - 5, band=1)
    idle = snapshot(state("e1", 0.1, running=1))
    assert sched.seq_caps == {} and place_band(sched, idle, 1).reason == "pool_saturated"
    assert sched.seq_caps == {"e1": 2}
    assert isinstance(place_band(sched, idle, 0), Placement)  # the free one: interactive
    more = snapshot(state("e1", 0.1, running=3))  # it runs more than configured: unlearned
    assert isinstance(place_band(sched, more, 1), Placement) and not sched.seq_caps


def test_a_busy_engine_whose_running_count_moves_learns_no_seq_limit():
    sched = scheduler()
    for n, running in enumerate((120, 121, 119, 121, 122, 120)):
        place_band(sched, snapshot(state("e1", 0.5, running=running, waiting=3,
                                         scraped_at=NOW - 1 + n / 10)), 1)
    assert not sched.seq_caps


def test_an_engine_short_of_kv_is_not_taken_for_one_short_of_sequences():
    """One running, work waiting, usage under the watermark — but the waiting prompts need
    more KV than is free: vLLM is waiting for blocks, and batch work must keep flowing."""
    sched = scheduler()
    sched.reserve("r", "a", "e1", 10, NOW - 5, band=1)
    sched.first_token("r", NOW - 5)
    sched.reserve("w", "a", "e1", 10, NOW - 5, band=1, prompt_tokens=300)  # 1000-token KV
    for n in range(6):
        place_band(sched, snapshot(state("e1", 0.65, running=1, waiting=1,
                                         scraped_at=NOW - 1 + n / 10)), 1)
    assert not sched.seq_caps


def test_a_learned_limit_of_one_still_lets_one_lower_band_request_run():
    sched = scheduler()
    sched.seq_caps["e1"] = 1
    assert isinstance(place_band(sched, snapshot(state("e1", 0.1)), 1), Placement)


def test_the_kept_sequence_is_lent_once_a_running_request_is_past_half_its_run():
    """Band 0 waits at most half a request's run (or SEQ_LEND_WAIT_S) for a sequence: the one
    kept free goes to batch work once a running request is expected to end within that long
    (its expected output at the pool's decode rate); never while that rate is unknown, never
    past the limit."""
    sched = scheduler(max_num_seqs=2)
    sched.reserve("b1", "a", "e1", 1100, NOW - 2, band=1, prompt_tokens=100)
    sched.first_token("b1", NOW - 2)

    def batch(at, running=1):
        snap = snapshot(state("e1", 0.1, running=running, scraped_at=at - 0.05,
                              capacity=50_000))
        return sched.place("a", 10, snap, at, random.Random(0), band=1)

    assert batch(NOW + 6).reason == "pool_saturated"  # no decode rate learned yet
    sched.decode_rate = 100.0  # 1,000 tokens of output from NOW - 2: a 10 s run
    assert SEQ_LEND_SHARE == 0.5
    assert batch(NOW + 2.9).reason == "pool_saturated"  # 5.1 s left
    assert isinstance(batch(NOW + 3), Placement)  # half its run left: lent
    sched.reserve("b2", "a", "e1", 10, NOW + 3, band=1)  # both sequences now run
    assert batch(NOW + 4, running=2).reason == "pool_saturated"
    both = snapshot(state("e1", 0.1, running=2, scraped_at=NOW + 3.95, capacity=50_000))
    assert isinstance(sched.place("a", 10, both, NOW + 4, random.Random(0)), Placement)


def test_a_short_run_lends_the_kept_sequence_for_its_last_second():
    """A 1.5 s run: SEQ_LEND_WAIT_S (1 s) is more than half of it."""
    sched = scheduler(max_num_seqs=2)
    sched.reserve("i1", "a", "e1", 1100, NOW, prompt_tokens=1000)  # 100 tokens of output
    sched.first_token("i1", NOW)
    sched.decode_rate = 100 / 1.5
    snap = snapshot(state("e1", 0.1, running=1, capacity=50_000))

    def batch(at):
        return sched.place("a", 10, snap, at, random.Random(0), band=1)

    assert SEQ_LEND_WAIT_S == 1.0
    assert batch(NOW + 0.4).reason == "pool_saturated"
    assert isinstance(batch(NOW + 0.5), Placement)


def test_a_pool_without_interactive_work_lends_the_kept_sequence_to_batch():
    """The sequence kept free is for band 0: after TOP_IDLE_S without a band-0 request,
    batch work takes it; the next band-0 request keeps it free again."""
    sched = scheduler(max_num_seqs=2)
    sched.reserve("b1", "a", "e1", 10, NOW - 5, band=1)

    def idle(at):
        return snapshot(state("e1", 0.1, running=1, scraped_at=at - 0.05))

    def batch(at):
        return sched.place("a", 10, idle(at), at, random.Random(0), band=1)

    assert batch(NOW).reason == "pool_saturated"  # the first request starts the clock
    assert batch(NOW + TOP_IDLE_S).reason == "pool_saturated"
    assert isinstance(batch(NOW + TOP_IDLE_S + 1), Placement)  # no interactive work: lent
    at = NOW + TOP_IDLE_S + 2
    sched.place("a", 10, idle(at), at, random.Random(0), band=0)
    assert batch(NOW + TOP_IDLE_S + 3).reason == "pool_saturated"  # kept free again


def test_each_refused_placement_counts_what_held_each_endpoint():
    """``holds`` answers "why does work wait?": per refused placement, one count per endpoint
    under the first check it failed."""
    sched = scheduler(prefill_clear_share=0.5)
    snap = snapshot(state("e1", 0.1), state("e2", 0.1))
    for lease in ("b1", "b2"):  # e1: its engine queue is full; e2 is kept clear
        sched.reserve(lease, "a", "e1", 10, NOW, band=1, prompt_tokens=5000)
    assert place_band(sched, snap, 1).reason == "pool_saturated"
    assert sched.holds == {"engine_queue": 1, "prefill_clear": 1}
    full = snapshot(state("e1", 0.97), state("e2", 0.945))  # e1 past critical: takes nothing
    assert place_band(sched, full, 0).reason == "pool_saturated"
    assert sched.holds == {"engine_queue": 1, "prefill_clear": 1, "engine_full": 1,
                           "kv_cache": 1}
    placed = dict(sched.holds)
    assert isinstance(place_band(sched, snapshot(state("e2", 0.1)), 0), Placement)
    assert sched.holds == placed  # a placement counts nothing
    assert set(sched.holds) <= set(HOLD_REASONS)


def test_holds_name_the_tenant_share_and_stale_metrics():
    sched = scheduler(weights={"a": 3.0, "b": 1.0})
    sched.reserve("a1", "a", "e1", 300, NOW - 1)
    sched.reserve("b1", "b", "e1", 300, NOW - 1)  # b holds half; its share is a quarter
    sched.first_token("a1", NOW - 1)
    sched.first_token("b1", NOW - 1)
    busy = snapshot(state("e1", 0.85))
    assert sched.place("b", 100, busy, NOW, random.Random(0), band=1).reason == (
        "kv_share_exceeded")
    assert sched.holds == {"tenant_share": 1}
    stale = snapshot(state("e1", 0.1, scraped_at=NOW - 60))
    assert isinstance(place(sched, stale), Reject)
    assert sched.holds == {"tenant_share": 1, "stale_metrics": 1}


def test_work_is_checked_at_its_prompt_now_and_at_its_peak_later():
    """Lower-band work needs only its prompt's KV under the watermark now: its output is
    checked where it will be held, at the future peak. Interactive work on a priority
    engine, exempt from that bound (the engine would preempt batch work for it), goes when
    either test passes: its whole reservation fits now, or its prompt now and its peak."""
    sched = scheduler(priority_scheduling=True)
    snap = snapshot(state("e1", 0.6))  # 600 tokens kvgate did not send: held throughout

    def asked(tokens, band):
        return sched.place("a", tokens, snap, NOW, random.Random(0), band=band,
                           prompt_tokens=100)

    for band in (0, 1):
        assert isinstance(asked(380, band), Placement)  # 600 + 100 now, 980 at its peak
        assert isinstance(asked(420, band), Reject)  # 1,020 at its peak; 1,020 at once


def test_endpoints_dns_dropped_are_forgotten_once_nothing_runs_there():
    """Each rollout gives pods new addresses: every per-endpoint table kept the old ones for
    good (and /debug/queues showed them)."""
    sched = scheduler(max_num_seqs=4)
    old, new = "10.0.0.1:8000", "10.0.0.2:8000"
    assert place(sched, snapshot(state(old, 0.1))).endpoints == [old]
    sched.reserve("r1", "a", old, 100, NOW, prompt_tokens=50)
    sched.observe(StoreSnapshot(2, {"p": {new: state(new, 0.1)}}))
    assert old in sched.in_flight  # still running there: kept
    sched.release("r1", NOW + 1)
    sched.observe(StoreSnapshot(3, {"p": {new: state(new, 0.1)}}))
    tables = (sched.by_endpoint, sched.in_flight, sched.unstarted, sched.committed,
              sched.prefill_tokens, sched.seq_caps)
    assert all(old not in table for table in tables)
    assert new in sched.seq_caps


def test_a_pool_that_is_not_kv_aware_forgets_endpoints_dns_dropped_too():
    """Such a pool places by in-flight count and never builds a view of a snapshot, where
    gone endpoints were forgotten: each rollout's old addresses stayed in its tables."""
    sched = scheduler(kv_aware=False)
    old, new = "10.0.0.1:8000", "10.0.0.2:8000"
    assert place(sched, snapshot(state(old, 0.1))).endpoints == [old]
    sched.reserve("r1", "a", old, 100, NOW, prompt_tokens=50)
    sched.observe(StoreSnapshot(2, {"p": {new: state(new, 0.1)}}))
    assert sched.in_flight[old] == 1  # still running there: kept
    sched.release("r1", NOW + 1)
    sched.observe(StoreSnapshot(3, {"p": {new: state(new, 0.1)}}))
    tables = (sched.by_endpoint, sched.in_flight, sched.unstarted, sched.committed,
              sched.prefill_tokens)
    assert all(old not in table for table in tables)


def test_interactive_prompts_may_take_a_priority_engine_past_critical():
    """On a priority-scheduled pool, band 0 goes to an endpoint still within the critical
    watermark when its prompt's blocks are free now, even past critical, and the future
    peak of the band-0 work there with it fits the cache: the engine preempts lower-priority
    work as the cache fills. On a 1,024-token cache 5% is less than one prompt, and
    interactive work waited seconds in kvgate's queue while the engine had the blocks.
    Lower bands and engines without priority scheduling stay within critical."""

    def placed(output, *, band=0, priority=True, usage=920 / 1024, ours=True, running=1):
        sched = scheduler(priority_scheduling=priority)
        for lease, prompt in (("r1", 600), ("r2", 320)) if ours else ():
            sched.reserve(lease, "b", "e1", prompt + 30, NOW - 2, band=running,
                          prompt_tokens=prompt)
            sched.first_token(lease, NOW - 1)  # running: the scrape shows their prompts
        snap = snapshot(state("e1", usage, capacity=1024))
        return isinstance(sched.place("a", 72 + output, snap, NOW, random.Random(0),
                                      band=band, prompt_tokens=72), Placement)

    assert placed(8)  # 920 + 72 = 0.969 of the cache now, past critical
    assert placed(40)  # the batch answers' peak with it passes the cache: they give way
    assert not placed(8, usage=0.96)  # the endpoint itself past critical: nothing
    assert not placed(8, band=1)  # lower bands stay within critical
    assert not placed(8, priority=False)  # no preemption to fall back on
    assert not placed(8, usage=960 / 1024)  # 960 + 72: its prompt does not fit now
    # interactive answers running there are not preempted for it: their peak counts
    assert placed(8, running=0)  # 608 + 328 + 80
    assert not placed(40, running=0)  # 630 + 350 + 102
    assert placed(8, ours=False)  # KV kvgate did not send counts as held throughout:
    assert not placed(40, ours=False)  # 920 + 80 fits the cache, 920 + 112 does not


def test_the_fair_price_is_the_mean_answer_given_what_a_request_has_made():
    """The fair order's price is the mean share of the tenant's recent answers, and, for a
    request running, the mean of those longer than what it has made so far — not the upper
    envelope that keeps the KV safe (~0.97 where answers used 0.58 on average, and the
    weighted shares moved toward the weight-1 tenants: ``bench.policy_sim --asks ceiling``).
    Too few answers: the envelope; one that ran past every answer: what it has made."""
    sched = scheduler()
    sched.decode_rate = 10.0  # output tokens per second of one sequence
    for i, output in enumerate([20, 40, 60, 80] * 2):  # shares 0.2–0.8 of 100, mean 0.5
        sched.reserve(f"s{i}", "a", "e1", 200, NOW, prompt_tokens=100)
        assert sched.fair_ratio("a") == sched.output_ratio("a")  # too few yet: the envelope
        sched.release(f"s{i}", NOW, output_tokens=output)
    assert sched.fair_ratio("a") == 0.5
    assert sched.output_ratio("a") > 0.75  # the KV estimate stays an upper envelope
    assert sched.expected_peak("a", 200, 100) > 175
    assert abs(sched.fair_ratio("a", made=0.5) - 0.7) < 1e-9  # longer than half: the 0.6s and 0.8s
    assert sched.fair_ratio("a", made=0.9) == 0.9  # longer than every answer: as made
    sched.reserve("run", "a", "e1", 200, NOW - 5, prompt_tokens=100)
    assert sched.fair_ratio_of("run", NOW) == 0.5  # not started: made nothing
    sched.first_token("run", NOW - 5)
    assert abs(sched.fair_ratio_of("run", NOW) - 0.7) < 1e-9  # 50 of 100 made
    assert sched.fair_ratio_of("gone", NOW) is None
    assert sched.fair_ratio("b") == sched.output_ratio("b") == 1.0  # per tenant
    sched.forget(["a"])
    assert "a" not in sched.answers
