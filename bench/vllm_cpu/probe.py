"""Probe a running real vLLM for the facts kvgate depends on (bench/vllm_cpu/README.md).

    .venv/bin/python -m bench.vllm_cpu.probe --url http://127.0.0.1:8011 --policy priority \
        --out /tmp/vllmx/priority.json [--metrics-out tests/data/vllm-0.32-metrics.txt]

Runs in the project venv (httpx, prometheus_client). Prints a JSON report: latency of
plain requests, the answer to a `"priority": 5` request, the tail of a streaming request
with `stream_options.include_usage`, /metrics KV capacity, and (with --saturate) a
saturation experiment: fill the server with long low-priority requests, then send one
high-priority and one low-priority short request at the same moment and compare TTFT,
sampling kv_cache_usage_perc / running / waiting every 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-llama"
LONG_PROMPT_WORDS = "the quick dog runs to the big house and the cat sees the red sun".split()  # noqa: SIM905


def long_prompt(n_words: int, tag: int = 0) -> str:
    """A prompt of ~n_words tokens; `tag` makes its first tokens unique, so vLLM's prefix
    cache (on by default) cannot share KV blocks between the fill requests."""
    head = " ".join(str(tag))  # digits are single tokens
    return (
        head + " " + " ".join(LONG_PROMPT_WORDS[i % len(LONG_PROMPT_WORDS)] for i in range(n_words))
    )


def gauges(text: str) -> dict:
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (
                "vllm:kv_cache_usage_perc",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:num_preemptions_total",
            ):
                out[s.name] = s.value
            if s.name == "vllm:cache_config_info":
                out["cache_config_info"] = dict(s.labels)
    return out


async def chat(client, content, *, max_tokens=64, priority=None, stream=False, **extra):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }
    if priority is not None:
        body["priority"] = priority
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def timed_stream(client, body) -> dict:
    """POST a streaming chat request; TTFT = first chunk with content, plus the raw tail."""
    t0 = time.monotonic()
    ttft = None
    chunks: list[str] = []
    n_content = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        status = r.status_code
        if status != 200:
            body = (await r.aread()).decode()
            return {"status": status, "body": body, "t_done": time.monotonic()}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            chunks.append(data)
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("choices") and obj["choices"][0].get("delta", {}).get("content"):
                n_content += 1
                if ttft is None:
                    ttft = time.monotonic() - t0
    return {
        "status": status,
        "t_done": time.monotonic(),
        "ttft_s": round(ttft, 3) if ttft is not None else None,
        "e2e_s": round(time.monotonic() - t0, 3),
        "content_chunks": n_content,
        "last_chunks": chunks[-2:],
        "n_chunks": len(chunks),
    }


async def timed_post(client, body) -> dict:
    """POST a non-streaming chat request; e2e latency and usage."""
    t0 = time.monotonic()
    r = await client.post("/v1/chat/completions", json=body)
    out = {
        "status": r.status_code,
        "e2e_s": round(time.monotonic() - t0, 3),
        "t_done": time.monotonic(),
    }
    if r.status_code == 200:
        out["usage"] = {k: r.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    else:
        out["body"] = r.text
    return out


async def run(args) -> dict:
    report: dict = {"url": args.url, "policy": args.policy}
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        if args.saturate_only:
            report["saturation"] = await saturate(client, args)
            report["metrics_after"] = gauges((await client.get("/metrics")).text)
            return report
        m0 = (await client.get("/metrics")).text
        report["metrics_at_idle"] = gauges(m0)
        report["models"] = (await client.get("/v1/models")).json()

        # (e) sequential latency, chat and completions, 64 tokens
        lat = []
        for i in range(5):
            t0 = time.monotonic()
            r = await client.post(
                "/v1/chat/completions", json=await chat(client, "hello how are you today")
            )
            lat.append(round(time.monotonic() - t0, 3))
            if i == 0:
                report["chat_example"] = r.json()
        report["chat_64_tokens_latency_s"] = lat
        lat = []
        for _ in range(3):
            t0 = time.monotonic()
            r = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "the world is",
                    "max_tokens": 64,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            lat.append(round(time.monotonic() - t0, 3))
        report["completions_64_tokens_latency_s"] = lat
        report["completions_usage"] = r.json().get("usage")

        # (a)/(b) priority field, non-streaming and streaming; also explicit 0 and negative
        for prio in (5, 0, -3):
            r = await client.post(
                "/v1/chat/completions",
                json=await chat(client, "hello", max_tokens=4, priority=prio),
            )
            report[f"priority_{prio}"] = {
                "status": r.status_code,
                "content_type": r.headers.get("content-type"),
                "body": r.text if r.status_code != 200 else "(200 ok, choices omitted)",
            }
        report["priority_5_stream"] = await timed_stream(
            client, await chat(client, "hello", max_tokens=4, priority=5, stream=True)
        )
        report["priority_5_stream"].pop("t_done")
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "priority": 5},
        )
        report["priority_5_completions"] = {"status": r.status_code, "body": r.text[:500]}

        # (c) streaming with include_usage
        report["stream_usage"] = await timed_stream(
            client, await chat(client, "tell me a story", max_tokens=16, stream=True)
        )
        report["stream_usage"].pop("t_done")

        if args.saturate:
            report["saturation"] = await saturate(client, args)

        mtext = (await client.get("/metrics")).text
        report["metrics_after"] = gauges(mtext)
        if args.metrics_out:
            with open(args.metrics_out, "w") as f:
                f.write(mtext)
    return report


async def saturate(client, args) -> dict:
    samples: list = []
    stop = asyncio.Event()

    async def sampler():
        t0 = time.monotonic()
        while not stop.is_set():
            try:
                g = gauges((await client.get("/metrics")).text)
                samples.append(
                    (
                        round(time.monotonic() - t0, 2),
                        round(g.get("vllm:kv_cache_usage_perc", -1), 3),
                        int(g.get("vllm:num_requests_running", -1)),
                        int(g.get("vllm:num_requests_waiting", -1)),
                        int(g.get("vllm:num_preemptions_total", -1)),
                    )
                )
            except Exception as e:  # keep sampling
                samples.append(("err", repr(e)))
            await asyncio.sleep(0.1)

    samp = asyncio.create_task(sampler())
    t0 = time.monotonic()
    low_prio, high_prio = args.low_priority, args.high_priority
    # Fill requests are NOT streamed by default: with this tiny model the engine makes
    # ~2,000 tokens/s and the API server's per-chunk SSE work, not the engine, becomes the
    # bottleneck when every fill request streams (all TTFTs then measure API-server lag).
    send = timed_stream if args.fill_stream else timed_post
    fill = [
        asyncio.create_task(
            send(
                client,
                await chat(
                    client,
                    long_prompt(args.fill_prompt_words, tag=1000 + i),
                    max_tokens=args.fill_max_tokens,
                    priority=low_prio,
                    stream=args.fill_stream,
                ),
            )
        )
        for i in range(args.fill)
    ]
    # send the probes only once the engine is saturated: requests waiting in vLLM's queue
    # (the API server on 2 cores can take a second or two to hand 10+ requests over)
    await asyncio.sleep(args.probe_after)
    while True:
        g_before = gauges((await client.get("/metrics")).text)
        if g_before.get("vllm:num_requests_waiting", 0) >= 1 or time.monotonic() - t0 > 30:
            break
        await asyncio.sleep(0.05)
    probes_sent_at = round(time.monotonic() - t0, 3)
    probe_body = dict(max_tokens=16, stream=True)
    hi, lo = await asyncio.gather(
        timed_stream(client, await chat(client, "hello there", priority=high_prio, **probe_body)),
        timed_stream(client, await chat(client, "hello you", priority=low_prio, **probe_body)),
    )
    fill_res = await asyncio.gather(*fill)
    for f in fill_res:  # completion time on the experiment's clock
        f["done_at_s"] = round(f.pop("t_done") - t0, 3)
    stop.set()
    await samp
    return {
        "fill": {
            "n": args.fill,
            "stream": args.fill_stream,
            "prompt_words": args.fill_prompt_words,
            "max_tokens": args.fill_max_tokens,
            "priority": low_prio,
        },
        "probes_sent_at_s": probes_sent_at,
        "gauges_when_probes_sent": g_before,
        "high_priority_probe": {
            "priority": high_prio,
            **hi,
            "done_at_s": round(hi.pop("t_done") - t0, 3),
        },
        "low_priority_probe": {
            "priority": low_prio,
            **lo,
            "done_at_s": round(lo.pop("t_done") - t0, 3),
        },
        "fill_results": [
            {k: v for k, v in f.items() if k not in ("last_chunks", "n_chunks")} for f in fill_res
        ],
        "total_s": round(time.monotonic() - t0, 2),
        "samples(t,kv_usage,running,waiting,preemptions)": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8011")
    ap.add_argument("--policy", default="priority")
    ap.add_argument("--out", default=None)
    ap.add_argument("--metrics-out", default=None)
    ap.add_argument("--saturate", action="store_true")
    ap.add_argument("--saturate-only", action="store_true")
    ap.add_argument("--fill-stream", action="store_true")
    ap.add_argument("--fill", type=int, default=8)
    ap.add_argument("--fill-prompt-words", type=int, default=600)
    ap.add_argument("--fill-max-tokens", type=int, default=400)
    ap.add_argument("--probe-after", type=float, default=0.3)
    ap.add_argument("--low-priority", type=int, default=10)
    ap.add_argument("--high-priority", type=int, default=-10)
    args = ap.parse_args()
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
