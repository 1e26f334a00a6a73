"""The admin port's status page (extproc.status) and the rejections ring behind it: a real
kvgate server on ephemeral ports, read over HTTP. The browser test is tests/e2e."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator
from html.parser import HTMLParser

import httpx
import orjson
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.engine.server import start_engine
from extproc.rejections import RecentRejections
from extproc.scheduler import HOLD_REASONS
from extproc.server import KvgateServer
from extproc.status import PAGE, render_page

KEY = "sk-status-acme"


def test_the_ring_keeps_the_newest_and_counts_every_reason() -> None:
    clock = iter(range(1000)).__next__
    ring = RecentRejections(size=3, clock=lambda: float(clock()))
    for i in range(5):
        ring.add(429, "tokens" if i % 2 else "requests", f"t{i}")
    assert [r["tenant"] for r in ring.recent()] == ["t4", "t3", "t2"]
    assert ring.by_reason == {"requests": 3, "tokens": 2}


def test_no_value_can_close_the_inline_script() -> None:
    """Escaping ``</`` alone let ``<!--<script>`` (an engine's error text can quote it) put
    the parser in a state that swallowed the page's own script: a blank page."""
    hostile = "</script><script>alert(1)</script><!--<script>&amp;"
    page = render_page({"tenants": [{"tenant": hostile}]})
    inline = page.split(b'type="application/json"', 1)[1].split(b"</script>", 1)[0]
    assert b"<" not in inline.split(b">", 1)[1] and b"&" not in inline
    assert orjson.loads(inline.split(b">", 1)[1])["tenants"][0]["tenant"] == hostile


async def test_many_tenants_show_the_busiest_and_say_how_many(server, monkeypatch) -> None:
    """Every tenant's usage on every poll held the event loop ~0.5 s at 20,000 tenants."""
    from extproc import status

    monkeypatch.setattr(status, "TENANTS_SHOWN", 0)
    _kvgate, admin = server
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{admin}/status.json")).json()
    assert state["tenants"] == [] and state["tenants_total"] == 1


@pytest.fixture
async def server() -> AsyncIterator[tuple[KvgateServer, str]]:
    engine = await start_engine(model="m")
    config = parse_config({
        "server": {"grpc_port": 0, "admin_port": 0},
        "tiers": {"gold": {"limits": {"max_concurrency": 4, "daily_token_quota": 10_000}}},
        "tenants": [{"name": "acme", "tier": "gold", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": [f"127.0.0.1:{engine.port}"]}],
    })
    kvgate = KvgateServer(config)
    await kvgate.start()
    try:
        yield kvgate, f"http://127.0.0.1:{kvgate.admin_port}"
    finally:
        await kvgate.stop(grace=0)
        await engine.stop()


async def test_status_json_shows_endpoints_tenants_queues_and_rejections(server) -> None:
    kvgate, admin = server
    kvgate.director.rejections.add(401, "invalid_api_key", None)
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{admin}/status.json")).json()
    [endpoint] = state["endpoints"]
    assert endpoint["healthy"] and endpoint["fresh"] and endpoint["kv_cache_usage"] == 0
    assert 0 <= endpoint["scrape_age_s"] < 2
    [tenant] = state["tenants"]
    assert tenant["tenant"] == "acme" and tenant["max_concurrency"] == 4
    assert tenant["quotas"]["daily"]["limit"] == 10_000
    assert state["queues"] == [{"pool": "p", "queued": 0, "oldest_wait_ms": 0, "depth": []}]
    assert state["rejections"]["by_reason"] == {"invalid_api_key": 1}
    assert state["limits"] == "in-memory"
    assert state["holds"] == {"p": {}}
    kvgate.director.schedulers["p"].holds.update(engine_queue=3, kv_cache=1)
    async with httpx.AsyncClient() as client:
        state = (await client.get(f"{admin}/status.json")).json()
    assert state["holds"] == {"p": {"engine_queue": 3, "kv_cache": 1}}


def test_the_page_says_what_each_hold_reason_points_at() -> None:
    script = PAGE.read_text().split("const KNOB = {", 1)[1].split("};", 1)[0]
    assert sorted(re.findall(r"^\s*(\w+):", script, re.M)) == sorted(HOLD_REASONS)


async def test_the_page_is_self_contained_and_never_shows_a_key(server) -> None:
    _, admin = server
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"{admin}/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    csp = reply.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = reply.text
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert KEY not in page and hash_api_key(KEY).removeprefix("sha256:") not in page
    inline = page.split('<script id="initial" type="application/json">')[1].split("</script>")[0]
    assert orjson.loads(inline)["tenants"][0]["tenant"] == "acme"


class _Inline(HTMLParser):
    """The text of a page's scripts that run (no ``type``) and of its styles."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        runs = tag == "style" or (tag == "script" and "type" not in dict(attrs))
        self._open = tag if runs else None
        if runs:
            self.blocks[tag].append("")

    def handle_endtag(self, _tag: str) -> None:
        self._open = None

    def handle_data(self, data: str) -> None:
        if self._open:
            self.blocks[self._open][-1] += data


async def test_the_page_may_run_its_own_script_and_style_and_nothing_else(server) -> None:
    """'unsafe-inline' let any script or style that got into the page run; only the page's
    own are allowed now, by hash."""
    _, admin = server
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"{admin}/")
    directives = dict(d.strip().split(" ", 1) for d in
                      reply.headers["content-security-policy"].split(";"))
    parsed = _Inline()
    parsed.feed(reply.text)
    for tag in ("script", "style"):
        digests = (hashlib.sha256(text.encode()).digest() for text in parsed.blocks[tag])
        own = {f"'sha256-{base64.b64encode(digest).decode()}'" for digest in digests}
        assert own and set(directives[f"{tag}-src"].split()) == own, (tag, directives)


async def test_a_tenant_served_without_redis_says_so(server, monkeypatch) -> None:
    """The failover store answers usage from this process's own counters while Redis is
    unreachable: the page showed them as the global ones, with no warning."""
    kvgate, admin = server

    async def local_usage(_name):
        return {"in_flight": 0, "store": "unavailable (local)"}

    monkeypatch.setattr(kvgate.director, "usage", local_usage)
    async with httpx.AsyncClient() as client:
        [tenant] = (await client.get(f"{admin}/status.json")).json()["tenants"]
    assert tenant["error"] == "Redis unavailable (local): these are this process's numbers only"


async def test_every_admin_answer_says_nosniff(server) -> None:
    _kvgate, admin = server
    async with httpx.AsyncClient() as client:
        for path in ("/healthz", "/readyz", "/debug/queues", "/metrics",
                     "/admin/tenants/acme/usage", "/admin/tenants/nobody/usage"):
            response = await client.get(admin + path)
            assert response.headers["x-content-type-options"] == "nosniff", path


async def test_a_reload_swapped_in_as_the_page_reads_its_tenants_is_no_500(server) -> None:
    """The tenants shown are picked from the running config, then each row is read in a
    task of its own, a loop turn later: a reload that removed one in that turn (its thread's
    read finished as the poll came) failed the row's ``assert`` and the page was a 500."""
    import asyncio

    from extproc.status import status

    kvgate, _admin = server
    data = kvgate.config.model_dump()
    both = parse_config({**data, "tenants": [
        *data["tenants"], {"name": "other", "tier": "gold", "api_keys": [hash_api_key("sk-o")]}]})
    kvgate.director.reconfigure(both)  # two tenants
    without_acme = parse_config({**data, "tenants": [t.model_dump() for t in both.tenants
                                                     if t.name != "acme"]})
    reading = asyncio.ensure_future(status(kvgate.director, started=0))
    asyncio.get_running_loop().call_soon(kvgate.director.reconfigure, without_acme)
    state = await reading
    assert [t["tenant"] for t in state["tenants"]] == ["other"]
