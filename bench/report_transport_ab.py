"""What the Lua meter's report costs Envoy, against other ways to hand kvgate the usage.

    .venv/bin/python -m bench.report_transport_ab [REPEATS] [MODES]

Non-streamed requests, c=16, closed loop, the layout of ``bench.overhead`` (Envoy, engine
and load generator on core 0, the ext_proc on core 1); each repeat runs every mode once,
window by window (3 windows of 2 s after a 2 s warm-up). Modes (default: all):

- ``minimal``: the do-nothing Python ext_proc and no Lua filter (the floor);
- ``kvgate``: as shipped — the Lua meter reads the response and calls kvgate
  (``POST /done/<lease>``), fire and forget, as the response ends;
- ``kvgate_sync``: the same call with the response's end held for kvgate's answer (the
  meter before 2026-12-04);
- ``kvgate_als``: no call; the meter only publishes the usage as dynamic metadata, and
  Envoy's gRPC access log sends every metered request's entry in batches (flushed every
  5 ms or at 16 KiB) to a stand-in receiver (``bench.als_sink``, pinned with the ext_proc:
  its CPU is the ``als`` column). A sketch of a transport, not a working kvgate: kvgate
  never learns the usage in this mode (it charges the reservation);
- ``kvgate_nodone``, ``kvgate_nopublish`` and ``kvgate_noop``: parts of the cost — the
  meter without its report (a lower bound: kvgate charges the reservation), without
  publishing the usage as metadata (the report kept), and a Lua filter that returns at once.

Every variant is made here, in the rendered bootstrap this run uses; nothing in kvgate
changes. Prints one line per mode and repeat, then the sink's count of batches and entries
and its Python time per entry (reading the lease and the usage out of the entry), and
writes the rows to ``/tmp/report-transport-ab.json``. Results:
``bench/results/overhead-report-transport.md``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import sys
from typing import Any

from bench import overhead as o
from extproc.ports import free_port

VARIANTS = ("kvgate_sync", "kvgate_als", "kvgate_nodone", "kvgate_nopublish", "kvgate_noop")
ALL_MODES = ("minimal", "kvgate", *VARIANTS)
DONE_CALL = ("    report(handle, meta, \"done\",\n"
             "           '{\"events\":' .. state.events .. ',\"answered\":' .. "
             "tostring(answered) ..\n"
             "           ',\"usage\":' .. (state.usage or \"null\") .. '}')\n")
PUBLISH_CALL = "    publish(handle, state.usage)\n  end"
ASYNC_CALL = 'handle:httpCall("kvgate_report", headers, body, TIMEOUT_MS, true)'
SYNC_DONE_CALL = 'handle:httpCall("kvgate_report", headers, body, TIMEOUT_MS, what == "first")'
ENTRY = "function envoy_on_response(handle)\n"
ALS_CLUSTER = "als_sink"


def _lua(bootstrap: dict[str, Any]) -> dict[str, Any]:
    for http_filter in o._http_filters(bootstrap):
        if http_filter["name"] == o.METER_FILTER:
            return http_filter["typed_config"]["default_source_code"]
    raise RuntimeError("no Lua meter in the rendered bootstrap")


def _edit(source: dict[str, Any], old: str, new: str) -> None:
    if old not in source["inline_string"]:
        raise RuntimeError(f"meter.lua changed: {old!r} not found")
    source["inline_string"] = source["inline_string"].replace(old, new)


def _access_log(bootstrap: dict[str, Any], port: int) -> None:
    """Every metered request's entry (``kvgate.meter`` set) to the sink, batched."""
    listener = bootstrap["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager.setdefault("access_log", []).append({
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"metadata_filter": {"matcher": {
            "filter": "kvgate", "path": [{"key": "meter"}], "value": {"present_match": True}}}},
        "typed_config": {
            "@type": "type.googleapis.com/"
                     "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "kvgate", "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": ALS_CLUSTER}},
                "buffer_flush_interval": "0.005s", "buffer_size_bytes": 16384}}})
    http2 = {"@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
             "explicit_http_config": {"http2_protocol_options": {}}}
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    bootstrap["static_resources"]["clusters"].append({
        "name": ALS_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": http2},
        "load_assignment": {"cluster_name": ALS_CLUSTER, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": address}}]}]}})


def variant_bootstrap(mode: str, bootstrap: dict[str, Any], sink_port: int) -> dict[str, Any]:
    bootstrap = copy.deepcopy(bootstrap)
    source = _lua(bootstrap)
    if mode == "kvgate_sync":
        _edit(source, ASYNC_CALL, SYNC_DONE_CALL)
    elif mode in ("kvgate_als", "kvgate_nodone"):
        _edit(source, DONE_CALL, "")
        if mode == "kvgate_als":
            _access_log(bootstrap, sink_port)
    elif mode == "kvgate_nopublish":
        _edit(source, PUBLISH_CALL, "  end")
    elif mode == "kvgate_noop":
        _edit(source, ENTRY, ENTRY + "  if true then return end\n")
    return bootstrap


def _sink_counts(port: int) -> list[float]:
    """The sink's messages, entries, entries with usage, and seconds of Python reading them."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
        return [float(n) for n in connection.makefile().readline().split()]


def main(argv: list[str]) -> None:
    repeats = int(argv[0]) if argv else 3
    modes = argv[1].split(",") if len(argv) > 1 else list(ALL_MODES)
    sink_port, stats_port = free_port(), free_port()
    shipped = o.bootstrap_for

    def bootstrap_for(mode: str, config: dict[str, Any], engine: Any) -> dict[str, Any]:
        rendered = shipped(mode, config, engine)
        return variant_bootstrap(mode, rendered, sink_port) if mode in VARIANTS else rendered

    o.bootstrap_for = bootstrap_for
    o.MODES = (*o.MODES, *VARIANTS)
    rows: list[dict[str, Any]] = []
    sink = o.Child("ALS sink", ["-m", "bench.als_sink", "--port", str(sink_port),
                                "--stats-port", str(stats_port)])
    with (o._own_affinity(o.LAYOUTS["split"]["loadgen"]), contextlib.ExitStack() as stack,
          o._runner() as runner):
        sink.start(lambda: o._port_accepts(stats_port))
        stack.callback(sink.stop)
        o.pin(sink.pid, o.LAYOUTS["split"]["ext_proc"])
        gateways = [stack.enter_context(o.gateway(m)) for m in modes]
        for gw in gateways:
            if gw.mode == "kvgate_als":
                gw.pids["als"] = sink.pid
        for _ in range(repeats):
            rows += o._level(runner, gateways, 16, 0, 2.0, 6.0, 3, lambda _line: None)
        messages, entries, with_usage, busy = _sink_counts(stats_port)
    for r in rows:
        cpu = r["cpu_us_per_request"]
        print(f"{r['mode']:14} rps {r['rps']:7.1f} p50 {r['p50_ms']:6.2f} "
              f"envoy {cpu['envoy']:5.0f} ext_proc {cpu.get('ext_proc', 0):5.0f} "
              f"als {cpu.get('als', 0):4.0f} reports {r['reports_per_request']:.2f} "
              f"statuses {dict(r['statuses'])} other {o._other_cores(r):.2f}", flush=True)
    print(f"ALS sink: {messages:.0f} messages, {entries:.0f} entries, {with_usage:.0f} with "
          f"usage ({entries / max(messages, 1):.1f} entries per message; Python reading "
          f"them: {1e6 * busy / max(entries, 1):.1f} µs per entry)")
    with open("/tmp/report-transport-ab.json", "w") as f:
        json.dump({"rows": rows, "sink": {"messages": messages, "entries": entries,
                                          "with_usage": with_usage, "python_s": busy}}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
