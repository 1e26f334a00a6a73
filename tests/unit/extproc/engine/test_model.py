"""The engine model (extproc.engine.model): vLLM V1's step loop in virtual and real time."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from extproc.engine.model import EngineConfig, EngineModel, EngineProfile, VirtualEngine, simulate

PROFILE = {"base_ms": 5.0, "decode_us_per_seq": 100.0, "prefill_us_per_token": 50.0}


def step_s(prefill_tokens: int, batch: int) -> float:
    return EngineProfile(**PROFILE).step_s(prefill_tokens, batch)


def test_step_time_follows_the_profile() -> None:
    engine = VirtualEngine(EngineConfig(**PROFILE))
    req = engine.submit(prompt_tokens=100, max_tokens=3, at=1.0)
    assert engine.next_time() == 1.0  # the step starts when the engine is advanced
    engine.advance(1.0)
    assert engine.next_time() == pytest.approx(1.0 + step_s(100, 1))
    engine.run()
    # The prefill step emits the first token; each decode step one more.
    assert req.ttft == pytest.approx(step_s(100, 1))
    assert req.finished_at == pytest.approx(1.0 + step_s(100, 1) + 2 * step_s(0, 1))
    assert req.generated == 3 and engine.used_blocks == 0


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    engine = VirtualEngine(EngineConfig(**PROFILE, max_num_batched_tokens=2048, kv_blocks=4096))
    req = engine.submit(prompt_tokens=5000, max_tokens=1, at=0.0)
    engine.run()
    assert req.ttft == pytest.approx(2 * step_s(2048, 1) + step_s(904, 1))


def test_a_bigger_batch_makes_every_decode_step_slower() -> None:
    def inter_token_s(batch: int) -> float:
        engine = VirtualEngine(EngineConfig(**PROFILE, max_num_seqs=64, kv_blocks=4096))
        reqs = [engine.submit(prompt_tokens=10, max_tokens=11, at=0.0) for _ in range(batch)]
        engine.run()
        return (reqs[0].finished_at - reqs[0].first_token_at) / 10

    one, eight, thirty_two = inter_token_s(1), inter_token_s(8), inter_token_s(32)
    assert one == pytest.approx(step_s(0, 1))
    assert eight == pytest.approx(step_s(0, 8))
    assert one < eight < thirty_two


def test_new_arrivals_wait_for_the_step_boundary() -> None:
    engine = VirtualEngine(EngineConfig(**PROFILE))
    first = engine.submit(prompt_tokens=1000, max_tokens=1, at=0.0)
    engine.advance(0.001)  # mid-step
    second = engine.submit(prompt_tokens=10, max_tokens=1, at=0.001)
    engine.run()
    assert first.first_token_at == pytest.approx(step_s(1000, 1))
    assert second.first_token_at == pytest.approx(step_s(1000, 1) + step_s(10, 1))


@pytest.mark.parametrize(("policy", "expected"), [("priority", ["blocker", "high", "low"]),
                                                  ("fcfs", ["blocker", "low", "high"])])
def test_waiting_queue_order(policy: str, expected: list[str]) -> None:
    engine = VirtualEngine(EngineConfig(**PROFILE, scheduling_policy=policy, max_num_seqs=1))
    done = engine.advance(0.0)
    engine.submit(10, 20, priority=0, at=0.0, request_id="blocker")
    done += engine.advance(0.01)
    engine.submit(10, 1, priority=5, at=0.01, request_id="low")
    done += engine.advance(0.02)
    engine.submit(10, 1, priority=-1, at=0.02, request_id="high")
    done += engine.run()
    assert [r.request_id for r in done] == expected


def run_until_preemption(policy: str) -> list[str]:
    """Three requests that outgrow an 8-block cache; the ids preempted, in order."""
    config = EngineConfig(**PROFILE, scheduling_policy=policy, kv_blocks=8, block_size=4)
    engine = VirtualEngine(config)
    engine.submit(4, 12, priority=1, at=0.0, request_id="mid")
    engine.submit(4, 12, priority=2, at=0.0, request_id="worst")
    engine.submit(4, 12, priority=0, at=0.0, request_id="best")
    preempted: list[str] = []
    while engine.next_time() is not None:
        before = {r.request_id: r.preemptions for r in engine.running}
        engine.advance(engine.next_time())
        now = {r.request_id: r.preemptions for r in [*engine.running, *engine.waiting.ordered()]}
        preempted += [rid for rid, n in before.items() if now.get(rid, n) > n]
    assert engine.used_blocks == 0 and engine.finished["length"] == 3
    return preempted


def test_priority_preempts_the_largest_priority_arrival() -> None:
    assert run_until_preemption("priority")[0] == "worst"


def test_fcfs_preempts_the_most_recently_admitted() -> None:
    # Admitted in arrival order (mid, worst, best): fcfs ignores priority and pops the last.
    assert run_until_preemption("fcfs")[0] == "best"


def test_kv_never_exceeds_the_cache_and_tokens_are_counted_once() -> None:
    config = EngineConfig(**PROFILE, scheduling_policy="priority", kv_blocks=16, block_size=4)
    reqs = simulate(config, [(0.001 * i, 8, 30, i % 3) for i in range(6)])
    assert all(r.generated == 30 for r in reqs)
    assert any(r.preemptions for r in reqs)


def random_workload(seed: int, n: int = 400) -> list[tuple[float, int, int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(20.0)
        out.append((t, rng.randint(50, 3000), rng.randint(10, 400), rng.randint(0, 2)))
    return out


def test_same_seed_same_result() -> None:
    config = EngineConfig(scheduling_policy="priority", kv_blocks=600, max_num_seqs=32)

    def outcome(seed: int) -> list[tuple]:
        return [(r.first_token_at, r.finished_at, r.generated, r.preemptions)
                for r in simulate(config, random_workload(seed))]

    first = outcome(7)
    assert first == outcome(7)
    assert first != outcome(8)
    assert sum(r[3] for r in first) > 0  # the cache was contended


def test_thousands_of_requests_in_virtual_time_are_fast() -> None:
    config = EngineConfig(kv_blocks=4000, max_num_seqs=128)
    start = time.perf_counter()
    reqs = simulate(config, random_workload(1, n=3000))
    assert all(r.finished_at is not None for r in reqs)
    assert time.perf_counter() - start < 10


async def test_real_time_driver_scales_step_time() -> None:
    config = EngineConfig(base_ms=10.0, decode_us_per_seq=0, prefill_us_per_token=0,
                          time_scale=2.0)
    model = EngineModel(config)
    req = model.new_request(prompt_tokens=4, max_tokens=3)
    start = time.monotonic()
    tokens = [i async for i in model.generate(req)]
    elapsed = time.monotonic() - start
    assert tokens == [0, 1, 2]
    assert elapsed >= 3 * 0.010 * 2 * 0.9  # three 10 ms steps, twice as slow
    assert model.used_blocks == 0 and model.finished["length"] == 1


async def test_real_time_batching_shares_steps() -> None:
    model = EngineModel(EngineConfig(ms_per_token=5, decode_us_per_seq=0, prefill_us_per_token=0))
    reqs = [model.new_request(prompt_tokens=4, max_tokens=10) for _ in range(8)]

    async def drain(req) -> None:
        async for _ in model.generate(req):
            pass

    start = time.monotonic()
    await asyncio.gather(*(drain(r) for r in reqs))
    # One batch of eight: ~10 steps of 5 ms, not 80.
    assert time.monotonic() - start < 0.3
