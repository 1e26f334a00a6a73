"""The shaping stage end to end: real Envoy, kvgate and a simulated engine. A tenant's burst
reaches the engine smoothed to its shaper's rate, with no 429 while the backlog has room;
past the backlog, 429 ``shaping_backlog_full`` with its Retry-After."""

from __future__ import annotations

import itertools
import socket
import threading
import time

import httpx
import orjson
import pytest

from extproc.config import Config, hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import free_port

pytestmark = pytest.mark.e2e

SMOOTH, TIGHT, LEAVING = "sk-smooth", "sk-tight", "sk-leaving"


def stack_config(tiers: dict, tenants: list[dict], **pool) -> Config:
    """One pool of one engine, Envoy and kvgate on free ports."""
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "scrape": {"interval_s": 0.05},
        "tiers": tiers,
        "tenants": tenants,
        "pools": [{"name": "one", "models": [{"name": "tiny-llama"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"], **pool}],
    })


@pytest.fixture(scope="module")
def stack():
    config = stack_config({"t": {}}, [
        {"name": "smooth", "tier": "t", "api_keys": [hash_api_key(SMOOTH)],
         "limits": {"shaping": {"requests_per_second": 4, "backlog": 10}}},
        {"name": "tight", "tier": "t", "api_keys": [hash_api_key(TIGHT)],
         "limits": {"shaping": {"requests_per_second": 2, "backlog": 3}}},
        {"name": "leaving", "tier": "t", "api_keys": [hash_api_key(LEAVING)],
         "limits": {"shaping": {"requests_per_second": 1, "backlog": 5}}},
    ])
    with local_stack(config, engine_options={"ms_per_token": 1}) as running:
        yield running


def burst(stack, key: str, n: int) -> list[httpx.Response]:
    """``n`` requests sent at once, each from its own thread."""
    responses: list[httpx.Response] = []
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        body = {"model": "tiny-llama", "max_tokens": 2,
                "messages": [{"role": "user", "content": f"burst {i}"}]}
        barrier.wait()
        responses.append(httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=60,
                                    headers={"authorization": f"Bearer {key}"}))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return responses


def test_a_burst_is_smoothed_to_the_rate_with_no_429(stack):
    (engine,) = stack.engines.values()
    engine.clear_requests()
    responses = burst(stack, SMOOTH, 8)
    assert [r.status_code for r in responses] == [200] * 8
    arrived = sorted(r["received_at"] for r in engine.requests())
    assert len(arrived) == 8
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrived)]
    # 4/s: 250 ms apart at kvgate; the margin is for a loaded machine's Envoy hop
    assert min(gaps) > 0.15, gaps
    assert arrived[-1] - arrived[0] >= 7 * 0.25 * 0.9, gaps


def test_past_the_backlog_429_with_retry_after(stack):
    responses = burst(stack, TIGHT, 6)  # one sent at once, three held, the rest refused
    refused = [r for r in responses if r.status_code == 429]
    assert sorted({r.status_code for r in responses}) in ([200], [200, 429])
    assert 1 <= len(refused) <= 2, [r.status_code for r in responses]
    for response in refused:
        assert response.headers["x-kvgate-reject"] == "shaping_backlog_full"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    # the first refused client gets the exact wait for a slot (at most one 500 ms spacing);
    # a second, refused in the same burst, the slot after it (limiter.herd)
    waits = sorted(int(r.headers["retry-after-ms"]) for r in refused)
    for k, wait in enumerate(waits):
        assert 0 < wait <= 500 * (k + 1)
    assert len(waits) < 2 or waits[1] - waits[0] >= 400
    assert sum(r.status_code == 200 for r in responses) >= 4


def test_held_clients_that_leave_give_their_slots_back(stack):
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}/admin/tenants/leaving/usage"
    headers = {"authorization": f"Bearer {LEAVING}"}
    body = {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    started = time.monotonic()
    assert httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30).status_code == 200  # sent at once; the next slot is in 1 s
    raw = orjson.dumps(body)
    leavers = [socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port))
               for _ in range(2)]
    for sock in leavers:  # held for their slots, 1 s and 2 s after the first
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + LEAVING.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    wait_until(lambda: httpx.get(admin).json()["shaping"]["held"] == 2)
    for sock in leavers:
        sock.close()
    left = time.monotonic()
    wait_until(lambda: httpx.get(admin).json()["shaping"]["held"] == 0)
    assert time.monotonic() - left < 0.6  # seen leaving (Envoy's half-close), well before
    assert httpx.get(admin).json()["in_flight"] == 0
    # the next request takes the first slot given back (1 s after the first), not the
    # one after the leavers' (3 s)
    assert httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30).status_code == 200
    assert time.monotonic() - started < 2.5


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


# --- overflow: reject --------------------------------------------------------------------

QUEUER, REJECTER = "sk-queuer", "sk-rejecter"


@pytest.fixture(scope="module")
def small_pool():
    """One engine whose KV cache holds one request at a time (as in test_queue.py)."""
    config = stack_config(
        {"t": {}, "impatient": {"overflow": "reject"}},
        [{"name": "queuer", "tier": "t", "api_keys": [hash_api_key(QUEUER)]},
         {"name": "rejecter", "tier": "impatient", "api_keys": [hash_api_key(REJECTER)]}],
        watermarks={"high": 0.45, "critical": 0.45},
    )
    engine = {"ms_per_token": 8, "kv_blocks": 8, "block_size": 16}
    with local_stack(config, engine_options=engine) as running:
        yield running


def test_overflow_reject_is_refused_at_once_while_queue_tenants_wait(small_pool):
    body = {"model": "tiny-llama", "max_tokens": 100, "stream": True,
            "messages": [{"role": "user", "content": "long"}]}
    statuses: dict[str, int] = {}

    def send(name: str, key: str) -> threading.Thread:
        def run() -> None:
            statuses[name] = httpx.post(small_pool.url + "/v1/chat/completions", json=body,
                                        timeout=60,
                                        headers={"authorization": f"Bearer {key}"}).status_code
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    director = small_pool.kvgate.server.director
    blocker = send("blocker", QUEUER)
    deadline = time.monotonic() + 10
    while not director.active:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    waiter = send("waiter", QUEUER)
    started = time.monotonic()
    refused = httpx.post(small_pool.url + "/v1/chat/completions", json=body, timeout=60,
                         headers={"authorization": f"Bearer {REJECTER}"})
    assert time.monotonic() - started < 0.5  # not held until the blocker ends (~0.8 s)
    assert refused.status_code == 503
    assert refused.headers["x-kvgate-reject"] == "pool_saturated"
    assert int(refused.headers["retry-after-ms"]) > 0
    for thread in (blocker, waiter):
        thread.join(60)
    assert statuses == {"blocker": 200, "waiter": 200}
