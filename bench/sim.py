"""Gateway policies in front of a pool of simulated vLLM engines, in virtual time.

A deterministic discrete-event simulation: open-loop arrivals (``workload``), a gateway
policy (:class:`Fifo` or :class:`Gated`), and N :class:`extproc.engine.model.VirtualEngine`\\ s
running vLLM V1's step loop. The gated policies run kvgate's own sans-IO code, not a copy:

- :class:`limiter.fairqueue.FairQueue` (bands, aging, FCFS per tenant) and
  :class:`limiter.fairness.VirtualCounters` (WFQ by tokens);
- :class:`extproc.scheduler.PoolScheduler` for placement: ``place`` over a
  :class:`~extproc.datalayer.endpoints.StoreSnapshot` built from the engines' state every
  ``scrape_s`` (kvgate scrapes ``/metrics`` every ~100 ms), ``reserve``/``release`` around
  each request, so admission sees the last scrape plus the reservations made since — the
  same predictive rule as production. With ``kv_aware=False`` it is kvgate's
  least-in-flight picker with a per-endpoint ``max_in_flight``. ``first_token`` is called
  when the engine emits a request's first token: what kvgate sees as the first chunk of a
  streamed response (``GateSettings.streamed``: which classes stream; a non-streamed
  response shows nothing before it ends, so that request counts as prefilling until then).

The dispatch loop mirrors ``extproc.flow.FlowController._dispatch``: a request waits in the
queue until some endpoint has room (``fits`` = ``place`` succeeds), candidates come from the
best band with a fitting head, the selector picks one, its KV is reserved and it is sent to
the chosen engine. Queue deadlines are not modelled: a request whose TTFT exceeds its class
SLA is counted as a timeout afterwards but still served, so every policy serves the same
work.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from extproc.config import Config, Model, Pool, Scoring, Watermarks, parse_config
from extproc.datalayer.endpoints import EndpointState, StoreSnapshot
from extproc.datalayer.metrics import EngineMetrics
from extproc.engine.model import EngineConfig, SimRequest, VirtualEngine
from extproc.flow import fair_queue
from extproc.scheduler import FAIR_REPRICE_S, Placement, PoolScheduler
from limiter.fairness import VirtualCounters
from limiter.fairqueue import FairQueue, QueuedRequest

NEVER_MS = 2**61


@dataclass(frozen=True)
class ClassSpec:
    """A request class: gateway band, vLLM priority, TTFT SLA, and its length ranges
    (uniform integers, inclusive)."""

    band: int
    priority: int
    sla_s: float
    prompt: tuple[int, int]
    output: tuple[int, int]


CLASSES = {
    "interactive": ClassSpec(band=0, priority=0, sla_s=2.0, prompt=(200, 1000), output=(50, 300)),
    "batch": ClassSpec(band=1, priority=1, sla_s=60.0, prompt=(2000, 8000), output=(200, 1000)),
}
TENANTS = {"platinum": 5.0, "gold": 3.0, "free-a": 1.0, "free-b": 1.0}


def kvgate_config(tenants: dict[str, float] = TENANTS, engines: int = 4,
                  **pool: object) -> Config:
    """kvgate's configuration for this workload, as a platform team would write it: tenants
    and their weights, the classes, the endpoints (priority-scheduled engines). Every
    scheduling and admission knob is the config model's default unless ``pool`` names it
    (the benchmark's alternative settings)."""
    return parse_config({
        "tiers": {name: {"weight": weight} for name, weight in tenants.items()},
        "tenants": [{"name": name, "tier": name, "api_keys": ["sha256:" + "0" * 63 + str(i)]}
                    for i, name in enumerate(tenants)],
        "classes": {name: {"priority": spec.priority} for name, spec in CLASSES.items()},
        "pools": [{"name": "sim", "models": ["m"], "priority_scheduling": True,
                   "endpoints": [f"10.0.0.{i + 1}:8000" for i in range(engines)], **pool}],
    })


QUEUE_PRICES = kvgate_config().queue


def a100_llama3_8b(policy: str = "fcfs") -> EngineConfig:
    """One vLLM engine: Llama-3-8B fp16 on an A100-80GB (profile: ``EngineProfile``).

    KV: 0.9 × 80 GB − 16 GB weights − ~3 GB activations ≈ 53 GB at 128 KiB per token
    (2 × 32 layers × 8 KV heads × 128 × 2 bytes) ≈ 430k tokens = 27,000 blocks of 16.
    ``max_num_seqs`` 256 and ``max_num_batched_tokens`` 2048: vLLM 0.32's A100 defaults.
    """
    return EngineConfig(scheduling_policy=policy, kv_blocks=27_000, block_size=16,
                        max_num_seqs=256, max_num_batched_tokens=2048)


@dataclass(eq=False)
class Job:
    """One client request and what happened to it."""

    id: str
    tenant: str
    klass: str
    arrival: float
    prompt: int
    max_tokens: int
    req: SimRequest | None = None
    engine: int | None = None
    charged: int = 0  # what its tenant's fair-order counter was charged for it
    charged_band0: bool = False  # … as band-0 work (Waiter.charged_band0)
    output: int | None = None  # the tokens the engine really produces (None: max_tokens)

    @property
    def produces(self) -> int:
        return self.max_tokens if self.output is None else self.output

    @property
    def cost(self) -> int:
        """KV tokens kvgate reserves: prompt + max output."""
        return self.prompt + self.max_tokens

    @property
    def price(self) -> int:
        """What the fair order charges once the request is corrected to its real usage
        (kvgate's default prices): the unit of the shares."""
        return QUEUE_PRICES.price(self.prompt, self.produces)

    @property
    def ttft(self) -> float | None:
        req = self.req
        if req is None or req.first_token_at is None:
            return None
        return req.first_token_at - self.arrival


ASKS = ("used", "ceiling")
"""What a workload's clients set ``max_tokens`` to: the output each answer makes (``used``,
the default), or its class's largest output (``ceiling``: a client that asks one fixed
``max_tokens`` for answers of every length, as most do)."""


def workload(n: int, rate: float, seed: int, tenants: dict[str, float] = TENANTS,
             interactive: float = 0.7, asks: str = "used") -> list[Job]:
    """``n`` Poisson arrivals at ``rate``/s; each tenant sends an equal share of requests
    (equal demand, unequal weights), ``interactive`` of them interactive, the rest batch;
    ``asks``: see :data:`ASKS` (the same draws either way, so the same answers).

    The same generator serves both scenarios of ``bench.policy_sim``: near capacity (the
    latency scenario) and at ~2× capacity (the contention scenario, where every tenant's
    demand — a quarter of 2× capacity — exceeds even platinum's weighted share, 5/10)."""
    rng = random.Random(seed)
    names = sorted(tenants)
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        klass = "interactive" if rng.random() < interactive else "batch"
        spec = CLASSES[klass]
        tenant, prompt, output = rng.choice(names), rng.randint(*spec.prompt), rng.randint(
            *spec.output)
        if asks == "ceiling":
            jobs.append(Job(f"j{i}", tenant, klass, t, prompt, spec.output[1], output=output))
        else:
            jobs.append(Job(f"j{i}", tenant, klass, t, prompt, output))
    return jobs


class Policy:
    """What the gateway does; the :class:`Simulation` calls these at events."""

    name = "policy"
    engine_policy = "fcfs"
    scrape_s: float | None = None  # how often on_tick runs; None = never

    def bind(self, sim: Simulation) -> None:
        self.sim = sim

    def on_arrival(self, job: Job, now: float) -> None:
        raise NotImplementedError

    def on_finish(self, job: Job, now: float) -> None:
        """A request finished on its engine."""

    def on_first_token(self, job: Job, now: float) -> None:
        """A request's first token came out of its engine."""

    def on_tick(self, now: float) -> None:
        """A scrape interval passed."""

    def backlog(self) -> int:
        return 0


class Fifo(Policy):
    """(a) No gateway queue: round-robin straight to FCFS engines."""

    name = "fifo"

    def __init__(self) -> None:
        self._next = 0

    def on_arrival(self, job: Job, now: float) -> None:
        self.sim.submit(job, self._next, 0, now)
        self._next = (self._next + 1) % len(self.sim.engines)


@dataclass
class GateSettings:
    """The knobs of one gated policy (kvgate's config names where it has them)."""

    name: str
    bands: bool = True  # interactive before batch; False: one band
    wfq: bool = True  # weighted fair queueing across tenants; False: FCFS in a band
    aging_s: float | None = None
    kv_aware: bool = False  # admit by KV watermark, route by KV score
    high_watermark: float = 0.8
    critical_watermark: float = 0.8  # = high: nothing above the high watermark
    max_in_flight: int | None = None  # per endpoint (kv_aware=False needs it)
    engine_priority: bool = True  # engines run --scheduling-policy priority
    scrape_s: float = 0.1
    scoring: Scoring | None = None  # picker weights; None = kvgate's defaults
    max_waiting: int | None = None  # watermarks.max_waiting: engine queue length cap
    reserved_in_flight: int = 0  # of max_in_flight, slots only band 0 may use
    prefill_clear_share: float = 0.0  # share of endpoints kept free of lower-band prefill
    streamed: tuple[str, ...] = ("interactive", "batch")  # classes whose first token is seen
    shipped: dict[str, object] | None = None  # kvgate's own configuration for this workload
    # (``kvgate_config``, with these pool settings on top): every knob above but name, bands,
    # wfq, engine_priority, scrape_s and streamed then comes from it


def defaults(name: str = "kvgate", streamed: tuple[str, ...] = ("interactive", "batch"),
             **pool: object) -> GateSettings:
    """kvgate as shipped: its config model's defaults for this workload (``kvgate_config``)."""
    return GateSettings(name, kv_aware=True, streamed=streamed, shipped=pool)


class Gated(Policy):
    """(b)–(d): kvgate's fair queue, fairness selector and pool scheduler."""

    def __init__(self, settings: GateSettings, seed: int = 0) -> None:
        self.settings = s = settings
        self.name = s.name
        self.engine_policy = "priority" if s.engine_priority else "fcfs"
        self.scrape_s = s.scrape_s if s.kv_aware else None
        aging = None if s.aging_s is None else int(s.aging_s * 1000)
        self.queue = FairQueue(max_size=10**7, aging_ms=aging)
        self.fairness = VirtualCounters()
        self.rng = random.Random(seed)
        self.jobs: dict[str, Job] = {}
        self.running: dict[str, Job] = {}  # dispatched, not finished
        self.snapshot = StoreSnapshot()
        self._repriced_at = -math.inf

    def bind(self, sim: Simulation) -> None:
        super().bind(sim)
        self.addresses = [f"10.0.0.{i + 1}:8000" for i in range(len(sim.engines))]
        shipped = self.settings.shipped
        if shipped is None:
            pool = self._pool()
        else:
            config = kvgate_config(dict(sim.tenants), len(sim.engines), **shipped)
            pool = config.pools[0]
            self.queue = fair_queue(config)
            self.queue.max_size = 10**7  # no queue deadlines or evictions are modelled
            self.fairness = VirtualCounters(lag_tokens=config.queue.share_lag_tokens)
        self.scheduler = PoolScheduler(pool, dict(sim.tenants))
        self.on_tick(0.0)

    def _pool(self) -> Pool:
        s = self.settings
        kv = dict(prefill_clear_share=s.prefill_clear_share,
                  watermarks=Watermarks(high=s.high_watermark, critical=s.critical_watermark,
                                        max_waiting=s.max_waiting),
                  scoring=s.scoring or Scoring()) if s.kv_aware else {}
        return Pool(name="sim", models=[Model(name="m")], endpoints=self.addresses,
                    kv_aware=s.kv_aware, priority_scheduling=s.engine_priority,
                    max_in_flight=s.max_in_flight, reserved_in_flight=s.reserved_in_flight,
                    **kv)

    def backlog(self) -> int:
        return len(self.queue)

    def on_arrival(self, job: Job, now: float) -> None:
        spec = CLASSES[job.klass]
        if self.settings.wfq and not self.queue.queued(job.tenant):
            self.fairness.activate(job.tenant)
        band = spec.band if self.settings.bands else 0
        item = QueuedRequest(job.id, job.tenant, band, job.cost, self.sim.tenants[job.tenant],
                             _ms(now), NEVER_MS, price=self._price(job))
        self.jobs[job.id] = job
        self.queue.push(item, _ms(now))
        self.dispatch(now)

    def _price(self, job: Job) -> int:
        """As the director prices a queued request: its prompt and the output its tenant's
        requests are expected to make (``Director._queue_price``: the scheduler's
        ``fair_ratio``); what dispatching it charges (``job.charged``) is its price then."""
        ratio = self.scheduler.fair_ratio(job.tenant)
        job.charged = QUEUE_PRICES.price(job.prompt, math.ceil(job.max_tokens * ratio))
        return job.charged

    def on_finish(self, job: Job, now: float) -> None:
        """As the director releases a request: the engine's usage teaches the scheduler,
        and the fair-order charge is corrected to it."""
        self.scheduler.release(job.id, now, output_tokens=job.produces)
        self.running.pop(job.id, None)
        if self.settings.wfq:
            self.fairness.correct(job.tenant, job.price - job.charged,
                                  self.sim.tenants[job.tenant], band0=job.charged_band0)
        self.dispatch(now)

    def on_first_token(self, job: Job, now: float) -> None:
        """What the stream sees as a streamed response's first chunk (a capacity event)."""
        if job.klass in self.settings.streamed:
            self.scheduler.first_token(job.id, now)
            self.dispatch(now)

    def on_tick(self, now: float) -> None:
        """A scrape: every engine's KV usage and queues, as kvgate's scraper reports them."""
        states = {}
        for address, engine in zip(self.addresses, self.sim.engines, strict=True):
            capacity = engine.config.kv_blocks * engine.config.block_size
            metrics = EngineMetrics(kv_cache_usage=engine.kv_cache_usage,
                                    num_requests_running=len(engine.running),
                                    num_requests_waiting=len(engine.waiting),
                                    kv_capacity_tokens=capacity)
            # Just before ``now``: reservations made at ``now`` are not in these numbers.
            states[address] = EndpointState(address, "sim", metrics, now - 1e-9, 0, True,
                                            capacity)
        self.snapshot = StoreSnapshot(self.snapshot.version + 1,
                                      MappingProxyType({"sim": MappingProxyType(states)}))
        self.scheduler.observe(self.snapshot)  # as the server's scrape hook does
        overran = bool(self.scheduler.take_overran())
        if self.settings.wfq and (overran or now - self._repriced_at >= FAIR_REPRICE_S):
            self._reprice(now)
        if now > 0:
            self.dispatch(now)

    def _reprice(self, now: float) -> None:
        """As ``Director._reprice`` does after a scrape: every request in flight priced
        again by the scheduler's ``fair_ratio_of``, one correction per tenant and band."""
        self._repriced_at = now
        moves: dict[tuple[str, bool], int] = {}
        for job in self.running.values():
            ratio = self.scheduler.fair_ratio_of(job.id, now)
            if ratio is None:
                continue
            price = QUEUE_PRICES.price(job.prompt, math.ceil(job.max_tokens * ratio))
            if price != job.charged:
                key = (job.tenant, job.charged_band0)
                moves[key] = moves.get(key, 0) + price - job.charged
                job.charged = price
        for (tenant, band0), tokens in moves.items():
            if tokens:
                self.fairness.correct(tenant, tokens, self.sim.tenants[tenant], band0=band0)

    def dispatch(self, now: float) -> None:
        """``FlowController._dispatch``: best band's fitting heads, selector, reserve, send."""
        now_ms = _ms(now)
        while len(self.queue):
            offers = self.queue.candidates(now_ms, lambda item: self._place(item, now)
                                           is not None)
            if self.settings.wfq:
                for offer in offers:  # priced as of the dispatch (flow._price_now)
                    offer.item.price = self._price(self.jobs[offer.item.id])
                chosen = self.fairness.choose(offers)
            else:  # strict priority: the best band's earliest request that fits
                fitting = [offer for offer in offers if offer.fits]
                chosen = min(fitting, key=lambda o: o.band).item if fitting else None
            if chosen is None:
                return
            self.queue.take(chosen.id)
            address = self._place(chosen, now)
            assert address is not None
            job = self.jobs.pop(chosen.id)
            self.running[chosen.id] = job
            band = self.queue.effective_band(chosen, now_ms)  # as offered: the band charged
            job.charged_band0 = band == 0
            self.scheduler.reserve(chosen.id, chosen.tenant, address, chosen.cost, now,
                                   band=band,
                                   prompt_tokens=job.prompt,
                                   streamed=job.klass in self.settings.streamed)
            priority = CLASSES[job.klass].priority if self.settings.engine_priority else 0
            self.sim.submit(job, self.addresses.index(address), priority, now)

    def _place(self, item: QueuedRequest, now: float) -> str | None:
        placed = self.scheduler.place(item.tenant, item.cost, self.snapshot, now, self.rng,
                                      band=self.queue.effective_band(item, _ms(now)),
                                      waited_s=now - item.enqueued_ms / 1000,
                                      prompt_tokens=self.jobs[item.id].prompt)
        return placed.endpoints[0] if isinstance(placed, Placement) else None


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


@dataclass
class SimResult:
    policy: str
    jobs: list[Job]
    contended: Counter[str]  # KV tokens admitted while every tenant was backlogged
    window: tuple[float, float]
    batch_tokens_in_window: int
    end: float
    preemptions: int


class Simulation:
    """The event loop: arrivals, engine step ends, scrape ticks, sampling instants."""

    def __init__(self, jobs: list[Job], policy: Policy, engines: int = 4,
                 engine_config: Callable[[str], EngineConfig] = a100_llama3_8b,
                 tenants: dict[str, float] = TENANTS) -> None:
        self.jobs, self.policy, self.tenants = jobs, policy, tenants
        self.engines = [VirtualEngine(engine_config(policy.engine_policy), f"e{i}")
                        for i in range(engines)]
        self.by_req: dict[int, Job] = {}
        self._first_tokens: list[Job] = []  # seen during an engine advance, handled after
        self.pending: Counter[str] = Counter()  # arrived, not yet admitted by an engine
        last = jobs[-1].arrival if jobs else 0.0
        self.window = (0.25 * last, 0.75 * last)
        self.contended: Counter[str] = Counter()
        self.now = 0.0
        self._window_tokens: list[int] = []
        for engine in self.engines:
            engine.on_admitted = self._admitted
            engine.on_first_token = self._first_token
        policy.bind(self)

    def submit(self, job: Job, engine: int, priority: int, now: float) -> None:
        job.engine = engine
        job.req = self.engines[engine].submit(job.prompt, job.produces, priority, now, job.id)
        self.by_req[id(job.req)] = job

    def _admitted(self, req: SimRequest, waited: float) -> None:
        job = self.by_req[id(req)]
        lo, hi = self.window
        if lo <= self.now < hi and all(self.pending[t] > 0 for t in self.tenants):
            self.contended[job.tenant] += job.price
        self.pending[job.tenant] -= 1

    def _first_token(self, req: SimRequest, waited: float) -> None:
        self._first_tokens.append(self.by_req[id(req)])

    def _batch_tokens(self) -> int:
        return sum(j.req.generated for j in self.jobs if j.klass == "batch" and j.req)

    def run(self) -> SimResult:
        arrivals, i, n = self.jobs, 0, len(self.jobs)
        tick = self.policy.scrape_s
        next_tick = tick if tick else math.inf
        marks = list(self.window)
        while True:
            t_engine = min((t for e in self.engines if (t := e.next_time()) is not None),
                           default=math.inf)
            t_arrival = arrivals[i].arrival if i < n else math.inf
            busy = i < n or self.policy.backlog() or t_engine < math.inf
            if not busy:
                break
            t_mark = marks[0] if marks else math.inf
            now = self.now = min(t_engine, t_arrival, next_tick, t_mark)
            self._advance_engines(now)
            if now == t_mark:
                self._window_tokens.append(self._batch_tokens())
                marks.pop(0)
            if now == t_arrival:
                job = arrivals[i]
                i += 1
                self.pending[job.tenant] += 1
                self.policy.on_arrival(job, now)
            if now == next_tick:
                self.policy.on_tick(now)
                next_tick += tick  # type: ignore[operator]
        end = max((j.req.finished_at or 0.0) for j in self.jobs if j.req) if self.jobs else 0.0
        window_tokens = (self._window_tokens[1] - self._window_tokens[0]
                         if len(self._window_tokens) == 2 else 0)
        return SimResult(self.policy.name, self.jobs, self.contended, self.window, window_tokens,
                         end, sum(e.num_preemptions for e in self.engines))

    def _advance_engines(self, now: float) -> None:
        for engine in self.engines:
            due = engine.next_time()
            if due is not None and due <= now:
                for req in engine.advance(now):
                    self.policy.on_finish(self.by_req.pop(id(req)), req.finished_at or now)
        firsts, self._first_tokens = self._first_tokens, []
        for job in firsts:
            assert job.req is not None and job.req.first_token_at is not None
            self.policy.on_first_token(job, job.req.first_token_at)


# -- metrics ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0–100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one takes everything."""
    if not values or not any(values):
        return math.nan
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def weighted_shares(result: SimResult, tenants: dict[str, float] = TENANTS) -> dict:
    """Weighted-share accuracy **under contention**.

    Meaningful only when every tenant wants more than its weighted share (run it on the
    contention scenario; near capacity with equal demand the heavy tenants never want 5/10
    of the pool, so their ratio stays under 1 whatever the scheduler does). Counted over
    the engine admissions (first admission of a request into an engine's running batch:
    where the tenant starts getting GPU time) made inside the loaded window (25–75% of the
    arrival period) while **every** tenant had at least one request waiting (arrived, not
    yet admitted: in the gateway queue or an engine's waiting queue) — "busy: share by
    weight". Each admission adds its price (prompt and max output at kvgate's default
    queue prices, what the fair order charges) to its tenant. ``ratio`` is a tenant's share
    of those priced tokens over its weight share; the error is ``max |ratio − 1|`` and Jain's
    index is over the ratios (1 = exactly weighted).
    """
    total = sum(result.contended.values())
    weight = sum(tenants.values())
    if not total:
        return {"tokens": 0, "ratio": {}, "max_error": math.nan, "jain": math.nan}
    ratios = {t: (result.contended[t] / total) / (w / weight) for t, w in tenants.items()}
    return {"tokens": total, "ratio": {t: round(r, 4) for t, r in ratios.items()},
            "max_error": max(abs(r - 1) for r in ratios.values()),
            "jain": jain(list(ratios.values()))}


def summarize(result: SimResult) -> dict:
    """The per-policy numbers the benchmark reports."""
    inter = [j.ttft for j in result.jobs if j.klass == "interactive" and j.ttft is not None]
    batch = [j.ttft for j in result.jobs if j.klass == "batch" and j.ttft is not None]
    sla = CLASSES["interactive"].sla_s
    lo, hi = result.window
    shares = weighted_shares(result)
    return {
        "policy": result.policy,
        "interactive_ttft_p50_s": percentile(inter, 50),
        "interactive_ttft_p99_s": percentile(inter, 99),
        "interactive_timeout_rate": sum(t > sla for t in inter) / len(inter) if inter else 0.0,
        "batch_ttft_p50_s": percentile(batch, 50),
        "batch_ttft_p99_s": percentile(batch, 99),
        "batch_timeout_rate": (sum(t > CLASSES["batch"].sla_s for t in batch) / len(batch)
                               if batch else 0.0),
        "batch_throughput_tok_s": result.batch_tokens_in_window / (hi - lo) if hi > lo else 0.0,
        "jain": shares["jain"],
        "weighted_share_error": shares["max_error"],
        "share_ratio": shares["ratio"],
        "contended_tokens": shares["tokens"],
        "preemptions": result.preemptions,
        "makespan_s": result.end,
    }
