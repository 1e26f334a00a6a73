"""Prometheus metrics kvgate exports on its admin port (``/metrics``): the one list of them.

Every series kvgate exports is declared in :class:`Metrics` (the README's Metrics table and
the dashboards are written from it; ``tests/unit/extproc/test_metrics.py`` checks the README
names every one). Label sets are bounded: a tenant, model or class label only ever holds a
configured name, :data:`OTHER` or :data:`NONE` — never a request id, a path or a key.

The series the request path bumps several times per request are :class:`Tally` s: a plain
dict add per bump, read when Prometheus scrapes. prometheus_client's own metrics take a lock
and walk label objects on every call — measurable at thousands of messages per second.
The rest (scrapes, queue events, breaker transitions) use prometheus_client directly, and
the endpoints' series are read from the endpoint store when Prometheus asks
(:class:`EndpointCollector`), so an endpoint that leaves the pool leaves no series behind.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from extproc.datalayer.endpoints import EndpointState
from extproc.scheduler import HOLD_REASONS

OTHER = "_other"
"""The label value of a tenant, model or class that is not in the configuration."""
NONE = "_none"
"""The label value where there is none yet (refused before the body named a model)."""
RELOAD_RESULTS = ("applied", "rejected")
"""``kvgate_config_reloads_total``'s results, each series exported at 0 from the start: a
series born at 1 has no earlier sample, so ``increase()`` over it reads 0 and an alert on
the first rejected reload would never fire."""


class Tally(Collector):
    """A counter (``kind="counter"``, exported as ``<name>_total``) or a gauge, by labels."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, kind: str = "counter"):
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.kind = kind
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def add(self, labels: tuple[str, ...], amount: float = 1) -> None:
        self.values[labels] = self.values.get(labels, 0) + amount

    def drop(self, label: str, values: frozenset[str]) -> None:
        """Stop exporting the series whose ``label`` holds one of ``values``."""
        index = self.labelnames.index(label)
        self.values = {labels: value for labels, value in self.values.items()
                       if labels[index] not in values}

    def collect(self) -> Iterator[Metric]:
        family_type = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = family_type(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(list(labels), value)
        yield family


class Timings(Collector):
    """A label-less histogram of durations in seconds: one bisect and two adds per sample."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry):
        self.name = name
        self.documentation = documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def collect(self) -> Iterator[Metric]:
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, self.sum)
        yield family


class EndpointCollector(Collector):
    """Each endpoint's last scrape, read from the endpoint store when Prometheus asks:
    ``states`` returns the current endpoint states, ``errors`` counts failed scrapes by
    address (the scraper's own tally)."""

    def __init__(self, states: Callable[[], Iterable[EndpointState]],
                 errors: Mapping[str, int], clock: Callable[[], float] = time.monotonic):
        self.states = states
        self.errors = errors
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "endpoint"]
        usage = GaugeMetricFamily("kvgate_endpoint_kv_cache_usage", ENDPOINT_HELP["usage"],
                                  labels=labels)
        waiting = GaugeMetricFamily("kvgate_endpoint_requests_waiting",
                                    ENDPOINT_HELP["waiting"], labels=labels)
        running = GaugeMetricFamily("kvgate_endpoint_requests_running",
                                    ENDPOINT_HELP["running"], labels=labels)
        healthy = GaugeMetricFamily("kvgate_endpoint_healthy", ENDPOINT_HELP["healthy"],
                                    labels=labels)
        age = GaugeMetricFamily("kvgate_endpoint_scrape_age_seconds", ENDPOINT_HELP["age"],
                                labels=labels)
        errors = CounterMetricFamily("kvgate_endpoint_scrape_errors", ENDPOINT_HELP["errors"],
                                     labels=labels)
        now = self.clock()
        for state in self.states():
            key = [state.pool, state.address]
            metrics, scraped_at = state.metrics, state.scraped_at
            healthy.add_metric(key, 1.0 if state.healthy else 0.0)
            errors.add_metric(key, float(self.errors.get(state.address, 0)))
            if scraped_at is not None:
                age.add_metric(key, max(0.0, now - scraped_at))
            if metrics is None:
                continue
            for family, value in ((usage, metrics.kv_cache_usage),
                                  (waiting, metrics.num_requests_waiting),
                                  (running, metrics.num_requests_running)):
                if value is not None:
                    family.add_metric(key, float(value))
        yield from (usage, waiting, running, healthy, age, errors)


class PoolCollector(Collector):
    """Why each pool's placements found no endpoint, read from its scheduler's tally when
    Prometheus asks (``holds``: pool → reason → count)."""

    def __init__(self, holds: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.holds = holds

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvgate_pool_holds",
            "Placements that found no endpoint: one count per endpoint and refused placement, "
            f"under the first check that held the endpoint ({', '.join(HOLD_REASONS)}).",
            labels=["pool", "reason"])
        for pool, reasons in self.holds().items():
            for reason, count in reasons.items():
                family.add_metric([pool, reason], float(count))
        yield family


class Collected(Collector):
    """Every family of a registry, read at one instant, for ``generate_latest`` to format
    on another thread: the collectors read live state, so they run on the event loop, but
    formatting is ~60% of a scrape's time (at 20,000 tenants: ~0.5 s of ~0.8 s for a ~10 MB
    page) and held every admission behind it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.families = list(registry.collect())

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


ENDPOINT_HELP = {
    "usage": "KV cache usage (0-1) each endpoint reported at its last successful scrape.",
    "waiting": "Requests waiting in each endpoint's engine (vllm:num_requests_waiting).",
    "running": "Requests running in each endpoint's engine (vllm:num_requests_running).",
    "healthy": "1 while the endpoint is reachable (fewer than scrape.unhealthy_after "
               "failed scrapes in a row), else 0.",
    "age": "Seconds since the endpoint's last successful scrape (absent: never scraped).",
    "errors": "Scrapes of the endpoint's /metrics that failed (unreachable, timed out, or "
              "no vLLM metrics in the answer).",
}


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tenants: frozenset[str] = frozenset()  # label values allowed (see configure)
        self.models: frozenset[str] = frozenset()
        self.classes: frozenset[str] = frozenset()
        self.requests = Tally(
            "kvgate_requests",
            "Requests by tenant, model, class and decision (admitted, rejected: 429/400 the "
            "tenant's limits; shed: 503; invalid: bad input or API key; cancelled: the client "
            "left while queued; error), with the reason (a rejection reason or error code; "
            "none when admitted).",
            ["tenant", "model", "class", "decision", "reason"], self.registry,
        )
        self.tokens_reserved = Tally(
            "kvgate_tokens_reserved",
            "Tokens reserved at admission (prompt estimate + max output), by tenant and model.",
            ["tenant", "model"], self.registry,
        )
        self.tokens_used = Tally(
            "kvgate_tokens_used",
            "Tokens charged to the tenant when its request ended (the engine's usage when it "
            "reported one), by tenant, model and kind (prompt or completion): for billing.",
            ["tenant", "model", "kind"], self.registry,
        )
        self.tokens_refunded = Tally(
            "kvgate_tokens_refunded",
            "Reserved tokens given back to the tenant's limits because the request used fewer.",
            ["tenant", "model"], self.registry,
        )
        self.charges = Tally(
            "kvgate_charges",
            "Admitted requests charged when they ended, by basis: usage (the engine's own "
            "count), usage_bounded (the engine's count past what the request can have used: "
            "charged at that bound), no_usage (an answer without a usage kvgate could read: "
            "charged its reservation), cut_off (the response ended early, the client left: "
            "reservation), engine_error (an error answer: prompt), not_started (the client "
            "left before the response began: prompt), not_sent (admitted as Envoy gave up "
            "on the stream: the routing reply never left kvgate, nothing went upstream: "
            "nothing), no_response (decided on headers: nothing).",
            ["basis"], self.registry,
        )
        self.long_prompts = Tally(
            "kvgate_long_prompts",
            "Prompts long enough to be counted off the event loop (a model with a tokenizer, "
            "more than 8,192 characters), by how: tokenizer (on the counting thread), estimate "
            "(the thread was too far behind: chars per token, corrected by the usage).",
            ["counted"], self.registry,
        )
        for how in ("tokenizer", "estimate"):  # exported at 0 from the start: alertable
            self.long_prompts.add((how,), 0)
        self.in_flight = Tally(
            "kvgate_in_flight_requests",
            "Admitted requests not yet finished, by tenant.",
            ["tenant"], self.registry, kind="gauge",
        )
        self.messages = Tally(
            "kvgate_extproc_messages",
            "ext_proc messages received, by kind.",
            ["kind"], self.registry,
        )
        self.reports = Tally(
            "kvgate_meter_reports",
            "Calls from Envoy's Lua response meter, by kind: first (a stream's first token), "
            "done (a response's end and usage), refused (a wrong key or a malformed call).",
            ["kind"], self.registry,
        )
        self.ratelimit = Tally(
            "kvgate_ratelimit_descriptors",
            "Rate Limit Service descriptors answered, by domain (configured ones; 'other') and "
            "code: ok, over_limit, shadow_over_limit (shadow mode: would have refused), "
            "unlimited, no_rule, error (the store failed).",
            ["domain", "code"], self.registry,
        )
        self.stream_errors = Tally(
            "kvgate_extproc_stream_errors",
            "ext_proc streams that ended abnormally (client disconnect, reset, internal error).",
            ["reason"], self.registry,
        )
        self.store_state = Gauge(
            "kvgate_store_breaker_open",
            "Shared-store circuit breakers open or half-open and asked by a request within "
            "10 s: one per Redis Cluster node (a single Redis has one), whose tenants' "
            "admissions follow redis.failure_policy; 0 when all are closed or idle.",
            registry=self.registry,
        )
        self.ratelimit_breakers = Gauge(
            "kvgate_ratelimit_breaker_open",
            "Rate Limit Service domains whose Redis circuit breaker is open or half-open and "
            "was asked within 10 s: their calls are answered UNAVAILABLE at once (Envoy's "
            "failure_mode_deny decides) instead of each waiting out redis.timeout_ms.",
            registry=self.registry,
        )
        self.store_transitions = Counter(
            "kvgate_store_breaker_transitions_total",
            "Circuit breaker transitions of the shared store, by new state.",
            ["state"],
            registry=self.registry,
        )
        self.store_fallbacks = Counter(
            "kvgate_store_fallback_admissions_total",
            "Admissions decided by the failure policy because the shared store was unavailable.",
            ["policy"],
            registry=self.registry,
        )
        self.store_errors = Counter(
            "kvgate_store_errors_total",
            "Shared-store (Redis) calls that failed, by error: timeout, connection, other.",
            ["error"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "kvgate_queue_depth",
            "Requests waiting in a pool's fair queue, by band and tenant.",
            ["pool", "band", "tenant"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time requests spent in the fair queue, by request class.",
            ["pool", "class"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.queue_events = Counter(
            "kvgate_queue_events_total",
            "Fair-queue outcomes: dispatched, expired, evicted, cancelled, shutdown, too_large.",
            ["pool", "event"],
            registry=self.registry,
        )
        self.queue_breaker = Gauge(
            "kvgate_queue_breaker_open",
            "1 while a pool's fair order is decided by this process's own counters because "
            "Redis does not answer (its breaker open or half-open, and asked by the queue "
            "within 10 s); 0 when Redis orders it or nothing has queued for 10 s.",
            ["pool"],
            registry=self.registry,
        )
        self.queue_fallbacks = Counter(
            "kvgate_queue_fallback_choices_total",
            "Fair-queue choices made by this process's own counters because Redis did not "
            "answer in time or its breaker was open.",
            ["pool"],
            registry=self.registry,
        )
        self.decision_seconds = Timings(
            "kvgate_admission_seconds",
            "Time to decide admission (store round trip and any queueing included).",
            (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1,
             5, 30),
            self.registry,
        )
        self.ready = Gauge(
            "kvgate_ready",
            "1 while /readyz answers 200 (config loaded, every pool scraped, not draining).",
            registry=self.registry,
        )
        self.draining = Gauge(
            "kvgate_draining",
            "1 from SIGTERM until the process exits (no new streams, open ones finishing).",
            registry=self.registry,
        )
        self.reloads = Counter(
            "kvgate_config_reloads_total",
            "Configuration reloads (SIGHUP or a changed file), by result: applied, rejected.",
            ["result"],
            registry=self.registry,
        )
        for result in RELOAD_RESULTS:  # exported at 0 from the start: see RELOAD_RESULTS
            self.reloads.labels(result)
        self.last_reload = Gauge(
            "kvgate_config_last_reload_success_timestamp_seconds",
            "Unix time the running configuration was loaded (start or last applied reload).",
            registry=self.registry,
        )

    def configure(self, tenants: Iterable[str], models: Iterable[str],
                  classes: Iterable[str]) -> None:
        """The names labels may hold. Tenants join here and leave by :meth:`forget`: a
        tenant a reload removed may still have requests to finish, counted under its own
        name."""
        self.tenants = self.tenants | frozenset(tenants)
        self.models = frozenset(models)
        self.classes = frozenset(classes)

    def forget(self, tenants: Iterable[str]) -> None:
        """Tenants a reload removed that have nothing left (``Director.forget_retired``): their
        series are no longer exported (a counter configured again starts at 0, which
        ``rate()`` and ``increase()`` read as a reset), and their names are no longer labels."""
        gone = frozenset(tenants)
        if not gone:
            return
        self.tenants = self.tenants - gone
        for tally in (self.requests, self.tokens_reserved, self.tokens_used,
                      self.tokens_refunded, self.in_flight):
            tally.drop("tenant", gone)

    def watch_endpoints(self, states: Callable[[], Iterable[EndpointState]],
                        errors: Mapping[str, int]) -> None:
        self.registry.register(EndpointCollector(states, errors))

    def watch_pools(self, holds: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.registry.register(PoolCollector(holds))

    # -- the request path ------------------------------------------------------------------

    def tenant(self, name: str | None) -> str:
        if name is None:
            return NONE
        return name if name in self.tenants else OTHER

    def model(self, name: str | None) -> str:
        if name is None:
            return NONE
        return name if name in self.models else OTHER

    def request_class(self, name: str | None) -> str:
        if name is None:
            return NONE
        return name if name in self.classes else OTHER

    def decided(self, tenant: str | None, model: str | None, request_class: str | None,
                decision: str, reason: str) -> None:
        """One request's outcome (every request gets exactly one)."""
        self.requests.add((self.tenant(tenant), self.model(model),
                           self.request_class(request_class), decision, reason))

    def admitted(self, tenant: str, model: str | None, request_class: str,
                 reserved: int) -> None:
        labels = (self.tenant(tenant), self.model(model))
        self.requests.add((*labels, self.request_class(request_class), "admitted", "none"))
        self.tokens_reserved.add(labels, reserved)
        self.in_flight.add((labels[0],))

    def finished(self, tenant: str, model: str | None, reserved: int, used: int,
                 completion: int, basis: str) -> None:
        """An admitted request ended: charged ``used`` tokens, ``completion`` of them output,
        on ``basis`` (the engine's usage, or why not: ``accounting.ResponseRecord.settle``)."""
        labels = (self.tenant(tenant), self.model(model))
        self.in_flight.add((labels[0],), -1)
        self.charges.add((basis,))
        self.tokens_used.add((*labels, "prompt"), max(0, used - completion))
        self.tokens_used.add((*labels, "completion"), completion)
        if reserved > used:
            self.tokens_refunded.add(labels, reserved - used)

    def store_error(self, error: BaseException) -> None:
        """A failed shared-store call, by a kind with a fixed set of values (the store wraps
        Redis's own errors: the first timeout or connection error along the chain of causes
        tells — ``asyncio.timeout``'s ``TimeoutError`` has the cancellation as its cause)."""
        kind = "other"
        seen: BaseException | None = error
        while seen is not None:
            name = type(seen).__name__
            if isinstance(seen, TimeoutError) or "Timeout" in name:
                kind = "timeout"
                break
            if isinstance(seen, OSError | ConnectionError) or "Connection" in name:
                kind = "connection"
                break
            seen = seen.__cause__
        self.store_errors.labels(kind).inc()


def metric_names(metrics: Metrics) -> list[str]:
    """Every family kvgate exports, as Prometheus names it (counters without ``_total``)."""
    return sorted({family.name for family in metrics.registry.collect()})
