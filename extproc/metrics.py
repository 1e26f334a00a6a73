"""Prometheus metrics kvgate exports on its admin port (``/metrics``).

The series the request path bumps several times per request are :class:`Tally` s: a plain
dict add per bump, read when Prometheus scrapes. prometheus_client's own metrics take a lock
and walk label objects on every call — measurable at thousands of messages per second.
The rest (scrapes, queue events, breaker transitions) use prometheus_client directly.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector


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


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Tally(
            "kvgate_decisions",
            "Admission outcomes by tenant and outcome (admitted, or the rejection reason).",
            ["tenant", "outcome"], self.registry,
        )
        self.tokens = Tally(
            "kvgate_tokens",
            "Tokens by tenant: reserved at admission, used per the engine's usage.",
            ["tenant", "kind"], self.registry,
        )
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
            "Calls from Envoy's Lua response meter, by kind: first (a stream's first chunk), "
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
            "1 while the shared store's circuit breaker is open or half-open, else 0.",
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
        self.endpoint_kv_usage = Gauge(
            "kvgate_endpoint_kv_cache_usage",
            "KV cache usage (0-1) each endpoint reported at its last scrape.",
            ["pool", "endpoint"],
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
            ["pool", "request_class"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.queue_events = Counter(
            "kvgate_queue_events_total",
            "Fair-queue outcomes: dispatched, expired, evicted, cancelled, shutdown.",
            ["pool", "event"],
            registry=self.registry,
        )
        self.decision_seconds = Timings(
            "kvgate_admission_seconds",
            "Time to decide admission (store round trip and any queueing included).",
            (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            self.registry,
        )
