"""The fallback endpoints kvgate lists are the ones Envoy uses: with the chosen engine dead
(connection refused), the request goes to the next one on the list, and kvgate releases
what the request held exactly once."""

from __future__ import annotations

import time

import httpx
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import free_port

pytestmark = pytest.mark.e2e

KEY = "sk-fallback"


@pytest.fixture(scope="module")
def stack():
    config = parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        # kvgate keeps choosing a dead engine for a while (its last reading stays fresh):
        # so Envoy, not kvgate's health checks, has to get the requests through
        "scrape": {"unhealthy_after": 10_000, "staleness_s": 120},
        "tiers": {"t": {"limits": {"requests_per_second": 1000, "max_concurrency": 100}}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "tiny", "models": [{"name": "tiny-llama", "default_max_tokens": 8}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(3)]}],
    })
    with local_stack(config, engine_options={"ms_per_token": 2}) as running:
        yield running


def envoy_stat(stack, name: str) -> int:
    text = httpx.get(stack.envoy.admin_url + "/stats", params={"filter": name}).text
    return sum(int(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.split(":")[0] == name)


def listed(request: dict) -> list[str]:
    """The endpoints kvgate listed for a request, as the engine received the header."""
    return request["headers"]["x-gateway-destination-endpoint"].split(",")


def test_a_dead_chosen_engine_falls_back_to_the_next_listed(stack):
    body = {"model": "tiny-llama", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for _ in range(6):
            assert http.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
        for address, engine in stack.engines.items():  # all alive: kvgate's choice is taken
            assert all(listed(r)[0] == address for r in engine.call("GET", "/debug/requests"))
            engine.call("DELETE", "/debug/requests")
        dead, *alive = stack.engines
        for address in alive:  # the others look busier: kvgate keeps choosing the dead one
            stack.engines[address].set_metrics(kv_cache_usage_perc=0.5)
        time.sleep(0.5)  # scraped: every reading fresh, the chosen engine idle
        stack.engines[dead].stop()  # connection refused from now on
        answers = [http.post("/v1/chat/completions", json=body | {"stream": i % 2 == 0},
                             headers=auth) for i in range(12)]
    assert [a.status_code for a in answers] == [200] * 12
    assert all("[DONE]" in a.text for a in answers[::2])  # streams complete
    served = [(address, listed(r)) for address, engine in stack.engines.items()
              if address != dead for r in engine.call("GET", "/debug/requests")]
    assert len(served) == 12
    for address, endpoints in served:  # kvgate's choice, or the next one when it was dead
        assert endpoints[0] == address or (endpoints[0] == dead and endpoints[1] == address)
    assert all(endpoints[0] == dead for _, endpoints in served)  # every one fell back
    failed = envoy_stat(stack, "cluster.kvgate_pool_tiny.upstream_cx_connect_fail")
    assert failed >= 1  # kvgate chose the dead engine, Envoy met it...
    assert envoy_stat(stack, "cluster.kvgate_pool_tiny.upstream_rq_retry_success") == 12
    director = stack.kvgate.server.director
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and director.active:
        time.sleep(0.05)
    assert director.active == {}  # ...and every admission was released
    assert stack.kvgate.call(director.store.in_flight("acme")) == 0
    scheduler = director.schedulers["tiny"]
    assert scheduler.reservations == {}  # KV reservations too, the dead engine's included
