"""Gateway policies compared in virtual time: FIFO, strict priority, WFQ, kvgate.

Run ``python -m bench.policy_sim [--requests N] [--seed S] [--engines 4]``. Deterministic:
the same arguments print the same numbers. Writes ``bench/results/policy-virtual.json``
(with the command) and, when matplotlib is installed, ``policy-virtual.png`` (TTFT CDFs).

Scenario (see ``bench.sim``): 4 tenants weighted 5/3/1/1 sending equal shares of Poisson
traffic, 70% interactive (prompt U[200, 1000], output U[50, 300] tokens, TTFT SLA 2 s) and
30% batch (prompt U[2000, 8000], output U[200, 1000], SLA 60 s), to 4 engines modelling
Llama-3-8B on an A100-80GB (``extproc.engine.model``). The load: a sweep of FIFO runs picks
the lowest rate at which FIFO's interactive P99 TTFT is at least 5× its P50 *and* above
the interactive SLA (i.e. FIFO is contended, not merely bursty). This **latency scenario**
gives the TTFT, timeout and batch-throughput numbers.

The weighted-share numbers come from a second, **contention scenario**: the same traffic mix
and equal demand per tenant at ``--contention-factor`` (2) × that load, so every tenant's
offered load (a quarter of ~2× capacity) exceeds its weighted share of capacity (at most
5/10) and every tenant stays backlogged. Tokens are counted per tenant as requests enter an
engine's running batch, only inside the loaded window and only while every tenant has work
waiting (``bench.sim.weighted_shares``); the table gives each tenant's share over its weight
share, Jain's index over those ratios, and the largest relative error.

(d) runs kvgate's production knobs: KV watermark 0.8, aging 5 s, a per-endpoint
``max_in_flight`` of 48 of which 12 are ``reserved_in_flight`` for band 0 (batch work may
hold 36), ``prefill_clear_share`` 0.25 (one of four engines) and ``scoring.prefill`` 2
(prefill isolation, see ``extproc.scheduler``). Without the in-flight cap the KV gate
never binds here (the scrape shows only running requests' KV, so work piles up in the
engines' own waiting queues, where WFQ cannot order it). Every request is streamed (kvgate
sees its first token); ``--d-sweep`` reports what other settings give, non-streamed batch
responses included.

Aging 5 s is tuned for the contention scenario: there each free tenant's interactive demand
alone exceeds its weighted share, so shares within 5% need bands to dissolve under sustained
overload (with aging off the error is ~11%). kvgate's shipped default ('auto': half a
class's deadline) instead protects the interactive band (README, "Priority and fair
queueing").
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

from bench.sim import (
    CLASSES,
    TENANTS,
    Fifo,
    Gated,
    GateSettings,
    Policy,
    Simulation,
    summarize,
    workload,
)
from extproc.config import Scoring

RESULTS = Path(__file__).resolve().parent / "results"
SWEEP_RATES = (10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0)
MAX_IN_FLIGHT = 64  # per engine, for (b) and (c): their only admission gate
D_MAX_IN_FLIGHT = 48  # per engine, for (d): on top of the KV watermark
D_RESERVED = 12  # of those, for band 0 only: batch work holds at most 36
D_CLEAR = 0.25  # share of endpoints kept free of batch prefill: 1 of 4
D_SCORING = Scoring(prefill=2.0)  # the rest: kvgate's defaults
CONTENTION_FACTOR = 2.0  # the contention scenario's load, × the latency scenario's
TARGETS = {
    "d_vs_a_interactive_p99": 0.2,
    "d_interactive_timeout_rate": 0.02,
    "d_vs_a_batch_throughput": 0.9,
    "d_weighted_share_error": 0.05,
}


def policies(seed: int, aging_s: float | None = 5.0, watermark: float = 0.8,
             max_in_flight: int | None = D_MAX_IN_FLIGHT) -> list[Policy]:
    """(a)–(d), with the knobs reported in the JSON."""
    return [
        Fifo(),
        Gated(GateSettings("strict-priority", wfq=False, max_in_flight=MAX_IN_FLIGHT), seed),
        Gated(GateSettings("wfq", bands=False, engine_priority=False,
                           max_in_flight=MAX_IN_FLIGHT), seed),
        d_policy(seed, aging_s=aging_s, watermark=watermark, max_in_flight=max_in_flight),
    ]


PREVIOUS = {"max_in_flight": 36, "reserved_in_flight": 0, "prefill_clear_share": 0.0,
            "scoring": Scoring()}  # (d) before prefill isolation
# Alternative settings for (d), all kvgate config knobs (``--d-sweep``).
D_SWEEP: dict[str, dict[str, Any]] = {
    "chosen": {},
    "no prefill isolation (previous d)": PREVIOUS,
    "previous d, no max_in_flight": PREVIOUS | {"max_in_flight": None},
    "scoring.prefill 0": {"scoring": Scoring()},
    "scoring.prefill 1": {"scoring": Scoring(prefill=1.0)},
    "prefill_clear_share 0": {"prefill_clear_share": 0.0},
    "prefill_clear_share 0.5": {"prefill_clear_share": 0.5},
    "reserved_in_flight 0 (cap 48)": {"reserved_in_flight": 0},
    "reserved_in_flight 0, cap 36": {"reserved_in_flight": 0, "max_in_flight": 36},
    "batch not streamed": {"streamed": ("interactive",)},
    "aging 30 s (auto, 60 s deadline)": {"aging_s": 30.0},
    "aging off": {"aging_s": None},
    "previous d, aging off": PREVIOUS | {"aging_s": None},
    "watermark 0.3, no max_in_flight": {"max_in_flight": None, "reserved_in_flight": 0,
                                        "watermark": 0.3},
    "max_waiting 2, no max_in_flight": {"max_in_flight": None, "reserved_in_flight": 0,
                                        "max_waiting": 2},
}


def d_policy(seed: int, aging_s: float | None = 5.0, watermark: float = 0.8,
             max_in_flight: int | None = D_MAX_IN_FLIGHT, scoring: Scoring = D_SCORING,
             max_waiting: int | None = None, reserved_in_flight: int = D_RESERVED,
             prefill_clear_share: float = D_CLEAR,
             streamed: tuple[str, ...] = ("interactive", "batch")) -> Gated:
    reserved = reserved_in_flight if max_in_flight else 0
    return Gated(GateSettings("kvgate", aging_s=aging_s, kv_aware=True, high_watermark=watermark,
                              critical_watermark=watermark, max_in_flight=max_in_flight,
                              scoring=scoring, max_waiting=max_waiting,
                              reserved_in_flight=reserved,
                              prefill_clear_share=prefill_clear_share,
                              streamed=streamed), seed)


def d_sweep(requests: int, rate: float, contention_rate: float, seed: int, engines: int,
            fifo: dict[str, Any]) -> list[dict[str, Any]]:
    """Each ``D_SWEEP`` setting of (d) in both scenarios, against FIFO's latency row."""
    out = []
    for label, knobs in D_SWEEP.items():
        lat, _ = run_policy(d_policy(seed, **knobs), requests, rate, seed, engines)
        con, _ = run_policy(d_policy(seed, **knobs), requests, contention_rate, seed, engines)
        out.append({
            "setting": label,
            "p99_vs_fifo": lat["interactive_ttft_p99_s"] / fifo["interactive_ttft_p99_s"],
            "interactive_timeout_rate": lat["interactive_timeout_rate"],
            "batch_vs_fifo": lat["batch_throughput_tok_s"] / fifo["batch_throughput_tok_s"],
            "contention_share_error": con["weighted_share_error"],
            "contention_jain": con["jain"],
        })
    return out


def sweep_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'(d) setting':34}{'P99/FIFO':>10}{'int t/o':>9}{'batch/FIFO':>12}"
            f"{'share err':>11}{'Jain':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['setting']:34}{r['p99_vs_fifo']:>10.3f}"
                     f"{r['interactive_timeout_rate']:>9.1%}{r['batch_vs_fifo']:>12.3f}"
                     f"{r['contention_share_error']:>11.1%}{r['contention_jain']:>7.3f}")
    return "\n".join(lines)


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


def check_targets(rows: dict[str, dict[str, Any]], contention: dict[str, dict[str, Any]]
                  ) -> dict[str, dict[str, Any]]:
    """Latency targets on the latency scenario; the share target on the contention one."""
    a, d = rows["fifo"], rows["kvgate"]
    measured = {
        "d_vs_a_interactive_p99": d["interactive_ttft_p99_s"] / a["interactive_ttft_p99_s"],
        "d_interactive_timeout_rate": d["interactive_timeout_rate"],
        "d_vs_a_batch_throughput": d["batch_throughput_tok_s"] / a["batch_throughput_tok_s"],
        "d_weighted_share_error": contention["kvgate"]["weighted_share_error"],
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
           ("preemptions", "preempt", "{}"))


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'policy':16}" + "".join(f"{label:>13}" for _, label, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        lines.append(f"{name:16}" + "".join(f"{fmt.format(row[key]):>13}"
                                            for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def share_table(rows: dict[str, dict[str, Any]]) -> str:
    """Per tenant: share of contended tokens over weight share (1 = exactly weighted)."""
    head = (f"{'policy':16}" + "".join(f"{t + ' ' + format(w, 'g'):>13}"
                                       for t, w in TENANTS.items())
            + f"{'Jain':>8}{'share err':>11}{'tokens':>11}")
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        ratios = row["share_ratio"]
        lines.append(f"{name:16}" + "".join(f"{ratios.get(t, math.nan):>13.3f}" for t in TENANTS)
                     + f"{row['jain']:>8.3f}{row['weighted_share_error']:>11.1%}"
                     + f"{row['contended_tokens']:>11}")
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
    p.add_argument("--aging-s", type=float, default=5.0, help="(d)'s aging (0 = off)")
    p.add_argument("--watermark", type=float, default=0.8)
    p.add_argument("--max-in-flight", type=int, default=D_MAX_IN_FLIGHT,
                   help="(d)'s per-endpoint max_in_flight (0 = none)")
    p.add_argument("--contention-factor", type=float, default=CONTENTION_FACTOR,
                   help="the contention scenario's load, × the latency scenario's")
    p.add_argument("--d-sweep", action="store_true",
                   help="also run (d) under other settings and report them")
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
    print(f"latency scenario: {rate:.1f} req/s (Poisson)")
    mif = args.max_in_flight or None
    aging = args.aging_s or None
    rows, sims = {}, {}
    for policy in policies(args.seed, aging, args.watermark, mif):
        rows[policy.name], sims[policy.name] = run_policy(policy, args.requests, rate,
                                                          args.seed, args.engines)
    print(table(rows))
    contention_rate = args.contention_factor * rate
    print(f"contention scenario: {contention_rate:.1f} req/s (Poisson, equal demand), "
          "share of tokens / weight share while every tenant is backlogged")
    contention = {}
    for policy in policies(args.seed, aging, args.watermark, mif):
        contention[policy.name], _ = run_policy(policy, args.requests, contention_rate,
                                                args.seed, args.engines)
    print(share_table(contention))
    sweep_d: list[dict[str, Any]] = []
    if args.d_sweep:
        sweep_d = d_sweep(args.requests, rate, contention_rate, args.seed, args.engines,
                          rows["fifo"])
        print(sweep_table(sweep_d))
    targets = check_targets(rows, contention)
    for name, t in targets.items():
        print(f"  {'PASS' if t['pass'] else 'MISS'} {name}: {t['value']:.3f} "
              f"(target {'>=' if name == 'd_vs_a_batch_throughput' else '<='} {t['target']})")
    report = {
        "command": "python -m bench.policy_sim " + shlex.join(argv if argv is not None
                                                              else sys.argv[1:]),
        "requests": args.requests, "seed": args.seed, "engines": args.engines,
        "rate_req_s": rate, "sweep": sweep,
        "knobs": {"max_in_flight_b_c": MAX_IN_FLIGHT, "max_in_flight_d": mif,
                  "reserved_in_flight_d": D_RESERVED if mif else 0,
                  "prefill_clear_share_d": D_CLEAR, "scoring_d": D_SCORING.model_dump(),
                  "aging_s_d": aging, "kv_watermark_d": args.watermark,
                  "scrape_s_d": 0.1, "streamed": ["interactive", "batch"]},
        "policies": rows,
        "contention": {"rate_req_s": contention_rate, "factor": args.contention_factor,
                       "policies": contention},
        "d_sweep": sweep_d, "targets": targets,
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
