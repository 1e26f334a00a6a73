"""Builds the parts a configuration asks for: the limit store, the fair-queue counters, and
the director over its pipeline's parts.

Stores are in-memory unless ``redis:`` is configured; then Redis behind the failover wrapper
(:mod:`limiter.stores.failover`), with its breaker and failure policy wired to metrics.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from extproc.classify import Classifier
from extproc.config import Config, RedisSettings, upstream_authorizations
from extproc.counting import PromptCosts
from extproc.datalayer.endpoints import EndpointStore
from extproc.director import Director
from extproc.flow import FlowController
from extproc.metrics import Metrics
from extproc.pricing import Pricer
from extproc.scheduler import PoolScheduler
from extproc.tenants import Tenants
from limiter.breaker import CircuitBreaker, Transition
from limiter.stores import (
    FailoverFairness,
    FailoverStore,
    FailurePolicy,
    Fairness,
    LimiterStore,
    MemoryFairness,
    MemoryStore,
)
from limiter.stores.ratelimit import MemoryRateCounters, RateCounters


def redis_client(settings: RedisSettings) -> Any:
    """No retries of the client's own: the store retries once on a dead connection, the
    breaker does the rest."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    timeout_s = settings.timeout_ms / 1000
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
               "retry": Retry(NoBackoff(), 0)}
    if settings.cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(settings.url, **options)
    return aioredis.from_url(settings.url, **options)


def build_store(config: Config, metrics: Metrics) -> LimiterStore:
    """In-memory unless ``redis`` is configured; then Redis behind the failure policy."""
    if config.redis is None:
        return MemoryStore()
    from limiter.stores.redis_store import RedisStore

    settings = config.redis
    timeout_s = settings.timeout_ms / 1000
    client = redis_client(settings)
    primary = RedisStore(
        client, prefix=settings.prefix, lease_ttl_ms=int(settings.lease_ttl_s * 1000)
    )

    def on_transition(transition: Transition) -> None:
        metrics.store_transitions.labels(transition.new.value).inc()

    store = FailoverStore(
        primary,
        policy=FailurePolicy(settings.failure_policy),
        replicas=settings.replicas,
        timeout_s=timeout_s,
        breaker=CircuitBreaker(settings.breaker_failures, settings.breaker_open_ms),
        on_transition=on_transition,
        on_fallback=lambda policy: metrics.store_fallbacks.labels(policy).inc(),
        on_error=metrics.store_error,
    )
    metrics.store_state.set_function(store.breakers_open)  # read at each scrape
    return store


def build_rate_counters(config: Config) -> RateCounters:
    """The Rate Limit Service's counters: in Redis (global) when configured. Its own client:
    an RLS call never waits behind an admission's."""
    if config.redis is None:
        return MemoryRateCounters()
    from limiter.stores.ratelimit import RedisRateCounters

    return RedisRateCounters(redis_client(config.redis), prefix=config.redis.prefix)


def rate_limit_breaker(config: Config) -> CircuitBreaker | None:
    """The settings of the Rate Limit Service's breaker per domain: the store's (Redis only)."""
    redis = config.redis
    return None if redis is None else CircuitBreaker(redis.breaker_failures,
                                                     redis.breaker_open_ms)


def build_fairness(config: Config, pool: str, metrics: Metrics) -> Fairness:
    """Who goes next in a pool's queue: counters shared through Redis when configured."""
    lag = config.queue.share_lag_tokens
    if config.redis is None:
        return MemoryFairness(lag_tokens=lag)
    from limiter.stores.fairness import RedisFairness

    shared = RedisFairness(redis_client(config.redis), pool=pool, prefix=config.redis.prefix,
                           lag_tokens=lag)
    breaker = CircuitBreaker(config.redis.breaker_failures, config.redis.breaker_open_ms)
    fairness = FailoverFairness(
        shared, config.redis.timeout_ms / 1000, lag_tokens=lag, breaker=breaker,
        on_fallback=metrics.queue_fallbacks.labels(pool).inc,
    )
    # read at each scrape: an open breaker nothing has asked lately orders nothing
    metrics.queue_breaker.labels(pool).set_function(fairness.ordering_locally)
    return fairness


def build_director(
    config: Config,
    store: LimiterStore,
    endpoints: EndpointStore | None = None,
    *,
    metrics: Metrics | None = None,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Director:
    """The director with a scheduler and a flow controller (fair queue) per pool."""
    endpoints = endpoints or EndpointStore()
    metrics = metrics or Metrics()
    rng = rng or random.Random()
    tenants = Tenants(config)
    weights = {t.name: tenants.weight(t) for t in config.tenants}
    schedulers = {p.name: PoolScheduler(p, weights, config.scrape.staleness_s)
                  for p in config.pools}
    flows = {name: FlowController(scheduler, build_fairness(config, name, metrics), config,
                                  endpoints, metrics, rng, clock)
             for name, scheduler in schedulers.items()}
    pricer = Pricer(config)
    return Director(config, tenants=tenants, pricer=pricer,
                    costs=PromptCosts(pricer, metrics.long_prompts),
                    classifier=Classifier(config), store=store, schedulers=schedulers,
                    flows=flows, endpoints=endpoints, rng=rng, clock=clock,
                    upstream_authorization=upstream_authorizations(config))
