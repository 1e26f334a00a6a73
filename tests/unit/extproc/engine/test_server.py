"""The simulated vLLM engine (extproc.engine): wire format, vLLM semantics, test hooks, KV model.

Most checks run against one subprocess engine (the form the demo and the end-to-end tests
use); scheduling-order checks run an engine in-process so they can look at its state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.engine.model import EngineConfig, EngineModel
from extproc.engine.server import EngineProcess, start_engine

FAST = {"ms_per_token": 2, "prefill_us_per_token": 10}
CHAT = {"model": "tiny-llama", "messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "count  these\nfive words please"}]},
]}  # 2 + 5 = 7 prompt tokens


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    with EngineProcess(**FAST) as proc:
        yield proc


@pytest.fixture
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=10) as c:
        yield c


def sse_events(lines: Iterator[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE stream, ``[DONE]`` kept as the string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# -- OpenAI API shapes ---------------------------------------------------------------------


def test_chat_completion_with_usage(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}


def test_max_completion_tokens_wins_and_default_is_16(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "max_tokens": 9, "max_completion_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.json()["usage"]["completion_tokens"] == 16


def test_chat_stream_include_usage(client: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 4
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, None, "length"]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_n_answers_that_many_choices_and_counts_them_all(client: httpx.Client) -> None:
    """vLLM answers ``n`` choices, ``index`` 0..n-1, and counts the prompt once and every
    choice's tokens: the engine refused n > 1, so kvgate's pricing of it had no end-to-end
    test."""
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "the quick brown " and c["finish_reason"] == "length"
               for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
    r = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "n": 2})
    assert [(c["index"], c["text"]) for c in r.json()["choices"]] == [
        (0, "the quick "), (1, "the quick ")]
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert client.post("/v1/completions", json={"prompt": "a", "n": 1}).status_code == 200
    for bad in (0, -1, 1.5, True):
        assert client.post("/v1/completions", json={"prompt": "a", "n": bad}).status_code == 400


def test_a_stream_of_n_choices_names_each_chunks_choice(client: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert all(len(c["choices"]) == 1 for c in chunks)
    # a role chunk per choice first, as vLLM sends them
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:2]] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    for choice in (0, 1):
        mine = [c for c in chunks[2:] if c["choices"][0]["index"] == choice]
        assert "".join(c["choices"][0]["delta"]["content"] for c in mine) == "the quick brown "
        assert [c["choices"][0]["finish_reason"] for c in mine] == [None, None, "length"]
        # continuous usage: the choice's own count, as vLLM's
        assert [c["usage"]["completion_tokens"] for c in mine] == [1, 2, 3]
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    body = {"prompt": "a b", "max_tokens": 2, "n": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert sorted((e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-1]) == [
        (0, "quick "), (0, "the "), (1, "quick "), (1, "the ")]


def test_stream_without_include_usage_has_no_usage_chunk(client: httpx.Client) -> None:
    body = {"prompt": "one two three", "max_tokens": 3, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["the ", "quick ", "brown "]
    assert all("usage" not in e for e in events[:-1])


def test_completion(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "a b c d",
                                             "max_tokens": 2})
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "the quick "
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 3
    r = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == 3  # vLLM takes a batch of token ids too


def test_embeddings_are_deterministic(client: httpx.Client) -> None:
    r1 = client.post("/v1/embeddings", json={"input": ["hello world", "x"]}).json()
    r2 = client.post("/v1/embeddings", json={"input": "hello world"}).json()
    assert [d["index"] for d in r1["data"]] == [0, 1]
    assert r1["data"][0]["embedding"] == r2["data"][0]["embedding"]
    assert r1["data"][0]["embedding"] != r1["data"][1]["embedding"]
    assert abs(sum(x * x for x in r1["data"][0]["embedding"]) - 1) < 1e-4
    assert r1["usage"]["prompt_tokens"] == 3


def test_models_and_health(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert client.get("/health").status_code == 200


def test_metrics_have_vllm_names(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    r = client.get("/metrics")
    assert r.status_code == 200
    samples = {s.name: s for f in text_string_to_metric_families(r.text) for s in f.samples}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:cache_config_info", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"):
        assert name in samples, name
    assert samples["vllm:kv_cache_usage_perc"].labels == {"model_name": "tiny-llama",
                                                          "engine": "0"}
    info = samples["vllm:cache_config_info"]
    assert info.value == 1
    # 2048 usable + the null block, as vLLM counts
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "2049"
    assert samples["vllm:generation_tokens_total"].value >= 1


# -- vLLM validation -----------------------------------------------------------------------


def test_fcfs_ignores_priority_like_vllm_0_32(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={**CHAT, "priority": -2, "max_tokens": 1})
    assert r.status_code == 200  # a real vLLM 0.32 accepts and ignores it (bench/vllm_cpu)


def test_fcfs_can_reject_priority_like_older_vllm() -> None:
    with EngineProcess(fcfs_priority="reject", **FAST) as strict, \
            httpx.Client(base_url=strict.url, timeout=10) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "priority": -2})
        assert r.status_code == 400
        assert r.json() == {"error": {
            "message": "Got priority -2 but Priority scheduling is not enabled.",
            "type": "BadRequestError", "param": None, "code": 400}}
        ok = client.post("/v1/chat/completions", json={**CHAT, "priority": 0, "max_tokens": 1})
        assert ok.status_code == 200


def test_bad_requests(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `gpt-9` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404}
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}).status_code == 400
    too_long = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 10**6})
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]


@pytest.mark.parametrize("content", [[{"type": "text", "text": 5}], [{"type": "text"}], [5],
                                     [None], 5, {"text": "a"}])
def test_malformed_content_is_a_400_not_a_500(client: httpx.Client, content: object) -> None:
    # kvgate lets odd content parts through (it only counts their text); the engine, like
    # vLLM, refuses them: a 500 here reached clients through the demo's Envoy
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"
    ok = [{"type": "text", "text": "a b"}, {"type": "image_url", "image_url": {"url": "x"}}]
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "messages": [{"role": "user", "content": ok},
                                               {"role": "assistant", "content": None}]})
    assert r.status_code == 200


# -- test hooks ----------------------------------------------------------------------------


def test_debug_requests_records_what_arrived(engine: EngineProcess, client: httpx.Client) -> None:
    engine.clear_requests()
    client.get("/v1/models")
    raw = orjson.dumps({**CHAT, "max_tokens": 1, "priority": 0})
    client.post("/v1/chat/completions", content=raw,
                headers={"content-type": "application/json", "X-Tenant-Hint": "acme"})
    log = engine.requests()
    assert [(e["method"], e["path"]) for e in log] == [("GET", "/v1/models"),
                                                       ("POST", "/v1/chat/completions")]
    last = log[-1]
    assert last["headers"]["x-tenant-hint"] == "acme"
    assert last["body"]["priority"] == 0
    assert last["body_bytes"] == len(raw)
    assert last["content_length"] == str(len(raw))
    assert log[0]["body"] is None and log[0]["content_length"] is None
    engine.clear_requests()
    assert engine.requests() == []


def test_debug_metric_overrides(engine: EngineProcess, client: httpx.Client) -> None:
    def sample(name: str) -> float:
        text = client.get("/metrics").text
        return next(s.value for f in text_string_to_metric_families(text)
                    for s in f.samples if s.name == name)

    engine.set_metrics(kv_cache_usage_perc=0.97, num_requests_waiting=12)
    assert sample("vllm:kv_cache_usage_perc") == 0.97
    assert sample("vllm:num_requests_waiting") == 12
    assert engine.state()["overrides"] == {"kv_cache_usage_perc": 0.97,
                                           "num_requests_waiting": 12}
    r = client.post("/debug/metrics", json={"no_such_metric": 1})
    assert r.status_code == 400
    engine.set_metrics()  # {} clears
    assert sample("vllm:kv_cache_usage_perc") == 0.0
    assert sample("vllm:num_requests_waiting") == 0


def test_stream_disconnect_frees_the_slot(engine: EngineProcess, client: httpx.Client) -> None:
    aborted = engine.state()["aborted"]
    body = {**CHAT, "max_tokens": 5000, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        state = engine.state()
        assert state["running"] == 1 and state["kv_blocks_used"] >= 1
    # Leaving the block closes the connection mid-stream.
    wait_for(lambda: engine.state()["running"] == 0)
    state = engine.state()
    assert state["aborted"] == aborted + 1
    assert state["kv_blocks_used"] == 0


def test_non_stream_disconnect_frees_the_slot(engine: EngineProcess) -> None:
    aborted = engine.state()["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/v1/chat/completions", json={**CHAT, "max_tokens": 5000},
                   timeout=0.3)
    wait_for(lambda: engine.state()["running"] == 0)
    assert engine.state()["aborted"] == aborted + 1


# -- scheduling and KV (in-process) --------------------------------------------------------


@pytest.mark.parametrize(("flavour", "low", "high"), [
    ("vllm", 5, -1),  # vLLM: lower values first
    ("sglang", -5, 1),  # SGLang (its default order): higher values first
])
async def test_priority_policy_orders_the_waiting_queue(flavour: str, low: int,
                                                        high: int) -> None:
    handle = await start_engine(0, scheduling_policy="priority", max_num_seqs=1,
                                metrics_flavour=flavour, **FAST)
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
            late = [asyncio.create_task(ask("low", low, 1)),
                    asyncio.create_task(ask("high", high, 1))]
            while len(handle.model.waiting) < 2:
                await asyncio.sleep(0.005)
            state = (await c.get("/debug/state")).json()
            assert (state["running"], state["waiting"]) == (1, 2)
            # the model's own order: lower first, an SGLang engine's values negated
            assert [r["priority"] for r in state["waiting_requests"]] == [-1, 5]
            await asyncio.gather(blocker, *late)
            assert done == ["blocker", "high", "low"]
    finally:
        await handle.stop()


async def test_kv_blocks_follow_prompt_and_generated_tokens() -> None:
    model = EngineModel(EngineConfig(kv_blocks=10, block_size=4, ms_per_token=0,
                                     prefill_us_per_token=0))
    req = model.new_request(prompt_tokens=7, max_tokens=3)
    seen = []
    async for _ in model.generate(req):
        seen.append((req.generated, model.used_blocks))
    # ceil((7 + generated) / 4) blocks while running, none once finished.
    assert seen == [(1, 2), (2, 3), (3, 3)]
    assert model.used_blocks == 0 and model.finished["length"] == 1


async def test_n_choices_are_n_sequences_each_with_its_kv() -> None:
    """Each choice runs as its own sequence (vLLM V1's child requests): n slots, n × the
    blocks (no prefix caching here, so each holds its prompt), each freed at its end."""
    model = EngineModel(EngineConfig(kv_blocks=20, block_size=4, ms_per_token=0,
                                     prefill_us_per_token=0))
    reqs = [model.new_request(prompt_tokens=7, max_tokens=3, request_id=f"{i}_r")
            for i in range(2)]
    seen = []
    async for choice, index in model.generate_many(reqs):
        seen.append((choice, index, len(model.running), model.used_blocks))
    assert [(c, i) for c, i, _, _ in seen] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [(running, used) for _, _, running, used in seen[:4]] == [
        (2, 4), (2, 4), (2, 6), (2, 6)]  # both decode together: ceil((7 + k) / 4) each
    assert model.used_blocks == 0 and model.finished["length"] == 2
    assert model.generation_tokens_total == 6


async def test_a_client_leaving_an_n_request_frees_every_choice() -> None:
    model = EngineModel(EngineConfig(kv_blocks=20, block_size=4, ms_per_token=1))
    reqs = [model.new_request(prompt_tokens=4, max_tokens=50) for _ in range(3)]
    tokens = model.generate_many(reqs)
    async for _ in tokens:
        break
    await tokens.aclose()
    assert model.used_blocks == 0 and not model.running and len(model.waiting) == 0
    assert model.finished["abort"] == 3


async def test_full_kv_cache_preempts_the_least_important() -> None:
    model = EngineModel(EngineConfig(kv_blocks=4, block_size=4, scheduling_policy="priority",
                                     ms_per_token=0, prefill_us_per_token=0))
    important = model.new_request(prompt_tokens=4, max_tokens=8, priority=0)
    batch = model.new_request(prompt_tokens=4, max_tokens=8, priority=1)

    async def run(req) -> None:
        async for _ in model.generate(req):
            assert model.used_blocks <= 4

    await asyncio.gather(run(batch), run(important))
    assert model.num_preemptions >= 1
    assert batch.preemptions >= 1 and important.preemptions == 0
    assert model.used_blocks == 0 and model.finished["length"] == 2
    assert model.prompt_tokens_total == 8 and model.generation_tokens_total == 16
