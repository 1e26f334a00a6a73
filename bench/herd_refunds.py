"""Retry-After for a refused herd whose requests use less than they reserve (virtual time).

A request reserves its prompt plus ``max_tokens`` from the tenant's token bucket and gives
back what it did not use when it ends. A herd of refused clients is told spaced retry slots
(``limiter.herd``): each bucket's promise moves on by the refill time of the client's whole
reservation, and a release's refund moves a live promise back only by what the herd is sure
to keep of it. This benchmark measures what that does to a tenant that reserves far more
than it uses, with the real limiter (``TenantLimiter``, the in-memory store's core) driven
by a virtual clock.

One tenant with a token bucket only: 1,000 tokens/s, burst 4,000 (``--burst``; a tenant's
default is a minute's worth, 60,000, under which the effect measured here is gone below the
rate). Every request reserves
2,000 tokens and uses 2,000 (``reserve = use``), 1,000 (``2x``), 400 (``5x``) or a uniform
17-100% of them; it is released with what it used a uniform 50-150% of ``--hold-ms``
(2,000) after its admission.
New requests arrive as a Poisson process (seeded) whose *used* tokens are 0.5, 0.67, 0.9 or
1.2 times the rate; ``lone`` is one client alone that sends its next request the moment the
previous one is admitted. A refused client comes back exactly ``retry-after-ms`` later, until
admitted or ``--max-tries`` attempts (10) have been refused. Arrivals stop at ``--run-s``
(600); the run goes on until every client is admitted or gave up; statistics cover the
requests that arrived after ``--warmup-s`` (60).

Variants (the same arrivals for each):

- ``shipped``: the limiter as it is.
- ``expected``: EXPERIMENT, patched in here only: the token bucket's promise moves on by
  the client's *expected* usage — its reservation × the tenant's mean used/reserved ratio,
  learnt from releases as the mean duration is (a running mean over 8, then 1/8 each) —
  and a refund no longer moves a live promise back (the expected usage counted it).
- ``expected+refunds``: EXPERIMENT, the same, but a refund still moves a live promise back
  as shipped (a promised client's refund then counts twice; a refund of a request admitted
  before the promise counts once, as it should).
- ``exact``: reference: no herd schedule, every refused client told its exact wait.
- ``oracle``: reference bound, no Retry-After at all: refused clients wait in one FIFO
  queue and the head is admitted the first millisecond the bucket holds it (it knows when
  releases come); nobody gives up.

Reported per scenario and variant (mean over seeds, with the seeds' range): offered usage
÷ the rate; used tokens/s admitted ÷ min(offered, rate); Retry-After (``retry-after-ms``)
P50, P90 and max; "RA ÷ exact": the mean Retry-After ÷ the mean exact wait at those
refusals (what a client alone would be told; 1.00: exact); refusals per admitted request;
the share of retries refused again (slots too early, or a newcomer took the tokens: a
promise reserves nothing); mean wait from a request's first attempt to its admission; the
share that gave up.

    python -m bench.herd_refunds [--seeds 1,2,3] [--run-s 600] [--hold-ms 2000]
        [--max-tries 10] [--variants shipped,...] [--scenarios REGEX] [--out PATH]

The ``expected`` variants subclass ``TenantLimiter`` and patch ``limiter.decision``, so they
need it uncompiled (``KVGATE_NATIVE=0`` when ``make native`` has built it).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import limiter.decision as decision
from limiter import Admit, Cost, Rate, Reason, Reject, TenantLimiter, TenantPolicy, ceil_div
from limiter.herd import observe, promise_bucket

RATE = 1000  # tokens/s
BURST = 4000  # --burst; a tenant's default is a minute's worth (60,000 here)
RESERVE = 2000  # tokens each request reserves (prompt + max_tokens)
# what a request uses: a fixed share of its reservation, or a uniform range of shares
USAGES: dict[str, float | tuple[float, float]] = {
    "reserve = use": 1.0, "reserve 2x use": 0.5, "reserve 5x use": 0.2,
    "use 17-100%": (0.17, 1.0),
}
LOADS = (0.5, 0.67, 0.9, 1.2)  # offered usage ÷ the rate; "lone" is one client in a loop
VARIANTS = ("shipped", "expected", "expected+refunds", "exact", "oracle")
PPM = 1_000_000
RELEASE, ATTEMPT = 0, 1  # at one ms, releases go first


def mean_use(usage: float | tuple[float, float]) -> float:
    if isinstance(usage, tuple):
        lo, hi = math.ceil(usage[0] * RESERVE), round(usage[1] * RESERVE)
        return (lo + hi) / 2
    return round(usage * RESERVE)


def draw_use(rng: random.Random, usage: float | tuple[float, float]) -> int:
    if isinstance(usage, tuple):
        return rng.randint(math.ceil(usage[0] * RESERVE), round(usage[1] * RESERVE))
    return round(usage * RESERVE)


def draw(rng: random.Random, arrival: int, usage: float | tuple[float, float],
         hold_ms: int) -> Request:
    """A request: what it uses, and how long it runs (50-150% of ``hold_ms``)."""
    return Request(arrival, draw_use(rng, usage), rng.randint(hold_ms // 2, hold_ms * 3 // 2))


@dataclass
class Request:
    arrival: int
    use: int
    hold: int  # ms from its admission to its release
    tries: int = 0
    admitted: int | None = None
    gave_up: bool = False
    retry_afters: list[int] = field(default_factory=list)
    exact: list[int] = field(default_factory=list)  # the exact wait at each refusal
    refused_retries: int = 0


class ExpectedUsage(TenantLimiter):
    """EXPERIMENT: a token bucket's promise moves on by the client's expected usage (its
    reservation × the used/reserved ratio learnt from releases), and a refund does not move
    a live promise back."""

    keep_refunds = False  # (ExpectedKeepingRefunds: as shipped)

    def __init__(self, policy: TenantPolicy, now_ms: int) -> None:
        super().__init__(policy, now_ms)
        self.ratio_ppm = PPM  # before any release: the whole reservation (as shipped)
        self.ratio_samples = 0

    def release(self, lease_id: str, used_tokens: int | None, now_ms: int, *,
                served: bool = True) -> bool:
        lease = self._leases.get(lease_id)
        if lease is not None and served and lease.cost.tokens:
            used = lease.cost.tokens if used_tokens is None else used_tokens
            self.ratio_ppm, self.ratio_samples = observe(
                self.ratio_ppm, self.ratio_samples, used * PPM // lease.cost.tokens)
        return super().release(lease_id, used_tokens, now_ms, served=served)

    def _promise(self, promised: int | None, bucket: Any, cost: int, final: int,
                 now_ms: int) -> int:
        if bucket is self._tokens:
            cost = min(cost, ceil_div(cost * self.ratio_ppm, PPM))
        return promise_bucket(promised, bucket, cost, final, now_ms)

    def _schedule(self, waits: list[tuple[Reason, int]], requests: int, tokens: int | None,
                  now_ms: int) -> list[tuple[Reason, int]]:
        with _patched(self._promise):
            return super()._schedule(waits, requests, tokens, now_ms)

    def _reconciled(self, reason: Reason, promised: int | None, bucket: Any, before: int,
                    now_ms: int) -> None:
        if promised is None:
            return  # no live promise (``before`` was not read)
        if (not self.keep_refunds and reason is Reason.TOKENS
                and bucket.level_at(now_ms) > before):
            return  # a refund: the expected usage already counted it
        super()._reconciled(reason, promised, bucket, before, now_ms)


@contextmanager
def _patched(promise: Any) -> Iterator[None]:
    shipped = decision.promise_bucket
    decision.promise_bucket = promise
    try:
        yield
    finally:
        decision.promise_bucket = shipped


def patchable() -> bool:
    """Whether the limiter runs as plain Python (the experiments subclass and patch it)."""
    return str(getattr(decision, "__file__", "")).endswith(".py")


def _check_patchable() -> None:
    if not patchable():
        raise SystemExit("the 'expected' variants patch limiter.decision: run with "
                         "KVGATE_NATIVE=0 (it is compiled here)")


class ExpectedKeepingRefunds(ExpectedUsage):
    """EXPERIMENT: as :class:`ExpectedUsage`, but a refund still moves a live promise back
    as shipped (so a promised client's refund counts twice)."""

    keep_refunds = True


LIMITERS = {"shipped": TenantLimiter, "expected": ExpectedUsage,
            "expected+refunds": ExpectedKeepingRefunds, "exact": TenantLimiter}
PATCHED = ("expected", "expected+refunds")  # subclass the limiter: need it uncompiled


def arrivals(usage: float | tuple[float, float], load: float, seed: int, run_ms: int,
             hold_ms: int) -> list[Request]:
    """Poisson arrivals whose mean usage is ``load`` × the rate."""
    rng = random.Random(f"{seed}/{usage}/{load}")
    per_ms = load * RATE / mean_use(usage) / 1000
    t, requests = 0.0, list[Request]()
    while True:
        t += rng.expovariate(per_ms)
        if t >= run_ms:
            return requests
        requests.append(draw(rng, int(t), usage, hold_ms))


def policy(burst: int) -> TenantPolicy:
    return TenantPolicy(token_rate=Rate(RATE, 1000), token_burst=burst)


def simulate(variant: str, usage: float | tuple[float, float], load: float | None,
             seed: int, run_ms: int, hold_ms: int, max_tries: int,
             burst: int = BURST) -> list[Request]:
    """Every request of one run, with what happened to it (``load`` None: the lone client)."""
    rng = random.Random(f"{seed}/{usage}/lone")  # the lone client's requests
    lone = load is None
    if load is None:
        requests = [draw(rng, 0, usage, hold_ms)]
    else:
        requests = arrivals(usage, load, seed, run_ms, hold_ms)
    if variant == "oracle":
        return _oracle(requests, usage, lone, rng, run_ms, hold_ms, burst)
    limiter = LIMITERS[variant](policy(burst), 0)
    bucket = limiter.token_bucket
    assert bucket is not None
    cost = Cost(RESERVE, 0)
    events = [(r.arrival, ATTEMPT, i) for i, r in enumerate(requests)]
    heapq.heapify(events)
    while events:
        now, kind, i = heapq.heappop(events)
        request = requests[i]
        if kind == RELEASE:
            limiter.release(f"r{i}", request.use, now)
            continue
        request.tries += 1
        exact = bucket.wait_ms(RESERVE, now)
        result = limiter.admit(cost, f"r{i}", now)
        if isinstance(result, Admit):
            request.admitted = now
            heapq.heappush(events, (now + request.hold, RELEASE, i))
            if lone and now < run_ms:  # the lone client's next request, at once
                requests.append(draw(rng, now, usage, hold_ms))
                heapq.heappush(events, (now, ATTEMPT, len(requests) - 1))
            continue
        assert isinstance(result, Reject) and result.retry_after_ms is not None
        retry_after = result.retry_after_ms
        if variant == "exact":  # told what a client alone would be; no schedule kept
            retry_after = exact
            limiter.forget_promises()
        request.retry_afters.append(retry_after)
        request.exact.append(exact)
        if request.tries > 1:
            request.refused_retries += 1
        if max_tries and request.tries >= max_tries:
            request.gave_up = True
        else:
            heapq.heappush(events, (now + retry_after, ATTEMPT, i))
    return requests


def _oracle(requests: list[Request], usage: float | tuple[float, float], lone: bool,
            rng: random.Random, run_ms: int, hold_ms: int, burst: int) -> list[Request]:
    """One FIFO queue; its head is admitted the first ms the bucket holds it."""
    limiter = TenantLimiter(policy(burst), 0)
    bucket = limiter.token_bucket
    assert bucket is not None
    cost = Cost(RESERVE, 0)
    events = [(r.arrival, ATTEMPT, i) for i, r in enumerate(requests)]
    heapq.heapify(events)
    queue: deque[int] = deque()
    check: int | None = None  # when the head is due to fit (absent releases)
    while events:
        now, kind, i = heapq.heappop(events)
        if kind == RELEASE:
            limiter.release(f"r{i}", requests[i].use, now)
        elif i >= 0:
            requests[i].tries = 1
            queue.append(i)
        elif check != now:
            continue  # a check superseded by an earlier one
        while queue:
            wait = bucket.wait_ms(RESERVE, now)
            if wait:
                if check is None or check <= now or now + wait < check:
                    check = now + wait
                    heapq.heappush(events, (check, ATTEMPT, -1))
                break
            head = queue.popleft()
            assert isinstance(limiter.admit(cost, f"r{head}", now), Admit)
            requests[head].admitted = now
            heapq.heappush(events, (now + requests[head].hold, RELEASE, head))
            if lone and now < run_ms:
                requests.append(draw(rng, now, usage, hold_ms))
                queue.append(len(requests) - 1)
                requests[-1].tries = 1
    return requests


def percentile(values: list[int], q: float) -> float:
    """Nearest rank (q in 0-100); NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def measure(requests: list[Request], lone: bool, run_ms: int, warmup_ms: int) -> dict[str, Any]:
    window_s = (run_ms - warmup_ms) / 1000
    counted = [r for r in requests if warmup_ms <= r.arrival < run_ms]
    admitted = [r for r in counted if r.admitted is not None]
    offered = math.inf if lone else sum(r.use for r in counted) / window_s
    used = sum(r.use for r in requests
               if r.admitted is not None and warmup_ms <= r.admitted < run_ms) / window_s
    retry_afters = [ra for r in counted for ra in r.retry_afters]
    exact = [ex for r in counted for ex in r.exact]
    retries = sum(max(0, r.tries - 1) for r in counted)
    row = {
        "requests": len(counted),
        "offered_x_rate": None if lone else offered / RATE,
        "used_per_s": used,
        "throughput": used / min(offered, RATE),
        "ra_p50_s": percentile(retry_afters, 50) / 1000,
        "ra_p90_s": percentile(retry_afters, 90) / 1000,
        "ra_max_s": (max(retry_afters) / 1000) if retry_afters else math.nan,
        "ra_mean_s": statistics.fmean(retry_afters) / 1000 if retry_afters else math.nan,
        "ra_x_exact": sum(retry_afters) / sum(exact) if exact and sum(exact) else math.nan,
        "refusals_per_admitted": len(retry_afters) / max(1, len(admitted)),
        "retries_refused": (sum(r.refused_retries for r in counted) / retries
                            if retries else math.nan),
        "mean_wait_s": (statistics.fmean((r.admitted or 0) - r.arrival for r in admitted)
                        / 1000 if admitted else math.nan),
        "gave_up": sum(r.gave_up for r in counted) / max(1, len(counted)),
    }
    return {key: None if isinstance(v, float) and math.isnan(v) else v  # (JSON has no NaN)
            for key, v in row.items()}


def scenarios() -> list[tuple[str, float | tuple[float, float], float | None]]:
    """(name, usage, load): the lone client per usage first, then every load."""
    rows: list[tuple[str, float | tuple[float, float], float | None]] = [
        (f"{name}, lone client", usage, None) for name, usage in USAGES.items()]
    rows += [(f"{name}, load {load:g}", usage, load) for name, usage in USAGES.items()
             for load in LOADS]
    return rows


def run(name: str, usage: float | tuple[float, float], load: float | None, variant: str,
        seed: int, run_s: float, warmup_s: float, hold_ms: int, max_tries: int,
        burst: int = BURST) -> dict[str, Any]:
    run_ms, warmup_ms = int(run_s * 1000), int(warmup_s * 1000)
    requests = simulate(variant, usage, load, seed, run_ms, hold_ms, max_tries, burst)
    return {"scenario": name, "variant": variant, "seed": seed,
            **measure(requests, load is None, run_ms, warmup_ms)}


def _spread(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) == 1 or format(min(values), fmt) == format(max(values), fmt):
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def _mean(values: list[float], fmt: str) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return format(statistics.fmean(values), fmt) if values else "–"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | variant | offered ÷ rate | used tokens/s ÷ min(offered, rate) "
             "| Retry-After P50 s | P90 s | max s | RA ÷ exact | refusals per admitted "
             "| retries refused again | mean wait s | gave up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["variant"]), []).append(row)
    for (scenario, variant), group in groups.items():
        def col(key: str) -> list[float]:
            return [r[key] for r in group]  # noqa: B023 (used at once)

        offered = "lone" if group[0]["offered_x_rate"] is None else _mean(
            col("offered_x_rate"), ".2f")
        if variant == "oracle":
            ra = "| – | – | – | – | – | – |"
        else:
            ra = (f"| {_spread(col('ra_p50_s'), '.2f')} | {_mean(col('ra_p90_s'), '.2f')} | "
                  f"{_mean(col('ra_max_s'), '.1f')} | {_mean(col('ra_x_exact'), '.2f')} | "
                  f"{_mean(col('refusals_per_admitted'), '.2f')} | "
                  f"{_mean(col('retries_refused'), '.1%')} |")
        lines.append(f"| {scenario} | {variant} | {offered} | "
                     f"{_spread(col('throughput'), '.3f')} {ra} "
                     f"{_spread(col('mean_wait_s'), '.2f')} | {_mean(col('gave_up'), '.1%')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--run-s", type=float, default=600.0,
                        help="seconds of arrivals (virtual)")
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="arrivals before this are not counted")
    parser.add_argument("--hold-ms", type=int, default=2000,
                        help="each request's mean time from admission to release")
    parser.add_argument("--burst", type=int, default=BURST,
                        help="the token bucket's burst (a tenant's default: a minute's worth, "
                        "60000 at this rate)")
    parser.add_argument("--max-tries", type=int, default=10,
                        help="attempts before a client gives up (0: never)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--scenarios", default=None,
                        help="a regular expression: only the scenarios it finds in the name")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {sorted(unknown)}")
    if set(variants) & set(PATCHED):
        _check_patchable()
    chosen = scenarios()
    if args.scenarios:
        chosen = [s for s in chosen if re.search(args.scenarios, s[0])]
    rows = [run(name, usage, load, variant, int(seed), args.run_s, args.warmup_s,
                args.hold_ms, args.max_tries, args.burst)
            for name, usage, load in chosen for variant in variants
            for seed in args.seeds.split(",")]
    text = table(rows)
    print(text)
    if args.out:
        env = ["KVGATE_NATIVE=0"] if os.environ.get("KVGATE_NATIVE") == "0" else []
        command = shlex.join([*env, "python", "-m", "bench.herd_refunds", *sys.argv[1:]])
        settings = {"rate_tokens_per_s": RATE, "burst": args.burst, "reserve": RESERVE,
                    "hold_ms": args.hold_ms, "max_tries": args.max_tries, "run_s": args.run_s,
                    "warmup_s": args.warmup_s, "seeds": args.seeds}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"command": command, "settings": settings, "rows": rows}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(
            f"# {__doc__.splitlines()[0]}\n\n`{command}`\n\n"
            f"Token rate {RATE:,}/s, burst {args.burst:,}, every request reserving {RESERVE:,}; "
            f"held {args.hold_ms // 2}-{args.hold_ms * 3 // 2} ms; "
            f"{args.max_tries or 'unlimited'} tries; arrivals for "
            f"{args.run_s:g} s, counted after {args.warmup_s:g} s; seeds {args.seeds} "
            "(mean, with the seeds' range in brackets). See the module docstring for the "
            "variants and columns.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
