"""Does kvgate, on its shipped defaults, order work on one real vLLM better than vLLM's own
priority scheduler? Measured, on the tiny local model (bench/vllm_cpu/README.md).

One vLLM (``--scheduling-policy priority --max-num-seqs 4``, KV bounded with
``--num-gpu-blocks-override``) per KV setting; every config runs against that same server:

- ``vllm-equal``     straight to vLLM, no ``priority`` field (all equal);
- ``vllm-priority``  straight to vLLM, ``priority`` in the body: interactive 0, batch 1;
- ``kvgate``         through the real Envoy + kvgate on its **shipped defaults**: the config
                     holds only the workload (one tenant, classes interactive (0) / batch (1)
                     chosen by the ``x-request-class`` header, one pool with the vLLM endpoint,
                     ``priority_scheduling: true``, the model name); kvgate injects the
                     priority itself.

One run (the same schedule for every config): ``--batch`` long non-streamed batch requests
(~50-word prompts, distinct first words, ``--batch-max-tokens``, ``ignore_eos``) at t=0, then
``--interactive`` short streamed interactive requests (``--interactive-max-tokens``) at
``--interactive-at`` seconds, when vLLM's 4 sequences are full. Per run: the interactive
TTFTs (median of them), the batch wall time (first send to last batch response), and
``vllm:num_preemptions_total``'s delta from vLLM's /metrics. Configs are interleaved across
``--reps`` repetitions. kvgate and Envoy live as long as the vLLM server (started once per
KV setting), as they would in production; kvgate's own /metrics (fair-queue waits) are
read before and after each of its runs.

Run it (both settings, ~8 min on 2 cores; each setting can be run alone and is merged into
the JSON)::

    .venv/bin/python -m bench.vllm_cpu.priority_proof [--settings main,small] [--reps 6]

Writes bench/results/vllm-priority.json and .md (the table, the targets, the command).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.vllm_cpu.launch import (
    SERVED_MODEL_NAME,
    VllmServer,
    default_vllm_cpus,
    missing,
    parse_cpus,
    pin_harness,
)

CONFIGS = ("vllm-equal", "vllm-priority", "kvgate")
PRIORITY = {"interactive": 0, "batch": 1}
KEY = "sk-priority-proof"
MAX_NUM_SEQS = 4
# KV settings: "main" holds the 4 running batch sequences at full length
# (4 x ceil(1560/128) = 52 blocks + the null block, with a little room); "small" holds ~1.5
# of them, so vLLM alone must preempt.
SETTINGS = {"main": {"num_gpu_blocks": 60, "reps": 6},
            "small": {"num_gpu_blocks": 20, "reps": 3, "configs": ("vllm-priority", "kvgate")}}
# all in the tiny model's vocabulary (make_tiny_model.WORDS): no <unk>
WORDS = "the dog run to the big house and the cat sit on the red box while the sun is over the sea"
WORDS_LIST = WORDS.split()


def prompt(i: int, words: int = 50) -> str:
    """~``words`` words of the tiny model's vocabulary, distinct from the first word on
    (the digits of ``i``), so vLLM's prefix cache shares nothing between requests."""
    head = " ".join(str(i))
    body = [WORDS_LIST[(i + k) % len(WORDS_LIST)] for k in range(words - len(str(i)))]
    return f"{head} {' '.join(body)}"


def body(kind: str, config: str, i: int, max_tokens: int) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": prompt(i) if kind == "batch"
                      else f"{' '.join(str(i))} hello there how are you"}],
        "max_tokens": max_tokens, "ignore_eos": True,
    }
    if kind == "interactive":
        b |= {"stream": True}
    if config == "vllm-priority":
        b["priority"] = PRIORITY[kind]
    return b


def vllm_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("vllm:num_preemptions_total", "vllm:num_requests_running",
                          "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def kvgate_metrics(text: str) -> dict[str, float]:
    """Fair-queue figures: how many requests waited in kvgate's queue, per class, and for how
    long in all; dispatches from the queue; admissions."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvgate_queue_wait_seconds_count":
                out[f"queued_{s.labels['class']}"] = s.value
            elif s.name == "kvgate_queue_wait_seconds_sum":
                out[f"queued_s_{s.labels['class']}"] = s.value
            elif s.name == "kvgate_queue_events_total":
                out[f"queue_{s.labels['event']}"] = s.value
            elif s.name == "kvgate_requests_total":
                outcome = s.labels["decision"] if s.labels["decision"] == "admitted" else (
                    s.labels["reason"])
                out[f"decision_{outcome}"] = out.get(f"decision_{outcome}", 0.0) + s.value
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


async def _get(client: httpx.AsyncClient, url: str) -> str:
    r = await client.get(url, timeout=30)
    r.raise_for_status()
    return r.text


async def wait_idle(client: httpx.AsyncClient, vllm_url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = vllm_metrics(await _get(client, vllm_url + "/metrics"))
        if not m.get("vllm:num_requests_running") and not m.get("vllm:num_requests_waiting"):
            return
        await asyncio.sleep(0.5)
    raise TimeoutError("vLLM did not go idle")


async def one_run(config: str, vllm_url: str, gateway_url: str | None, admin_url: str | None,
                  args: argparse.Namespace, seq: int) -> dict[str, Any]:
    """One repetition of the schedule against ``config``; ``seq`` makes prompts unique."""
    url = (gateway_url if config == "kvgate" else vllm_url) + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10), limits=limits) as c:
        await wait_idle(c, vllm_url)
        await asyncio.sleep(args.settle)
        before = vllm_metrics(await _get(c, vllm_url + "/metrics"))
        kv_before = kvgate_metrics(await _get(c, admin_url + "/metrics")) if (
            config == "kvgate" and admin_url) else {}

        def headers(kind: str) -> dict[str, str]:
            if config != "kvgate":
                return {}
            return {"authorization": f"Bearer {KEY}", "x-request-class": kind}

        t0 = time.monotonic()

        async def batch(i: int) -> dict[str, Any]:
            r = await c.post(url, json=body("batch", config, seq * 1000 + i,
                                            args.batch_max_tokens), headers=headers("batch"))
            done = time.monotonic() - t0
            usage = r.json().get("usage", {}) if r.status_code == 200 else {}
            return {"status": r.status_code, "done_s": done,
                    "completion_tokens": usage.get("completion_tokens"),
                    "error": None if r.status_code == 200 else r.text[:300]}

        async def interactive(i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + args.interactive_at - time.monotonic()))
            sent = time.monotonic()
            ttft, chunks, status = None, 0, None
            async with c.stream("POST", url, json=body("interactive", config,
                                                       seq * 1000 + 500 + i,
                                                       args.interactive_max_tokens),
                                headers=headers("interactive")) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[6:]).get("choices") or []
                    if any((ch.get("delta") or {}).get("content") for ch in choices):
                        chunks += 1
                        if ttft is None:
                            ttft = time.monotonic() - sent
            return {"status": status, "ttft_s": ttft, "sent_s": sent - t0,
                    "done_s": time.monotonic() - t0, "content_chunks": chunks}

        async def sample_at_send() -> dict[str, float]:
            await asyncio.sleep(max(0.0, t0 + args.interactive_at - time.monotonic()))
            return vllm_metrics(await _get(c, vllm_url + "/metrics"))

        tasks = [asyncio.create_task(batch(i)) for i in range(args.batch)]
        itasks = [asyncio.create_task(interactive(i)) for i in range(args.interactive)]
        at_send = asyncio.create_task(sample_at_send())
        batches = await asyncio.gather(*tasks)
        inter = await asyncio.gather(*itasks)
        at_send_m = await at_send
        await wait_idle(c, vllm_url)
        after = vllm_metrics(await _get(c, vllm_url + "/metrics"))
        kv_after = kvgate_metrics(await _get(c, admin_url + "/metrics")) if (
            config == "kvgate" and admin_url) else {}
    ttfts = [x["ttft_s"] for x in inter if x["ttft_s"] is not None]
    ok = all(b["status"] == 200 for b in batches) and all(x["status"] == 200 for x in inter)
    return {
        "config": config, "ok": ok,
        "interactive_ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "interactive_ttfts_s": ttfts,
        "batch_wall_s": max(b["done_s"] for b in batches),
        "preemptions": after.get("vllm:num_preemptions_total", 0)
        - before.get("vllm:num_preemptions_total", 0),
        "vllm_at_interactive_send": {"running": at_send_m.get("vllm:num_requests_running"),
                                     "waiting": at_send_m.get("vllm:num_requests_waiting"),
                                     "kv_usage": at_send_m.get("vllm:kv_cache_usage_perc")},
        "kvgate": _delta(kv_after, kv_before) if config == "kvgate" else None,
        "batch": batches, "interactive": inter,
    }


def kvgate_config(vllm_port: int, known_seqs: bool = False):  # type: ignore[no-untyped-def]
    """Only the workload: every scheduling and admission knob is the config model's default.
    (Ports are not knobs: free ones, so nothing here collides with a running stack.)
    ``known_seqs``: the pool is told vLLM's --max-num-seqs (``max_num_seqs``, not a default)."""
    from extproc.config import hash_api_key, parse_config
    from extproc.ports import free_port

    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"default": {}},
        "classes": {"interactive": {"priority": PRIORITY["interactive"]},
                    "batch": {"priority": PRIORITY["batch"]}},
        "tenants": [{"name": "proof", "tier": "default", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "vllm", "endpoints": [f"127.0.0.1:{vllm_port}"],
                   "priority_scheduling": True, "models": [{"name": SERVED_MODEL_NAME}],
                   **({"max_num_seqs": MAX_NUM_SEQS} if known_seqs else {})}],
    })


@contextlib.contextmanager
def gateway(vllm_port: int, known_seqs: bool = False) -> Iterator[tuple[Any, str, str]]:
    """kvgate (in this process, in-memory limits) + the real Envoy in front of the vLLM."""
    from extproc.demo import ServerThread
    from extproc.envoy_proc import EnvoyProcess

    config = kvgate_config(vllm_port, known_seqs)
    kvgate = ServerThread(config).start()
    try:
        with EnvoyProcess(config) as envoy:
            admin = f"http://{config.server.admin_host}:{kvgate.server.admin_port}"
            try:
                yield kvgate, envoy.url, admin
            except (httpx.ConnectError, httpx.ConnectTimeout):
                # the gateway stopped answering: say whether Envoy is still there, and why not
                code = envoy.process.poll() if envoy.process else None
                print(f"Envoy at {envoy.url}: exit code {code}\n{envoy.log_tail(60)}",
                      file=sys.stderr, flush=True)
                raise
    finally:
        kvgate.stop()


def seq_caps(kvgate: Any) -> dict[str, Any]:
    """kvgate's per-endpoint scheduler state after a run (the engine idle by then): the
    learned sequence limit, and the counters that should all be back at 0."""
    out: dict[str, Any] = {}
    for flow in kvgate.server.director.flows.values():
        sch = flow.scheduler
        out |= {"seq_caps": dict(sch.seq_caps), "in_flight": dict(sch.in_flight),
                "unstarted": dict(sch.unstarted), "low_prefills": dict(sch.low_prefills),
                "prefill_tokens": dict(sch.prefill_tokens),
                "reservations": len(sch.reservations), "queued": len(flow.queue)}
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float | None]:
        vals = [r[key] for r in runs if r[key] is not None]
        if not vals:
            return {"median": None, "min": None, "max": None}
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    return {"runs": len(runs), "all_ok": all(r["ok"] for r in runs),
            "interactive_ttft_s": stat("interactive_ttft_median_s"),
            "batch_wall_s": stat("batch_wall_s"), "preemptions": stat("preemptions")}


def targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    main = results.get("main", {}).get("summary", {})

    def med(cfg: str, key: str) -> float | None:
        return (main.get(cfg) or {}).get(key, {}).get("median")

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    for name, num, den, limit in (
        ("interactive TTFT kvgate / vllm-priority", ("kvgate", "interactive_ttft_s"),
         ("vllm-priority", "interactive_ttft_s"), 0.5),
        ("interactive TTFT kvgate / vllm-equal", ("kvgate", "interactive_ttft_s"),
         ("vllm-equal", "interactive_ttft_s"), 0.15),
        ("batch wall kvgate / vllm-priority", ("kvgate", "batch_wall_s"),
         ("vllm-priority", "batch_wall_s"), 1.2),
    ):
        value = ratio(med(*num), med(*den))
        if value is not None:
            out[name] = {"value": value, "target": f"<= {limit}", "pass": value <= limit}
    small = results.get("small", {}).get("runs", {}).get("kvgate")
    if small:
        # a run whose batch requests were refused never loaded the KV cache: its preemption
        # count proves nothing, so only complete runs count, and any failed run is a MISS
        complete = [r["preemptions"] for r in small if r["ok"]]
        value = statistics.median(complete) if complete else None
        out["small KV: preemptions per run through kvgate (median of complete runs)"] = {
            "value": value, "target": "<= 1, every run complete",
            "pass": value is not None and value <= 1 and len(complete) == len(small),
            "complete_runs": len(complete), "runs": len(small)}
    for setting, res in results.items():
        failed = [r for rs in res["runs"].values() for r in rs if not r["ok"]]
        if failed:
            out[f"{setting} KV: runs with refused or failed requests"] = {
                "value": len(failed), "target": "0", "pass": False,
                "configs": sorted({r["config"] for r in failed})}
    return out


def _f(v: float | None, d: int = 2) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def table(results: dict[str, Any], checks: dict[str, Any]) -> str:
    lines = ["| KV setting | config | runs | interactive TTFT s, median (min–max) | "
             "batch wall s, median (min–max) | preemptions/run, median (min–max) |",
             "|---|---|---|---|---|---|"]
    for setting, res in results.items():
        for cfg, s in res["summary"].items():
            t, w, p = s["interactive_ttft_s"], s["batch_wall_s"], s["preemptions"]
            lines.append(
                f"| {setting} ({res['num_gpu_blocks']} blocks) | {cfg} | {s['runs']}"
                f"{'' if s['all_ok'] else ' (errors)'} | {_f(t['median'])} "
                f"({_f(t['min'])}–{_f(t['max'])}) | {_f(w['median'])} ({_f(w['min'])}–"
                f"{_f(w['max'])}) | {_f(p['median'], 1)} ({_f(p['min'], 0)}–{_f(p['max'], 0)}) |")
    lines += ["", "| target | value | limit | result |", "|---|---|---|---|"]
    for name, c in checks.items():
        lines.append(f"| {name} | {_f(c['value'], 3)} | {c['target']} | "
                     f"{'PASS' if c['pass'] else 'MISS'} |")
    return "\n".join(lines)


def run_setting(name: str, blocks: int, configs: tuple[str, ...], reps: int,
                args: argparse.Namespace) -> dict[str, Any]:
    log = Path(args.log_dir) / f"vllm-priority-{name}.log"
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    caps: list[dict[str, int]] = []
    with VllmServer("priority", num_gpu_blocks=blocks, max_num_seqs=MAX_NUM_SEQS,
                    max_model_len=args.max_model_len, log_path=log,
                    startup_timeout=args.startup_timeout, cpus=args.vllm_cpus) as srv:
        print(f"[{name}] vLLM healthy at {srv.url} after {srv.start_seconds:.1f}s "
              f"({blocks} blocks; log {log})", flush=True)
        with gateway(srv.port, args.known_seqs) as (kvgate, gw_url, admin_url):
            time.sleep(1.0)  # a few scrape rounds: kvgate sees the engine fresh
            # warm-up: one request each way (first requests after start are slower)
            with httpx.Client(timeout=120) as c:
                for cfg in ("vllm-equal", "kvgate"):
                    u = (gw_url if cfg == "kvgate" else srv.url) + "/v1/chat/completions"
                    h = {"authorization": f"Bearer {KEY}", "x-request-class": "interactive"}
                    c.post(u, json=body("interactive", "vllm-equal", 999_999, 8) | {
                        "stream": False}, headers=h if cfg == "kvgate" else {})
            seq = 0
            for rep in range(reps):
                order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                for cfg in order:
                    seq += 1
                    r = asyncio.run(one_run(cfg, srv.url, gw_url, admin_url, args, seq))
                    r["rep"] = rep
                    runs[cfg].append(r)
                    extra = f" kvgate {r['kvgate']}" if r["kvgate"] is not None else ""
                    print(f"[{name}] rep {rep} {cfg:<13} ok={r['ok']} "
                          f"TTFT med {_f(r['interactive_ttft_median_s'])} s "
                          f"{[round(x, 2) for x in r['interactive_ttfts_s']]} "
                          f"batch wall {r['batch_wall_s']:.2f} s "
                          f"preempt {r['preemptions']:.0f} "
                          f"at-send {r['vllm_at_interactive_send']}{extra}", flush=True)
                    if cfg == "kvgate":
                        caps.append(seq_caps(kvgate))
                    # every run as it ends, so a run cut short by a timeout keeps its data
                    partial = Path(args.out).with_suffix(f".partial-{name}.json")
                    partial.write_text(json.dumps({"num_gpu_blocks": blocks, "runs": runs}))
            with httpx.Client(timeout=10) as c:
                queues = c.get(admin_url + "/debug/queues").json()
    return {"num_gpu_blocks": blocks, "kv_tokens": blocks * 128, "reps": reps,
            "vllm_start_s": srv.start_seconds, "kvgate_state_after_each_run": caps,
            "kvgate_debug_queues_at_end": queues,
            "summary": {c: summarize(rs) for c, rs in runs.items()}, "runs": runs}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_cpu.priority_proof",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="main,small")
    p.add_argument("--reps", type=int, default=None, help="override each setting's reps")
    p.add_argument("--main-blocks", type=int, default=SETTINGS["main"]["num_gpu_blocks"])
    p.add_argument("--small-blocks", type=int, default=SETTINGS["small"]["num_gpu_blocks"])
    p.add_argument("--configs", default=None, help="override: comma-separated configs")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--batch-max-tokens", type=int, default=1500)
    p.add_argument("--interactive", type=int, default=4)
    p.add_argument("--interactive-max-tokens", type=int, default=16)
    p.add_argument("--interactive-at", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--settle", type=float, default=1.0, help="idle seconds before a run")
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--log-dir", default="/tmp/kvgate-vllm-priority")
    p.add_argument("--out", default="bench/results/vllm-priority.json")
    p.add_argument("--vllm-cpus", type=parse_cpus, default=default_vllm_cpus(),
                   help="cores for vLLM (comma-separated, or 'all'); this process, Envoy and "
                        "kvgate get the others. Default: the first half (core 0 of 2)")
    p.add_argument("--known-seqs", action="store_true",
                   help="tell kvgate's pool vLLM's --max-num-seqs (max_num_seqs) instead of "
                        "leaving it to learn it: not the shipped defaults")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = "python -m bench.vllm_cpu.priority_proof " + " ".join(
        sys.argv[1:] if argv is None else argv)
    why = missing()
    if why:
        print(f"real vLLM not available: {why}", file=sys.stderr)
        return 2
    harness_cpus = pin_harness(args.vllm_cpus)
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    results: dict[str, Any] = dict(previous.get("settings", {}))
    commands: dict[str, str] = dict(previous.get("commands", {}))
    settings = [n for n in args.settings.split(",") if n]  # none: rewrite the report only
    for name in settings:
        spec = SETTINGS[name]
        blocks = args.main_blocks if name == "main" else args.small_blocks
        configs = tuple(args.configs.split(",")) if args.configs else spec.get("configs",
                                                                                 CONFIGS)
        results[name] = run_setting(name, blocks, configs, args.reps or spec["reps"], args)
        commands[name] = cmd
    checks = targets(results)
    text = table(results, checks)
    print("\n" + text)
    schedule = {k: getattr(args, k) for k in ("batch", "batch_max_tokens", "interactive",
                                              "interactive_max_tokens", "interactive_at",
                                              "max_model_len", "settle")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"commands": commands, "schedule": schedule,
                               "max_num_seqs": MAX_NUM_SEQS,
                               "cpus": {"vllm": sorted(args.vllm_cpus or []) or "all",
                                        "gateway_and_client": sorted(harness_cpus or [])
                                        or "all"},
                               "kvgate": ("shipped defaults + pool max_num_seqs"
                                          if args.known_seqs else "shipped defaults"),
                               "targets": checks, "settings": results}, indent=1) + "\n")
    md = out.with_suffix(".md")
    md.write_text("# kvgate vs vLLM's priority scheduler, one real vLLM (vllm-cpu 0.32)\n\n"
                  + "Commands:\n\n" + "".join(f"    .venv/bin/{c}   # {n}\n"
                                              for n, c in commands.items())
                  + f"\nSchedule: {json.dumps(schedule)}; --max-num-seqs {MAX_NUM_SEQS}; "
                  + f"vLLM on cores {sorted(args.vllm_cpus or []) or 'all'}, the gateway "
                  + f"and the client on {sorted(harness_cpus or []) or 'all'}.\n\n"
                  + text + "\n")
    for name in settings:
        out.with_suffix(f".partial-{name}.json").unlink(missing_ok=True)
    print(f"wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
