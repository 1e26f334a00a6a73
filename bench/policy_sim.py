"""Gateway policies compared in virtual time: FIFO, strict priority, WFQ, kvgate as shipped.

Run ``python -m bench.policy_sim [--requests N] [--seed S] [--mix 0.7]`` for one workload, or
``python -m bench.policy_sim --matrix`` for every cell of seeds 1–10 × loads {0.8, 1.0, 1.25}
× the FIFO knee × mixes {70/30, 50/50} interactive/batch (``--jobs`` processes). Each cell is
deterministic: the same arguments print the same numbers. Writes
``bench/results/policy-virtual.json`` (or ``policy-matrix.json``, with every cell), the command
that produced it, and a PNG when matplotlib is installed.

``--variant '{"prefill_clear_hold_s": 2}' --against bench/results/policy-matrix.json`` reruns
only kvgate, with those pool settings on top of its defaults (not what ships), on every cell
of a recorded matrix, against that record's FIFO and strict-priority rows, knees and rates:
a change to the scheduler is measured on the same cells in a quarter of the time.

``--asks ceiling`` gives every request its class's largest output as ``max_tokens`` (300
interactive, 1,000 batch) while its answer keeps its drawn length: clients that ask one fixed
``max_tokens`` and get shorter answers, which kvgate reserves by ``max_tokens`` and charges by
what its tenant's answers are expected to use. The default (``used``) asks what each answer
makes.

Scenario (see ``bench.sim``): 4 tenants weighted 5/3/1/1 sending equal shares of Poisson
traffic, ``--mix`` of it interactive (prompt U[200, 1000], output U[50, 300] tokens, TTFT SLA
2 s), the rest batch (prompt U[2000, 8000], output U[200, 1000], SLA 60 s), to 4 engines
modelling Llama-3-8B on an A100-80GB (``extproc.engine.model``), run with vLLM's priority
scheduling. **The knee**: the lowest swept rate (1.5–15 req/s per engine, 2 req/s apart) at
which FIFO's interactive P99 TTFT is at least 5× its P50 *and* above the SLA. The **latency
scenario** runs at ``--load`` × the knee and gives the TTFT, timeout and batch-throughput
numbers.

The weighted-share numbers come from a second, **contention scenario**: the same traffic at
``--contention-factor`` (4) × the latency scenario's rate, and at least 3.2× the knee (the
matrix's lowest load × 4), so that every tenant's demand (a quarter of it) exceeds its
weighted share of what the pool can serve — platinum's is half. At 2× the knee it did not:
half of 2× the knee is below half of the pool's real capacity, so platinum was rightly
served all it asked and the others split the rest. (Without the floor, a latency scenario
at 0.3× the knee measured share errors of 70–210%: platinum got 0.44–0.75 of its weighted
share under every policy, FIFO's ~0.5 being its demand.) Tokens are counted
per tenant as requests enter an engine's running batch, priced as kvgate's fair order prices
them (prompt 1, output 2), only inside the loaded window and only while every tenant has work
waiting (``bench.sim.weighted_shares``); the table gives each tenant's share over its weight
share, Jain's index over those ratios, and the largest relative error. The contention
scenario is twice as long (in requests): a share is a long-run property, and in the window
of a 2000-request run one batch request of a weight-1 tenant is ~5% of its share.

(d) is kvgate **as shipped**: ``bench.sim.kvgate_config`` describes only the workload (the
tenants and their weights, the two classes, four priority-scheduled endpoints) and every
scheduling and admission knob is the config model's default. (b) and (c) are the textbook
policies in front of the same engines, each with a per-endpoint in-flight cap of 64 as its
only gate. Every request is streamed (kvgate sees its first token).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.sim import (
    ASKS,
    CLASSES,
    TENANTS,
    Fifo,
    Gated,
    GateSettings,
    Policy,
    Simulation,
    defaults,
    summarize,
    workload,
)

RESULTS = Path(__file__).resolve().parent / "results"
# the knee sweep: from 1.5 to 15 req/s per engine, 2 req/s apart (4 engines: 6, 8, …, 60), so
# that a pool of any size is swept from below its knee (a fixed 6–30 req/s put 2 engines' knee
# at the top, 5× past it, and 8 engines' below it); finer steps than 2 can miss less of the
# knee's narrow band (P99 ≥ 5× P50 while above the SLA), coarser ones skipped it at 8 engines
SWEEP_PER_ENGINE, SWEEP_STEP = (1.5, 15.0), 2.0


def sweep_rates(engines: int) -> tuple[float, ...]:
    low, high = (engines * r for r in SWEEP_PER_ENGINE)
    return tuple(low + SWEEP_STEP * k for k in range(int((high - low) / SWEEP_STEP) + 1))
MAX_IN_FLIGHT = 64  # per engine, for (b) and (c): their only admission gate
CONTENTION_FACTOR = 4.0  # the contention scenario's load, × the latency scenario's
# … and at least this × the knee (the matrix's lowest load × the factor), so that every
# tenant's demand exceeds its weighted share whatever the latency scenario's load
CONTENTION_MIN_KNEES = 3.2
CONTENTION_LENGTH = 2  # and its length in requests, × the latency scenario's
MATRIX_SEEDS = tuple(range(1, 11))
MATRIX_LOADS = (0.8, 1.0, 1.25)
MATRIX_MIXES = (0.7, 0.5)
# What every cell must show ((d) against the others in the same cell).
CONTENDED_WORST, CONTENDED_MEDIAN = 0.35, 0.2  # (d) P99 / FIFO's where FIFO is contended
UNCONTENDED_MAX = 1.1  # (d) P99 / FIFO's where it is not: no harm
VS_STRICT_MAX = 1.2  # (d) P99 / strict priority's
TIMEOUT_MAX = 0.01  # (d) interactive requests over their SLA
BATCH_MIN = 0.95  # (d) batch throughput / FIFO's
SHARE_ERROR_MAX, JAIN_MIN = 0.05, 0.98  # contention scenario


def policies(seed: int) -> list[Policy]:
    """(a)–(d); (d) on kvgate's shipped defaults."""
    return [
        Fifo(),
        Gated(GateSettings("strict-priority", wfq=False, max_in_flight=MAX_IN_FLIGHT), seed),
        Gated(GateSettings("wfq", bands=False, engine_priority=False,
                           max_in_flight=MAX_IN_FLIGHT), seed),
        Gated(defaults(), seed),
    ]


def run_policy(policy: Policy, requests: int, rate: float, seed: int, engines: int,
               mix: float = 0.7, asks: str = "used") -> tuple[dict[str, Any], Simulation]:
    sim = Simulation(workload(requests, rate, seed, interactive=mix, asks=asks), policy,
                     engines)
    return summarize(sim.run()), sim


def find_load(requests: int, seed: int, engines: int, mix: float = 0.7,
              rates: tuple[float, ...] | None = None, quiet: bool = False, asks: str = "used"
              ) -> tuple[float, list[dict[str, float]]]:
    """The knee: the lowest swept rate (default: :func:`sweep_rates`) where FIFO's
    interactive P99 ≥ 5 × P50 and > SLA. A steep pool can step over that band (8 engines,
    seed 31: P99 6.3× P50 at 1.86 s, then 4.9× at 2.15 s): then the lowest rate where
    P99 > SLA, or the top (either way the sweep's last entry has ``knee`` false)."""
    sweep: list[dict[str, float]] = []
    for rate in rates or sweep_rates(engines):
        stats, _ = run_policy(Fifo(), requests, rate, seed, engines, mix, asks)
        p50, p99 = stats["interactive_ttft_p50_s"], stats["interactive_ttft_p99_s"]
        knee = p99 >= 5 * p50 and p99 > CLASSES["interactive"].sla_s
        sweep.append({"rate": rate, "p50": p50, "p99": p99, "ratio": p99 / p50, "knee": knee})
        if not quiet:
            print(f"  sweep: {rate:5.1f} req/s  FIFO interactive P50 {p50:6.3f} s  "
                  f"P99 {p99:6.3f} s  ({p99 / p50:4.1f}x)", flush=True)
        if knee:
            return rate, sweep
    late = [s for s in sweep if s["p99"] > CLASSES["interactive"].sla_s]
    return (late[0] if late else sweep[-1])["rate"], sweep


def contention_rate(rate: float, knee: float | None,
                    factor: float = CONTENTION_FACTOR) -> float:
    """The contention scenario's rate: ``factor`` × the latency scenario's, and at least
    ``CONTENTION_MIN_KNEES`` × the knee when it is known. Below that (a latency scenario at
    0.3× the knee gives 1.2× it) the heavy tenants' demand falls short of their weighted
    share, so their shares measure what they asked for, not the scheduler."""
    return max(factor * rate, CONTENTION_MIN_KNEES * knee if knee else 0.0)


def run_cell(requests: int, rate: float, seed: int, engines: int, mix: float,
             contention: float | None = None, asks: str = "used"
             ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]],
                        dict[str, Simulation]]:
    """Every policy in the latency scenario (``rate``) and in the contention scenario
    (``contention`` req/s; default: :func:`contention_rate` without a knee)."""
    rows, shares, sims = {}, {}, {}
    for policy in policies(seed):
        rows[policy.name], sims[policy.name] = run_policy(policy, requests, rate, seed,
                                                          engines, mix, asks)
    busy = contention or contention_rate(rate, None)
    for policy in policies(seed):
        shares[policy.name], _ = run_policy(policy, CONTENTION_LENGTH * requests, busy, seed,
                                            engines, mix, asks)
    return rows, shares, sims


def fifo_contended(fifo: dict[str, Any], sla_s: float) -> bool:
    """FIFO's interactive tail is contended: its P99 at least 5× its P50, or past the SLA
    (unknown: contended). Below that, 0.3× of FIFO's P99 can be less than an idle engine's
    first token, and the bound is no harm (``UNCONTENDED_MAX``)."""
    p50, p99 = fifo["interactive_ttft_p50_s"], fifo["interactive_ttft_p99_s"]
    if p99 is None:
        return True
    return (p50 is not None and p99 >= 5 * p50) or p99 > sla_s


def check_cell(rows: dict[str, dict[str, Any]], contention: dict[str, dict[str, Any]]
               ) -> dict[str, Any]:
    """(d)'s ratios in one cell and which of the must-show bounds they meet."""
    a, b, d = rows["fifo"], rows["strict-priority"], rows["kvgate"]
    contended = fifo_contended(a, CLASSES["interactive"].sla_s)
    share = contention["kvgate"]
    ratios = {
        "p99_vs_fifo": d["interactive_ttft_p99_s"] / a["interactive_ttft_p99_s"],
        "p99_vs_strict": d["interactive_ttft_p99_s"] / b["interactive_ttft_p99_s"],
        "interactive_timeout_rate": d["interactive_timeout_rate"],
        "batch_vs_fifo": d["batch_throughput_tok_s"] / a["batch_throughput_tok_s"],
        "share_error": share["weighted_share_error"],
        "jain": share["jain"],
    }
    passes = {
        "p99_vs_fifo": (ratios["p99_vs_fifo"] <= CONTENDED_WORST if contended
                        else ratios["p99_vs_fifo"] <= UNCONTENDED_MAX),
        "p99_vs_strict": ratios["p99_vs_strict"] <= VS_STRICT_MAX,
        "interactive_timeout_rate": ratios["interactive_timeout_rate"] <= TIMEOUT_MAX,
        "batch_vs_fifo": ratios["batch_vs_fifo"] >= BATCH_MIN,
        "share_error": ratios["share_error"] <= SHARE_ERROR_MAX,
        "jain": ratios["jain"] >= JAIN_MIN,
    }
    return {"fifo_contended": contended, **ratios,
            "pass": {k: bool(v) for k, v in passes.items()}}


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
    plt = _pyplot()
    if plt is None:
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


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# -- the matrix ------------------------------------------------------------------------------


def matrix_knee(job: tuple[int, int, int, float, str]) -> tuple[int, float, float, bool]:
    requests, engines, seed, mix, asks = job
    rate, sweep = find_load(requests, seed, engines, mix, quiet=True, asks=asks)
    return seed, mix, rate, bool(sweep[-1]["knee"])


def matrix_cell(job: tuple[int, int, int, float, float, float, bool, str]) -> dict[str, Any]:
    requests, engines, seed, mix, load, knee, found, asks = job
    busy = contention_rate(load * knee, knee)
    rows, contention, _ = run_cell(requests, load * knee, seed, engines, mix, busy, asks)
    return {"seed": seed, "mix": mix, "load": load, "knee_req_s": knee, "knee_found": found,
            "rate_req_s": load * knee, "contention_req_s": busy,
            "check": check_cell(rows, contention),
            "policies": rows, "contention": contention}


def run_matrix(requests: int, engines: int, jobs: int, seeds: tuple[int, ...],
               loads: tuple[float, ...], mixes: tuple[float, ...], asks: str = "used"
               ) -> list[dict[str, Any]]:
    # spawned, not forked: a fork of a process with gRPC threads running (a test session)
    # can spin forever in the child
    with ProcessPoolExecutor(max_workers=jobs,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        knees = {(seed, mix): (rate, found) for seed, mix, rate, found in pool.map(
            matrix_knee, [(requests, engines, s, m, asks) for s in seeds for m in mixes])}
        work = [(requests, engines, s, m, load, *knees[(s, m)], asks)
                for s in seeds for m in mixes for load in loads]
        cells = []
        for cell in pool.map(matrix_cell, work):
            print(cell_line(cell), flush=True)
            cells.append(cell)
    return cells


CELL_HEAD = (f"{'seed':>4}{'mix':>5}{'load':>6}{'req/s':>7}{'FIFO':>6}{'P99/FIFO':>10}"
             f"{'P99/strict':>11}{'int t/o':>9}{'batch/FIFO':>11}{'share err':>10}{'Jain':>7}"
             "  misses")


def cell_line(cell: dict[str, Any]) -> str:
    c = cell["check"]
    misses = ",".join(k for k, ok in c["pass"].items() if not ok) or "-"
    if not cell.get("knee_found", True):
        misses += " (no swept rate met both knee conditions: P99 above the SLA alone)"
    return (f"{cell['seed']:>4}{cell['mix']:>5.0%}{cell['load']:>6.2f}{cell['rate_req_s']:>7.1f}"
            f"{'cont' if c['fifo_contended'] else 'calm':>6}{c['p99_vs_fifo']:>10.3f}"
            f"{c['p99_vs_strict']:>11.3f}{c['interactive_timeout_rate']:>9.1%}"
            f"{c['batch_vs_fifo']:>11.3f}{c['share_error']:>10.1%}{c['jain']:>7.3f}  {misses}")


def summarize_matrix(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst over the cells, each bound checked where the issue applies it."""
    checks = [c["check"] for c in cells]
    contended = [c["p99_vs_fifo"] for c in checks if c["fifo_contended"]]
    calm = [c["p99_vs_fifo"] for c in checks if not c["fifo_contended"]]
    worst_max = {k: max(c[k] for c in checks) for k in
                 ("p99_vs_strict", "interactive_timeout_rate", "share_error")}
    worst_min = {k: min(c[k] for c in checks) for k in ("batch_vs_fifo", "jain")}
    median = {k: statistics.median(c[k] for c in checks) for k in
              ("p99_vs_strict", "interactive_timeout_rate", "share_error", "batch_vs_fifo",
               "jain")}
    bounds = {
        "contended_p99_vs_fifo_worst": (max(contended, default=math.nan), CONTENDED_WORST),
        "contended_p99_vs_fifo_median": (statistics.median(contended) if contended
                                         else math.nan, CONTENDED_MEDIAN),
        "uncontended_p99_vs_fifo_worst": (max(calm, default=math.nan), UNCONTENDED_MAX),
        "p99_vs_strict_worst": (worst_max["p99_vs_strict"], VS_STRICT_MAX),
        "interactive_timeout_rate_worst": (worst_max["interactive_timeout_rate"], TIMEOUT_MAX),
        "share_error_worst": (worst_max["share_error"], SHARE_ERROR_MAX),
        "batch_vs_fifo_worst": (worst_min["batch_vs_fifo"], BATCH_MIN),
        "jain_worst": (worst_min["jain"], JAIN_MIN),
    }
    targets = {}
    for name, (value, bound) in bounds.items():
        at_least = name.startswith(("batch", "jain"))
        ok = (value >= bound) if at_least else (value <= bound)
        if math.isnan(value):
            ok = name.startswith("uncontended") and not calm  # no such cell: nothing to harm
        targets[name] = {"value": value, "bound": bound, "at_least": at_least,
                         "pass": bool(ok)}
    return {"cells": len(cells), "contended_cells": len(contended), "median": median,
            "targets": targets,
            "cells_missing": sum(1 for c in checks if not all(c["pass"].values()))}


PLOT_MARKERS = "os^vD<>p"  # one per mix, in the order the cells' mixes sort
PLOT_COLORS = ("tab:green", "tab:blue", "tab:red", "tab:orange", "tab:purple", "tab:brown",
               "tab:pink", "tab:olive")  # one per load


def matrix_series(cells: list[dict[str, Any]], key: str
                  ) -> list[tuple[str, str, str, list[int], list[float]]]:
    """One scatter series per mix and load the cells hold: label, marker (by mix), colour
    (by load), seeds, and each cell's ``check[key]``."""
    mixes = sorted({c["mix"] for c in cells}, reverse=True)
    loads = sorted({c["load"] for c in cells})
    series = []
    for i, mix in enumerate(mixes):
        for j, load in enumerate(loads):
            here = [c for c in cells if c["mix"] == mix and c["load"] == load]
            if here:
                series.append((f"{mix:.0%} interactive, {load}× knee",
                               PLOT_MARKERS[i % len(PLOT_MARKERS)],
                               PLOT_COLORS[j % len(PLOT_COLORS)],
                               [c["seed"] for c in here], [c["check"][key] for c in here]))
    return series


def plot_matrix(cells: list[dict[str, Any]], path: Path) -> bool:
    """(d)'s interactive P99 over FIFO's and over strict priority's, per cell: every mix
    and load the cells hold (``--mixes``/``--loads`` other than the matrix's included)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, bound, title in ((axes[0], "p99_vs_fifo", CONTENDED_WORST, "(d) / FIFO"),
                                  (axes[1], "p99_vs_strict", VS_STRICT_MAX,
                                   "(d) / strict priority")):
        for label, marker, color, seeds, ratios in matrix_series(cells, key):
            ax.scatter(seeds, ratios, marker=marker, color=color, label=label)
        ax.axhline(bound, color="grey", linestyle=":")
        ax.set_xlabel("seed")
        ax.set_ylabel("interactive P99 TTFT ratio")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def matrix_report(cells: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [CELL_HEAD, "-" * len(CELL_HEAD)]
    lines += [cell_line(c) for c in sorted(cells, key=lambda c: (c["mix"], c["seed"],
                                                                 c["load"]))]
    lines.append("")
    for name, t in summary["targets"].items():
        sign = ">=" if t["at_least"] else "<="
        lines.append(f"  {'PASS' if t['pass'] else 'MISS'} {name}: {t['value']:.3f} "
                     f"(bound {sign} {t['bound']})")
    lines.append(f"  cells: {summary['cells']} ({summary['contended_cells']} with FIFO "
                 f"contended), cells missing a bound: {summary['cells_missing']}")
    return "\n".join(lines)


# -- entry point -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.policy_sim",
                                description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--mix", type=float, default=0.7, help="interactive share of requests")
    p.add_argument("--asks", choices=ASKS, default="used",
                   help="max_tokens: each answer's length (used), or its class's largest "
                   "(ceiling: one fixed max_tokens per class, answers shorter)")
    p.add_argument("--load", type=float, default=1.0, help="× the FIFO knee")
    p.add_argument("--rate", type=float, default=None, help="skip the sweep, use this req/s")
    p.add_argument("--contention-factor", type=float, default=CONTENTION_FACTOR,
                   help="the contention scenario's load, × the latency scenario's (and at "
                   f"least {CONTENTION_MIN_KNEES} × the knee when it is swept)")
    p.add_argument("--matrix", action="store_true",
                   help="every cell: seeds × loads × mixes (see --seeds, --loads, --mixes)")
    p.add_argument("--seeds", default=",".join(map(str, MATRIX_SEEDS)))
    p.add_argument("--loads", default=",".join(map(str, MATRIX_LOADS)))
    p.add_argument("--mixes", default=",".join(map(str, MATRIX_MIXES)))
    p.add_argument("--jobs", type=int, default=2, help="processes for --matrix")
    p.add_argument("--variant", type=json.loads, default=None, metavar="JSON",
                   help="pool settings for kvgate (on top of its defaults); needs --against")
    p.add_argument("--against", type=Path, default=None,
                   help="a recorded --matrix JSON whose cells --variant reruns")
    p.add_argument("--share-lengths", type=_lengths, default=None, metavar="N,N",
                   help="rerun only kvgate's contention scenario of every cell of --against, "
                   f"N × --requests requests long (the matrix's: {CONTENTION_LENGTH}): how "
                   "the weighted-share error shrinks over longer busy periods")
    p.add_argument("--replot", type=Path, default=None, metavar="M.json",
                   help="draw a recorded --matrix JSON's plot again (beside it), run nothing")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.against is None and (args.variant is not None or args.share_lengths):
        p.error("--variant and --share-lengths need --against (a recorded --matrix JSON)")
    if args.against is not None and (args.variant is None) == (not args.share_lengths):
        p.error("--against goes with one of --variant and --share-lengths")
    return args


def _lengths(text: str) -> tuple[int, ...]:
    lengths = tuple(int(n) for n in text.split(","))
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError("lengths are whole numbers, 1 or more")
    return lengths


def command(argv: list[str] | None) -> str:
    return "python -m bench.policy_sim " + shlex.join(argv if argv is not None
                                                      else sys.argv[1:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.replot is not None:
        recorded = json.loads(args.replot.read_text())
        png = args.replot.with_suffix(".png")
        drawn = plot_matrix(recorded["cells"], png)
        print(f"wrote {png}" if drawn else "no matplotlib: nothing drawn")
        return recorded
    if args.variant is not None:
        return main_variant(args, argv, started)
    if args.share_lengths:
        return main_share_lengths(args, argv, started)
    if args.matrix:
        return main_matrix(args, argv, started)
    print(f"bench.policy_sim: {args.requests} requests, seed {args.seed}, {args.engines} "
          f"engines, {args.mix:.0%} interactive")
    sweep: list[dict[str, float]] = []
    rate, knee = args.rate, None
    if rate is None:
        knee, sweep = find_load(args.requests, args.seed, args.engines, args.mix,
                                asks=args.asks)
        rate = args.load * knee
    busy = contention_rate(rate, knee, args.contention_factor)
    print(f"latency scenario: {rate:.1f} req/s (Poisson)")
    rows, contention, sims = run_cell(args.requests, rate, args.seed, args.engines, args.mix,
                                      busy, args.asks)
    print(table(rows))
    print(f"contention scenario: {busy:.1f} req/s (Poisson, equal "
          "demand), share of priced tokens / weight share while every tenant is backlogged")
    print(share_table(contention))
    check = check_cell(rows, contention)
    for name, ok in check["pass"].items():
        print(f"  {'PASS' if ok else 'MISS'} {name}: {check[name]:.3f}")
    report = {
        "command": command(argv), "requests": args.requests, "seed": args.seed,
        "engines": args.engines, "mix": args.mix, "asks": args.asks, "rate_req_s": rate,
        "sweep": sweep,
        "policies": rows,
        "contention": {"rate_req_s": busy, "factor": args.contention_factor,
                       "min_knees": CONTENTION_MIN_KNEES if knee else None,
                       "policies": contention},
        "check": check, "seconds": round(time.perf_counter() - started, 1),
    }
    out = args.out or RESULTS / "policy-virtual.json"
    write(report, out)
    png = out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if plot(sims, png) else " (no matplotlib)"))
    return report


def main_matrix(args: argparse.Namespace, argv: list[str] | None, started: float
                ) -> dict[str, Any]:
    seeds = tuple(int(s) for s in args.seeds.split(","))
    loads = tuple(float(x) for x in args.loads.split(","))
    mixes = tuple(float(x) for x in args.mixes.split(","))
    print(f"bench.policy_sim --matrix: {len(seeds)} seeds × {len(loads)} loads × "
          f"{len(mixes)} mixes, {args.requests} requests each, {args.jobs} processes")
    print(CELL_HEAD)
    cells = run_matrix(args.requests, args.engines, args.jobs, seeds, loads, mixes, args.asks)
    summary = summarize_matrix(cells)
    text = matrix_report(cells, summary)
    print(text)
    report = {"command": command(argv), "requests": args.requests, "engines": args.engines,
              "asks": args.asks, "contention_factor": CONTENTION_FACTOR,
              "contention_min_knees": CONTENTION_MIN_KNEES, "summary": summary, "cells": cells,
              "seconds": round(time.perf_counter() - started, 1)}
    out = args.out or RESULTS / "policy-matrix.json"
    write_with_table(report, text, out)
    png = out.with_suffix(".png")
    print(f"wrote {out}, {out.with_suffix('.md')}"
          + (f" and {png}" if plot_matrix(cells, png) else " (no matplotlib)"))
    print(f"done in {report['seconds']} s")
    return report


def variant_cell(job: tuple[dict[str, Any], int, int, dict[str, Any], str]) -> dict[str, Any]:
    """A recorded cell with kvgate rerun under ``pool`` settings (both scenarios)."""
    cell, requests, engines, pool, asks = job
    seed, mix, rate = cell["seed"], cell["mix"], cell["rate_req_s"]
    row, _ = run_policy(Gated(defaults(**pool), seed), requests, rate, seed, engines, mix, asks)
    busy = cell.get("contention_req_s") or contention_rate(rate, cell["knee_req_s"])
    share, _ = run_policy(Gated(defaults(**pool), seed), CONTENTION_LENGTH * requests, busy,
                          seed, engines, mix, asks)
    rows = {**cell["policies"], "kvgate": row}
    return {**cell, "policies": rows, "contention": {**cell["contention"], "kvgate": share},
            "check": check_cell(rows, {"kvgate": share}), "recorded_check": cell["check"]}


def main_variant(args: argparse.Namespace, argv: list[str] | None, started: float
                 ) -> dict[str, Any]:
    recorded = json.loads(args.against.read_text())
    requests, engines = recorded["requests"], recorded["engines"]
    print(f"bench.policy_sim --variant {json.dumps(args.variant)}: kvgate on the "
          f"{len(recorded['cells'])} cells of {args.against} ({recorded['command']}), "
          f"{args.jobs} processes")
    print(CELL_HEAD)
    cells = rerun(recorded, args.jobs, variant_cell, args.variant, show=True)
    summary = summarize_matrix(cells)
    text = matrix_report(cells, summary)
    before = summarize_matrix(recorded["cells"])["cells_missing"]
    text += f"\n  recorded ({args.against}): cells missing a bound: {before}"
    print(text)
    report = {"command": command(argv), "variant": args.variant, "against": str(args.against),
              "requests": requests, "engines": engines, "summary": summary, "cells": cells,
              "seconds": round(time.perf_counter() - started, 1)}
    out = args.out or RESULTS / "policy-variant.json"
    write_with_table(report, text, out)
    print(f"wrote {out} and {out.with_suffix('.md')} in {report['seconds']} s")
    return report


def share_length_cell(job: tuple[dict[str, Any], int, int, tuple[int, ...], str]
                      ) -> dict[str, Any]:
    """kvgate's contention scenario of a recorded cell at each length (× ``requests``)."""
    cell, requests, engines, lengths, asks = job
    busy = cell.get("contention_req_s") or contention_rate(cell["rate_req_s"],
                                                            cell["knee_req_s"])
    errors = {}
    for length in lengths:
        share, _ = run_policy(Gated(defaults(), cell["seed"]), length * requests, busy,
                              cell["seed"], engines, cell["mix"], asks)
        errors[str(length)] = {"share_error": share["weighted_share_error"],
                               "jain": share["jain"], "share_ratio": share["share_ratio"]}
    recorded = cell["contention"]["kvgate"]
    errors.setdefault(str(CONTENTION_LENGTH), {"share_error": recorded["weighted_share_error"],
                                               "jain": recorded["jain"],
                                               "share_ratio": recorded["share_ratio"]})
    return {"seed": cell["seed"], "mix": cell["mix"], "load": cell["load"],
            "contention_req_s": busy, "lengths": errors}


def share_lengths_report(cells: list[dict[str, Any]], lengths: list[str]) -> str:
    """Per cell the share error at each length; then per length the cells over the bound,
    the median and the worst."""
    lines = [f"{'seed':>4}{'mix':>5}{'load':>6}"
             + "".join(f"{'×' + n:>9}" for n in lengths)]
    for c in cells:
        lines.append(f"{c['seed']:>4}{c['mix']:>5.0%}{c['load']:>6.2f}" + "".join(
            f"{c['lengths'][n]['share_error']:>9.1%}" for n in lengths))
    for n in lengths:
        errors = [c["lengths"][n]["share_error"] for c in cells]
        over = sum(e > SHARE_ERROR_MAX for e in errors)
        lines.append(f"  ×{n} the latency scenario's requests: share error over "
                     f"{SHARE_ERROR_MAX:.0%} in {over} "
                     f"of {len(errors)} cells, median {statistics.median(errors):.1%}, "
                     f"worst {max(errors):.1%}")
    return "\n".join(lines)


def main_share_lengths(args: argparse.Namespace, argv: list[str] | None, started: float
                       ) -> dict[str, Any]:
    recorded = json.loads(args.against.read_text())
    requests, engines = recorded["requests"], recorded["engines"]
    asks = recorded.get("asks", "used")
    print(f"bench.policy_sim --share-lengths: kvgate's contention scenario of the "
          f"{len(recorded['cells'])} cells of {args.against} ({recorded['command']}) at "
          f"{', '.join(f'{n} ×' for n in args.share_lengths)} {requests} requests")
    cells = rerun(recorded, args.jobs, share_length_cell, args.share_lengths)
    lengths = sorted(cells[0]["lengths"], key=int) if cells else []
    text = share_lengths_report(cells, lengths)
    print(text)
    report = {"command": command(argv), "against": str(args.against), "requests": requests,
              "engines": engines, "asks": asks, "cells": cells,
              "seconds": round(time.perf_counter() - started, 1)}
    out = args.out or RESULTS / "policy-share-lengths.json"
    write_with_table(report, text, out)
    print(f"wrote {out} and {out.with_suffix('.md')} in {report['seconds']} s")
    return report


def rerun(recorded: dict[str, Any], jobs: int, work: Callable[[Any], dict[str, Any]],
          extra: Any, *, show: bool = False) -> list[dict[str, Any]]:
    """Every cell of a recorded matrix through ``work((cell, requests, engines, extra,
    asks))``, in ``jobs`` spawned processes, in order (each printed as it comes: ``show``)."""
    requests, engines = recorded["requests"], recorded["engines"]
    asks = recorded.get("asks", "used")
    with ProcessPoolExecutor(max_workers=jobs,
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        cells = []
        for cell in pool.map(work, [(c, requests, engines, extra, asks)
                                    for c in recorded["cells"]]):
            if show:
                print(cell_line(cell), flush=True)
            cells.append(cell)
    return cells


def write_with_table(report: dict[str, Any], text: str, path: Path) -> None:
    """The JSON report, and beside it (``.md``) its command over the printed table."""
    write(report, path)
    path.with_suffix(".md").write_text(f"# {report['command']}\n\n```\n{text}\n```\n")


def write(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
