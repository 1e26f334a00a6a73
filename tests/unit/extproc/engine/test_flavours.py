"""The simulated engine speaking other engines' ``/metrics`` (``--metrics-flavour``): every
flavour reads back, through kvgate's own parser with that engine's names, as the same
modelled state; an ``sglang`` engine runs higher priorities first, as SGLang does."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from extproc.datalayer.metrics import ENGINES, parse_metrics
from extproc.engine.model import EngineConfig
from extproc.engine.server import EngineProcess, EngineServer, parse_args, start_engine

FAST = {"ms_per_token": 2, "prefill_us_per_token": 10}


@pytest.mark.parametrize("flavour", sorted(ENGINES))
def test_every_flavour_reads_back_as_the_modelled_state(flavour: str) -> None:
    server = EngineServer(EngineConfig(kv_blocks=100, block_size=16, metrics_flavour=flavour))
    server.metrics.set_overrides({"kv_cache_usage_perc": 0.375, "num_requests_waiting": 4,
                                  "num_requests_running": 3})
    body = server.metrics.render().decode()
    metrics = parse_metrics(body, ENGINES[flavour])
    assert (metrics.kv_cache_usage, metrics.num_requests_waiting,
            metrics.num_requests_running, metrics.kv_capacity_tokens) == (0.375, 4, 3, 1600)
    assert metrics.problems == ()
    others = [name for name in ENGINES if name != flavour]
    assert not any(parse_metrics(body, ENGINES[other]).has_data for other in others)


def test_the_flag_reaches_the_subprocess() -> None:
    assert parse_args(["--port", "1", "--metrics-flavour", "tgi"]).metrics_flavour == "tgi"
    with EngineProcess(metrics_flavour="sglang", **FAST) as engine:
        body = httpx.get(engine.url + "/metrics", timeout=5).text
    assert "sglang:token_usage{" in body and "vllm:" not in body


async def test_an_sglang_engine_runs_higher_priorities_first() -> None:
    handle = await start_engine(0, scheduling_policy="priority", max_num_seqs=1,
                                metrics_flavour="sglang", **FAST)
    try:
        async with httpx.AsyncClient(base_url=handle.url, timeout=10) as c:
            done: list[str] = []

            async def ask(name: str, priority: int, tokens: int) -> None:
                r = await c.post("/v1/completions", json={"prompt": name, "max_tokens": tokens,
                                                          "priority": priority})
                assert r.status_code == 200
                done.append(name)

            blocker = asyncio.create_task(ask("blocker", 0, 40))
            while not handle.model.running:
                await asyncio.sleep(0.005)
            late = [asyncio.create_task(ask("low", -5, 1)),
                    asyncio.create_task(ask("high", 1, 1))]
            while len(handle.model.waiting) < 2:
                await asyncio.sleep(0.005)
            await asyncio.gather(blocker, *late)
            assert done == ["blocker", "high", "low"]
    finally:
        await handle.stop()
