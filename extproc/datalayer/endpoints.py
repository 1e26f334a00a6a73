"""What kvgate knows about every endpoint, and the store the request path reads it from.

Concurrency design. The request path (picker, admission) runs on every ext_proc message
and must never wait for the network; writers (the scraper once per round, discovery when
DNS changes) are rare and slow because they wait on I/O. So:

- All state lives in one immutable ``StoreSnapshot`` (frozen dataclasses inside read-only
  mappings). ``EndpointStore.snapshot()`` is a plain, lock-free attribute read: it cannot
  block, and whatever a reader holds stays internally consistent — every field of an
  endpoint, and every endpoint of a round, come from the same swap — however long it keeps
  it and however many awaits it spans. That is why readers need no reader lock at all.
- Writers do their I/O *outside* any lock, then take the ``aiorwlock`` writer lock only to
  read-modify-swap the snapshot (build new dicts, replace one reference). The lock
  serializes writers from different tasks (scraper round vs. discovery change), so neither
  loses the other's update, even if a future writer awaits inside its critical section.
  Each critical section is pure computation over at most a few hundred small objects.
- One swap per scrape round (not per endpoint), so a reader never sees half a round, and
  ``version`` lets a consumer (the queue, via the scraper's ``on_update``) tell whether
  anything changed since it last looked.

An endpoint belongs to a pool; the same ``ip:port`` in two pools is two states that share
scrape results (the scraper fetches each address once per round).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from aiorwlock import RWLock

from extproc.datalayer.metrics import EngineMetrics
from extproc.datalayer.nvml import GpuReading

DEFAULT_STALENESS_S = 2.0  # the Inference Extension's bound: older metrics are not used
DEFAULT_UNHEALTHY_AFTER = 3


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One endpoint as of the last swap.

    A new endpoint starts unscraped: ``scraped_at`` None, not healthy, not fresh.
    ``scraped_at`` and ``gpus_read_at`` are ``time.monotonic()`` of the last *successful*
    read, so a failing endpoint keeps its last metrics but goes stale. ``healthy`` turns
    False after ``unhealthy_after`` consecutive scrapes that could not reach the engine
    (``consecutive_failures``) and True on the next success; a slow or garbled answer only
    lets the last reading age, since a busy engine is not a gone one.
    ``kv_capacity_tokens`` is the engine's own figure, else the pool's configured fallback.
    """

    address: str
    pool: str
    metrics: EngineMetrics | None = None
    scraped_at: float | None = None
    consecutive_failures: int = 0
    healthy: bool = False
    kv_capacity_tokens: int | None = None
    gpus: tuple[GpuReading, ...] = ()
    gpus_read_at: float | None = None
    last_error: str | None = None

    def is_fresh(self, now: float, staleness_s: float = DEFAULT_STALENESS_S) -> bool:
        """Whether the last successful scrape is at most ``staleness_s`` old."""
        return self.scraped_at is not None and now - self.scraped_at <= staleness_s

    def is_usable(self, now: float, staleness_s: float = DEFAULT_STALENESS_S) -> bool:
        """Healthy and fresh: what a picker should require before trusting the numbers."""
        return now <= self.usable_until(staleness_s)

    def usable_until(self, staleness_s: float = DEFAULT_STALENESS_S) -> float:
        """The last instant this state is usable (-inf: never), so that a reader holding a
        snapshot compares one number with the clock per request."""
        if not self.healthy or self.scraped_at is None:
            return -math.inf
        return self.scraped_at + staleness_s

    @property
    def kv_cache_usage(self) -> float | None:
        return None if self.metrics is None else self.metrics.kv_cache_usage

    @property
    def gpu_memory_used_ratio(self) -> float | None:
        """The fullest of this endpoint's GPUs (a tensor-parallel engine spans several)."""
        ratios = [r for g in self.gpus if (r := g.memory_used_ratio) is not None]
        return max(ratios) if ratios else None

    def current_gpu_memory_used_ratio(self, staleness_s: float = DEFAULT_STALENESS_S
                                      ) -> float | None:
        """``gpu_memory_used_ratio``, or None (unknown, as without NVML) when the GPUs were
        read more than ``staleness_s`` before the engine's last scrape. A failing GPU source
        (an agent hung or gone, a local read timing out) keeps its last reading so that a
        blip changes nothing, but kept for good it would hold a full GPU's endpoint forever,
        or keep sending work to one that filled since."""
        if self.gpus_read_at is None or self.scraped_at is None:
            return None
        if self.scraped_at - self.gpus_read_at > staleness_s:
            return None
        return self.gpu_memory_used_ratio


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """One round's outcome for one address: metrics or an error, and maybe GPU readings.

    ``gpus`` None means "no GPU reading this round" (no source, or the source failed): the
    previous readings are kept and age through ``gpus_read_at`` (past the staleness bound
    they count as none: ``current_gpu_memory_used_ratio``). ``reached`` marks an error
    from an engine that was there (timed out, answered HTTP 500 or not metrics): it does not
    count towards unhealthy.
    """

    address: str
    at: float
    metrics: EngineMetrics | None = None
    error: str | None = None
    gpus: tuple[GpuReading, ...] | None = None
    reached: bool = False


def advance(state: EndpointState, result: ScrapeResult, unhealthy_after: int,
            kv_capacity_fallback: int | None = None) -> EndpointState:
    """The state after one scrape result: the health rules, as a pure function."""
    if result.gpus is not None:
        state = replace(state, gpus=result.gpus, gpus_read_at=result.at)
    if result.metrics is None and result.reached:  # there, so the unreachable run ends
        return replace(state, consecutive_failures=0, last_error=result.error)
    if result.metrics is None:
        failures = state.consecutive_failures + 1
        return replace(state, consecutive_failures=failures, last_error=result.error,
                       healthy=state.healthy and failures < unhealthy_after)
    capacity = result.metrics.kv_capacity_tokens or kv_capacity_fallback
    return replace(state, metrics=result.metrics, scraped_at=result.at, consecutive_failures=0,
                   healthy=True, kv_capacity_tokens=capacity, last_error=None)


@dataclass(frozen=True, slots=True)
class EndpointChange:
    """What ``set_endpoints`` did to a pool."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    """Every pool's endpoint states at one instant; immutable, safe to keep and share."""

    version: int = 0
    pools: Mapping[str, Mapping[str, EndpointState]] = field(
        default_factory=lambda: MappingProxyType({}))

    def endpoints(self, pool: str) -> tuple[EndpointState, ...]:
        return tuple(self.pools.get(pool, {}).values())

    def get(self, pool: str, address: str) -> EndpointState | None:
        return self.pools.get(pool, {}).get(address)

    def states(self) -> Iterator[EndpointState]:
        for states in self.pools.values():
            yield from states.values()

    def addresses(self) -> set[str]:
        return {state.address for state in self.states()}

    def usable(self, pool: str, now: float,
               staleness_s: float = DEFAULT_STALENESS_S) -> tuple[EndpointState, ...]:
        return tuple(s for s in self.endpoints(pool) if s.is_usable(now, staleness_s))


class EndpointStore:
    """The endpoint states of all pools: lock-free snapshots for readers, locked swaps.

    ``kv_capacity_fallback`` maps a pool name to the KV capacity (tokens) to assume for its
    endpoints when vLLM does not export ``vllm:cache_config_info``.
    """

    def __init__(self, kv_capacity_fallback: Mapping[str, int] | None = None):
        self._snapshot = StoreSnapshot()
        self._lock = RWLock()
        self._fallback = dict(kv_capacity_fallback or {})

    def snapshot(self) -> StoreSnapshot:
        """The current state; never blocks (see the module docstring)."""
        return self._snapshot

    async def set_endpoints(self, pool: str, addresses: Iterable[str]) -> EndpointChange:
        """Make ``addresses`` the pool's endpoints: new ones start unscraped, gone ones vanish.

        Endpoints that stay keep their state, so a DNS refresh does not reset health.
        """
        wanted = list(dict.fromkeys(addresses))
        async with self._lock.writer:
            pools = dict(self._snapshot.pools)
            current = pools.get(pool, {})
            fallback = self._fallback.get(pool)
            pools[pool] = MappingProxyType({
                address: current.get(address)
                or EndpointState(address, pool, kv_capacity_tokens=fallback)
                for address in wanted
            })
            change = EndpointChange(
                added=tuple(a for a in wanted if a not in current),
                removed=tuple(a for a in current if a not in pools[pool]),
            )
            if change or pool not in self._snapshot.pools:
                self._swap(pools)
        return change

    async def apply(self, results: Iterable[ScrapeResult],
                    unhealthy_after: int = DEFAULT_UNHEALTHY_AFTER
                    ) -> list[tuple[EndpointState, EndpointState]]:
        """Apply one scrape round in one swap; returns (before, after) of health changes.

        Results for addresses no longer in any pool (removed mid-round) are dropped.
        """
        by_address = {result.address: result for result in results}
        transitions = []
        async with self._lock.writer:
            pools = {}
            for pool, states in self._snapshot.pools.items():
                updated = {}
                for address, state in states.items():
                    result = by_address.get(address)
                    new = state if result is None else advance(
                        state, result, unhealthy_after, self._fallback.get(pool))
                    if new.healthy != state.healthy:
                        transitions.append((state, new))
                    updated[address] = new
                pools[pool] = MappingProxyType(updated)
            self._swap(pools)
        return transitions

    def _swap(self, pools: dict[str, Mapping[str, EndpointState]]) -> None:
        """Replace the snapshot: one reference assignment, atomic for every reader."""
        self._snapshot = StoreSnapshot(self._snapshot.version + 1, MappingProxyType(pools))
