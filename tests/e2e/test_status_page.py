"""The admin port's status page in a real browser: headless Chromium (Debian's ``chromium``)
renders ``GET /`` of a running kvgate — real Envoy in front, two simulated engines behind,
live traffic through it — and the page must show that traffic: the engines' addresses with
non-zero KV usage, the tenants, requests waiting in the queue and what holds them back, the
rejections.

``KVGATE_SCREENSHOT=docs/status-page.png pytest tests/e2e/test_status_page.py`` also keeps
the screenshot (the README's picture is made that way).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import Stack, local_stack
from extproc.scheduler import HOLD_REASONS
from tests.conftest import free_port, need_binary

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium")
KEYS = {"acme": "sk-status-acme", "globex": "sk-status-globex"}
STREAMS = 8  # acme's long answers: together more KV than the pool lets batch work use


@pytest.fixture(scope="module")
def chromium() -> str:
    return need_binary(CHROMIUM, "chromium", "chromium")


def status_config():
    return parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"gold": {"weight": 2, "limits": {"tokens_per_minute": 20_000,
                                                   "daily_token_quota": 1_000_000}},
                  "free": {"limits": {"requests_per_second": 0.2, "request_burst": 1,
                                      "max_concurrency": 2}}},
        "classes": {"interactive": {"priority": 0}, "batch": {"priority": 1}},
        "tenants": [{"name": "acme", "tier": "gold", "default_class": "batch",
                     "api_keys": [hash_api_key(KEYS["acme"])]},
                    {"name": "globex", "tier": "free", "api_keys": [hash_api_key(KEYS["globex"])]}],
        "pools": [{"name": "chat", "models": [{"name": "tiny-llama", "default_max_tokens": 64}],
                   "endpoints": [f"127.0.0.1:{free_port()}" for _ in range(2)],
                   "priority_scheduling": True}],
    })


def post(stack: Stack, tenant: str, max_tokens: int = 8, words: int = 4) -> httpx.Response:
    body = {"model": "tiny-llama", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "tell me more " * words}]}
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEYS.get(tenant, tenant)}"})


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[Stack, str]]:
    """The stack with traffic running: acme's long streams fill the engines' KV (small
    caches) and queue, globex goes over its rate, someone sends a wrong key. Each stream
    takes ~8 s (160 tokens at 50 ms), so what queued is still queued when Chromium, started
    once it queued, reads the page (at 25 ms a token the queue had once drained by then)."""
    options = {"ms_per_token": 50, "kv_blocks": 96, "block_size": 16}
    with local_stack(status_config(), engine_options=options) as stack:
        streams = [threading.Thread(target=post, args=(stack, "acme", 160, 120))
                   for _ in range(STREAMS)]
        for thread in streams:
            thread.start()
        for tenant in ("globex", "globex", "globex", "sk-wrong"):
            post(stack, tenant)
        admin = f"http://127.0.0.1:{stack.kvgate.server.admin_port}"
        wait_until_busy(admin)
        try:
            yield stack, admin
        finally:
            for thread in streams:
                thread.join(timeout=60)


def wait_until_busy(admin: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{admin}/status.json").json()
        if any(e["kv_cache_usage"] for e in state["endpoints"]) and any(
                q["queued"] for q in state["queues"]):
            return
        time.sleep(0.1)
    raise AssertionError(f"no KV usage or nothing queued: {state}")


def browse(chromium: str, url: str, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """Headless Chromium on ``url``: no network but this page, no profile kept; virtual
    time lets the page's own script run (and poll once) before the result is taken. The
    output, and the messages of the page's console (a CSP violation is one)."""
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--hide-scrollbars",
               "--enable-logging=stderr", "--v=0",
               f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=2500", *args, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def csp_violations(console: list[str]) -> list[str]:
    return [line for line in console if "Content Security Policy" in line]


def section(dom: str, name: str) -> str:
    return dom.split(f'<div id="{name}">', 1)[1].split("</section>", 1)[0]


def test_chromium_shows_live_data(live, chromium, tmp_path) -> None:
    stack, admin = live
    dom, console = browse(chromium, f"{admin}/", tmp_path, "--dump-dom")
    assert csp_violations(console) == []  # its own script and style, allowed by hash
    endpoints = section(dom, "endpoints")
    for address in stack.engines:
        assert address in endpoints
    usage = [float(x) for x in re.findall(r"<em>(\d+\.\d)%</em>", endpoints)]
    assert len(usage) == 2 and max(usage) > 0, endpoints
    assert "fresh" in endpoints
    tenants = section(dom, "tenants")
    assert "acme" in tenants and "globex" in tenants and "gold" in tenants
    queues = section(dom, "queues")
    assert "acme" in queues and "batch (1)" in queues, queues
    holds = section(dom, "holds")  # the queued batch work is held by some check
    assert any(f"<td>{reason}</td>" in holds for reason in HOLD_REASONS), holds
    rejections = section(dom, "reasons")
    assert "invalid_api_key" in rejections and "requests" in rejections
    assert 'id="state" class="live"' in dom  # the poll reached status.json
    for key in KEYS.values():
        assert key not in dom and hash_api_key(key)[7:] not in dom

    screenshot = tmp_path / "status.png"
    browse(chromium, f"{admin}/", tmp_path, f"--screenshot={screenshot}",
           "--window-size=1280,700")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 20_000  # a rendered page, not a blank one
    if keep := os.environ.get("KVGATE_SCREENSHOT"):
        shutil.copyfile(screenshot, keep)


def test_a_hostile_value_cannot_blank_the_page(chromium, tmp_path) -> None:
    """An engine whose malformed reply is quoted in its scrape error (``<!--<script>``) put
    the parser in a state that swallowed the page's own script: the page stayed blank."""
    from extproc.status import render_page

    state = {"generated_at": 0, "uptime_s": 1, "hot_path": "python", "limits": "in-memory",
             "endpoints": [{"pool": "p", "address": "10.0.0.1:8000", "healthy": True,
                            "fresh": True, "scrape_age_s": 0.1, "kv_cache_usage": 0.5,
                            "kv_capacity_tokens": 1000, "running": 1, "waiting": 0,
                            "in_flight": 1,
                            "last_error": "400, message: Invalid header <!--<script>"}],
             "queues": [], "holds": {}, "tenants_total": 1,
             "tenants": [{"tenant": "acme<!--<script>", "tier": "gold", "weight": 1,
                          "in_flight": 0, "requests": None, "tokens": None, "quotas": {}}],
             "rejections": {"by_reason": {}, "recent": []}}
    page = tmp_path / "page.html"
    page.write_bytes(render_page(state))
    dom, _ = browse(chromium, page.as_uri(), tmp_path, "--dump-dom")
    assert "10.0.0.1:8000" in section(dom, "endpoints")  # the page's script ran
    assert "acme&lt;!--&lt;script&gt;" in section(dom, "tenants")  # shown, as text


INJECTED = b"<script>document.title = 'injected'</script><style>body { display: none }</style>"


def test_a_script_that_got_into_the_page_is_refused(live, chromium, tmp_path,
                                                      monkeypatch) -> None:
    """Were a value ever to escape into the page as markup, its script would run: the CSP
    allowed any inline script and style. Now only the page's own run, and it still works."""
    from extproc import status

    rendered = status.render_page
    monkeypatch.setattr(status, "render_page",
                        lambda state: rendered(state).replace(b"</body>", INJECTED + b"</body>"))
    _stack, admin = live
    dom, console = browse(chromium, f"{admin}/", tmp_path, "--dump-dom")
    assert "<title>kvgate status</title>" in dom  # the injected script did not run
    assert "<td>acme</td>" in section(dom, "tenants")  # the page's own did
    assert 'id="state" class="live"' in dom  # and polled
    refused = csp_violations(console)
    assert len(refused) == 2, refused
    assert any("'script-src " in r for r in refused) and any("'style-src " in r for r in refused)
