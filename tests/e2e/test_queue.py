"""The fair queue end to end: real Envoy, kvgate, and one simulated engine whose small KV
cache holds one request at a time, so every other request waits in kvgate's queue."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
import orjson
import pytest

from extproc.demo import local_stack
from tests.conftest import queue_config

pytestmark = pytest.mark.e2e

KEY = "sk-queue"
# 8 blocks × 16 tokens = 128 tokens of KV; a request reserves ~104 (0.81) and grows to it as
# it decodes: the KV committed to one leaves no room for another's, and with the watermark at
# 0.45 nor does the cache now for another's whole reservation, so the engine takes a new
# request only once the one before has ended. Each runs long enough (~2 s) for a loaded
# machine to queue the others behind it.
ENGINE = {"ms_per_token": 20, "kv_blocks": 8, "block_size": 16}  # a request runs ~2 s


@pytest.fixture(scope="module")
def stack():
    config = queue_config(KEY, pool={"priority_scheduling": True,
                                     "watermarks": {"high": 0.45, "critical": 0.45}})
    with local_stack(config, engine_options=ENGINE) as running:
        yield running


def body(tag: str) -> dict:
    return {"model": "tiny-llama", "max_tokens": 100, "stream": True,
            "messages": [{"role": "user", "content": tag}]}


def send(stack, tag: str, klass: str, results: dict) -> threading.Thread:
    def run() -> None:
        response = httpx.post(stack.url + "/v1/chat/completions", json=body(tag), timeout=60,
                              headers={"authorization": f"Bearer {KEY}",
                                       "x-request-class": klass})
        results[tag] = response.status_code
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def queued(stack) -> int:
    admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
    return httpx.get(admin + "/debug/queues").json()["pools"][0]["queued"]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def kv_in_use_seen(stack) -> bool:
    """kvgate's latest scrape shows the engine holding KV. Until then a request sent next
    may pass the gate: a scrape taken after the blocker was sent (so its reservation no
    longer counts on top) but before the engine allocated its KV shows the engine empty."""
    states = stack.kvgate.server.director.endpoints.snapshot().states()
    return all((state.kv_cache_usage or 0.0) > 0 for state in states)


def test_interactive_is_dispatched_before_earlier_queued_batch(stack):
    (engine,) = stack.engines.values()
    engine.clear_requests()
    results: dict[str, int] = {}
    threads = [send(stack, "blocker", "interactive", results)]
    wait_until(lambda: len(engine.requests()) == 1)
    wait_until(lambda: kv_in_use_seen(stack))
    for waiting, tag in enumerate(("batch1", "batch2"), start=1):
        threads.append(send(stack, tag, "batch", results))
        wait_until(lambda n=waiting: queued(stack) == n)
    threads.append(send(stack, "urgent", "interactive", results))
    wait_until(lambda: queued(stack) == 3)
    for thread in threads:
        thread.join(60)
    assert results == dict.fromkeys(("blocker", "batch1", "batch2", "urgent"), 200)
    received = engine.requests()
    order = [r["body"]["messages"][0]["content"] for r in received]
    assert order == ["blocker", "urgent", "batch1", "batch2"]
    priorities = {r["body"]["messages"][0]["content"]: r["body"]["priority"] for r in received}
    assert priorities == {"blocker": 0, "urgent": 0, "batch1": 5, "batch2": 5}


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_client_that_disconnects_while_queued_leaves_nothing_behind(stack, how):
    """A queued request whose client goes away leaves the queue at once (not after Envoy's
    1 s wait for a half-closed ext_proc stream), so it is never dispatched."""
    results: dict[str, int] = {}
    (engine,) = stack.engines.values()
    engine.clear_requests()
    counted = stack.kvgate.server.metrics.requests.values
    gone = ("acme", "tiny-llama", "interactive", "cancelled", "client_gone")
    before = counted.get(gone, 0)
    blocker = send(stack, "blocker", "interactive", results)
    wait_until(lambda: len(engine.requests()) == 1)
    wait_until(lambda: kv_in_use_seen(stack))  # else a leaver may pass the gate (see there)
    raw = orjson.dumps(body("leaver"))
    leavers = [socket.create_connection((stack.envoy.listen_host, stack.envoy.listen_port))
               for _ in range(3)]
    for sock in leavers:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    wait_until(lambda: queued(stack) == len(leavers))
    for sock in leavers:
        if how == "rst":  # linger 0: close() sends RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    left = time.monotonic()
    wait_until(lambda: queued(stack) == 0)  # gone with their clients, not dispatched
    # ~0.1 s on an idle machine; the bound leaves room for a loaded one, well under 1 s
    assert time.monotonic() - left < 0.6
    assert counted.get(gone, 0) - before == len(leavers)  # in kvgate_requests_total
    blocker.join(60)
    assert results == {"blocker": 200}
    director = stack.kvgate.server.director
    wait_until(lambda: not director.active and not director.schedulers["one"].reservations)
    in_flight = stack.kvgate.call(director.store.in_flight("acme"))
    assert in_flight == 0
    assert "leaver" not in [r["body"]["messages"][0]["content"] for r in engine.requests()]
