"""The admin port's status page: what this kvgate process sees now, readable in a browser.

``GET /`` is one self-contained page — inline CSS and script, nothing fetched from anywhere
else (a locked-down cluster has no CDN, and the page must not leak to one) — that carries
the current state inline, as JSON in a block that is never run, and then polls
``GET /status.json`` every two seconds. Its Content-Security-Policy lets run only the
page's own script and style, by their hashes. Tenants appear by name and tier: API keys,
even their hashes, never leave the config.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

import kvgate_native
from extproc.datalayer.endpoints import EndpointState
from extproc.director import Director
from extproc.flow import FlowController

REFRESH_MS = 2000
RECENT_SHOWN = 50  # of the rejections ring, newest first
# tenant rows at most, the busiest first (requests in flight or queued): each row is a
# usage read, and 20,000 tenants' took ~0.5 s of the event loop admission runs on, per poll
TENANTS_SHOWN = 200
PAGE = Path(__file__).with_name("status.html")
# The page as served, but for its state (read once, at start-up)
TEMPLATE = PAGE.read_bytes().replace(b"__REFRESH_MS__", str(REFRESH_MS).encode())


def _own(tag: bytes) -> str:
    """CSP sources for the page's own inline ``<tag>`` blocks, each by its SHA-256 (those
    with no attributes: the state's ``type="application/json"`` block is never run)."""
    page = re.sub(rb"<!--.*?-->", b"", TEMPLATE, flags=re.DOTALL)
    blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag, tag), page, re.DOTALL)
    assert blocks, f"status.html has no <{tag.decode()}>"
    # as the browser hashes them: the HTML parser has turned CR LF into LF
    digests = (hashlib.sha256(block.replace(b"\r\n", b"\n")).digest() for block in blocks)
    return " ".join(f"'sha256-{base64.b64encode(d).decode()}'" for d in digests)


# The page may run its own script and styles (nothing injected into it: no 'unsafe-inline')
# and call back to this port, nothing more.
CSP = (f"default-src 'none'; script-src {_own(b'script')}; style-src {_own(b'style')}; "
       "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")


def add_status_routes(app: web.Application, director: Callable[[], Director]) -> None:
    """``/`` and ``/status.json``; ``director`` is read per request, so a reload that swaps
    it is shown at once."""
    started = time.time()

    async def page(_request: web.Request) -> web.Response:
        state = await status(director(), started=started)
        return web.Response(body=render_page(state), content_type="text/html",
                            charset="utf-8", headers=_no_store(csp=True))

    async def as_json(_request: web.Request) -> web.Response:
        state = await status(director(), started=started)
        return web.Response(body=orjson.dumps(state), content_type="application/json",
                            headers=_no_store())

    app.router.add_get("/", page)
    app.router.add_get("/status.json", as_json)


def _no_store(*, csp: bool = False) -> dict[str, str]:
    headers = {"cache-control": "no-store", "x-content-type-options": "nosniff"}
    if csp:
        headers["content-security-policy"] = CSP
    return headers


def render_page(state: dict[str, Any]) -> bytes:
    """The page with ``state`` inline: ``<``, ``>`` and ``&`` as JSON escapes, so no value
    can end the script or put the parser in another state (an engine's error text quoting
    ``<!--<script>`` swallowed the page's own script: a blank page)."""
    inline = (orjson.dumps(state).replace(b"<", b"\\u003c").replace(b">", b"\\u003e")
              .replace(b"&", b"\\u0026"))
    return TEMPLATE.replace(b"__STATE__", inline)


async def status(director: Director, *, started: float) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-friendly data."""
    config = director.config
    rows = await asyncio.gather(*(_tenant(director, name)
                                  for name in _busiest_tenants(director)))
    tenants = [row for row in rows if row is not None]
    return {
        "generated_at": time.time(),
        "uptime_s": round(time.time() - started, 1),
        "hot_path": kvgate_native.status(),
        "limits": "redis" if config.redis is not None else "in-memory",
        "endpoints": _endpoints(director),
        "queues": [await _queue(flow, config.class_order) for flow in director.flows.values()],
        # why placements found no endpoint, per pool (kvgate_pool_holds_total): the page
        # shows what each reason added since its last refresh
        "holds": {pool: dict(sorted(scheduler.holds.items()))
                  for pool, scheduler in director.schedulers.items()},
        "tenants": tenants,
        "tenants_total": len(config.tenants),
        "rejections": {"by_reason": dict(sorted(director.rejections.by_reason.items())),
                       "recent": director.rejections.recent()[:RECENT_SHOWN]},
    }


def _busiest_tenants(director: Director) -> list[str]:
    """The tenants shown: every one, or the ``TENANTS_SHOWN`` with the most requests in
    flight or queued (config order among equals)."""
    names = [t.name for t in director.config.tenants]
    if len(names) <= TENANTS_SHOWN:
        return names
    busy = Counter(director.leases.open.values())
    return sorted(names, key=lambda name: -busy[name])[:TENANTS_SHOWN]


def _endpoints(director: Director) -> list[dict[str, Any]]:
    now = director.clock()
    staleness = director.config.scrape.staleness_s
    return [_endpoint(state, director, now, staleness)
            for state in director.endpoints.snapshot().states()]


def _endpoint(state: EndpointState, director: Director, now: float,
              staleness_s: float) -> dict[str, Any]:
    scheduler = director.schedulers.get(state.pool)
    engine = state.metrics
    return {
        "pool": state.pool,
        "address": state.address,
        "healthy": state.healthy,
        "fresh": state.is_fresh(now, staleness_s),
        "scrape_age_s": None if state.scraped_at is None else round(now - state.scraped_at, 3),
        "kv_cache_usage": state.kv_cache_usage,
        "kv_capacity_tokens": state.kv_capacity_tokens,
        "running": None if engine is None else engine.num_requests_running,
        "waiting": None if engine is None else engine.num_requests_waiting,
        "in_flight": 0 if scheduler is None else scheduler.in_flight.get(state.address, 0),
        "last_error": state.last_error,
    }


async def _queue(flow: FlowController, class_order: list[str]) -> dict[str, Any]:
    now = flow.clock_ms()
    items = list(flow.queue.items())
    return {
        "pool": flow.pool,
        "queued": len(items),
        "oldest_wait_ms": max((now - i.enqueued_ms for i in items), default=0),
        "depth": [{"band": band, "class": class_order[band] if band < len(class_order) else "",
                   "tenant": tenant, "count": count}
                  for (band, tenant), count in sorted(flow.queue.depth().items())],
    }


async def _tenant(director: Director, name: str) -> dict[str, Any] | None:
    """None: a reload removed the tenant since it was picked (each row is read in a task
    of its own, a loop turn later)."""
    tenant = director.tenants.get(name)
    if tenant is None:
        return None
    row: dict[str, Any] = {"tenant": name, "tier": tenant.tier,
                           "weight": director.tenants.weight(tenant)}
    try:
        usage = await director.usage(name)
    except Exception as exc:  # Redis down: the page still shows the rest
        return {**row, "error": f"limits unavailable: {type(exc).__name__}"}
    store = (usage or {}).get("store", "")
    if isinstance(store, str) and store.startswith("unavailable"):  # the failover's own
        return {**row, "error": f"Redis {store}: these are this process's numbers only"}
    return {**row, **(usage or {})}
