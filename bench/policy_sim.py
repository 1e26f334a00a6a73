"""Gateway policies compared in virtual time: FIFO, strict priority, WFQ, kvgate.

Run ``python -m bench.policy_sim [--requests N] [--seed S] [--engines 4]``. Deterministic:
the same arguments print the same numbers. Writes ``bench/results/policy-virtual.json``
(with the command) and, when matplotlib is installed, ``policy-virtual.png`` (TTFT CDFs).

Scenario (see ``bench.sim``): 4 tenants weighted 5/3/1/1 sending equal shares of Poisson
traffic, 70% interactive (prompt U[200, 1000], output U[50, 300] tokens, TTFT SLA 2 s) and
30% batch (prompt U[2000, 8000], output U[200, 1000], SLA 60 s), to 4 engines modelling
Llama-3-8B on an A100-80GB (``bench.engine_model``). The load: a sweep of FIFO runs picks
the lowest rate at which FIFO's interactive P99 TTFT is at least 5× its P50 *and* above
the interactive SLA (i.e. FIFO is contended, not merely bursty).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.sim import CLASSES, Fifo, Gated, GateSettings, Policy, Simulation, summarize, workload

RESULTS = Path(__file__).resolve().parent / "results"
SWEEP_RATES = (10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0)
MAX_IN_FLIGHT = 64  # per engine, for (b) and (c): their only admission gate
TARGETS = {
    "d_vs_a_interactive_p99": 0.2,
    "d_interactive_timeout_rate": 0.02,
    "d_vs_a_batch_throughput": 0.9,
    "d_weighted_share_error": 0.05,
}


def policies(seed: int, aging_s: float = 5.0, watermark: float = 0.8) -> list[Policy]:
    """(a)–(d), with the knobs reported in the JSON."""
    return [
        Fifo(),
        Gated(GateSettings("strict-priority", wfq=False, max_in_flight=MAX_IN_FLIGHT), seed),
        Gated(GateSettings("wfq", bands=False, engine_priority=False,
                           max_in_flight=MAX_IN_FLIGHT), seed),
        Gated(GateSettings("kvgate", aging_s=aging_s, kv_aware=True, high_watermark=watermark,
                           critical_watermark=watermark), seed),
    ]


def run_policy(policy: Policy, requests: int, rate: float, seed: int, engines: int
               ) -> tuple[dict[str, Any], Simulation]:
    sim = Simulation(workload(requests, rate, seed), policy, engines)
    return summarize(sim.run()), sim


def find_load(requests: int, seed: int, engines: int, rates: tuple[float, ...] = SWEEP_RATES
              ) -> tuple[float, list[dict[str, float]]]:
    """The lowest swept rate where FIFO's interactive P99 ≥ 5 × P50 and > the SLA."""
    sweep = []
    for rate in rates:
        stats, _ = run_policy(Fifo(), requests, rate, seed, engines)
        p50, p99 = stats["interactive_ttft_p50_s"], stats["interactive_ttft_p99_s"]
        sweep.append({"rate": rate, "p50": p50, "p99": p99, "ratio": p99 / p50})
        print(f"  sweep: {rate:5.1f} req/s  FIFO interactive P50 {p50:6.3f} s  "
              f"P99 {p99:6.3f} s  ({p99 / p50:4.1f}x)", flush=True)
        if p99 >= 5 * p50 and p99 > CLASSES["interactive"].sla_s:
            return rate, sweep
    return rates[-1], sweep


def check_targets(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    a, d = rows["fifo"], rows["kvgate"]
    measured = {
        "d_vs_a_interactive_p99": d["interactive_ttft_p99_s"] / a["interactive_ttft_p99_s"],
        "d_interactive_timeout_rate": d["interactive_timeout_rate"],
        "d_vs_a_batch_throughput": d["batch_throughput_tok_s"] / a["batch_throughput_tok_s"],
        "d_weighted_share_error": d["weighted_share_error"],
    }
    out = {}
    for name, value in measured.items():
        bound = TARGETS[name]
        ok = value >= bound if name == "d_vs_a_batch_throughput" else value <= bound
        out[name] = {"value": value, "target": bound, "pass": bool(ok and not math.isnan(value))}
    return out


COLUMNS = (("interactive_ttft_p50_s", "int P50 s", "{:.3f}"),
           ("interactive_ttft_p99_s", "int P99 s", "{:.3f}"),
           ("interactive_timeout_rate", "int t/o", "{:.1%}"),
           ("batch_ttft_p99_s", "batch P99 s", "{:.1f}"),
           ("batch_throughput_tok_s", "batch tok/s", "{:.0f}"),
           ("jain", "Jain", "{:.3f}"),
           ("weighted_share_error", "share err", "{:.1%}"),
           ("preemptions", "preempt", "{}"))


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'policy':16}" + "".join(f"{label:>13}" for _, label, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        lines.append(f"{name:16}" + "".join(f"{fmt.format(row[key]):>13}"
                                            for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def plot(sims: dict[str, Simulation], path: Path) -> bool:
    """TTFT CDF per class per policy; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, klass in zip(axes, CLASSES, strict=True):
        for name, sim in sims.items():
            ttfts = sorted(j.ttft for j in sim.jobs if j.klass == klass and j.ttft is not None)
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.plot(ttfts, ys, label=name)
        ax.axvline(CLASSES[klass].sla_s, color="grey", linestyle=":", label="SLA")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, virtual)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{klass} TTFT CDF")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.policy_sim",
                                description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--rate", type=float, default=None, help="skip the sweep, use this req/s")
    p.add_argument("--aging-s", type=float, default=5.0)
    p.add_argument("--watermark", type=float, default=0.8)
    p.add_argument("--out", type=Path, default=RESULTS / "policy-virtual.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    print(f"bench.policy_sim: {args.requests} requests, seed {args.seed}, {args.engines} engines")
    sweep: list[dict[str, float]] = []
    rate = args.rate
    if rate is None:
        rate, sweep = find_load(args.requests, args.seed, args.engines)
    print(f"load: {rate:.1f} req/s (Poisson)")
    rows, sims = {}, {}
    for policy in policies(args.seed, args.aging_s, args.watermark):
        rows[policy.name], sims[policy.name] = run_policy(policy, args.requests, rate,
                                                          args.seed, args.engines)
    print(table(rows))
    targets = check_targets(rows)
    for name, t in targets.items():
        print(f"  {'PASS' if t['pass'] else 'MISS'} {name}: {t['value']:.3f} "
              f"(target {'>=' if name == 'd_vs_a_batch_throughput' else '<='} {t['target']})")
    report = {
        "command": "python -m bench.policy_sim " + shlex.join(argv if argv is not None
                                                              else sys.argv[1:]),
        "requests": args.requests, "seed": args.seed, "engines": args.engines,
        "rate_req_s": rate, "sweep": sweep,
        "knobs": {"max_in_flight_b_c": MAX_IN_FLIGHT, "aging_s_d": args.aging_s,
                  "kv_watermark_d": args.watermark, "scrape_s_d": 0.1},
        "policies": rows, "targets": targets,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    png = args.out.with_suffix(".png")
    print(f"wrote {args.out}" + (f" and {png}" if plot(sims, png) else " (no matplotlib)"))
    print(f"done in {report['seconds']} s")
    return report


def _json_default(value: Any) -> Any:
    return str(value)


if __name__ == "__main__":
    main()
