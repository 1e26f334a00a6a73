"""Which endpoints a pool has: a static list, or a DNS name re-resolved periodically.

In Kubernetes a headless Service's name resolves to the IPs of its ready pods, so
re-resolving it every few seconds follows scale-ups, scale-downs and rollouts without
talking to the API server. Each resolution replaces the pool's endpoint set in the store:
new endpoints start unscraped (so stale, so unused until the scraper has read them), gone
ones disappear, and the ones that stay keep their state.

A failed lookup keeps the last known set: a DNS blip must not empty a pool, and endpoints
that really went away fail their scrapes and turn unhealthy on their own. A lookup that
succeeds with no addresses (a resolver may answer so) does empty the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

from extproc.datalayer.endpoints import EndpointChange, EndpointStore
from extproc.tasks import cancel

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[Iterable[str]]]
"""hostname → its IP addresses (IPv4 and/or IPv6, as text)."""


async def resolve_host(hostname: str) -> list[str]:
    """A and AAAA records of ``hostname`` via the event loop's ``getaddrinfo`` (threaded)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        hostname, None, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]


def endpoint_address(ip: str, port: int) -> str:
    """``ip:port``, with IPv6 in brackets (``[fd00::1]:8000``), as Envoy expects it."""
    version = ipaddress.ip_address(ip.split("%", 1)[0]).version
    return f"[{ip}]:{port}" if version == 6 else f"{ip}:{port}"


class StaticDiscovery:
    """A fixed endpoint list, with the same ``refresh``/``start``/``stop`` as DNS discovery."""

    def __init__(self, store: EndpointStore, pool: str, endpoints: Iterable[str]):
        self.store, self.pool, self.endpoints = store, pool, list(endpoints)

    async def refresh(self) -> EndpointChange:
        return await self.store.set_endpoints(self.pool, self.endpoints)

    async def start(self) -> None:
        await self.refresh()

    async def stop(self) -> None:
        pass


class DnsDiscovery:
    """Re-resolves ``hostname`` every ``interval_s`` and reports ``ip:port`` to the store.

    ``resolver`` defaults to ``resolve_host``; tests inject one to script changes.
    """

    def __init__(self, store: EndpointStore, pool: str, hostname: str, port: int,
                 interval_s: float = 5.0, resolver: Resolver | None = None):
        self.store, self.pool = store, pool
        self.hostname, self.port, self.interval_s = hostname, port, interval_s
        self.resolver = resolver or resolve_host
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> EndpointChange | None:
        """Resolve once and apply the result; None when the lookup failed (set kept)."""
        try:
            ips = await self.resolver(self.hostname)
            addresses = sorted({endpoint_address(ip, self.port) for ip in ips})
        except Exception as exc:
            self._failed(exc)
            return None
        if self.last_error is not None:
            log.info("pool %s: resolving %s works again", self.pool, self.hostname)
        self.last_error = None
        change = await self.store.set_endpoints(self.pool, addresses)
        if change:
            log.info("pool %s: %s now resolves to %d endpoint(s) (+%s -%s)", self.pool,
                     self.hostname, len(addresses), list(change.added), list(change.removed))
        return change

    def _failed(self, exc: Exception) -> None:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        if self.last_error is None:
            log.warning("pool %s: resolving %s failed (%s); keeping the last known endpoints",
                        self.pool, self.hostname, message)
        self.last_error = message

    async def start(self) -> None:
        """Resolve once now (so the pool is populated before traffic), then periodically."""
        await self.refresh()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"kvgate-dns-{self.pool}")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # refresh handles lookups; this is a bug, but keep following
                log.exception("pool %s: DNS discovery round failed", self.pool)
