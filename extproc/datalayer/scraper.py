"""The scrape loop: every endpoint's engine ``/metrics`` (and GPU readings) every ~100 ms.

Each round fetches every address in the store once, at most ``max_concurrency`` at a time,
each bounded by ``timeout_s``, over one reused ``aiohttp.ClientSession`` (keep-alive: a
round is a handful of requests on open connections). GPU sources are read in the same
round, each source once however many endpoints it serves. The round's results are applied
to the store in one swap, then ``on_update`` is called so a queue can dispatch on fresh
data.

Rounds run at a fixed rate (the next starts ``interval_s`` after the previous started, or
at once if that one overran). So the age of a healthy endpoint's metrics is bounded by
``interval_s`` plus one round; a round is bounded by ``timeout_s`` per wave of
``max_concurrency`` scrapes (defaults: 0.1 + 0.5 s for up to 16 endpoints, well inside the
2 s staleness bound). GPU reads, local NVML calls included, get the same timeout.

Each endpoint is asked only for the series kvgate reads (``?name[]=…``, which Prometheus's
Python client answers with those families alone): a vLLM page is ~450 lines of histograms,
and rendering it costs the engine's API server milliseconds of CPU on every scrape from
every kvgate process. vLLM puts another handler, which ignores the query, on ``/metrics``
itself and the client library's behind it (``/metrics/``), so both are tried. Nothing is
assumed: the first scrape of an endpoint (and the first after it could not be reached, or
its filtered page answered something other than metrics: it may have been replaced) fetches
the whole page, and a filtered one is used only if it is
at most half its size and reads every figure the whole one has; else the whole page is
read, as from a server without the filter (TGI, Triton) or with a multiprocess registry
(SGLang, vLLM with several API server processes), which answers a filter with nothing.
Bodies are asked for uncompressed: compressing a page costs the engine more than sending it
over a cluster network.

Only an engine that cannot be reached (refused, reset, its name gone) counts towards
``unhealthy_after``: one that is slow or answers with something other than metrics keeps its
last reading, which ages out after ``staleness_s`` (then the picker stops using it).

Nothing that goes wrong in a round stops the loop. Logging is by transition only: one line
when an endpoint turns unhealthy or recovers, one when a GPU source starts or stops failing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlencode

import aiohttp

from extproc.datalayer.endpoints import (
    DEFAULT_STALENESS_S,
    DEFAULT_UNHEALTHY_AFTER,
    EndpointState,
    EndpointStore,
    ScrapeResult,
    StoreSnapshot,
)
from extproc.datalayer.metrics import ENGINES, VLLM, EngineMetrics, EngineNames, parse_metrics
from extproc.datalayer.nvml import AsyncGpuReader, GpuReader, GpuReading, parse_gpu_metrics
from extproc.tasks import cancel

log = logging.getLogger(__name__)

LOCAL = "local"
ACCEPT = "text/plain;version=0.0.4;q=1.0, */*;q=0.1"  # vLLM's classic text format
# A GPU page past this is refused unread: a node's agent serves a few dozen readings (8 GPUs
# of 7 MIG slots: ~30 KB), and parsing runs on the event loop every admission shares (an
# 18 MB page of 100,000 readings held it 1.3 s a round, and every placement then read them all)
MAX_GPU_PAGE_BYTES = 256 * 1024
# An engine page past this is refused unread (not metrics: the endpoint goes stale and the
# error is logged): vLLM 0.32's whole page is ~56 KB, and a page is parsed on the event loop
# every admission shares at every round (a 40 MB one stalled it up to 0.34 s a round)
MAX_ENGINE_PAGE_BYTES = 8 * 1024 * 1024

UpdateHook = Callable[[StoreSnapshot], Awaitable[None] | None]
Scraped = tuple[float, EngineMetrics | None, str | None, bool]  # when, metrics, error, reached
SessionFactory = Callable[[], aiohttp.ClientSession]


@dataclass(frozen=True, slots=True)
class ScrapeSettings:
    """The scraper's knobs, as the config file will carry them.

    ``staleness_s`` is not the scraper's: it is what readers pass to ``is_fresh``/``usable``.
    """

    interval_s: float = 0.1
    timeout_s: float = 0.5
    max_concurrency: int = 16
    unhealthy_after: int = DEFAULT_UNHEALTHY_AFTER
    staleness_s: float = DEFAULT_STALENESS_S
    metrics_path: str = "/metrics"


@dataclass(frozen=True, slots=True)
class GpuSource:
    """Where an endpoint's GPU readings come from, and which GPUs are its own.

    ``url`` None means this process's ``GpuReader`` ("local", the sidecar case); otherwise
    a ``kvgate agent`` metrics URL, where ``{ip}`` stands for the endpoint's IP (an agent
    container beside vLLM in the same pod answers on the pod IP). ``gpus`` keeps only the
    readings whose ``GpuReading.key`` (``"0"``, ``"0:2"`` for a MIG slot) or UUID it names;
    empty keeps all.
    """

    url: str | None = None
    gpus: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, spec: str | GpuSource) -> GpuSource:
        """``"local"``, or an agent URL (``/metrics`` is added when it has no path)."""
        if isinstance(spec, GpuSource):
            return spec
        if spec == LOCAL:
            return cls()
        scheme, sep, rest = spec.partition("://")
        if scheme not in ("http", "https") or not sep or not rest:
            raise ValueError(f"GPU source {spec!r} is neither 'local' nor an http(s) URL")
        return cls(spec if "/" in rest else f"{spec}/metrics")

    def target(self, address: str) -> str:
        """What to read for ``address``: ``"local"`` or the agent URL with ``{ip}`` filled."""
        if self.url is None:
            return LOCAL
        host = address.rpartition(":")[0]
        return self.url.replace("{ip}", host)

    def select(self, readings: Iterable[GpuReading]) -> tuple[GpuReading, ...]:
        if not self.gpus:
            return tuple(readings)
        return tuple(r for r in readings if r.key in self.gpus or r.uuid in self.gpus)


class Scraper:
    """Scrapes every endpoint in ``store`` once per round; ``start()``/``stop()`` the loop.

    ``gpu_sources`` maps an endpoint address (``ip:port``) or a pool name to a ``GpuSource``
    (or its string form); the address wins. ``gpu_reader`` serves the "local" sources.
    ``engines`` maps a pool name to the engine serving it (``"sglang"``, or its
    ``EngineNames``), which says which metric names its bodies are read by; vLLM otherwise.
    ``metrics_ports`` maps a pool name to the port its engines serve metrics on, where that
    is not their serving port (Triton's 8002).
    ``session_factory`` makes the one ``ClientSession`` (created on first use, closed by
    ``stop()``); the default suits the bounded concurrency.
    """

    def __init__(
        self,
        store: EndpointStore,
        session_factory: SessionFactory | None = None,
        interval_s: float = 0.1,
        timeout_s: float = 0.5,
        max_concurrency: int = 16,
        gpu_sources: Mapping[str, GpuSource | str] | None = None,
        *,
        gpu_reader: GpuReader | None = None,
        unhealthy_after: int = DEFAULT_UNHEALTHY_AFTER,
        metrics_path: str = "/metrics",
        on_update: UpdateHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        pools: Collection[str] | None = None,
        engines: Mapping[str, str | EngineNames] | None = None,
        metrics_ports: Mapping[str, int] | None = None,
    ):
        if max_concurrency < 1 or interval_s <= 0 or timeout_s <= 0 or unhealthy_after < 1:
            raise ValueError("interval_s, timeout_s, max_concurrency, unhealthy_after must "
                             "be positive")
        self.store = store
        self.session_factory = session_factory or self._default_session
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.max_concurrency = max_concurrency
        self.gpu_sources = {key: GpuSource.parse(v) for key, v in (gpu_sources or {}).items()}
        self.gpu_reader = None if gpu_reader is None else AsyncGpuReader(gpu_reader)
        self.unhealthy_after = unhealthy_after
        self.metrics_path = metrics_path
        self.on_update = on_update
        self.clock = clock
        self.pools = None if pools is None else frozenset(pools)  # None: every pool
        self.engines = {pool: ENGINES[e] if isinstance(e, str) else e
                        for pool, e in (engines or {}).items()}
        self.metrics_ports = dict(metrics_ports or {})
        self.rounds = 0
        self.errors: dict[str, int] = {}  # address → failed scrapes (the metrics read it)
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        # address → the URL its figures are read from: a filtered page, or the whole one
        # (absent: not chosen since it was last reachable)
        self.pages: dict[str, str] = {}
        self._failing_gpu_targets: set[str] = set()
        self._last_loop_error: str | None = None
        self._last_hook_error: str | None = None

    @classmethod
    def from_settings(cls, store: EndpointStore, settings: ScrapeSettings, *,
                      session_factory: SessionFactory | None = None,
                      gpu_sources: Mapping[str, GpuSource | str] | None = None,
                      gpu_reader: GpuReader | None = None,
                      on_update: UpdateHook | None = None) -> Scraper:
        return cls(store, session_factory, settings.interval_s, settings.timeout_s,
                   settings.max_concurrency, gpu_sources, gpu_reader=gpu_reader,
                   unhealthy_after=settings.unhealthy_after,
                   metrics_path=settings.metrics_path, on_update=on_update)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvgate-scraper")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while True:
            started = self.clock()
            try:
                await self.scrape_once()
                self._last_loop_error = None
            except Exception as exc:  # a bug, not a scrape failure: keep scraping anyway
                message = f"{type(exc).__name__}: {exc}"
                if message != self._last_loop_error:
                    log.exception("scrape round failed; the loop goes on")
                self._last_loop_error = message
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    def _default_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self.max_concurrency, keepalive_timeout=30)
        return aiohttp.ClientSession(connector=connector, headers={
            "accept": ACCEPT, "accept-encoding": "identity"})

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self.session_factory()
        return self._session

    # -- one round ---------------------------------------------------------------------------

    async def scrape_once(self) -> StoreSnapshot:
        """One round over every endpoint in the store; returns the snapshot it produced."""
        snapshot = self.store.snapshot()
        engines = self._engine_plan(snapshot)
        addresses = sorted(engines)
        plan = self._gpu_plan(snapshot)
        scrapes = [self._scrape_metrics(a, *engines[a]) for a in addresses]
        if plan:
            metrics, gpu_readings = await asyncio.gather(
                asyncio.gather(*scrapes),
                self._read_gpu_targets({target for _source, target in plan.values()}),
            )
        else:  # no GPU sources: no second gather to pay for every round
            metrics, gpu_readings = await _gather(scrapes), {}
        for gone in self.errors.keys() - engines.keys():  # an address DNS dropped
            del self.errors[gone]
        for gone in self.pages.keys() - engines.keys():  # (given again, maybe to another
            del self.pages[gone]  # server: its page is chosen afresh)
        results = []
        for address, (at, parsed, error, reached) in zip(addresses, metrics, strict=True):
            if error is not None:
                self.errors[address] = self.errors.get(address, 0) + 1
            gpus = None
            if address in plan:
                source, target = plan[address]
                readings = gpu_readings[target]
                gpus = None if readings is None else source.select(readings)
            results.append(ScrapeResult(address, at, parsed, error, gpus, reached))
        for before, after in await self.store.apply(results, self.unhealthy_after):
            _log_health(before, after)
        self.rounds += 1
        current = self.store.snapshot()
        await self._notify(current)
        return current

    def _engine_plan(self, snapshot: StoreSnapshot) -> dict[str, tuple[str, EngineNames]]:
        """address → (its metrics URL, the engine its body is read as): its (first) scraped
        pool's."""
        plan: dict[str, tuple[str, EngineNames]] = {}
        for state in snapshot.states():
            if (self.pools is None or state.pool in self.pools) and state.address not in plan:
                where = state.address
                if (port := self.metrics_ports.get(state.pool)) is not None:
                    where = f"{state.address.rpartition(':')[0]}:{port}"
                plan[state.address] = (f"http://{where}{self.metrics_path}",
                                       self.engines.get(state.pool, VLLM))
        return plan

    async def _scrape_metrics(self, address: str, url: str, names: EngineNames = VLLM
                              ) -> Scraped:
        at = self.clock()  # when asked: anything admitted later is not in these numbers yet
        page = self.pages.get(address)
        try:
            body = await self._fetch(page or url)
        except Exception as exc:
            unreachable = _unreachable(exc)
            if unreachable:
                self.pages.pop(address, None)  # what answers next may be another server
            elif page not in (None, url) and not isinstance(exc, TimeoutError):
                self._forget_filter(address)
            return self.clock(), None, _describe(exc, self.timeout_s), not unreachable
        metrics = parse_metrics(body, names)
        if not metrics.has_data:
            if page not in (None, url):
                self._forget_filter(address)
            return at, None, f"no {names.engine} metrics at {page or url}", True
        if page is None:
            page = self.pages[address] = await self._smallest_page(url, names, metrics,
                                                                   len(body))
            log.info("endpoint %s: metrics read from %s", address,
                     "its whole page (no smaller page gave every figure)" if page == url
                     else page.partition("?")[0] + "?name[]=… (the series kvgate reads)")
        return at, metrics, None, True

    def _forget_filter(self, address: str) -> None:
        """A filtered page answered something other than metrics: read the whole page next
        time, and choose again from it. The server may not be the one the filter was chosen
        on, yet never have been unreachable (a proxy in front of the engine, a service
        mesh's sidecar, answers while it restarts), and the new one may answer the filter
        with nothing (run now with several API server processes, whose multiprocess
        registry does) or not serve the filtered path at all: kept, the filter would leave
        the endpoint stale for good (healthy, as something answers) while its whole page
        reads fine. A timeout keeps it: a busy engine, which a whole page costs more."""
        self.pages.pop(address, None)

    async def _smallest_page(self, url: str, names: EngineNames, whole: EngineMetrics,
                             size: int) -> str:
        """The first filtered URL whose page is at most half the whole one (``size``
        characters, read as ``whole``: a page that ignored the filter differs by a few bytes
        of moving values) and gives every figure it did; else ``url``."""
        for candidate in filtered_urls(url, names):
            try:
                body = await self._fetch(candidate)
            except Exception:
                continue
            if 2 * len(body) <= size and _figures(parse_metrics(body, names)) == _figures(
                    whole):
                return candidate
        return url

    async def _fetch(self, url: str, limit: int = MAX_ENGINE_PAGE_BYTES) -> str:
        """GET ``url``'s body, bounded by the semaphore (waiting) and the timeout (not);
        a body over ``limit`` bytes is a ``ScrapeError``, found before it is all read."""
        async with self._semaphore:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self._client().get(url, timeout=timeout) as response:
                body = await _read_at_most(response, limit, url)
                if response.status != 200:
                    raise ScrapeError(f"HTTP {response.status} from {url}")
        return body.decode("utf-8", errors="replace")

    # -- GPU sources -------------------------------------------------------------------------

    def _gpu_plan(self, snapshot: StoreSnapshot) -> dict[str, tuple[GpuSource, str]]:
        """address → (its GPU source, what to read: ``"local"`` or a URL), where it has one.

        An address's own entry wins over its pool's; in several pools, the first pool's.
        """
        plan: dict[str, tuple[GpuSource, str]] = {}
        if not self.gpu_sources:
            return plan
        for state in snapshot.states():
            source = self.gpu_sources.get(state.address) or self.gpu_sources.get(state.pool)
            if source is not None and state.address not in plan:
                plan[state.address] = (source, source.target(state.address))
        return plan

    async def _read_gpu_targets(self, targets: set[str]) -> dict[str, list[GpuReading] | None]:
        ordered = sorted(targets)
        readings = await asyncio.gather(*(self._read_gpu_target(t) for t in ordered))
        return dict(zip(ordered, readings, strict=True))

    async def _read_gpu_target(self, target: str) -> list[GpuReading] | None:
        try:
            if target == LOCAL:
                if self.gpu_reader is None:
                    raise RuntimeError("no local GPU reader (NVML unavailable)")
                readings = await self.gpu_reader.read(self.timeout_s)
            else:
                readings = parse_gpu_metrics(await self._fetch(target, MAX_GPU_PAGE_BYTES))
        except Exception as exc:
            if target not in self._failing_gpu_targets:
                log.warning("GPU source %s failed: %s", target, _describe(exc, self.timeout_s))
            self._failing_gpu_targets.add(target)
            return None
        if target in self._failing_gpu_targets:
            log.info("GPU source %s works again", target)
        self._failing_gpu_targets.discard(target)
        return readings

    # -- after a round -----------------------------------------------------------------------

    async def _notify(self, snapshot: StoreSnapshot) -> None:
        """Call the hook (keep it quick: the next round waits for it); log a new error once."""
        if self.on_update is None:
            return
        try:
            outcome = self.on_update(snapshot)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if message != self._last_hook_error:
                log.exception("on_update hook failed; scraping goes on")
            self._last_hook_error = message
        else:
            self._last_hook_error = None


def filtered_urls(url: str, names: EngineNames) -> tuple[str, ...]:
    """``url`` asking a Prometheus client library for the series in ``names`` alone; and, for
    a path, the same below it (vLLM's ``/metrics/``: see the module's docstring)."""
    query = _names_query(names)
    if "?" in url:
        return (f"{url}&{query}",)
    return f"{url}?{query}", f"{url.rstrip('/')}/?{query}"


@functools.cache
def _names_query(names: EngineNames) -> str:
    return urlencode([("name[]", name) for name in sorted(names.wanted)])


def _figures(metrics: EngineMetrics) -> tuple[object, ...]:
    """What a reading holds, not what it reads: which figures it has, and for which engines
    and models (values move between two fetches)."""
    present = tuple(getattr(metrics, f.name) is not None for f in dataclasses.fields(metrics)
                    if f.name not in ("models", "engines", "problems"))
    return present, metrics.engines, metrics.models


class ScrapeError(Exception):
    """A scrape that got an answer, but not metrics."""


async def _read_at_most(response: aiohttp.ClientResponse, limit: int, url: str) -> bytes:
    """The body, or ``ScrapeError`` as soon as it is known to pass ``limit`` bytes (from its
    ``content-length`` or as it arrives): a huge answer costs neither memory nor parsing."""
    if (response.content_length or 0) > limit:
        raise ScrapeError(f"{url} answered {response.content_length} bytes (over {limit})")
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise ScrapeError(f"{url} answered over {limit} bytes")
    return bytes(body)


async def _gather(scrapes: list[Awaitable[Scraped]]) -> list[Scraped]:
    """``asyncio.gather``, except that a lone scrape (a pool of one) is awaited in place:
    a task for it would only add its creation and a loop iteration to every round."""
    if len(scrapes) == 1:
        return [await scrapes[0]]
    return await asyncio.gather(*scrapes)


def _log_health(before: EndpointState, after: EndpointState) -> None:
    where = f"endpoint {after.address} (pool {after.pool})"
    if after.healthy:
        log.info("%s %s", where, "up" if before.scraped_at is None else "recovered")
    else:
        log.warning("%s unhealthy after %d failed scrapes: %s", where,
                    after.consecutive_failures, after.last_error)


def _unreachable(exc: BaseException) -> bool:
    """Refused, reset, closed before answering, or a name that no longer resolves: the engine
    is not there. A timeout (also an ``OSError``) is a busy engine, not a missing one."""
    if isinstance(exc, TimeoutError):
        return False
    return isinstance(exc, OSError | aiohttp.ServerDisconnectedError)


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout_s:g}s"
    if isinstance(exc, ScrapeError):
        return str(exc)
    return " ".join(f"{type(exc).__name__}: {exc}".split())
