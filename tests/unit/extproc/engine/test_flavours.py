"""The simulated engine speaking other engines' ``/metrics`` (``--metrics-flavour``): every
flavour reads back, through kvgate's own parser with that engine's names, as the same
modelled state. (An ``sglang`` engine's priority order: test_server.py.)"""

from __future__ import annotations

import httpx
import pytest

from extproc.datalayer.metrics import ENGINES, parse_metrics
from extproc.engine.model import EngineConfig
from extproc.engine.server import EngineProcess, EngineServer, parse_args

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
