"""An open-loop load generator for kvgate (or any OpenAI-compatible endpoint).

Why open loop: a closed-loop client (N workers, each waiting for its answer) slows down
exactly when the server does, so it hides queueing collapse. Real multi-tenant traffic keeps
arriving; here requests arrive as a seeded Poisson process at ``rate`` req/s and each one is
sent on schedule, whatever the others are doing.

Run it::

    python -m bench.loadgen --url http://127.0.0.1:10000 --scenario reference \\
        --duration 30 --rate 20 --seed 1 --out results.json [--plot results.png]
    python -m bench.loadgen plot a.json b.json --out cdf.png   # one line per file

or from Python: ``result = await run_load(url, scenario, duration_s, rate, seed)``.

A scenario (``builtin`` name or YAML file, see ``REFERENCE_SCENARIO`` for every field) names
tenants (API key, weight, share of arrivals) and request classes (share of arrivals, prompt
and output length distributions, TTFT SLA). Prompts are whitespace words (the simulated
engine counts a word as a token; each word is 3 letters + a space, so kvgate's 4 characters
per token estimate agrees). Clients behave like openai-python: 408/409/429/≥500 are retried
twice, honouring ``retry-after-ms`` then ``retry-after`` when 0 < delay ≤ 60 s, else
exponential backoff; ``x-should-retry`` overrides the status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.utils
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

RETRYABLE = frozenset({408, 409, 429})
MAX_HONOURED_RETRY_AFTER_S = 60.0
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
WORDS = ("the", "fox", "dog", "cat", "sun", "sky", "sea", "map", "key", "box", "red", "run")


# -- scenario --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """A length distribution in tokens: ``fixed`` (value), ``uniform`` (low..high, inclusive)
    or ``lognormal`` (median, sigma), clipped to [min, max]. Lognormal because real prompt
    and output lengths are heavy-tailed: a few long ones dominate the KV cache."""

    kind: str = "fixed"
    value: int = 16
    low: int = 1
    high: int = 16
    median: float = 16.0
    sigma: float = 0.5
    min: int = 1
    max: int = 100_000

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            raw = float(self.value)
        elif self.kind == "uniform":
            raw = float(rng.randint(self.low, self.high))
        elif self.kind == "lognormal":
            raw = rng.lognormvariate(math.log(self.median), self.sigma)
        else:
            raise ValueError(f"unknown distribution {self.kind!r}")
        return int(min(max(round(raw), self.min), self.max))

    def mean(self) -> float:
        """Mean before clipping, for sizing a run (offered tokens/s)."""
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)
        return float(self.value)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_key: str
    weight: float = 1.0  # for reporting fairness (and for building a kvgate config)
    share: float = 1.0  # relative share of arrivals


@dataclass(frozen=True)
class ClassSpec:
    name: str
    share: float = 1.0  # relative share of arrivals
    prompt: Dist = Dist()
    output: Dist = Dist()
    sla_ttft_s: float = 2.0


@dataclass(frozen=True)
class Scenario:
    name: str
    tenants: tuple[TenantSpec, ...]
    classes: tuple[ClassSpec, ...]
    model: str = "tiny-llama"
    path: str = "/v1/chat/completions"
    stream: bool = True
    max_retries: int = 2
    request_timeout_s: float = 60.0
    class_header: str = "x-request-class"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        tenants = tuple(TenantSpec(**t) for t in data["tenants"])
        classes = tuple(
            ClassSpec(**{**c, "prompt": Dist(**c.get("prompt", {})),
                         "output": Dist(**c.get("output", {}))})
            for c in data["classes"]
        )
        rest = {k: v for k, v in data.items() if k not in ("tenants", "classes")}
        return cls(tenants=tenants, classes=classes, **rest)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


REFERENCE_SCENARIO: dict[str, Any] = {
    "name": "reference",
    "model": "tiny-llama",
    "tenants": [
        {"name": "platinum", "api_key": "sk-ref-platinum", "weight": 5, "share": 1},
        {"name": "gold", "api_key": "sk-ref-gold", "weight": 3, "share": 1},
        {"name": "free-a", "api_key": "sk-ref-free-a", "weight": 1, "share": 1},
        {"name": "free-b", "api_key": "sk-ref-free-b", "weight": 1, "share": 1},
    ],
    "classes": [
        {"name": "interactive", "share": 0.7, "sla_ttft_s": 2.0,
         "prompt": {"kind": "lognormal", "median": 48, "sigma": 0.5, "min": 8, "max": 256},
         "output": {"kind": "uniform", "low": 16, "high": 48}},
        {"name": "batch", "share": 0.3, "sla_ttft_s": 30.0,
         "prompt": {"kind": "lognormal", "median": 192, "sigma": 0.4, "min": 64, "max": 512},
         "output": {"kind": "uniform", "low": 64, "high": 160}},
    ],
}
BUILTIN = {"reference": REFERENCE_SCENARIO}


def load_scenario(spec: str | Path | dict[str, Any] | Scenario) -> Scenario:
    """A Scenario from a builtin name, a YAML/JSON file path or a dict."""
    if isinstance(spec, Scenario):
        return spec
    if isinstance(spec, dict):
        return Scenario.from_dict(spec)
    if str(spec) in BUILTIN:
        return Scenario.from_dict(BUILTIN[str(spec)])
    return Scenario.from_dict(yaml.safe_load(Path(spec).read_text()))


def kvgate_tenants(scenario: Scenario, *, same_weight: bool = False) -> dict[str, Any]:
    """``tiers`` and ``tenants`` sections of a kvgate config serving this scenario's tenants:
    one tier per tenant carrying its weight, every class allowed through the header."""
    from extproc.config import hash_api_key

    classes = [c.name for c in scenario.classes]
    tiers = {f"tier-{t.name}": {"weight": 1.0 if same_weight else t.weight}
             for t in scenario.tenants}
    tenants = [{"name": t.name, "tier": f"tier-{t.name}", "api_keys": [hash_api_key(t.api_key)],
                "default_class": classes[0], "max_class": classes[0], "class_header": True}
               for t in scenario.tenants]
    return {"tiers": tiers, "tenants": tenants}


# -- the arrival schedule ----------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    tenant: str
    klass: str
    prompt_tokens: int
    max_tokens: int


def poisson_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival instants of a Poisson process: exponential gaps of mean 1/rate."""
    times, now = [], rng.expovariate(rate)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def build_schedule(scenario: Scenario, rate: float, duration_s: float, seed: int
                   ) -> list[Arrival]:
    """The whole run decided up front from the seed, so every configuration under test sees
    exactly the same requests at exactly the same offsets."""
    rng = random.Random(seed)
    tenants, classes = scenario.tenants, scenario.classes
    tenant_w = [t.share for t in tenants]
    class_w = [c.share for c in classes]
    arrivals = []
    for at in poisson_times(rate, duration_s, rng):
        tenant = rng.choices(tenants, tenant_w)[0]
        klass = rng.choices(classes, class_w)[0]
        arrivals.append(Arrival(at, tenant.name, klass.name, klass.prompt.sample(rng),
                                klass.output.sample(rng)))
    return arrivals


def prompt_text(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


# -- one request, with openai-python's retry behaviour ----------------------------------------


@dataclass
class Record:
    tenant: str
    klass: str
    sent_at: float
    status: int | None = None  # final HTTP status; None: no answer (timeout, connection)
    outcome: str = "pending"  # ok | rejected | error | timeout
    ttft_s: float | None = None  # from the first attempt's send to the first content token
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    offered_tokens: int = 0  # prompt + max_tokens: what the request asked for
    retries: int = 0
    statuses: list[int] = field(default_factory=list)  # every attempt's status
    sla_missed: bool = False


def parse_retry_after(headers: Any) -> float | None:
    """Seconds to wait, as openai-python reads it: ``retry-after-ms`` first, then
    ``retry-after`` (seconds or an HTTP date); None if absent or unparsable."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        with contextlib.suppress(ValueError):
            return float(raw_ms) / 1000
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(raw) if raw.strip() else None
        return None if parsed is None else parsed.timestamp() - time.time()


def should_retry(status: int, headers: Any) -> bool:
    """``x-should-retry`` wins; else 408, 409, 429 and ≥ 500 are retried."""
    explicit = (headers.get("x-should-retry") or "").lower()
    if explicit in ("true", "false"):
        return explicit == "true"
    return status in RETRYABLE or status >= 500


def retry_delay(headers: Any, retries_done: int, rng: random.Random) -> float:
    """The server's hint when 0 < hint ≤ 60 s, else 0.5 s·2ⁿ (≤ 8 s) minus up to 25% jitter."""
    hint = parse_retry_after(headers) if headers is not None else None
    if hint is not None and 0 < hint <= MAX_HONOURED_RETRY_AFTER_S:
        return hint
    backoff = min(INITIAL_BACKOFF_S * 2.0**retries_done, MAX_BACKOFF_S)
    return backoff * (1 - 0.25 * rng.random())


def request_body(scenario: Scenario, arrival: Arrival, rng: random.Random) -> bytes:
    body: dict[str, Any] = {"model": scenario.model, "max_tokens": arrival.max_tokens,
                            "stream": scenario.stream}
    text = prompt_text(arrival.prompt_tokens, rng)
    if scenario.path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if scenario.stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def _read_stream(resp: aiohttp.ClientResponse, record: Record, t0: float) -> None:
    """Consume an SSE stream: TTFT at the first non-empty content, usage from its chunk."""
    async for raw_line in resp.content:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = orjson.loads(data)
        _take_usage(record, chunk)
        if record.ttft_s is None and _has_content(chunk):
            record.ttft_s = time.monotonic() - t0


async def _read_json(resp: aiohttp.ClientResponse, record: Record, t0: float) -> None:
    body = orjson.loads(await resp.read())
    record.ttft_s = time.monotonic() - t0  # no stream: the whole answer is the first token
    _take_usage(record, body)


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


def _take_usage(record: Record, chunk: dict[str, Any]) -> None:
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.completion_tokens = int(usage.get("completion_tokens", 0))


async def _attempt(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                   body: bytes, record: Record, t0: float, stream: bool) -> Any:
    """One HTTP attempt; returns the response headers of a non-200 (for the retry decision),
    None on success."""
    async with session.post(url, data=body, headers=headers) as resp:
        record.statuses.append(resp.status)
        record.status = resp.status
        if resp.status != 200:
            await resp.read()
            return resp.headers
        await (_read_stream if stream else _read_json)(resp, record, t0)
        return None


async def send_request(session: aiohttp.ClientSession, base_url: str, scenario: Scenario,
                       arrival: Arrival, rng: random.Random, record: Record) -> Record:
    """Send one request like openai-python would, retrying what it retries."""
    tenant = next(t for t in scenario.tenants if t.name == arrival.tenant)
    headers = {"authorization": f"Bearer {tenant.api_key}", "content-type": "application/json",
               scenario.class_header: arrival.klass}
    body = request_body(scenario, arrival, rng)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(scenario.request_timeout_s):
            await _attempts(session, base_url + scenario.path, headers, body, record, t0,
                            scenario, rng)
    except TimeoutError:
        record.outcome = "timeout"
    record.e2e_s = time.monotonic() - t0
    return record


async def _attempts(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                    body: bytes, record: Record, t0: float, scenario: Scenario,
                    rng: random.Random) -> None:
    while True:
        try:
            failed = await _attempt(session, url, headers, body, record, t0, scenario.stream)
        except aiohttp.ClientError:
            failed, record.status = {}, None  # connection trouble: retried with backoff
        if failed is None:
            record.outcome = "ok"
            return
        status = record.status or 0
        retryable = record.status is None or should_retry(status, failed)
        if not retryable or record.retries >= scenario.max_retries:
            record.outcome = "rejected" if status in (429, 503) else "error"
            return
        await asyncio.sleep(retry_delay(failed, record.retries, rng))
        record.retries += 1


# -- the run -----------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """Everything a run produced: the raw records and the summary computed from them."""

    url: str
    scenario: Scenario
    rate: float
    duration_s: float
    seed: int
    elapsed_s: float
    records: list[Record]
    label: str = ""

    def summary(self) -> dict[str, Any]:
        return summarize(self.records, self.scenario, self.elapsed_s)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "url": self.url, "scenario": self.scenario.to_dict(),
                "rate": self.rate, "duration_s": self.duration_s, "seed": self.seed,
                "elapsed_s": self.elapsed_s, "summary": self.summary(),
                "records": [asdict(r) for r in self.records]}


class Progress:
    """tqdm on stderr when it is installed, else one line rewritten in place."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self._bar = total, 0, enabled, None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled and (self.done % 10 == 0 or self.done == self.total):
            print(f"\r{self.done}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


async def run_load(url: str, scenario: Scenario | str | dict[str, Any], duration_s: float,
                   rate: float, seed: int = 0, *, progress: bool = False,
                   label: str = "") -> LoadResult:
    """Offer ``rate`` req/s of the scenario to ``url`` for ``duration_s``, then wait for the
    stragglers (each bounded by the scenario's ``request_timeout_s``)."""
    scenario = load_scenario(scenario)
    arrivals = build_schedule(scenario, rate, duration_s, seed)
    rng = random.Random(seed + 1)
    bar = Progress(len(arrivals), progress)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    records: list[Record] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()
        tasks = []
        for arrival in arrivals:
            await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
            record = Record(arrival.tenant, arrival.klass, sent_at=time.monotonic() - start,
                            offered_tokens=arrival.prompt_tokens + arrival.max_tokens)
            records.append(record)
            task = asyncio.create_task(send_request(session, url, scenario, arrival, rng, record))
            task.add_done_callback(lambda _t: bar.update())
            tasks.append(task)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
    bar.close()
    return LoadResult(url, scenario, rate, duration_s, seed, elapsed, records, label)


# -- summaries -----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def jain_index(xs: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)²/(n·Σx²): 1 when all equal, 1/n when one takes all."""
    squares = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * squares) if xs and squares > 0 else None


def weighted_max_min(demands: dict[str, float], weights: dict[str, float], capacity: float
                     ) -> dict[str, float]:
    """Weighted max-min fair allocation ("busy: share by weight; idle: borrow"): a tenant
    asking for less than its weighted share gets its demand, the rest is split by weight."""
    alloc = dict.fromkeys(demands, 0.0)
    active = {t for t, d in demands.items() if d > 0}
    left = capacity
    while active and left > 1e-9:
        total_w = sum(weights[t] for t in active)
        offer = {t: left * weights[t] / total_w for t in active}
        sated = {t for t in active if demands[t] - alloc[t] <= offer[t]}
        if not sated:
            for t in active:
                alloc[t] += offer[t]
            break
        for t in sated:
            left -= demands[t] - alloc[t]
            alloc[t] = demands[t]
        active -= sated
    return alloc


def _class_summary(records: list[Record], sla_s: float, elapsed_s: float) -> dict[str, Any]:
    ttft = [r.ttft_s for r in records if r.outcome == "ok" and r.ttft_s is not None]
    e2e = [r.e2e_s for r in records if r.outcome == "ok" and r.e2e_s is not None]
    statuses = Counter(str(r.status) for r in records)
    attempts = Counter(s for r in records for s in r.statuses)
    timeouts = sum(r.sla_missed for r in records)
    tokens = sum(r.completion_tokens for r in records if r.outcome == "ok")
    n = len(records)
    return {
        "requests": n, "ok": sum(r.outcome == "ok" for r in records),
        "outcomes": dict(Counter(r.outcome for r in records)), "final_status": dict(statuses),
        "attempts_429": attempts[429], "attempts_503": attempts[503],
        "final_429": statuses["429"], "final_503": statuses["503"],
        "retries": sum(r.retries for r in records), "sla_ttft_s": sla_s,
        **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 90, 99)},
        **{f"e2e_p{q}_s": percentile(e2e, q) for q in (50, 90, 99)},
        "timeout_rate": timeouts / n if n else None,
        "reject_rate": sum(r.outcome == "rejected" for r in records) / n if n else None,
        "completion_tokens": tokens, "tokens_per_s": tokens / elapsed_s if elapsed_s else None,
    }


def _fairness(records: list[Record], scenario: Scenario) -> dict[str, Any]:
    """Token shares (prompt + completion of answered requests) against two targets: the
    tier weights (right when every tenant is backlogged) and the weighted max-min fair share
    given what each tenant asked for (right in general)."""
    names = [t.name for t in scenario.tenants]
    weights = {t.name: t.weight for t in scenario.tenants}
    served: dict[str, float] = defaultdict(float)
    offered: dict[str, float] = defaultdict(float)
    for r in records:
        offered[r.tenant] += r.offered_tokens
        if r.outcome == "ok":
            served[r.tenant] += r.prompt_tokens + r.completion_tokens
    total = sum(served.values())
    fair = weighted_max_min({n: offered[n] for n in names}, weights, total)
    wsum = sum(weights.values())
    tenants, vs_weight, vs_fair = {}, [], []
    for name in names:
        share = served[name] / total if total else 0.0
        wshare, fshare = weights[name] / wsum, (fair[name] / total if total else 0.0)
        tenants[name] = {"weight": weights[name], "tokens": served[name],
                         "offered_tokens": offered[name], "share": share,
                         "weight_share": wshare, "fair_share": fshare}
        vs_weight.append(share / wshare)
        if fshare > 0:
            vs_fair.append(share / fshare)
    return {"tenants": tenants, "jain": jain_index(vs_weight),
            "max_share_error": max(abs(t["share"] - t["weight_share"]) for t in tenants.values()),
            "jain_demand_aware": jain_index(vs_fair),
            "max_share_error_demand_aware": max(abs(t["share"] - t["fair_share"])
                                                for t in tenants.values())}


def summarize(records: list[Record], scenario: Scenario, elapsed_s: float) -> dict[str, Any]:
    """Per class latency percentiles, SLA misses, rejections, throughput; per tenant shares."""
    slas = {c.name: c.sla_ttft_s for c in scenario.classes}
    for r in records:  # an SLA miss: late first token, or none before the client gave up
        late = r.ttft_s is not None and r.ttft_s > slas[r.klass]
        r.sla_missed = late or r.outcome == "timeout"
    by_class = {c.name: [r for r in records if r.klass == c.name] for c in scenario.classes}
    classes = {name: _class_summary(rs, slas[name], elapsed_s) for name, rs in by_class.items()}
    return {"requests": len(records), "elapsed_s": elapsed_s, "classes": classes,
            **_fairness(records, scenario)}


# -- output: JSON, table, plots --------------------------------------------------------------


def ttft_cdf_plot(results: Iterable[dict[str, Any]], out: str | Path) -> Path:
    """One panel per class, one TTFT CDF line per result (labelled by its ``label``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = list(results)
    classes = list(dict.fromkeys(c["name"] for r in results for c in r["scenario"]["classes"]))
    fig, axes = plt.subplots(1, len(classes), figsize=(6 * len(classes), 4.2), squeeze=False)
    for ax, klass in zip(axes[0], classes, strict=True):
        for i, result in enumerate(results):
            ttfts = sorted(rec["ttft_s"] for rec in result["records"]
                           if rec["klass"] == klass and rec["outcome"] == "ok")
            if ttfts:
                ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
                ax.step(ttfts, ys, where="post", label=result.get("label") or f"run {i}")
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF — {klass} (answered requests)")
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("fraction")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["class        reqs   ok  p50/p90/p99 TTFT s       p50/p99 e2e s  timeout  "
             "429  503  tok/s"]
    for name, c in summary["classes"].items():
        lines.append(
            f"{name:<12}{c['requests']:>5}{c['ok']:>5}  "
            f"{_fmt(c['ttft_p50_s'])}/{_fmt(c['ttft_p90_s'])}/{_fmt(c['ttft_p99_s']):<13}"
            f"{_fmt(c['e2e_p50_s'])}/{_fmt(c['e2e_p99_s']):<10}{_fmt(c['timeout_rate'], 100, 1)}%"
            f"{c['final_429']:>6}{c['final_503']:>5}{_fmt(c['tokens_per_s'], 1, 1):>7}")
    for name, t in summary["tenants"].items():
        lines.append(f"tenant {name:<10} weight {t['weight']:<4g} share {t['share']:.3f} "
                     f"(weight share {t['weight_share']:.3f}, fair share {t['fair_share']:.3f})")
    lines.append(f"Jain (vs weights) {_fmt(summary['jain'], 1, 3)}  max share error "
                 f"{_fmt(summary['max_share_error'], 100, 1)}%  | demand-aware: Jain "
                 f"{_fmt(summary['jain_demand_aware'], 1, 3)}, error "
                 f"{_fmt(summary['max_share_error_demand_aware'], 100, 1)}%")
    return "\n".join(lines)


def write_json(data: Any, out: str | Path) -> None:
    Path(out).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:10000")
    p.add_argument("--scenario", default="reference", help="builtin name or YAML file")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--rate", type=float, default=20.0, help="mean arrivals per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="loadgen-results.json")
    p.add_argument("--plot", default=None, help="PNG of TTFT CDFs per class")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def plot_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen plot",
                                description="TTFT CDFs of several result files, per class")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    loaded = []
    for path in args.results:
        data = json.loads(Path(path).read_text())
        runs = data.get("runs", [data])  # policy_real files hold several runs
        loaded += [{**r, "label": r.get("label") or Path(path).stem} for r in runs]
    print(ttft_cdf_plot(loaded, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    args = parse_args(argv)
    result = asyncio.run(run_load(args.url, args.scenario, args.duration, args.rate, args.seed,
                                  progress=not args.no_progress, label=args.label))
    data = {"command": "python -m bench.loadgen " + " ".join(argv), **result.to_json()}
    write_json(data, args.out)
    print(format_summary(data["summary"]))
    if args.plot:
        print(ttft_cdf_plot([data], args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
