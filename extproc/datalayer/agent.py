"""``kvgate agent``: serve this node's GPU readings for a gateway-mode kvgate to scrape.

The agent reads NVML every ``interval_s`` in a worker thread and serves the last rendering,
so any number of scrapers cost one NVML pass per interval and a scrape never waits on the
driver. Without NVML it still serves a valid (comment-only) ``/metrics`` and ``/healthz``:
an agent DaemonSet scheduled onto a CPU node should not crash-loop.

When a read fails or hangs (it is given ``max(interval_s, 1 s)``) the agent serves no
samples, and a comment saying why, rather than the last good ones: a scraper then knows it
has no reading instead of trusting a stale one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from extproc.datalayer.nvml import AsyncGpuReader, GpuReader, render_gpu_metrics
from extproc.http_port import serve_http
from extproc.tasks import cancel

log = logging.getLogger(__name__)

NO_NVML_TEXT = "# kvgate agent: NVML unavailable on this host; no GPU metrics\n"


class GpuMetricsPage:
    """The current ``/metrics`` text, refreshed from a reader."""

    def __init__(self, reader: GpuReader | None, timeout_s: float = 1.0):
        self.reader = None if reader is None else AsyncGpuReader(reader)
        self.timeout_s = timeout_s
        self.text = NO_NVML_TEXT
        self._failing = False

    async def refresh(self) -> None:
        if self.reader is None:
            return
        try:
            text = render_gpu_metrics(await self.reader.read(self.timeout_s))
        except Exception as exc:
            reason = self._describe(exc)
            if not self._failing:
                log.warning("kvgate agent: reading GPUs failed: %s", reason)
            self._failing = True
            self.text = f"# kvgate agent: reading GPUs failed: {reason}\n"
            return
        if self._failing:
            log.info("kvgate agent: reading GPUs works again")
        self._failing = False
        self.text = text

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return f"NVML did not answer within {self.timeout_s:g}s"
        return " ".join(f"{type(exc).__name__}: {exc}".split())

    async def refresh_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.refresh()




def make_app(page: GpuMetricsPage) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page.text, headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


@dataclass
class AgentHandle:
    """A running agent: where it listens, and how to stop it."""

    runner: web.AppRunner
    refresher: asyncio.Task[None] | None
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    async def stop(self) -> None:
        await cancel(self.refresher)
        await self.runner.cleanup()


async def start_agent(host: str = "127.0.0.1", port: int = 0, reader: GpuReader | None = None,
                      interval_s: float = 1.0) -> AgentHandle:
    """Serve from the caller's event loop; ``port=0`` picks a free port (see ``.port``).

    The first reading is taken before the port opens, so the first scrape has data.
    """
    page = GpuMetricsPage(reader, timeout_s=max(interval_s, 1.0))
    await page.refresh()
    runner = await serve_http(make_app(page), host, port, "kvgate.agent", shutdown_timeout=0.25)
    bound_port = runner.addresses[0][1]
    refresher = None
    if reader is not None:
        refresher = asyncio.create_task(page.refresh_every(interval_s), name="kvgate-agent")
    return AgentHandle(runner, refresher, host, bound_port)


async def run_agent(host: str, port: int, reader: GpuReader | None,
                    interval_s: float = 1.0) -> None:
    """Serve until cancelled (the CLI cancels on SIGTERM/SIGINT)."""
    handle = await start_agent(host, port, reader, interval_s)
    what = "GPU metrics" if reader is not None else "no GPU metrics (NVML unavailable)"
    log.info("kvgate agent serving %s on %s/metrics", what, handle.url)
    try:
        await asyncio.Event().wait()
    finally:
        await handle.stop()
