"""Endpoint discovery (extproc.datalayer.discovery): static lists and DNS."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable

import pytest

from extproc.config import parse_endpoint
from extproc.datalayer.discovery import (
    DnsDiscovery,
    StaticDiscovery,
    endpoint_address,
    resolve_host,
)
from extproc.datalayer.endpoints import EndpointChange, EndpointStore, ScrapeResult
from extproc.datalayer.metrics import EngineMetrics


class ScriptedResolver:
    """Answers lookups from a script: a list of IPs, or an exception to raise."""

    def __init__(self, *answers: Iterable[str] | Exception):
        self.answers = list(answers)
        self.lookups = 0

    async def __call__(self, hostname: str) -> list[str]:
        answer = self.answers[min(self.lookups, len(self.answers) - 1)]
        self.lookups += 1
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


def addresses(store: EndpointStore, pool: str = "chat") -> list[str]:
    return [state.address for state in store.snapshot().endpoints(pool)]


async def eventually(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    """Wait until ``condition()`` holds; fail the test (not hang it) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_localhost_resolves_through_getaddrinfo() -> None:
    assert "127.0.0.1" in await resolve_host("localhost")
    store = EndpointStore()
    change = await DnsDiscovery(store, "chat", "localhost", 8000).refresh()
    assert change is not None and "127.0.0.1:8000" in change.added
    assert "127.0.0.1:8000" in addresses(store)


async def test_endpoints_follow_the_answers() -> None:
    resolver = ScriptedResolver(["10.0.0.2", "10.0.0.1"], ["10.0.0.2", "10.0.0.3"])
    store = EndpointStore()
    dns = DnsDiscovery(store, "chat", "vllm.ns.svc.cluster.local", 8000, resolver=resolver)

    assert await dns.refresh() == EndpointChange(added=("10.0.0.1:8000", "10.0.0.2:8000"))
    await store.apply([ScrapeResult("10.0.0.2:8000", 1.0, EngineMetrics(engines=("0",)))])

    change = await dns.refresh()
    assert change == EndpointChange(added=("10.0.0.3:8000",), removed=("10.0.0.1:8000",))
    assert addresses(store) == ["10.0.0.2:8000", "10.0.0.3:8000"]
    assert store.snapshot().get("chat", "10.0.0.2:8000").healthy  # kept its state
    assert store.snapshot().get("chat", "10.0.0.3:8000").scraped_at is None  # starts stale


async def test_a_failed_lookup_keeps_the_last_set_and_logs_once(
        caplog: pytest.LogCaptureFixture) -> None:
    nxdomain = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    resolver = ScriptedResolver(["10.0.0.1"], nxdomain, nxdomain, ["10.0.0.1"], [])
    store = EndpointStore()
    dns = DnsDiscovery(store, "chat", "vllm", 8000, resolver=resolver)
    await dns.refresh()
    with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
        assert await dns.refresh() is None
        assert await dns.refresh() is None
        assert addresses(store) == ["10.0.0.1:8000"] and "not known" in dns.last_error
        assert not await dns.refresh()  # works again, same set: no change
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert await dns.refresh() == EndpointChange(removed=("10.0.0.1:8000",))
    assert addresses(store) == []  # an answer with no addresses does empty the pool


async def test_ipv6_addresses_are_bracketed_as_config_and_envoy_expect() -> None:
    assert endpoint_address("fd00::1", 8000) == "[fd00::1]:8000"
    assert endpoint_address("10.1.2.3", 8000) == "10.1.2.3:8000"
    assert parse_endpoint(endpoint_address("fd00::1", 8000)) == ("fd00::1", 8000)
    store = EndpointStore()
    await DnsDiscovery(store, "chat", "v6", 80, resolver=ScriptedResolver(["fd00::1"])).refresh()
    assert addresses(store) == ["[fd00::1]:80"]


async def test_periodic_resolution_picks_up_changes() -> None:
    resolver = ScriptedResolver(["10.0.0.1"], ["10.0.0.1"], ["10.0.0.1", "10.0.0.2"])
    store = EndpointStore()
    dns = DnsDiscovery(store, "chat", "vllm", 8000, interval_s=0.01, resolver=resolver)
    await dns.start()
    try:
        assert addresses(store) == ["10.0.0.1:8000"]  # populated before start() returns
        await eventually(lambda: len(addresses(store)) == 2)
    finally:
        await dns.stop()
    lookups = resolver.lookups
    await asyncio.sleep(0.03)
    assert resolver.lookups == lookups  # stopped


async def test_static_endpoints() -> None:
    store = EndpointStore()
    static = StaticDiscovery(store, "chat", ["10.0.0.1:8000", "10.0.0.2:8000"])
    await static.start()
    assert addresses(store) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert not await static.refresh()
    await static.stop()
