"""kvgate's own metrics: bounded label values, the token counters billing reads, and the
README naming every series kvgate exports (extproc/metrics.py is the one list)."""

from __future__ import annotations

import asyncio
import inspect
import re

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc import rls
from extproc.config import hash_api_key, parse_config
from extproc.datalayer.endpoints import EndpointState
from extproc.datalayer.metrics import EngineMetrics
from extproc.metrics import NONE, OTHER, Collected, Metrics, metric_names
from extproc.ports import free_port
from extproc.wiring import build_store
from limiter import Admit, Cost
from limiter.decision import TenantPolicy
from limiter.fairqueue import Offer, QueuedRequest
from limiter.stores.base import StoreUnavailable
from limiter.stores.failover import BREAKER_IDLE_MS, FailoverFairness, FailoverStore
from tests.limiter_support import one_pool_fairness
from tests.paths import REPO

ORDER = ("tenant", "pool", "endpoint", "model", "class", "decision", "reason", "kind",
         "error", "basis", "result")


def values(metrics: Metrics, name: str) -> dict[tuple[str, ...], float]:
    """A series' samples by their label values, in ``ORDER``."""
    text = generate_latest(metrics.registry).decode()
    return {tuple(s.labels[k] for k in ORDER if k in s.labels): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def configured() -> Metrics:
    metrics = Metrics()
    metrics.configure(["acme"], ["m"], ["interactive"])
    return metrics


def test_label_values_are_configured_names_or_two_fixed_ones() -> None:
    metrics = configured()
    metrics.decided("acme", "m", "interactive", "rejected", "tokens")
    metrics.decided("intruder", "gpt-9", "vip", "invalid", "model_not_found")
    metrics.decided(None, None, None, "invalid", "invalid_api_key")
    assert set(values(metrics, "kvgate_requests_total")) == {
        ("acme", "m", "interactive", "rejected", "tokens"),
        (OTHER, OTHER, OTHER, "invalid", "model_not_found"),
        (NONE, NONE, NONE, "invalid", "invalid_api_key"),
    }


def test_reload_results_are_exported_at_zero_from_the_start() -> None:
    """Alerts take increase() of them: a series born at 1 on the first rejected reload has
    no earlier sample to increase from, and that reload would never alert."""
    assert values(Metrics(), "kvgate_config_reloads_total") == {
        ("applied",): 0, ("rejected",): 0}


def test_a_tenant_removed_by_a_reload_keeps_its_label() -> None:
    metrics = configured()
    metrics.admitted("acme", "m", "interactive", 10)
    metrics.configure([], ["m"], ["interactive"])  # acme removed while in flight
    metrics.finished("acme", "m", 10, 4, 1, "usage")
    assert values(metrics, "kvgate_in_flight_requests") == {("acme",): 0}


def test_a_forgotten_tenant_is_no_longer_exported() -> None:
    """Once a removed tenant has nothing left (``Director.forget_retired``) its series go:
    a platform that renames its tenants every day exported every tenant it ever had."""
    metrics = configured()
    metrics.configure(["acme", "gone"], ["m"], ["interactive"])
    for tenant in ("acme", "gone"):
        metrics.admitted(tenant, "m", "interactive", 10)
        metrics.finished(tenant, "m", 10, 4, 1, "usage")
        metrics.decided(tenant, "m", "interactive", "rejected", "tokens")
    metrics.configure(["acme"], ["m"], ["interactive"])  # removed: still exported
    assert ("gone",) in values(metrics, "kvgate_in_flight_requests")
    metrics.forget(["gone"])
    text = generate_latest(metrics.registry).decode()
    assert 'tenant="gone"' not in text and 'tenant="acme"' in text
    metrics.decided("gone", "m", "interactive", "invalid", "invalid_api_key")
    assert ("_other", "m", "interactive", "invalid", "invalid_api_key") in values(
        metrics, "kvgate_requests_total")


def test_tokens_reserved_used_and_refunded() -> None:
    metrics = configured()
    metrics.admitted("acme", "m", "interactive", 100)
    metrics.finished("acme", "m", 100, 30, 20, "usage")
    metrics.finished("acme", "m", 100, 100, 90, "no_usage")
    assert values(metrics, "kvgate_tokens_used_total") == {
        ("acme", "m", "prompt"): 20, ("acme", "m", "completion"): 110}
    assert values(metrics, "kvgate_tokens_refunded_total") == {("acme", "m"): 70}
    assert values(metrics, "kvgate_charges_total") == {("usage",): 1, ("no_usage",): 1}


def test_store_errors_by_kind() -> None:
    metrics = configured()
    for error in (TimeoutError(), ConnectionRefusedError(), ValueError()):
        try:
            raise RuntimeError("store call failed") from error
        except RuntimeError as wrapped:
            metrics.store_error(wrapped)
    assert values(metrics, "kvgate_store_errors_total") == {
        ("timeout",): 1, ("connection",): 1, ("other",): 1}


async def test_a_call_cut_by_asyncio_timeout_counts_as_a_timeout() -> None:
    """``asyncio.timeout`` raises a ``TimeoutError`` whose cause is the cancellation."""
    metrics = configured()
    try:
        try:
            async with asyncio.timeout(0.001):
                await asyncio.sleep(1)
        except TimeoutError as timed_out:
            raise RuntimeError("store call failed") from timed_out
    except RuntimeError as wrapped:
        metrics.store_error(wrapped)
    assert values(metrics, "kvgate_store_errors_total") == {("timeout",): 1}


def test_endpoint_series_come_from_the_store_when_scraped() -> None:
    metrics = Metrics()
    states = [EndpointState("10.0.0.1:8000", "p", EngineMetrics(
        kv_cache_usage=0.5, num_requests_running=3, num_requests_waiting=1), scraped_at=0.0,
        healthy=True), EndpointState("10.0.0.2:8000", "p")]
    metrics.watch_endpoints(lambda: states, {"10.0.0.2:8000": 4})
    one, two = ("p", "10.0.0.1:8000"), ("p", "10.0.0.2:8000")
    assert values(metrics, "kvgate_endpoint_kv_cache_usage") == {one: 0.5}
    assert values(metrics, "kvgate_endpoint_requests_running") == {one: 3}
    assert values(metrics, "kvgate_endpoint_requests_waiting") == {one: 1}
    assert values(metrics, "kvgate_endpoint_healthy") == {one: 1, two: 0}
    assert values(metrics, "kvgate_endpoint_scrape_errors_total") == {one: 0, two: 4}
    assert set(values(metrics, "kvgate_endpoint_scrape_age_seconds")) == {one}
    states.pop(0)  # an endpoint that left the pool leaves no series
    assert set(values(metrics, "kvgate_endpoint_healthy")) == {two}


def test_pool_holds_come_from_the_schedulers_tally() -> None:
    metrics = Metrics()
    holds = {"p": {"kv_cache": 3, "engine_queue": 1}, "q": {}}
    metrics.watch_pools(lambda: holds)
    assert values(metrics, "kvgate_pool_holds_total") == {
        ("p", "kv_cache"): 3, ("p", "engine_queue"): 1}
    holds["q"]["prefill_clear"] = 2  # read when Prometheus asks
    assert values(metrics, "kvgate_pool_holds_total")[("q", "prefill_clear")] == 2


def test_the_readme_lists_every_metric() -> None:
    metrics = Metrics()
    metrics.watch_endpoints(lambda: [], {})
    metrics.watch_pools(lambda: {})
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(kvgate_[a-z_]+)", section))
    counters = {f.name for f in metrics.registry.collect() if f.type == "counter"}
    exported = {name + "_total" if name in counters else name
                for name in metric_names(metrics)}
    assert exported <= listed, f"not in the README: {sorted(exported - listed)}"
    assert listed <= exported | {"kvgate_decisions_total", "kvgate_tokens_total"}, (
        f"in the README, not exported: {sorted(listed - exported)}")


def _readme_row(metric: str) -> str:
    section = (REPO / "README.md").read_text().split("\n## Metrics", 1)[1]
    (row,) = [line for line in section.splitlines() if line.startswith(f"| `{metric}`")]
    return row


def test_the_readme_names_the_label_values_kvgate_exports() -> None:
    """A query written from the Metrics table must match what kvgate exports: the table
    said ``OK`` / ``OVER_LIMIT`` for the Rate Limit Service's codes (exported lower case,
    with four more), and ``client_gone`` for a stream error that is never counted there (a
    client leaving while queued is ``kvgate_requests_total{decision="cancelled"}``; only
    a stream holding an admission, or failing in kvgate, counts as a stream error)."""
    rls_source = (REPO / "extproc" / "rls.py").read_text()
    codes = set(re.findall(r'"(\w+)"', inspect.getsource(rls._code))) | {"error"}
    assert '(label, "error")' in rls_source
    named = set(re.findall(r"`(\w+)`", _readme_row("kvgate_ratelimit_descriptors_total")))
    assert codes <= named and not {"OK", "OVER_LIMIT"} & named, named
    sources = "".join(p.read_text() for p in (REPO / "extproc").glob("*.py"))
    counted = set(re.findall(r'stream_errors\.add\(\("(\w+)"', sources))
    ended = set(re.findall(r'ending(?:: str \| None)? = "(\w+)"', sources))
    ended -= {"client_gone"}  # (set when the stream holds no admission: not counted)
    ended |= set(re.findall(r'self\._release\(stream, "(\w+)"\)', sources))
    listed = set(re.findall(r"`(\w+)`", _readme_row("kvgate_extproc_stream_errors_total")))
    assert listed - {"reason", "kvgate_extproc_stream_errors_total"} == counted | ended, listed


def test_collected_families_format_as_the_registry_does() -> None:
    """``/metrics`` formats what it collected on a thread: the same page as formatting the
    registry itself."""
    metrics = Metrics()
    metrics.ratelimit.add(("d", "ok"), 3)
    assert generate_latest(Collected(metrics.registry)) == generate_latest(metrics.registry)


class _DownFairness:
    """Redis's fair-queue counters while Redis is down: every call fails at once."""

    async def choose(self, *_args: object) -> None:
        raise StoreUnavailable("redis fairness choose failed: connection refused")

    async def undo(self, *_args: object) -> bool:
        return True

    async def close(self) -> None:
        pass


async def test_the_fair_queue_breaker_gauge_goes_back_to_0_once_nothing_is_ordered() -> None:
    """``kvgate_queue_breaker_open{pool}`` says the pool's fair order is this process's own.
    Only a queue call moves the breaker, and a pool queues only while saturated: an outage
    during one burst left the gauge at 1 (and KvgateFairOrderLocal firing) while Redis was
    back and nothing queued, until the pool next saturated. It counts a breaker a queue
    call asked within ``BREAKER_IDLE_MS``."""
    fair, metrics = one_pool_fairness({"url": f"redis://127.0.0.1:{free_port()}",
                                       "breaker_failures": 2, "breaker_open_ms": 60_000})
    assert isinstance(fair, FailoverFairness)
    now = [1_000_000]
    fair.shared, fair.clock_ms = _DownFairness(), lambda: now[0]  # type: ignore[assignment]

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("kvgate_queue_breaker_open", {"pool": "one"})

    assert gauge() == 0
    two = [Offer(QueuedRequest(t, t, 1, 10, 1.0, 0, 10**12), 1, True) for t in "AB"]
    for _ in range(3):  # two fail in Redis, then the breaker skips it: the order is local
        assert await fair.choose(two) is not None
    assert gauge() == 1
    now[0] += BREAKER_IDLE_MS  # still ordering (a choice may be seconds apart)
    assert gauge() == 1
    now[0] += 1  # the queue emptied: nothing has asked for 10 s, nothing is ordered
    assert gauge() == 0
    assert await fair.choose(two) is not None  # saturated again, Redis still down
    assert gauge() == 1
    await fair.close()


async def test_the_store_breaker_gauge_counts_only_a_breaker_admissions_still_ask() -> None:
    """``kvgate_store_breaker_open`` counts the Redis nodes whose tenants the failure policy
    decides. Only a call moves a breaker: a single Redis's stayed open (and
    KvgateRedisBypassed firing) on a replica that got no request after Redis came back,
    however long. Like a cluster node's, it counts while a call asked it within
    ``BREAKER_IDLE_MS``."""
    config = parse_config({
        "redis": {"url": f"redis://127.0.0.1:{free_port()}", "breaker_failures": 2,
                  "breaker_open_ms": 60_000, "failure_policy": "local"},
        "tiers": {"t": {}},
        "tenants": [{"name": "A", "tier": "t", "api_keys": [hash_api_key("sk-a")]}],
        "pools": [{"name": "one", "models": [{"name": "m"}], "endpoints": ["127.0.0.1:1"]}],
    })
    metrics = Metrics()
    store = build_store(config, metrics)
    assert isinstance(store, FailoverStore)
    now = [1_000_000]
    store.clock_ms = lambda: now[0]  # type: ignore[method-assign]

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("kvgate_store_breaker_open")

    assert gauge() == 0
    for n in range(3):  # two fail in Redis (refused), then the breaker skips it
        admit = await store.admit("A", TenantPolicy(), Cost(10, 10), f"lease-{n}")
        assert isinstance(admit, Admit)  # by failure_policy local
        await store.release("A", TenantPolicy(), f"lease-{n}", 15)
    assert gauge() == 1
    now[0] += BREAKER_IDLE_MS
    assert gauge() == 1
    now[0] += 1  # no request since: nothing is decided by the failure policy
    assert gauge() == 0
    assert await store.check_requests("A", TenantPolicy()) is None  # a request again
    assert gauge() == 1
    await store.close()
