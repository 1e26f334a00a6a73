"""Shared test helpers: free ports, a redis-server per module, the redis marker's install
check, and which hot path (compiled or pure Python) the run tests."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvgate_native
from bench.redis_server import REDIS_SERVER, RedisCluster, RedisServer
from extproc.ports import free_port, share_ports

__all__ = ["consecutive_free_ports", "free_port"]


def consecutive_free_ports(count: int) -> int:
    """A port such that it and the ``count - 1`` after it are free (``--workers``: worker i
    listens on ``admin_port + i``)."""
    while True:
        first = free_port()
        taken = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                taken.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in taken:
                sock.close()


def pytest_report_header() -> str:
    return f"kvgate hot path: {kvgate_native.status()}"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker picks free ports from its own part of the range: two
    workers picked one port (each before the other's Envoy bound it) in a CI run."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit():
        share_ports(int(worker[2:]), int(count))


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI or a server sets up logging for the process (the root
    logger's handler and level): put them back, so later tests' log capture sees only what
    they expect and no handler writes to a stream a finished test has closed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds: for effects that land after the reply (meter
    reports, background cancels), which a test must not race."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def engines_one_by_one(stack: Any, send: Callable[[], Any], n: int) -> list[str | None]:
    """The engines (``x-bench-engine``) ``n`` requests went to, each sent by ``send`` once
    kvgate has released the one before. A client has its answer a moment before kvgate
    hears that the request ended (the meter's report, the stream's close); sent in that
    moment, the next request sees the last one still in prefill on its engine and may go
    elsewhere (a routing test failed so once, with a second test worker busy)."""
    director = stack.kvgate.server.director
    served = []
    for _ in range(n):
        served.append(send().headers.get("x-bench-engine"))
        assert wait_for(lambda: not director.active), director.active
    return served


def need_binary(path: str | None, name: str, package: str) -> str:
    """A system program a test needs: skipped without it locally, failed under CI
    (``.ci/run`` installs Debian's ``package``, so its absence there is a broken install)."""
    if path is None:
        message = f"{name} not installed (apt-get install {package}); .ci/run installs it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``redis`` need the redis-server binary: skipped without it locally, and
    failed under CI (``.ci/run`` installs it, so its absence there is a broken install)."""
    if REDIS_SERVER is not None:
        return
    message = "redis-server not installed (apt-get install redis-server); .ci/run installs it"
    for item in items:
        if "redis" in item.keywords:
            if os.environ.get("CI"):
                item.add_marker(pytest.mark.xfail(reason=message, strict=True, run=False))
            else:
                item.add_marker(pytest.mark.skip(reason=message))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the test module that asks for it (tests flush as needed)."""
    with RedisServer() as srv:
        yield srv


def queue_config(api_key: str, limits: dict[str, Any] | None = None,
                 pool: dict[str, Any] | None = None) -> Any:
    """One tenant (``acme``, ``api_key``) and one pool of one engine, with interactive and
    batch classes of 30 s deadlines and no aging: the queueing tests' gateway."""
    from extproc.config import hash_api_key, parse_config

    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "scrape": {"interval_s": 0.05},
        "queue": {"aging_s": None},
        "classes": {"interactive": {"priority": 0, "deadline_s": 30},
                    "batch": {"priority": 5, "deadline_s": 30}},
        "tiers": {"t": {"limits": limits} if limits else {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(api_key)]}],
        "pools": [{"name": "one", "models": [{"name": "tiny-llama"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"], **(pool or {})}],
    })


def store_section(request: pytest.FixtureRequest, timeout_ms: int = 250) -> dict[str, Any]:
    """In a fixture parametrized ``["memory", "redis"]``: the config's ``redis`` section on
    the module's real redis-server for ``redis``, nothing (the in-memory store) for
    ``memory``."""
    if request.param != "redis":
        return {}
    return {"redis": {"url": request.getfixturevalue("redis_server").url,
                      "timeout_ms": timeout_ms}}


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    """A real 3-shard Redis Cluster (three redis-servers) for the test module."""
    with RedisCluster(3) as cluster:
        yield cluster
