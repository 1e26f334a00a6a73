"""The kvgate process: the ext_proc gRPC service, gRPC health, and the admin HTTP port.

grpc.aio (with uvloop where available) because kvgate holds a stream open for the whole
LLM call; a thread per stream would not scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvgate_native
from extproc import duplex, messages
from extproc.config import Config, ConfigError, GrpcTls, for_worker
from extproc.config import Server as ServerSettings
from extproc.datalayer.discovery import DnsDiscovery, StaticDiscovery
from extproc.datalayer.endpoints import EndpointStore, StoreSnapshot
from extproc.datalayer.nvml import open_gpu_reader
from extproc.datalayer.scraper import GpuSource, Scraper
from extproc.director import Director, Prepared, prepare
from extproc.duplex import DuplexStream
from extproc.http_port import serve_http
from extproc.logs import quiet_grpc_write_failures
from extproc.metrics import Collected, Metrics
from extproc.ports import connect_host
from extproc.reload import ConfigFile, Reload, plan
from extproc.reports import ReportDesk
from extproc.rls import SERVICE as RLS_SERVICE
from extproc.rls import RateLimitService
from extproc.status import add_status_routes
from extproc.stream import RequestStream
from extproc.tasks import cancel
from extproc.wiring import (
    build_director,
    build_rate_counters,
    build_store,
    rate_limit_breaker,
)
from limiter.stores import LimiterStore, StoreUnavailable

log = logging.getLogger(__name__)


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# How long a release waits for a response's meter report once Envoy has ended its stream:
# the report leaves Envoy just before the stream's end, on another connection.
REPORT_WAIT_S = 0.5
CUT_MARGIN_S = 0.2  # past the shutdown grace, before gRPC cuts the streams counted as cut
# How long worker 0's /readyz waits for each other worker's own answer (a probe's default
# timeout is 1 s)
SIBLING_TIMEOUT_S = 0.5
# How often the tenants reloads removed are looked at again, to forget those with nothing
# left (a reload looks at once): and the in-memory store's limits that have faded drop
FORGET_EVERY_S = 2.0
GRPC_PING_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
)
"""Envoy pings its ext_proc and RLS connections (every 30 s as rendered) whether or not
they carry data, and an ext_proc stream carries none while its answer streams back. gRPC's
defaults (a ping a 5 minutes without data, none at all without calls, 2 strikes) answered
the fourth ping with GOAWAY ``too_many_pings``, breaking every stream on the connection:
answers running longer than ~2 minutes were cut (their leases released while the engines
still ran them), and a request that raced an idle connection's GOAWAY got a 503. Pings a
second or more apart are taken, with calls or without."""


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, director: Director, metrics: Metrics, config: Config, desk: ReportDesk):
        self.director = director
        self.metrics = metrics
        self.settings = config.server
        self.duplex = config.server.body_mode == "full_duplex"  # else: as each stream says
        self.desk = desk
        self.open: set[RequestStream] = set()  # streams whose RPC is running
        # the request bodies full-duplex streams gather, bounded together
        self.bodies = duplex.HeldBodies(duplex.HELD_BODIES * config.server.max_body_bytes)
        self.releasing: set[asyncio.Future[None]] = set()  # releases under way
        self.cut = 0  # streams still open when a shutdown's grace ran out

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[messages.Reply]:
        incoming = Incoming(request_iterator)
        message = await incoming.next()
        if message is None:
            return
        # a gateway that streams bodies full duplex (the Inference Extension's): duplex.py
        parts = (self.director, self.metrics, self.settings, self.desk, incoming.watch)
        stream = (DuplexStream(*parts, bodies=self.bodies)
                  if self.duplex or duplex.requested(message) else RequestStream(*parts))
        self.open.add(stream)
        ending: str | None = "envoy_closed"  # unless the stream is done: see finally
        # whether gRPC took the reply that routed the request: it resumes this generator
        # after a reply only once that reply is written. With the RPC already cancelled
        # (Envoy's message timeout fired, or Envoy reset the stream, as kvgate admitted the
        # request) the write fails and gRPC drops the generator at that yield, unresumed:
        # the request never went upstream (see finally)
        routed = False
        try:
            if isinstance(stream, DuplexStream):
                while message is not None:
                    for reply in await stream.exchange(message):
                        yield reply
                        routed = stream.admission is not None
                    if stream.done:
                        return
                    message = await incoming.next()
            handle = stream.handle
            while message is not None:
                yield await handle(message)
                routed = stream.admission is not None
                if stream.done:
                    return  # ending the RPC here lets Envoy close the stream gracefully
                message = await incoming.next()
            # Envoy ended the stream: after the response (reported done), or a headers-only
            # request once routed; otherwise the response was cut off
            if stream.response is None or stream.response.done:
                ending = None
        except asyncio.CancelledError:
            if not incoming.departed:
                ending = "cancelled"
                raise
            _uncancel()  # the watch cancelled the wait: its client left while it queued
            ending = "client_gone"
            stream.departed()
        finally:
            if stream.done or (stream.response is not None and stream.response.done):
                # the last reply was produced, or the response was reported whole, so the
                # request ended normally however the RPC did: Envoy may reset a stream it is
                # done with, and gRPC then cancels the handler or closes this generator at
                # that reply's yield (GeneratorExit)
                ending = None
            if not routed and stream.admission is not None:
                stream.unsent = True  # released at once and charged nothing (stream.close)
            self.open.discard(stream)
            if isinstance(stream, DuplexStream):
                stream.let_go()  # a body it was still gathering
            await incoming.close()
            if stream.holds_admission:
                await self._release(stream, ending)

    async def _release(self, stream: RequestStream, ending: str | None) -> None:
        """Awaited in place when the release cannot wait (``Director.release_waits``):
        nothing can then interrupt it part way, and a task per request costs CPU. Otherwise
        a task the RPC does not wait for (nothing can cancel it part way), kept in
        ``releasing`` so a shutdown can wait for it before closing the stores. A response
        whose meter report has not come yet is released by a task that waits for it first
        (the RPC ends now)."""
        if ending != "shutdown" and stream.report_pending and not self.desk.silent:
            # (a meter seen not to report at all sends none: its slot is not held for one)
            self._track(self._release_after_report(stream, ending))
            return
        admission = stream.admission
        if admission is None or not self.director.release_waits(admission):
            await stream.close(ending)
            return
        self._track(stream.close(ending))

    def _track(self, release: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(release)
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)
        return task

    async def _release_after_report(self, stream: RequestStream, ending: str | None) -> None:
        """Envoy ended the stream first; the meter's done report (sent without waiting for
        an answer, after the response's last byte) is usually a moment behind: the request
        is charged its usage if it comes within ``REPORT_WAIT_S``, else as cut off."""
        if await stream.wait_for_report(REPORT_WAIT_S):
            ending = None
        await stream.close(ending)

    async def settle(self) -> None:
        """After the gRPC server stopped (cutting the streams still open at the grace):
        release anything a stream still holds, and wait for every release under way."""
        for stream in [stream for stream in self.open if stream.holds_admission]:
            with contextlib.suppress(Exception):
                await self._release(stream, "shutdown")
        while self.releasing:
            await asyncio.gather(*self.releasing, return_exceptions=True)


class Incoming:
    """Envoy's messages on one ext_proc stream, and a watch for the client leaving while its
    request waits in the queue.

    When an HTTP client goes away, Envoy half-closes the ext_proc stream and resets it only
    after a second without kvgate ending the RPC (graceful close, see envoy_config.py; the
    second is Envoy's ``envoy.filters.http.ext_proc.remote_close_timeout_milliseconds``);
    a servicer awaiting the queue reads nothing meanwhile, so it would learn of the departure
    a second late, and the request could be dispatched to an engine for nobody. Inside
    :meth:`watch` the next read runs ahead, and the stream's end cancels the waiting task.
    Only queued requests pay for it: an admission decided at once reads nothing ahead.
    """

    __slots__ = ("_ahead", "_requests", "departed")

    def __init__(self, requests: AsyncIterator[pb.ProcessingRequest]):
        self._requests = aiter(requests)
        self._ahead: asyncio.Future[pb.ProcessingRequest | None] | None = None
        self.departed = False  # the watch saw the stream end and cancelled the wait

    async def next(self) -> pb.ProcessingRequest | None:
        """The next message, or None at the end of the stream."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return await ahead
        return await anext(self._requests, None)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """While inside, the end of the stream cancels the task that entered; a message that
        arrives instead is kept for :meth:`next`."""
        task = asyncio.current_task()
        if self._ahead is None:
            self._ahead = asyncio.ensure_future(anext(self._requests, None))
        watching = True

        def on_read(ahead: asyncio.Future[pb.ProcessingRequest | None]) -> None:
            if watching and task is not None and _ended(ahead):
                self.departed = True
                task.cancel()

        self._ahead.add_done_callback(on_read)
        try:
            yield
        finally:
            watching = False

    async def close(self) -> None:
        """Stop a pending read; its failure, if any, no longer matters (the RPC is over)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await ahead


def _ended(ahead: asyncio.Future[pb.ProcessingRequest | None]) -> bool:
    """The read ahead found the end of the stream, or the stream broke."""
    return ahead.cancelled() or ahead.exception() is not None or ahead.result() is None


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _add_processor(processor: ExternalProcessor, server: grpc.aio.Server) -> None:
    """The generated ``add_ExternalProcessorServicer_to_server``, with a serializer that
    sends replies kvgate already serialized (``messages.Reply``) as they are."""
    service = EXT_PROC_SERVICE
    handlers = {"Process": grpc.stream_stream_rpc_method_handler(
        processor.Process,
        request_deserializer=messages.parse_request,
        response_serializer=messages.serialize_reply,
    )}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _sibling_admins(settings: ServerSettings, workers: int) -> list[tuple[int, str]]:
    """Workers 1 … N-1's admin ports (``admin_port`` + i) as worker 0 reaches them: none
    with one worker, or without a fixed admin port (each worker's is then its own)."""
    if workers < 2 or not settings.admin_port:
        return []
    host = settings.admin_host
    host = _bracketed(connect_host(host))
    return [(i, f"http://{host}:{settings.admin_port + i}/readyz") for i in range(1, workers)]


async def _sibling_waiting(session: aiohttp.ClientSession, index: int, url: str) -> list[str]:
    """Why worker ``index`` is not ready, by its own ``/readyz`` (empty: ready)."""
    try:
        async with session.get(url) as response:
            if response.status == 200:
                return []
            waiting = (await response.json(content_type=None)).get("waiting_for") or ["?"]
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
        waiting = [f"no answer on {url} ({type(exc).__name__})"]
    return [f"worker {index}: {reason}" for reason in waiting]


def _bracketed(host: str) -> str:
    """``host`` as the host part of ``host:port``: an IPv6 address in brackets (gRPC read
    ``:::9001``, for ``server.host: "::"``, as a misformatted name and kvgate did not start;
    Envoy reads a report address ``::1:9010`` as no address at all)."""
    return f"[{host}]" if ":" in host else host


def _report_host(settings: ServerSettings) -> str:
    if settings.report_host == "auto":  # the pod IP: Kubernetes maps the pod's name to it
        return socket.gethostbyname(socket.gethostname())
    if settings.report_host is not None:
        return settings.report_host
    return connect_host(settings.host)


def _server_credentials(tls: GrpcTls) -> grpc.ServerCredentials:
    """The listener's certificate; with a client CA, clients must present one it signed.
    Files that cannot be read are config problems (exit 2, not a traceback), every one of
    them at once, each by its full path (``server.tls.key_file``): the caller names the
    config file (it was "server.tls: 1 problem(s) / cert_file: …", the key file unsaid)."""
    problems: list[str] = []
    chain, key = _read("cert_file", tls.cert_file, problems), _read("key_file", tls.key_file,
                                                                    problems)
    ca = (None if tls.client_ca_file is None
          else _read("client_ca_file", tls.client_ca_file, problems))
    if problems:
        raise ConfigError("<config>", problems)
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _read(field: str, path: str, problems: list[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        problems.append(f"server.tls.{field}: cannot read {path}: {exc.strerror}")
        return b""


class KvgateServer:
    """Owns the gRPC server and the admin site; ports 0 bind ephemeral ports (tests)."""

    def __init__(
        self, config: Config, store: LimiterStore | None = None, *, reuse_port: bool = False,
        config_path: str | Path | None = None, worker: int = 0, workers: int = 1,
    ):
        self.config = config
        self.worker = worker  # of `kvgate serve --workers`: its ports are the file's + worker
        # worker 0 answers the pod's readiness probe for every worker (_siblings_not_ready)
        self.siblings = _sibling_admins(config.server, workers) if worker == 0 else []
        self.metrics = Metrics()
        self.metrics.configure(*_label_names(config))
        # the file reloads read (SIGHUP, or polled): none for a config built in code
        self.config_file = None if config_path is None else ConfigFile(config_path)
        self._reload_lock = asyncio.Lock()
        self._reloads: set[asyncio.Task[bool]] = set()
        self._sighup_waiting = False  # a SIGHUP's reload waits for its turn (see _on_sighup)
        self._config_problem: str | None = None  # why the polled file is unreadable, once
        self.endpoints = EndpointStore({p.name: p.kv_capacity_tokens for p in config.pools
                                        if p.kv_capacity_tokens})
        self.director = build_director(config, store or build_store(config, self.metrics),
                                       self.endpoints, metrics=self.metrics)
        self.discoveries: list[StaticDiscovery | DnsDiscovery] = [
            DnsDiscovery(self.endpoints, p.name, p.dns.hostname, p.dns.port, p.dns.interval_s)
            if p.dns else StaticDiscovery(self.endpoints, p.name, p.endpoints)
            for p in config.pools
        ]
        self.scraper = _scraper(config, self.endpoints, self.director, self._on_scraped)
        self.reuse_port = reuse_port  # several worker processes share the gRPC port
        self.desk = ReportDesk(self.metrics)
        self.metrics.watch_endpoints(lambda: self.endpoints.snapshot().states(),
                                     self.scraper.errors)
        self.metrics.watch_pools(lambda: {name: scheduler.holds for name, scheduler
                                          in self.director.schedulers.items()})
        self.ratelimit = RateLimitService(
            config.ratelimit, build_rate_counters(config),
            timeout_s=None if config.redis is None else config.redis.timeout_ms / 1000,
            metrics=self.metrics, breaker=rate_limit_breaker(config))
        self.metrics.ratelimit_breakers.set_function(self.ratelimit.breakers_open)
        self._renewer: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._forgetter: asyncio.Task[None] | None = None
        self.grpc_port = 0
        self.admin_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._processor: ExternalProcessor | None = None
        self._admin: web.AppRunner | None = None
        self.started = False  # serving
        self.draining = False  # SIGTERM: no new streams, open ones finishing
        self._scraped_pools: set[str] = set()  # KV-aware pools with an endpoint scraped once

    async def start(self) -> None:
        """Discover endpoints and scrape them once (so the first requests are scheduled on
        real data), then serve."""
        settings = self.config.server
        # first: an unreadable certificate fails the start before anything runs
        credentials = None if settings.tls is None else _server_credentials(settings.tls)
        for discovery in self.discoveries:
            await discovery.start()
        await self.scraper.scrape_once()
        self.scraper.start()
        for flow in self.director.flows.values():
            flow.start()
        # the whole buffered request body arrives as one gRPC message
        max_message = settings.max_body_bytes + 1024 * 1024
        quiet_grpc_write_failures()
        self._grpc = grpc.aio.server(options=[
            ("grpc.so_reuseport", int(self.reuse_port)),
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            *GRPC_PING_OPTIONS,
        ])
        await self.desk.start(settings.host, settings.report_port, _report_host(settings))
        self._processor = ExternalProcessor(self.director, self.metrics, self.config, self.desk)
        _add_processor(self._processor, self._grpc)
        self._health = health_servicer = health.aio.HealthServicer()
        self.ratelimit.attach(self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._grpc)
        address = f"{_bracketed(settings.host)}:{settings.grpc_port}"
        if credentials is None:
            self.grpc_port = self._grpc.add_insecure_port(address)
        else:
            self.grpc_port = self._grpc.add_secure_port(address, credentials)
        await self._grpc.start()
        for service in ("", EXT_PROC_SERVICE, RLS_SERVICE):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        if settings.admin_port is not None:
            await self._start_admin(settings.admin_host, settings.admin_port)
        if self.config.redis is not None:
            self._renewer = asyncio.create_task(self._renew_leases(self.config.redis.lease_ttl_s))
        if self.config_file is not None and settings.reload_poll_s > 0:
            self._poller = asyncio.create_task(self._poll_config(settings.reload_poll_s))
        self._forgetter = asyncio.create_task(self._forget_every(FORGET_EVERY_S))
        self.started = True
        self.metrics.last_reload.set(time.time())
        self._note_scraped(self.endpoints.snapshot())
        admin = ("off (server.admin_port: null)" if settings.admin_port is None  # not :0
                 else f"on {settings.admin_host}:{self.admin_port}")
        log.info("kvgate ext_proc on %s:%d (%s), admin %s; hot path: %s", settings.host,
                 self.grpc_port, "plaintext" if settings.tls is None else "TLS", admin,
                 kvgate_native.status())

    def _on_scraped(self, snapshot: StoreSnapshot) -> None:
        if any(p.kv_aware and p.name not in self._scraped_pools for p in self.config.pools):
            self._note_scraped(snapshot)  # until every pool is seen

    async def _start_admin(self, host: str, port: int) -> None:
        app = web.Application(middlewares=[_json_errors])
        app.on_response_prepare.append(_nosniff)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/admin/tenants/{tenant}/usage", self._usage)
        app.router.add_get("/debug/queues", self._queues)
        add_status_routes(app, lambda: self.director)  # GET / and /status.json
        self._admin = await serve_http(app, host, port, "kvgate.admin")
        self.admin_port = self._admin.addresses[0][1]

    async def _renew_leases(self, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                await self.director.renew_leases()
            except Exception:  # the loop must outlive any one failure
                log.exception("lease renewal failed")

    async def _usage(self, request: web.Request) -> web.Response:
        usage = await self.director.usage(request.match_info["tenant"])
        if usage is None:
            return web.json_response({"error": {"message": "unknown tenant"}}, status=404)
        return web.json_response(usage)

    async def _queues(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"pools": [await flow.debug() for flow in self.director.flows.values()]}
        )

    async def _metrics(self, _request: web.Request) -> web.Response:
        """Collected here, formatted on a thread (``Collected``): admissions wait for the
        collectors only, not for the text of every series."""
        body = await asyncio.to_thread(generate_latest, Collected(self.metrics.registry))
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _request: web.Request) -> web.Response:
        """Alive: the event loop answers (a liveness probe; readiness is ``/readyz``)."""
        return web.json_response({"status": "ok"})

    async def _readyz(self, _request: web.Request) -> web.Response:
        waiting = self.not_ready() + await self._siblings_not_ready()
        if waiting:
            return web.json_response({"status": "not ready", "waiting_for": waiting},
                                     status=503)
        return web.json_response({"status": "ready"})

    def not_ready(self) -> list[str]:
        """Why this process should get no traffic yet (empty: ready): still starting, a
        KV-aware pool none of whose endpoints has answered a scrape yet (once one has, the
        pool counts as seen: an engine outage later is the scheduler's business, not a
        reason to take kvgate out of service), or draining."""
        waiting = [] if self.started else ["start"]
        waiting += [f"pool {p.name}: no endpoint scraped yet" for p in self.config.pools
                    if p.kv_aware and p.name not in self._scraped_pools]
        if self.draining:
            waiting.append("draining (shutting down)")
        self.metrics.ready.set(0 if waiting else 1)
        return waiting

    async def _siblings_not_ready(self) -> list[str]:
        """With ``--workers N``, worker 0 (whose admin port the pod's probes ask) is ready
        only when every other worker is too: one still starting, draining, stuck or gone
        takes the pod out of its Services, as a single process would. Each answers its own
        ``/readyz``; one that does not within :data:`SIBLING_TIMEOUT_S` counts as not ready."""
        if not self.siblings:
            return []
        timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            answers = await asyncio.gather(*(_sibling_waiting(session, index, address)
                                             for index, address in self.siblings))
        return [reason for answer in answers for reason in answer]

    def _note_scraped(self, snapshot: StoreSnapshot) -> None:
        """Remember the pools that have had an endpoint scraped (readiness)."""
        for state in snapshot.states():
            if state.scraped_at is not None:
                self._scraped_pools.add(state.pool)
        self.not_ready()

    # -- reload ----------------------------------------------------------------------------

    async def _poll_config(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reload_if_changed("file changed")
            except Exception:  # the poll must outlive any one failure
                log.exception("config poll failed")

    async def reload_if_changed(self, why: str) -> bool:
        """Reload if the file's content changed. The look runs in a worker thread: hashing
        a large file took milliseconds of every admission's loop, and a FIFO at the path
        blocked it. A file gone or not regular keeps the running config; it is logged and
        counted as a rejected reload once, not at every poll, until it is readable again.
        Whether a reload was applied."""
        if self.config_file is None:
            return False
        async with self._reload_lock:  # the look and a reload's read do not interleave
            polled = await asyncio.to_thread(self.config_file.check)
            self._note_unreadable(polled.problem)
            if polled.changed:
                return await self._reload_locked(why)
        return False

    def _note_unreadable(self, problem: str | None) -> None:
        """Report the config file turning unreadable once, and its coming back."""
        assert self.config_file is not None
        if problem == self._config_problem:
            return
        if problem is None:
            log.info("config file %s is readable again", self.config_file.path)
        else:
            self.metrics.reloads.labels("rejected").inc()
            log.warning("config file %s cannot be read (%s): the running config stays until "
                        "it can", self.config_file.path, problem)
        self._config_problem = problem

    async def _forget_every(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                self.forget_retired()
            except Exception:  # the loop must outlive any one failure
                log.exception("forgetting removed tenants failed")

    def forget_retired(self) -> list[str]:
        """Forget the tenants reloads removed that have nothing left admitted, queued or
        owed (``Director.forget_retired``), their metric series with them."""
        forgotten = self.director.forget_retired()
        if forgotten:
            self.metrics.forget(forgotten)
            shown = ", ".join(forgotten[:10]) + (
                f" and {len(forgotten) - 10} more" if len(forgotten) > 10 else "")
            log.info("forgot %d removed tenant(s), nothing of theirs left: %s",
                     len(forgotten), shown)
        return forgotten

    def _on_sighup(self) -> None:
        """A SIGHUP while another's reload waits for its turn joins that one: it reads the
        file once it starts, so it sees what this one would. A burst of SIGHUPs (a script's
        loop, a config tool on every replica) costs two reloads — the one under way and one
        after it — not one each: with tens of thousands of tenants each takes seconds, and
        50 in a second kept kvgate reloading for four minutes, its latency up meanwhile."""
        if self._sighup_waiting:
            return
        self._sighup_waiting = True
        self._reload_soon(self._sighup_reload())

    def _reload_soon(self, reload: Coroutine[Any, Any, bool]) -> None:
        task = asyncio.get_running_loop().create_task(reload)
        self._reloads.add(task)  # (held until done: the loop keeps only weak references)
        task.add_done_callback(self._reloads.discard)

    async def _sighup_reload(self) -> bool:
        async with self._reload_lock:
            self._sighup_waiting = False  # from now on a SIGHUP needs a read after this one
            return await self._reload_locked("SIGHUP")

    async def reload_in_thread(self, why: str) -> bool:
        """:meth:`reload`, with the file read and validated in a worker thread: a config of
        tens of thousands of tenants takes seconds to parse, which on the event loop would
        stall every request. One reload at a time; the swap itself is on the loop."""
        async with self._reload_lock:
            return await self._reload_locked(why)

    async def _reload_locked(self, why: str) -> bool:
        if self.config_file is None:
            return self.reload(why)
        # the config only changes here, under the lock: the plan against it holds at the swap
        loaded = await asyncio.to_thread(self._load_config_file, self.config)
        return self._apply(why, loaded)

    def reload(self, why: str = "SIGHUP") -> bool:
        """Read the config file again; apply it if valid, else keep the running one. No
        await from validation to swap: no request sees half of it."""
        if self.config_file is None:
            log.warning("config reload (%s) ignored: this server has no config file", why)
            return False
        return self._apply(why, self._load_config_file(self.config))

    def _load_config_file(self, running: Config) -> tuple[Reload, Prepared] | ConfigError:
        """Read, validate and plan the file against the ``running`` config, and build what
        the swap needs from it: everything but the swap, so it can run in a thread."""
        assert self.config_file is not None
        try:
            loaded = self.config_file.load()
            # as this worker runs the file (its own ports): no "server changed" otherwise
            change = plan(running, for_worker(loaded, self.worker), str(self.config_file.path))
        except ConfigError as error:
            return error
        return change, prepare(change.config)

    def _apply(self, why: str, loaded: tuple[Reload, Prepared] | ConfigError) -> bool:
        assert self.config_file is not None
        source = str(self.config_file.path)
        if isinstance(loaded, ConfigError):
            self.metrics.reloads.labels("rejected").inc()
            log.error("config reload (%s) rejected, the running config stays: %s", why, loaded)
            return False
        change, prepared = loaded
        self.director.reconfigure(change.config, prepared)
        self.config = change.config
        self.metrics.configure(*_label_names(change.config))
        self.metrics.reloads.labels("applied").inc()
        self.metrics.last_reload.set(time.time())
        log.info("config reloaded (%s) from %s: tenants added %s, removed %s, changed %s",
                 why, source, change.added or "none", change.removed or "none",
                 change.changed or "none")
        if change.restart:
            log.warning("config reload: %s changed in %s and take effect only after a restart "
                        "(the running values stay)", ", ".join(change.restart), source)
        self.forget_retired()  # those removed now with nothing in flight: at once
        return True

    # -- shutdown --------------------------------------------------------------------------

    async def drain(self, grace: float, delay: float = 0) -> None:
        """SIGTERM: not ready (``/readyz`` 503, gRPC health NOT_SERVING); after ``delay``
        no new streams, and open ones get ``grace`` seconds to finish; then everything is
        released and closed."""
        self.draining = True
        self.metrics.draining.set(1)
        self.not_ready()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if delay:
            log.info("draining: not ready; new streams still taken for %g s", delay)
            await asyncio.sleep(delay)
        open_streams = 0 if self._processor is None else len(self._processor.open)
        log.info("draining: not ready, no new streams; %d open stream(s) get up to %g s",
                 open_streams, grace)
        await self.stop(grace)

    async def stop(self, grace: float = 1.0) -> None:
        if self._grpc is not None:
            await self._stop_grpc(self._grpc, grace)
        if self._processor is not None:
            await self._processor.settle()
        self.director.costs.close()
        await cancel(self._poller)
        await cancel(self._forgetter)
        await self.desk.stop()
        await cancel(self._renewer)
        await self.scraper.stop()
        for discovery in self.discoveries:
            await discovery.stop()
        for flow in self.director.flows.values():
            await flow.stop()
            await _closed(flow.fairness.close(), "the fair queue's shared counters")
        if self._admin is not None:
            await self._admin.cleanup()
        await _closed(self.director.store.close(), "the limits store")
        await _closed(self.ratelimit.close(), "the Rate Limit Service's counters")
        log.info("stopped: %d stream(s) cut at the grace, %d lease(s) left held",
                 0 if self._processor is None else self._processor.cut,
                 len(self.director.active))

    async def _stop_grpc(self, server: grpc.aio.Server, grace: float) -> None:
        """No new streams; open ones get ``grace`` (those still open then are counted, and
        gRPC cuts them a moment later)."""
        stopping = asyncio.ensure_future(server.stop(grace + CUT_MARGIN_S if grace else 0))
        done, _ = await asyncio.wait({stopping}, timeout=grace)
        if not done and self._processor is not None:
            # requests still queued or held for their slot were never sent upstream: they
            # get kvgate's 503 with its Retry-After in the margin, not a cut stream
            refused = self.director.refuse_waiting()
            self._processor.cut = max(0, len(self._processor.open) - refused)
        await stopping

    async def serve_forever(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain: open streams get ``shutdown_grace_s``.

        The stop is handled from before the start: the gRPC port opens during it, and a
        SIGTERM between that and a handler installed after it took the default action (the
        process killed, its admitted requests' streams cut, their leases held in Redis until
        they expire) or, as a container's PID 1, was lost. One that comes while it starts
        drains as soon as it has started, without ``drain_delay_s``: it never reported ready.
        """
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        stopped_starting = stop.is_set()
        if stopped_starting:
            log.info("stop asked while starting: draining at once")
        else:
            # Everything built so far (modules, config, protobuf descriptors) lives as long
            # as the process: keep it out of the collector's way, so its full passes only
            # walk what requests allocate.
            gc.collect()
            gc.freeze()
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            if self.config_file is not None:
                # changed while kvgate started (read at its start): a SIGHUP then was ignored
                self._reload_soon(self.reload_if_changed("file changed while starting"))
            await stop.wait()
        # not removed: without a handler SIGHUP's default action ends the process, which
        # cut every stream still draining and left its leases held
        loop.add_signal_handler(signal.SIGHUP, _ignored_while_draining)
        await self.drain(self.config.server.shutdown_grace_s,
                         0 if stopped_starting else self.config.server.drain_delay_s)


def _label_names(config: Config) -> tuple[list[str], list[str], list[str]]:
    """The tenants, models and classes metrics may name (see ``Metrics.configure``)."""
    return ([t.name for t in config.tenants],
            [m.name for p in config.pools for m in p.models], list(config.classes))


def _scraper(
    config: Config, endpoints: EndpointStore, director: Director,
    on_scraped: Callable[[StoreSnapshot], None] | None = None,
) -> Scraper:
    """The scrape loop for the KV-aware pools, with their GPU sources."""
    sources = gpu_sources(config)
    local = any(s.url is None for s in sources.values())
    settings = config.scrape

    def on_update(snapshot: StoreSnapshot) -> None:
        director.scraped(snapshot)
        if on_scraped is not None:
            on_scraped(snapshot)

    return Scraper(
        endpoints,
        interval_s=settings.interval_s,
        timeout_s=settings.timeout_s,
        max_concurrency=settings.max_concurrency,
        gpu_sources=sources,
        gpu_reader=open_gpu_reader() if local else None,
        unhealthy_after=settings.unhealthy_after,
        metrics_path=settings.metrics_path,
        on_update=on_update,
        pools={p.name for p in config.pools if p.kv_aware},
        engines={p.name: p.engine for p in config.pools},
        metrics_ports={p.name: p.metrics_port for p in config.pools if p.metrics_port},
    )


def gpu_sources(config: Config) -> dict[str, GpuSource]:
    """Each pool's GPU source, and each endpoint's own where it names its GPUs or MIG
    slices (``endpoint_gpus``): the scraper prefers an address's entry to its pool's, so
    that endpoint's memory watermark reads only its own slice."""
    sources: dict[str, GpuSource] = {}
    for pool in config.pools:
        if pool.gpu_source:
            url = GpuSource.parse(pool.gpu_source).url
            sources[pool.name] = GpuSource(url, frozenset(pool.gpus))
            for address, gpus in pool.endpoint_gpus.items():
                sources[address] = GpuSource(url, frozenset(gpus))
    return sources


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop `kvgate serve` runs on: uvloop's, where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def install_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """The router's 404 and 405 as JSON, as the port's other answers are (aiohttp's own are
    plain-text pages); a 405 keeps its ``Allow``."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status not in (404, 405):
            raise
        allow = {"allow": error.headers["allow"]} if "allow" in error.headers else {}
        return web.json_response({"error": {"message": error.reason.lower(),
                                            "type": "invalid_request_error"}},
                                 status=error.status, headers=allow)


async def _nosniff(_request: web.Request, response: web.StreamResponse) -> None:
    """Every admin answer is read as the type it says (JSON, text), never sniffed."""
    response.headers.setdefault("x-content-type-options", "nosniff")


def _ignored_while_draining() -> None:
    log.info("SIGHUP ignored: shutting down (the config is not reloaded while draining)")


async def _closed(closing: Awaitable[None], what: str) -> None:
    """A store's close at shutdown: one that fails (Redis slow to answer its last call)
    is logged, and the shutdown goes on — it used to end in a traceback, without the
    `stopped:` line or the other stores' close."""
    try:
        await closing
    except StoreUnavailable as error:
        log.warning("closing %s failed (%s); its connections are dropped", what, error)
