"""A shutdown whose grace passes while requests still wait — held for their shaper's
departure slot, or in a pool's fair queue — answers them with kvgate's 503 and its
Retry-After. They were never sent upstream; gRPC used to cut their streams at the grace, and
Envoy answered its bare "admission control is unavailable" 503 with no Retry-After."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from extproc.demo import local_stack
from tests.conftest import queue_config

pytestmark = pytest.mark.e2e

KEY = "sk-shutdown-waiting"


def send(url: str, n: int, results: dict[int, httpx.Response]) -> threading.Thread:
    def run() -> None:
        body = {"model": "tiny-llama", "max_tokens": 100, "stream": False,
                "messages": [{"role": "user", "content": f"waiting {n}"}]}
        results[n] = httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                                headers={"authorization": f"Bearer {KEY}"})
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def waiting_at_the_grace(stack, sent: int) -> list[httpx.Response]:
    """Send ``sent`` requests, stop kvgate with a short grace; the answers kvgate gave
    (a request running upstream at the grace is cut: Envoy answers that one)."""
    results: dict[int, httpx.Response] = {}
    threads = []
    for n in range(sent):
        threads.append(send(stack.url, n, results))
        time.sleep(0.1)
    time.sleep(0.5)
    stack.kvgate.stop(grace=1.0)
    for thread in threads:
        thread.join(30)
    assert len(results) == sent
    return [r for r in results.values() if r.status_code != 200
            and "admission control is unavailable" not in r.text]


def assert_answered_by_kvgate(refused: list[httpx.Response], waiting: int) -> None:
    assert len(refused) == waiting, [r.text for r in refused]
    for response in refused:
        assert response.status_code == 503, response.text
        assert response.headers.get("x-kvgate-reject") == "pool_saturated", response.text
        assert int(response.headers["retry-after"]) >= 1
        assert "shutting down" in response.json()["error"]["message"]


def test_requests_held_by_the_shaper_at_the_grace_get_a_503_with_retry_after():
    cfg = queue_config(KEY, {"shaping": {"requests_per_second": 0.2, "backlog": 5}})
    with local_stack(cfg, engine_options={"ms_per_token": 1}) as stack:
        # the first departs at once, the next two are held 5 s and 10 s: past the grace
        assert_answered_by_kvgate(waiting_at_the_grace(stack, 3), 2)


def test_requests_in_the_fair_queue_at_the_grace_get_a_503_with_retry_after():
    # one request at a time fits the engine's KV (test_queue.py): the others queue
    cfg = queue_config(KEY, pool={"priority_scheduling": True,
                                  "watermarks": {"high": 0.45, "critical": 0.45}})
    # the first runs ~3 s, past the grace (cut: Envoy answers it); two wait in the queue
    with local_stack(cfg, engine_options={"ms_per_token": 30, "kv_blocks": 8,
                                          "block_size": 16}) as stack:
        assert_answered_by_kvgate(waiting_at_the_grace(stack, 3), 2)
