"""A tenant that asks for far more output than it uses, beside one that does not (virtual time).

Clients often send a ``max_tokens`` far above what their answers use (a generous default,
or the model's whole context). kvgate expects a tenant's requests to use the share of
``max_tokens`` its answers lately used (KV admission, the fair order's charge) and corrects
by what they did use when they end — so such a tenant must not hurt its neighbours: neither
their interactive tail nor their share of the pool; nor one whose short answers turn long.

Two tenants of equal weight on four simulated engines, kvgate on its shipped defaults
(``bench.sim.defaults``), 600 s of arrivals: ``victim`` sends interactive requests at 8/s and
batch at 4/s, honest (``max_tokens`` what it uses); ``neighbour`` sends batch at 6/s whose
answers are 200–1,000 tokens, with ``max_tokens`` as the scenario says — or, in the
"short then long" scenarios, 20–100-token answers for the first fifth of the run and then
3,000–4,000-token ones (``max_tokens`` 4,000) at 4/s. Reported per scenario and seed: the
victim's interactive TTFT (P50, P99, share over its 2 s SLA) and batch TTFT P50 over the
loaded window (25–75% of the run), its share of the real priced tokens the engines admitted
while both tenants had work waiting (0.5 is its weighted share), and the engines'
preemptions.

    python -m bench.inflated_max_tokens [--seeds 1,2,3] [--duration 600] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from bench.sim import CLASSES, Gated, Job, Simulation, defaults, percentile

DURATION_S = 600.0  # of arrivals (--duration)
TENANTS = {"victim": 1.0, "neighbour": 1.0}
MaxTokens = int | tuple[int, int] | None  # None: what the answer uses
# the neighbour's max_tokens: equal to its answer, a generous range, a far-off constant
STEADY: dict[str, MaxTokens] = {"honest": None, "generous 2,000-4,000": (2000, 4000),
                                "inflated 30,000": 30000}
# or: answers of 20-100 tokens for the first SWITCH of the run, then 3,000-4,000-token ones
# (max_tokens 4,000) at 4/s — asking for what they use before the switch, or for 4,000
SWITCHING: dict[str, MaxTokens] = {"short then long, honest": None,
                                   "short then long, asking 4,000": 4000}
SCENARIOS = [*STEADY, *SWITCHING]
SWITCH = 0.2


def arrivals(tenant: str, klass: str, rate: float, seed: int, span: tuple[float, float],
             max_tokens: MaxTokens = None, output: tuple[int, int] | None = None) -> list[Job]:
    """Poisson arrivals of one tenant's class over ``span`` (seconds); ``output``: the
    answers' lengths (default: the class's)."""
    rng, spec = random.Random(seed), CLASSES[klass]
    t, jobs = span[0], []
    while True:
        t += rng.expovariate(rate)
        if t >= span[1]:
            return jobs
        prompt, made = rng.randint(*spec.prompt), rng.randint(*(output or spec.output))
        asked = (made if max_tokens is None else max_tokens if isinstance(max_tokens, int)
                 else rng.randint(*max_tokens))
        jobs.append(Job(f"{tenant}-{klass}-{span[0]:g}-{len(jobs)}", tenant, klass, t, prompt,
                        max(made, asked), output=made))


def neighbour(scenario: str, seed: int, duration_s: float) -> list[Job]:
    if scenario in STEADY:
        return arrivals("neighbour", "batch", 6.0, seed, (0.0, duration_s), STEADY[scenario])
    switch = SWITCH * duration_s
    return (arrivals("neighbour", "batch", 6.0, seed, (0.0, switch), SWITCHING[scenario],
                     output=(20, 100))
            + arrivals("neighbour", "batch", 4.0, seed + 1, (switch, duration_s), 4000,
                       output=(3000, 4000)))


def run(scenario: str, seed: int, duration_s: float = DURATION_S) -> dict[str, object]:
    jobs = (arrivals("victim", "interactive", 8.0, seed, (0.0, duration_s))
            + arrivals("victim", "batch", 4.0, seed + 50, (0.0, duration_s))
            + neighbour(scenario, seed + 100, duration_s))
    jobs.sort(key=lambda job: job.arrival)
    started = time.perf_counter()
    sim = Simulation(jobs, Gated(defaults(), seed), 4, tenants=TENANTS)
    result = sim.run()
    lo, hi = 0.25 * duration_s, 0.75 * duration_s
    ttfts = [j.ttft for j in jobs if j.tenant == "victim" and j.klass == "interactive"
             and lo <= j.arrival < hi and j.ttft is not None]
    contended = sum(result.contended.values()) or 1
    batch = [j.ttft for j in jobs if j.tenant == "victim" and j.klass == "batch"
             and lo <= j.arrival < hi and j.ttft is not None]
    return {"scenario": scenario, "seed": seed, "victim_interactive": len(ttfts),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "over_sla": sum(t > CLASSES["interactive"].sla_s for t in ttfts) / max(1, len(ttfts)),
            "victim_share": result.contended["victim"] / contended,
            "victim_batch_ttft_p50_s": percentile(batch, 50),
            "preemptions": result.preemptions,
            "wall_s": time.perf_counter() - started}


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| neighbour's max_tokens | seed | victim interactive TTFT P50 s | P99 s | over 2 s "
             "| victim's share (0.5 = weighted) | victim batch TTFT P50 s | preemptions |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['seed']} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p99_s']:.3f} | {r['over_sla']:.1%} | {r['victim_share']:.3f} | "
                     f"{r['victim_batch_ttft_p50_s']:.1f} | {r['preemptions']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--duration", type=float, default=DURATION_S,
                        help="seconds of arrivals (virtual)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write OUT.md and OUT.json")
    args = parser.parse_args()
    rows = [run(scenario, int(seed), args.duration) for seed in args.seeds.split(",")
            for scenario in SCENARIOS]
    text = table(rows)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
