"""Prometheus metrics kvgate exports on its admin port (``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """One registry per server, so tests can run several servers in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.decisions = Counter(
            "kvgate_decisions_total",
            "Admission outcomes by tenant and outcome (admitted, or the rejection reason).",
            ["tenant", "outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "kvgate_tokens_total",
            "Tokens by tenant: reserved at admission, used per the engine's usage.",
            ["tenant", "kind"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "kvgate_in_flight_requests",
            "Admitted requests not yet finished, by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.messages = Counter(
            "kvgate_extproc_messages_total",
            "ext_proc messages received, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "kvgate_extproc_stream_errors_total",
            "ext_proc streams that ended abnormally (client disconnect, reset, internal error).",
            ["reason"],
            registry=self.registry,
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
        self.decision_seconds = Histogram(
            "kvgate_admission_seconds",
            "Time to decide admission (store round trip and any queueing included).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=self.registry,
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoised: the request path calls this several times
        per message, and prometheus_client's own lookup takes a lock and builds a key."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
