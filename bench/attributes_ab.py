"""The headers phase against ``envoy.request_attributes``, same run, interleaved.

    .venv/bin/python -m bench.attributes_ab MODES LEVEL TOKENS REPEATS [overload|overload,bigbody]

e.g. ``minimal,kvgate_headers,kvgate 16 0 3`` (admitted, non-streamed; ``kvgate`` is the
shipped ``request_attributes: true``), ``... 16 64 2`` (streamed 64 tokens),
``kvgate_headers,kvgate 16 0 3 overload`` (the tenant's limit is 5
requests/s: ~99% refused 429), ``overload,bigbody`` (and a 24 KB prompt). Each repeat runs
every mode once, window by window, as ``bench.overhead`` does (3 windows of 2 s, 2 s
warm-up). Prints one line per mode and repeat; writes the rows to
``/tmp/attributes-ab-LEVEL-TOKENS-CASE.json``. Results: ``bench/results/overhead-attributes.md``.
"""

from __future__ import annotations

import contextlib
import json
import sys

from bench import overhead as o


def main(argv: list[str]) -> None:
    modes, level, tokens, repeats = argv[0].split(","), int(argv[1]), int(argv[2]), int(argv[3])
    case = argv[4] if len(argv) > 4 else ""
    if "overload" in case:
        o.LIMITS = {**o.LIMITS, "requests_per_second": 5, "request_burst": 5}
    if "bigbody" in case:
        big = json.dumps({"model": o.MODEL, "max_tokens": o.MAX_TOKENS, "stream": False,
                          "messages": [{"role": "user", "content": "hello " * 4000}]}).encode()
        o.BODY = big
        o.request_body = lambda _tokens: big
    rows = []
    with (o._own_affinity(o.LAYOUTS["split"]["loadgen"]), contextlib.ExitStack() as stack,
          o._runner() as runner):
        paced = o.STREAM_MS_PER_TOKEN if tokens else 0
        gateways = [stack.enter_context(o.gateway(m, ms_per_token=paced)) for m in modes]
        for _ in range(repeats):
            rows += o._level(runner, gateways, level, tokens, 2.0, 6.0, 3, lambda _line: None)
    for r in rows:
        cpu = r["cpu_us_per_request"]
        print(f"{r['mode']:14} rps {r['rps']:7.1f} p50 {r['p50_ms']:7.2f} "
              f"ttft {r['ttft_p50_ms']:6.2f} ext_proc {cpu.get('ext_proc', 0):6.0f} "
              f"envoy {cpu['envoy']:6.0f} msgs {r['messages_per_request']:.2f} "
              f"statuses {r['statuses']} other {o._other_cores(r):.2f}", flush=True)
    out = f"/tmp/attributes-ab-{level}-{tokens}-{case or 'plain'}.json"
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1:])
