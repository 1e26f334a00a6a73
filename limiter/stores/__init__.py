"""The limiter's I/O adapters: where admission state lives, behind one async protocol each.

- ``base``: the :class:`LimiterStore` and :class:`Fairness` protocols and
  :class:`StoreUnavailable`;
- ``memory``: :class:`MemoryStore` and :class:`MemoryFairness`, this process only (the
  embedded default);
- ``redis_store`` / ``redis_scripts``: the Redis store and its Lua (global limits across
  replicas); ``fairness``: the fair-queue counters, in memory or in Redis;
- ``failover``: a shared store behind a timeout, a circuit breaker and a failure policy.

The rules themselves live in the sans-IO core (``limiter.decision``, ``limiter.fairness``);
every store answers with the core's types. The Redis classes import ``redis`` lazily
(``limiter.stores.RedisStore``), so the in-memory path needs no client.
"""

from typing import Any

import kvgate_native

kvgate_native.activate(__name__, __path__)  # compiled modules, when built (make native)

from limiter.stores.base import Fairness, LeasesLost, LimiterStore, StoreUnavailable
from limiter.stores.failover import FailoverFairness, FailoverStore, FailurePolicy
from limiter.stores.memory import MemoryFairness, MemoryStore

__all__ = [
    "FailoverFairness",
    "FailoverStore",
    "FailurePolicy",
    "Fairness",
    "LeasesLost",
    "LimiterStore",
    "MemoryFairness",
    "MemoryStore",
    "RedisFairness",
    "RedisStore",
    "StoreUnavailable",
]


def __getattr__(name: str) -> Any:
    """The Redis adapters on first use, so users of the in-memory stores need no client."""
    if name == "RedisStore":
        from limiter.stores.redis_store import RedisStore

        return RedisStore
    if name == "RedisFairness":
        from limiter.stores.fairness import RedisFairness

        return RedisFairness
    raise AttributeError(f"module 'limiter.stores' has no attribute {name!r}")
