"""Where Envoy's Lua meter (``meter.lua``) reports each response kvgate admitted.

kvgate reads no response body over ext_proc: at one gRPC message per chunk, a streamed
answer would cost Python time in proportion to its length. The Lua filter reads the response
inside Envoy instead and sends this process at most two small HTTP/1.1 calls per request:
``POST /first/<lease>`` when a stream's first token (data line) passes (prefill is done) and
``POST /done/<lease>`` with the engine's usage when the response's body has ended. Both are
sent without waiting for the answer: the response's end never waits for this process, and a
client that hangs up at once cancels no call (a cancelled HTTP/1.1 call costs Envoy its
connection). The done report usually arrives just before Envoy ends the request's ext_proc
stream, which is where kvgate releases the request; when it comes just after, the release
waits for it (``server.REPORT_WAIT_S``), and a request whose report never comes is charged
its reservation.

Each kvgate process listens on its own port (``--workers`` share the gRPC port, not this
one) and names its address in every admission's dynamic metadata, so the report reaches the
process that holds the lease; Envoy's ``kvgate_report`` cluster is an original-destination
cluster that goes where the report's ``x-envoy-original-dst-host`` says. A per-process key
in the same metadata keeps anyone else from reporting.

Only Envoy talks to this port: the parser takes what Envoy's HTTP/1.1 codec sends (a sized
body, keep-alive) and closes the connection on anything else, or on a report without the
key (so one without it gets one answer per connection). Anyone else who reaches it
holds at most :data:`MAX_CONNECTIONS` connections, or a quarter of the open-files limit
(past them, the one quiet longest is closed), none quiet for more than
:data:`IDLE_TIMEOUT_S`: Envoy closes its own idle report connections well before
(``envoy_config.REPORT_IDLE_TIMEOUT``), so kvgate never closes one Envoy may be sending on.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import orjson

from extproc.metrics import Metrics
from extproc.openai import Usage, usage_from

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
PARTIAL_TIMEOUT_S = 10.0  # a report begun and not finished within this is dropped
MAX_REPORT_BYTES = 65536
IDLE_TIMEOUT_S = 300.0  # a connection quiet this long is closed (Envoy's close at 60 s)
SILENT_AFTER = 20
"""Metered responses in a row that ended with no report of theirs, with no report of any
other arriving meanwhile, after which the meter is taken as unable to report
(``ReportDesk.silent``)."""
MAX_CONNECTIONS = 4096  # open at once; one more closes the one quiet longest
DESCRIPTOR_SHARE = 4  # ... and never more than 1/4 of the process's open-files limit
KEY_HEADER = b"x-kvgate-report-key"
_KEY_FIELD = b"\r\n" + KEY_HEADER + b":"
_NO_CONTENT = b"HTTP/1.1 204 No Content\r\n\r\n"
_BAD = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# Answers after which the connection is closed and the rest of its bytes dropped: nothing
# after a malformed request can be trusted, and a sender without the key gets one answer
# per connection (answering each of its pipelined requests let one connection that never
# read hold the event loop for seconds and pile up ~100 MB of answers)
_LAST_ANSWERS = (_BAD, _FORBIDDEN)


class Reported(Protocol):
    """What a request's stream does with its reports (``stream.RequestStream``)."""

    def first_reported(self) -> None: ...

    def done_reported(self, usage: Usage | None, events: int, answered: bool) -> None: ...


class ReportDesk:
    """The open requests whose responses are being metered, by lease id."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.key = secrets.token_hex(16)
        self.address = ""  # host:port as Envoy reaches it, set once listening
        self._open: dict[str, Reported] = {}
        self._server: asyncio.Server | None = None
        self._connections = Connections()
        self._sweeper: asyncio.TimerHandle | None = None
        self._unreported = 0  # responses ended without a report since the last report

    @property
    def silent(self) -> bool:
        """Whether the meter seems unable to report (a wrong ``server.report_host``, the
        report port unreachable, an Envoy config without the meter): the last
        :data:`SILENT_AFTER` metered responses ended without a report, and none came for
        any other. A stream that ends with no report is then not taken for one whose client
        left before its first token (charged its prompt only): it may have been answered
        whole. While the meter reports, a report of any response ends this."""
        return self._unreported >= SILENT_AFTER

    def unreported(self) -> None:
        """A metered response ended (and the wait for its report passed) with no report."""
        self._unreported += 1

    def expect(self, lease: str, stream: Reported) -> None:
        self._open[lease] = stream

    def forget(self, lease: str) -> None:
        self._open.pop(lease, None)

    async def start(self, host: str, port: int, advertise_host: str) -> None:
        loop = asyncio.get_running_loop()
        connections = self._connections
        connections.most = connection_cap()
        self._server = await loop.create_server(
            lambda: _ReportProtocol(self.receive, connections), host, port)
        bound = self._server.sockets[0].getsockname()[1]
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host  # IPv6
        self.address = f"{host}:{bound}"
        self._sweep()

    def _sweep(self) -> None:
        self._connections.close_idle(IDLE_TIMEOUT_S)
        self._sweeper = asyncio.get_running_loop().call_later(IDLE_TIMEOUT_S / 10, self._sweep)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def receive(self, path: bytes, key: bytes | None, body: bytes) -> bytes:
        """One report; returns the HTTP answer."""
        kind, _, lease = path.removeprefix(b"/").partition(b"/")
        if key is None or not secrets.compare_digest(key, self.key.encode()):
            self._count("refused")
            return _FORBIDDEN
        if kind not in (b"first", b"done"):
            self._count("refused")
            return _BAD
        self._count(kind.decode())
        self._unreported = 0  # the meter reaches this process
        stream = self._open.get(lease.decode("ascii", "replace"))
        if stream is None:  # released already (a late report), or never ours
            return _NO_CONTENT
        if kind == b"first":
            stream.first_reported()
        else:
            stream.done_reported(*parse_done(body))
        return _NO_CONTENT

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.reports.add((kind,))


def parse_done(body: bytes) -> tuple[Usage | None, int, bool]:
    """``{"events": <SSE data events>, "answered": <a 2xx response>, "usage": <the engine's
    usage object or null>}``; a report that does not say is taken as an answer (the charge
    without usage is then the reservation, never less than what was used). The meter copies
    the engine's usage object as it found it, last: one that is no JSON (balanced braces
    around anything) loses only the usage, not the events and the status before it."""
    document = _json(body)
    if document is None:  # the meter's own fields come first, and hold no such key
        head, found, _usage = body.partition(b',"usage":')
        document = _json(head + b"}") if found else None
    if not isinstance(document, dict):
        return None, 0, True
    events = document.get("events")
    return (usage_from(document), events if type(events) is int and events >= 0 else 0,
            document.get("answered") is not False)


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def connection_cap() -> int:
    """How many report connections may be open at once: :data:`MAX_CONNECTIONS`, or a
    :data:`DESCRIPTOR_SHARE` of the open-files limit when that is lower. At a limit of
    1024 (a common default soft limit), 1,200 idle connections from anyone who reached
    the port took every descriptor: the gRPC port, the admin port's probes and the engine
    scrapes all failed until they went."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft // DESCRIPTOR_SHARE))


class Connections:
    """The report port's open connections, the one quiet longest first."""

    def __init__(self, most: int | None = None) -> None:
        self.most = MAX_CONNECTIONS if most is None else most
        self._quiet_since: dict[_ReportProtocol, float] = {}  # oldest activity first

    def active(self, connection: _ReportProtocol) -> None:
        """``connection`` was opened or sent something; past the cap, the quietest goes."""
        quiet = self._quiet_since
        quiet.pop(connection, None)
        quiet[connection] = time.monotonic()
        if len(quiet) > self.most:
            self.close(next(iter(quiet)))

    def close_idle(self, idle_s: float) -> None:
        too_old = time.monotonic() - idle_s
        quiet = self._quiet_since
        while quiet:
            connection, since = next(iter(quiet.items()))
            if since > too_old:
                return
            self.close(connection)

    def close(self, connection: _ReportProtocol) -> None:
        self.lost(connection)
        connection.hang_up()

    def lost(self, connection: _ReportProtocol) -> None:
        self._quiet_since.pop(connection, None)


class _ReportProtocol(asyncio.Protocol):
    """HTTP/1.1 requests with a content-length, one after another on a kept-alive
    connection."""

    def __init__(self, receive: Callable[[bytes, bytes | None, bytes], bytes],
                 connections: Connections | None = None):
        self._receive = receive
        self._connections = connections if connections is not None else Connections()
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._partial: asyncio.TimerHandle | None = None  # hangs up on a request left half

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._connections.active(self)

    def hang_up(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._buffer = b""

    def data_received(self, data: bytes) -> None:
        self._connections.active(self)
        self._buffer += data
        while self._transport is not None and self._next_request():
            pass
        # Envoy sends each report whole: one left half for PARTIAL_TIMEOUT_S is dropped
        # (connections holding half-sent requests held their buffers without end)
        if self._buffer and self._partial is None and self._transport is not None:
            self._partial = asyncio.get_running_loop().call_later(PARTIAL_TIMEOUT_S,
                                                                  self._fail)
        elif not self._buffer and self._partial is not None:
            self._partial.cancel()
            self._partial = None

    def _next_request(self) -> bool:
        """Answer one whole request from the buffer; False when it holds none yet."""
        buffer = self._buffer
        head_end = buffer.find(b"\r\n\r\n")
        if head_end == -1:
            if len(buffer) > MAX_HEAD_BYTES:
                self._fail()
            return False
        head = buffer[:head_end]
        names = head.lower()  # header names match whatever their case; offsets stay the same
        line_end = head.find(b"\r\n")
        parts = (head if line_end == -1 else head[:line_end]).split(b" ")  # the request line
        length = _value(head, names, b"\r\ncontent-length:")
        length = b"0" if length is None else length
        # a length of more digits than the limit's is refused before int() reads it
        if (len(parts) != 3 or parts[0] != b"POST" or not length.isdigit()
                or len(length) > len(str(MAX_REPORT_BYTES)) or int(length) > MAX_REPORT_BYTES
                or b"\r\ntransfer-encoding:" in names):
            self._fail()
            return False
        end = head_end + 4 + int(length)
        if len(buffer) < end:
            return False
        self._buffer = buffer[end:]
        try:
            answer = self._receive(parts[1], _value(head, names, _KEY_FIELD),
                                   buffer[head_end + 4 : end])
        except Exception:
            log.exception("a response report failed")
            answer = _BAD
        if answer in _LAST_ANSWERS:
            self._fail(answer)
            return False
        assert self._transport is not None
        self._transport.write(answer)
        return True

    def _fail(self, answer: bytes = _BAD) -> None:
        """Answer (400 unless told) and hang up: nothing after a malformed request, or one
        without the key, can be trusted."""
        if self._transport is not None:
            self._transport.write(answer)
            self._transport.close()
            self._transport = None
        self._buffer = b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._connections.lost(self)
        if self._partial is not None:
            self._partial.cancel()
            self._partial = None


def _value(head: bytes, names: bytes, field: bytes) -> bytes | None:
    """A header's value in a request's ``head`` (``names``: the head in lower case; ``field``:
    CRLF, the lower-case name and its colon). None when absent; sent twice, b"", which no
    check accepts. Three searches in C instead of splitting every header into a dict: this
    runs for every report."""
    at = names.find(field)
    if at == -1:
        return None
    if names.find(field, at + 1) != -1:
        return b""
    start = at + len(field)
    end = head.find(b"\r\n", start)
    return head[start : len(head) if end == -1 else end].strip()
