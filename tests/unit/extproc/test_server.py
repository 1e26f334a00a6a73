"""The kvgate server (extproc.server): reading a stream ahead while a request queues, what a
request admitted as Envoy gives up is charged, where each port binds, and gRPC over TLS.

Real servers on ephemeral ports; throwaway certificates from ``tests.pki`` (``openssl``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from extproc import http_port
from extproc import server as server_module
from extproc.config import Config, ConfigError, for_worker, hash_api_key, parse_config
from extproc.datalayer.agent import start_agent
from extproc.director import Admission
from extproc.metrics import Collected, Metrics
from extproc.reports import ReportDesk
from extproc.server import ExternalProcessor, Incoming, KvgateServer
from extproc.wiring import build_director
from limiter.stores import MemoryStore
from tests.conftest import consecutive_free_ports, free_port
from tests.pki import make_pki
from tests.unit.extproc.test_logs import UNPARSABLE, raw_reply
from tests.unit.extproc.test_stream import body_msg, chat, headers_msg, make_config


def config(**server: object) -> Config:
    return parse_config({
        "server": {"grpc_port": 0, "admin_port": 0, **server},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key("sk-x")]}],
        "pools": [{"name": "p", "models": [{"name": "m"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })


async def started(cfg: Config) -> AsyncIterator[KvgateServer]:
    server = KvgateServer(cfg)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0)


# -- a stream that ends while its admission waits --------------------------------------------


HEADERS = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
BODY = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}"))


async def envoy_messages(*messages: pb.ProcessingRequest,
                         end: asyncio.Event) -> AsyncIterator[pb.ProcessingRequest]:
    for message in messages:
        yield message
    await end.wait()  # then Envoy half-closes


async def test_the_end_of_the_stream_cancels_a_watched_wait() -> None:
    end, cancelled = asyncio.Event(), asyncio.Event()
    incoming = Incoming(envoy_messages(BODY, end=end))
    assert await incoming.next() == BODY

    async def queued() -> None:
        with incoming.watch():
            try:
                await asyncio.sleep(3600)
            finally:
                cancelled.set()

    waiting = asyncio.create_task(queued())
    await asyncio.sleep(0.01)
    end.set()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 2)
    assert cancelled.is_set() and incoming.departed
    await incoming.close()


async def test_a_message_read_while_watching_is_kept_and_nothing_is_cancelled() -> None:
    end = asyncio.Event()
    incoming = Incoming(envoy_messages(HEADERS, BODY, end=end))
    assert await incoming.next() == HEADERS
    with incoming.watch():
        await asyncio.sleep(0.05)  # the next message arrives meanwhile
    assert await incoming.next() == BODY  # read ahead, not lost
    assert not incoming.departed
    end.set()
    assert await incoming.next() is None


async def test_unwatched_admissions_read_nothing_ahead() -> None:
    """Only a queued request pays for the read-ahead: outside a watch the stream is read
    only when the servicer asks for the next message."""
    end = asyncio.Event()
    incoming = Incoming(envoy_messages(HEADERS, end=end))
    assert await incoming.next() == HEADERS
    assert incoming._ahead is None
    end.set()
    assert await incoming.next() is None


# -- a request admitted as Envoy gives up ---------------------------------------------------
#
# gRPC resumes the handler after a reply only once that reply is written; when the RPC is
# already cancelled (Envoy's message timeout fired, or Envoy reset the stream, while kvgate
# was deciding) the write fails, gRPC drops the handler there and the generator is closed at
# that yield (GeneratorExit). The routing reply never left: the request never went upstream.

# (a token a minute comes back: a test never waits long enough to see one)
LIMITS = {"tokens_per_minute": 1, "token_burst": 10_000, "daily_token_quota": 100_000,
          "max_concurrency": 5}


def new_processor() -> tuple[ExternalProcessor, MemoryStore]:
    cfg = make_config(**LIMITS)
    store = MemoryStore()
    director = build_director(cfg, store)
    return ExternalProcessor(director, Metrics(), cfg, ReportDesk()), store


async def charged(processor: ExternalProcessor) -> tuple[int, int]:
    """(tokens of the daily quota used, tokens the token bucket is short of its limit)."""
    usage = await processor.director.usage("acme")
    assert usage is not None
    tokens = usage["tokens"]
    return usage["quotas"]["daily"]["used"], tokens["limit"] - tokens["available"]


def held(processor: ExternalProcessor) -> Admission:
    (stream,) = processor.open
    assert stream.admission is not None
    return stream.admission


async def routed(processor: ExternalProcessor, streamed: bool):
    """The handler on a chat request, run up to its routing reply (yielded, not yet resumed);
    Envoy sends nothing more."""
    messages = (headers_msg(), body_msg(chat(max_tokens=100, stream=streamed)))
    handler = processor.Process(envoy_messages(*messages, end=asyncio.Event()), None)
    await anext(handler)  # the headers' answer
    reply = await anext(handler)  # the routing reply, handed to gRPC
    assert isinstance(reply, bytes) and b"x-gateway-destination-endpoint" in reply
    assert len(processor.director.active) == 1
    return handler


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_request_whose_routing_reply_never_left_is_charged_nothing(streamed) -> None:
    """gRPC dropped the handler at the routing reply (the RPC was cancelled as it was
    admitted): the tenant's tokens and quota come back in full, at once (no wait for a meter
    report that cannot come), its KV is freed without counting as drained, and the charge
    is counted as ``not_sent``."""
    processor, store = new_processor()
    handler = await routed(processor, streamed)
    admission = held(processor)
    scheduler = admission.scheduler
    assert await charged(processor) == (admission.cost.tokens, admission.cost.tokens)
    await handler.aclose()  # what gRPC does when the reply could not be written
    assert processor.director.active == {} and not processor.releasing
    assert await charged(processor) == (0, 0)
    assert await store.in_flight("acme") == 0
    assert scheduler.reservations == {} and scheduler.drain.per_second(time.monotonic()) == 0
    assert processor.metrics.charges.values == {("not_sent",): 1}


@pytest.mark.parametrize(("streamed", "basis"), [(False, "cut_off"), (True, "not_started")])
async def test_a_request_cancelled_after_its_routing_reply_left_is_charged_as_before(
        streamed, basis, monkeypatch) -> None:
    """Once gRPC took the routing reply (the handler resumed after it) the request may be at
    its engine: a stream reset then (the client left) is charged as ever — its reservation,
    or, streamed and not started, its prompt."""
    monkeypatch.setattr(server_module, "REPORT_WAIT_S", 0.05)
    processor, _store = new_processor()
    handler = await routed(processor, streamed)
    admission = held(processor)
    waiting = asyncio.ensure_future(anext(handler))  # resumed: reads Envoy's next message
    await asyncio.sleep(0.01)
    waiting.cancel()  # Envoy reset the stream: gRPC cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await waiting
    while processor.releasing:  # the wait for a meter report that may trail the reset
        await asyncio.sleep(0.01)
    assert processor.director.active == {}
    cost = admission.cost
    expected = cost.prompt_tokens if streamed else cost.tokens
    assert await charged(processor) == (expected, expected)
    assert processor.metrics.charges.values == {(basis,): 1}


async def test_a_grpc_call_cancelled_while_kvgate_decides_is_charged_nothing(
        monkeypatch) -> None:
    """Through a real gRPC server: the client cancels the call while kvgate's event loop is
    busy deciding (a decision that ends as Envoy's message timeout fires); the admission
    comes through, but its routing reply cannot be written."""
    cfg = make_config(**LIMITS)
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(
        update={"grpc_port": 0, "admin_port": None})})
    server = KvgateServer(cfg)
    await server.start()
    cancelled = threading.Event()
    director = server.director
    admit = director.admit

    async def admit_as_the_client_leaves(*args, **kwargs):  # type: ignore[no-untyped-def]
        decision = await admit(*args, **kwargs)
        assert cancelled.wait(10)  # kvgate's loop is busy meanwhile
        time.sleep(0.2)  # ... while gRPC takes in the reset
        return decision

    monkeypatch.setattr(director, "admit", admit_as_the_client_leaves)

    def envoy() -> None:
        async def call() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stream = channel.stream_stream(
                    "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                    request_serializer=pb.ProcessingRequest.SerializeToString,
                    response_deserializer=pb.ProcessingResponse.FromString)()
                await stream.write(headers_msg())
                await stream.read()
                await stream.write(body_msg(chat(max_tokens=100)))
                await asyncio.sleep(0.1)  # kvgate is deciding
                stream.cancel()
                cancelled.set()

        asyncio.run(call())

    client = threading.Thread(target=envoy)
    client.start()
    try:
        deadline = time.monotonic() + 10
        while (client.is_alive() or director.active) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        processor = server._processor
        assert processor is not None and director.active == {}
        assert server.metrics.charges.values == {("not_sent",): 1}
        assert await charged(processor) == (0, 0)
    finally:
        client.join(10)
        await server.stop(grace=0)


# -- listeners -----------------------------------------------------------------------------


def admin_host(server: KvgateServer) -> str:
    assert server._admin is not None
    return server._admin.addresses[0][0]


async def test_admin_listens_on_loopback_unless_told_otherwise() -> None:
    async for server in started(config(host="0.0.0.0")):  # gRPC for Envoy, on every address
        assert admin_host(server) == "127.0.0.1"  # /admin and /debug are unauthenticated
    async for server in started(config(host="127.0.0.1", admin_host="0.0.0.0")):
        assert admin_host(server) == "0.0.0.0"


async def test_a_request_the_admin_port_cannot_parse_is_a_400_and_no_error_line(
        caplog: pytest.LogCaptureFixture) -> None:
    async for server in started(config()):
        with caplog.at_level(logging.INFO):
            for request in UNPARSABLE:
                reply = await raw_reply(admin_host(server), server.admin_port, request)
                assert reply.split(b" ", 2)[1] == b"400"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_nothing_on_the_admin_port_changes_state() -> None:
    """The admin port is unauthenticated, and a page on another site, opened in a browser
    that reaches the port, can send it requests. Every path is a GET (a POST is 405) and no
    answer carries CORS headers: nothing to forge, nothing for that page to read. A path that
    changed state would need protection against cross-site requests first."""
    async for server in started(config()):
        assert server._admin is not None
        methods = {route.method for route in server._admin.app.router.routes()}
        assert methods <= {"GET", "HEAD"}, methods
        url = f"http://{admin_host(server)}:{server.admin_port}"
        async with httpx.AsyncClient() as client:
            refused = await client.post(f"{url}/admin/tenants/acme/usage")
            assert refused.status_code == 405 and refused.headers["allow"] == "GET,HEAD"
            assert refused.json()["error"]["message"] == "method not allowed"
            unknown = await client.get(f"{url}/admin/nothing-here")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["message"] == "not found"  # JSON, not a text page
            reply = await client.get(f"{url}/status.json",
                                     headers={"origin": "https://elsewhere.example"})
            assert reply.status_code == 200
            assert not [h for h in reply.headers if h.startswith("access-control-")]


async def hang_up_after(host: str, port: int, head: bytes, *, within: float) -> float | None:
    """Send ``head``, then one byte a tenth of a second as a slowloris does; how many seconds
    until the server hung up (None: not ``within`` that long)."""
    reader, writer = await asyncio.open_connection(host, port)
    start = time.monotonic()
    writer.write(head)
    try:
        while time.monotonic() - start < within:
            try:
                while await asyncio.wait_for(reader.read(4096), 0.1):
                    pass  # an answer (a 200, then lingering): read on to the hang-up
                return time.monotonic() - start
            except TimeoutError:
                writer.write(b"a")
        return None
    finally:
        writer.close()


async def test_a_request_not_whole_within_the_timeout_is_dropped(monkeypatch) -> None:
    """Slowloris: a client sending its request headers (or a body nothing reads) a byte at
    a time held its connection, and a file descriptor, for as long as it kept sending."""
    monkeypatch.setattr(http_port, "REQUEST_TIMEOUT_S", 0.5)
    async for server in started(config()):
        host, port = admin_host(server), server.admin_port
        headers = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
        body = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        for head in (headers, body):
            took = await hang_up_after(host, port, head, within=5)
            assert took is not None and 0.4 < took < 2.5, (head, took)
        async with httpx.AsyncClient() as client:  # a whole request is answered as before
            assert (await client.get(f"http://{host}:{port}/healthz")).status_code == 200


async def test_the_agents_port_drops_a_request_not_whole_within_the_timeout(monkeypatch):
    """``kvgate agent`` listens on every address by default: the same bound as the admin
    port (before, aiohttp's 3,630 s keep-alive was its only one)."""
    monkeypatch.setattr(http_port, "REQUEST_TIMEOUT_S", 0.5)
    agent = await start_agent()
    try:
        took = await hang_up_after("127.0.0.1", agent.port,
                                   b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ", within=5)
        assert took is not None and 0.4 < took < 2.5, took
    finally:
        await agent.stop()


async def test_past_the_connection_cap_a_new_connection_closes_the_oldest(monkeypatch) -> None:
    """Slow connections past a cap must not hold a file descriptor each without bound, nor
    lock Prometheus and the probes out: each new connection closes the oldest of the peer
    holding the most, so another peer's connection (older than all of them) stays."""
    monkeypatch.setattr(http_port, "MAX_CONNECTIONS", 5)
    async for server in started(config()):
        host, port = admin_host(server), server.admin_port
        partial = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # and no more
        other, other_writer = await asyncio.open_connection(host, port,
                                                            local_addr=("127.0.0.2", 0))
        other_writer.write(partial)
        slow = []
        for _ in range(20):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(partial)
            slow.append((reader, writer))
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            for path in ("/metrics", "/healthz"):
                reply = await client.get(f"http://{host}:{port}{path}", timeout=2)
                assert reply.status_code == 200
        hung_up = [await closed(reader) for reader, _ in slow]
        assert not await closed(other)
        for _, writer in [*slow, (other, other_writer)]:
            writer.close()
        assert all(hung_up[:15]) and hung_up.count(False) <= 4, hung_up


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(4096), 0.5) == b""
    except TimeoutError:
        return False


# -- drain -----------------------------------------------------------------------------------


def health_request() -> pb.ProcessingRequest:
    """GET /health: admitted on its headers and routed to an engine, then the stream stays
    open (as it would for the response) until Envoy ends it."""
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue

    values = {":method": "GET", ":path": "/health", "authorization": "Bearer sk-x"}
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]),
        end_of_stream=True))


async def test_a_stream_cut_at_the_grace_is_released_and_health_flips_first() -> None:
    cfg = parse_config({**config().model_dump(mode="json", exclude_none=True),
                        "pools": [{"name": "p", "models": ["m"], "kv_aware": False,
                                   "endpoints": [f"127.0.0.1:{free_port()}"]}]})
    server = KvgateServer(cfg)
    await server.start()
    assert server.not_ready() == []
    target = f"127.0.0.1:{server.grpc_port}"
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString)()
        await call.write(health_request())
        await call.read()  # routed: the admission is held until the stream ends
        assert len(server.director.active) == 1
        drained = asyncio.create_task(server.drain(grace=0.3, delay=0.3))
        await asyncio.sleep(0.1)
        assert server.not_ready() == ["draining (shutting down)"]
        assert await health(target, None) == health_pb2.HealthCheckResponse.NOT_SERVING
        await drained  # the client never ends its stream: cut at the grace
        call.cancel()
    assert server.director.active == {}
    assert await server.director.store.in_flight("acme") == 0
    assert server._processor is not None and server._processor.cut == 1


async def test_worker_0_is_ready_only_when_every_worker_is() -> None:
    """The pod's probes ask worker 0's admin port: a worker still starting, draining, stuck
    or gone took no part in the answer, and the pod stayed in its Services."""
    cfg = parse_config({**config().model_dump(mode="json", exclude_none=True),
                        "server": {"grpc_port": 0, "admin_port": consecutive_free_ports(2)},
                        "pools": [{"name": "p", "models": ["m"], "kv_aware": False,
                                   "endpoints": [f"127.0.0.1:{free_port()}"]}]})
    first = KvgateServer(cfg, worker=0, workers=2)
    await first.start()
    ready = f"http://127.0.0.1:{first.admin_port}/readyz"
    try:
        async with httpx.AsyncClient() as client:
            answer = await client.get(ready)  # worker 1 not listening yet
            assert answer.status_code == 503
            [why] = answer.json()["waiting_for"]
            assert why.startswith(f"worker 1: no answer on http://127.0.0.1:"
                                  f"{cfg.server.admin_port + 1}/readyz")
            assert first.not_ready() == []  # its own readiness (kvgate_ready) is its own
            second = KvgateServer(for_worker(cfg, 1), worker=1, workers=2)
            await second.start()
            try:
                assert (await client.get(ready)).status_code == 200
                second.draining = True
                answer = await client.get(ready)
                assert answer.status_code == 503
                assert answer.json()["waiting_for"] == ["worker 1: draining (shutting down)"]
            finally:
                await second.stop(grace=0)
    finally:
        await first.stop(grace=0)


async def test_report_host_auto_names_this_hosts_own_address() -> None:
    """Gateway mode in Kubernetes: Envoy, in another pod, reports to each replica's pod IP,
    which is what the pod's hostname resolves to."""
    own = socket.gethostbyname(socket.gethostname())
    async for server in started(config(host="0.0.0.0", report_host="auto")):
        assert server.desk.address.rpartition(":")[0] == own

# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def health(target: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (grpc.aio.insecure_channel(target) if credentials is None
               else grpc.aio.secure_channel(target, credentials))
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def client_tls(pki: Path, *, with_cert: bool) -> grpc.ChannelCredentials:
    cert = {"private_key": (pki / "envoy.key").read_bytes(),
            "certificate_chain": (pki / "envoy.pem").read_bytes()} if with_cert else {}
    return grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes(), **cert)


async def test_a_tls_listener_serves_tls_clients_and_refuses_plaintext(pki: Path) -> None:
    tls = {"cert_file": str(pki / "localhost.pem"), "key_file": str(pki / "localhost.key")}
    async for server in started(config(tls=tls)):
        target = f"localhost:{server.grpc_port}"
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await health(target, client_tls(pki, with_cert=False)) == serving
        with pytest.raises(grpc.aio.AioRpcError):
            await health(target, None)


async def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki: Path) -> None:
    tls = {"cert_file": str(pki / "localhost.pem"), "key_file": str(pki / "localhost.key"),
           "client_ca_file": str(pki / "ca.pem")}
    async for server in started(config(tls=tls)):
        target = f"localhost:{server.grpc_port}"
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await health(target, client_tls(pki, with_cert=True)) == serving
        with pytest.raises(grpc.aio.AioRpcError):
            await health(target, client_tls(pki, with_cert=False))


async def test_an_unreadable_certificate_is_a_config_error(tmp_path: Path) -> None:
    tls = {"cert_file": str(tmp_path / "missing.pem"), "key_file": str(tmp_path / "k.pem")}
    with pytest.raises(ConfigError, match="cert_file: cannot read"):
        async for _server in started(config(tls=tls)):
            pass


async def test_a_store_that_fails_to_close_does_not_break_the_shutdown(caplog) -> None:
    """Redis slow to answer its last call at shutdown made the store's close raise: the
    shutdown ended in a traceback, without the other stores' close or the stopped line."""
    from limiter.stores import StoreUnavailable

    server = KvgateServer(config())
    await server.start()

    async def failing() -> None:
        raise StoreUnavailable("redis close failed: Timed out closing connection after 0.05")

    server.director.store.close = failing  # type: ignore[method-assign]
    with caplog.at_level("INFO", logger="extproc.server"):
        await server.stop(grace=0)
    assert "closing the limits store failed" in caplog.text
    assert "stopped: 0 stream(s) cut at the grace" in caplog.text


async def test_metrics_are_formatted_off_the_event_loop(monkeypatch) -> None:
    """The text of every series is written on a thread (at 20,000 tenants ~0.5 s of each
    scrape), so admissions wait on the collectors only."""
    threads = []

    def formatting(registry: Collected) -> bytes:
        threads.append(threading.current_thread())
        return generate_latest(registry)

    monkeypatch.setattr(server_module, "generate_latest", formatting)
    async for server in started(config()):
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://{admin_host(server)}:{server.admin_port}/metrics")
        assert reply.status_code == 200 and b"kvgate_" in reply.content
    assert threads and threading.main_thread() not in threads


async def test_the_start_line_says_the_admin_port_is_off(caplog) -> None:
    """``admin_port: null`` logged "admin on 127.0.0.1:0", as though it listened on a
    port, which an operator then looked for."""
    caplog.set_level(logging.INFO, "extproc.server")
    async for _server in started(config(admin_port=None)):
        assert "admin off (server.admin_port: null)" in caplog.text
    caplog.clear()
    async for server in started(config()):
        assert f"admin on 127.0.0.1:{server.admin_port};" in caplog.text
