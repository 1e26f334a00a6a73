"""The meter's report port (``extproc.reports``) over a real socket: what Envoy sends is
answered, anything else is refused without an error escaping into the event loop."""

from __future__ import annotations

import asyncio
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc import reports
from extproc.openai import Usage
from extproc.reports import ReportDesk, parse_done

STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


class Stream:
    """What a request's stream records of its reports."""

    def __init__(self) -> None:
        self.first = 0
        self.done: list[tuple[object, int]] = []

    def first_reported(self) -> None:
        self.first += 1

    def done_reported(self, usage: object, events: int, answered: bool) -> None:
        self.done.append((usage, events))


def report(path: str, key: str, body: bytes = b"", extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: kvgate\r\nx-kvgate-report-key: {key}\r\n"
            f"content-length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


async def exchange(raw: bytes, *, lease_stream: Stream | None = None, wait_s: float = 0.3
                   ) -> tuple[list[int], bool, list[dict]]:
    """Send ``raw`` to a fresh desk: the statuses answered within ``wait_s`` of the last,
    whether the desk hung up, and any error that reached the event loop."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    desk = ReportDesk()
    await desk.start("127.0.0.1", 0, "127.0.0.1")
    if lease_stream is not None:
        desk.expect("lease-1", lease_stream)
    reader, writer = await asyncio.open_connection(*desk.address.split(":"))
    writer.write(raw.replace(b"{key}", desk.key.encode()))
    await writer.drain()
    answered = b""
    closed = False
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), wait_s)
            if not chunk:
                closed = True
                break
            answered += chunk
    except TimeoutError:
        pass
    except ConnectionResetError:  # hung up on with bytes of ours unread
        closed = True
    writer.close()
    await desk.stop()
    return [int(code) for code in STATUS.findall(answered)], closed, errors


async def test_reports_pipelined_on_one_connection_are_each_answered():
    stream = Stream()
    raw = (report("/first/lease-1", "{key}")
           + report("/done/lease-1", "{key}", b'{"usage":{"prompt_tokens":3,'
                    b'"completion_tokens":2,"total_tokens":5},"events":2}')
           + report("/done/unknown-lease", "{key}", b"{}"))
    codes, closed, errors = await exchange(raw, lease_stream=stream)
    assert codes == [204, 204, 204] and not closed and not errors
    assert stream.first == 1 and len(stream.done) == 1 and stream.done[0][1] == 2


async def test_a_wrong_key_is_forbidden_and_the_connection_closed():
    """Nothing sent after a report without the key is read, even with the key."""
    stream = Stream()
    codes, closed, errors = await exchange(report("/done/lease-1", "nope", b"{}")
                                           + report("/first/lease-1", "{key}"),
                                           lease_stream=stream)
    assert codes == [403] and closed and not errors
    assert stream.done == [] and stream.first == 0


async def test_a_sender_without_the_key_gets_one_answer_per_connection():
    """Answering every pipelined request of a sender that never read let one connection
    hold the event loop for seconds and pile up ~100 MB of 403s."""
    codes, closed, errors = await exchange(b"POST /x HTTP/1.1\r\n\r\n" * 20_000)
    # the hang-up with the rest unread is a reset, which may overtake the 403
    assert codes in ([403], []) and closed and not errors


async def test_header_names_match_whatever_their_case_and_a_key_sent_twice_is_refused():
    stream = Stream()
    mixed = (b"POST /done/lease-1 HTTP/1.1\r\nHost: kvgate\r\nX-Kvgate-Report-Key: {key}\r\n"
             b"Content-Length: 2\r\n\r\n{}")
    twice = report("/first/lease-1", "{key}", extra=b"x-kvgate-report-key: {key}\r\n")
    codes, closed, errors = await exchange(mixed + twice, lease_stream=stream)
    assert codes == [204, 403] and closed and not errors
    assert len(stream.done) == 1 and stream.first == 0


HOSTILE = {
    "not POST": b"GET /done/lease-1 HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
    "request line": b"POST /done/lease-1\r\ncontent-length: 0\r\n\r\n",
    "chunked": report("/done/lease-1", "{key}", extra=b"transfer-encoding: chunked\r\n"),
    "length not a number": b"POST /done/x HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
    "length of 5,000 digits": b"POST /done/x HTTP/1.1\r\ncontent-length: "
                              + b"9" * 5000 + b"\r\n\r\n",
    "length over the limit": b"POST /done/x HTTP/1.1\r\ncontent-length: 65537\r\n\r\n",
    "head never ends": b"POST /done/x HTTP/1.1\r\n" + b"x-pad: y\r\n" * 1000,
    "unknown kind": report("/gone/lease-1", "{key}"),
    "length twice": report("/done/lease-1", "{key}", b"{}", extra=b"Content-Length: 2\r\n"),
}


async def test_malformed_requests_are_refused_with_400_and_a_hang_up():
    for name, raw in HOSTILE.items():
        codes, closed, errors = await exchange(raw)
        assert (codes, closed, errors) == ([400], True, []), name


async def test_a_report_left_half_sent_is_dropped(monkeypatch):
    """Connections holding half-sent reports kept their buffers without end (800 of them
    held 50 MB); a whole report, and a kept-alive idle connection, are never cut."""
    monkeypatch.setattr(reports, "PARTIAL_TIMEOUT_S", 0.2)
    whole = report("/first/lease-1", "{key}")
    codes, closed, _ = await exchange(whole[:20], wait_s=1.0)
    assert (codes, closed) == ([400], True)
    codes, closed, _ = await exchange(whole, lease_stream=Stream(), wait_s=0.6)
    assert (codes, closed) == ([204], False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.binary(max_size=300),
                          st.sampled_from([report("/done/lease-1", "{key}", b"{}"),
                                           report("/first/lease-1", "{key}"), b"\r\n\r\n",
                                           b"content-length: 99999999999999999999\r\n"])),
                max_size=5))
def test_any_bytes_get_only_known_answers_and_no_error_escapes(parts):
    codes, _, errors = asyncio.run(exchange(b"".join(parts), lease_stream=Stream(), wait_s=0.05))
    assert set(codes) <= {204, 400, 403} and not errors


def test_a_done_report_says_whether_the_engine_answered():
    """A report that does not say is taken as an answer: without usage, the reservation."""
    usage = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}, "events": 0'
    assert parse_done(usage + b', "answered": false}')[2] is False
    assert parse_done(usage + b', "answered": true}')[2] is True
    assert parse_done(usage + b"}") == (Usage(3, 2), 0, True)
    assert parse_done(b"garbage") == (None, 0, True)


def test_a_usage_object_that_is_no_json_loses_only_the_usage():
    """The meter copies the engine's usage object as it found it (balanced braces), last:
    one that is no JSON cost the whole report, and an engine's error answer was then taken
    as an answer with no events."""
    for usage in (b'{"prompt_tokens": 3, "completion_tokens": "2\n3}', b"{nope}",
                  b'{"x": 1,"usage":{"usage":{}', b'{"prompt_tokens": 1,"usage":}'):
        body = b'{"events":4,"answered":false,"usage":' + usage + b"}"
        assert parse_done(body) == (None, 4, False), usage
    whole = b'{"events":4,"answered":true,"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    assert parse_done(whole) == (Usage(3, 2), 4, True)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), seconds) == b""
    except TimeoutError:
        return False


async def test_a_connection_quiet_past_the_idle_timeout_is_closed(monkeypatch):
    """Only Envoy should reach this port, and Envoy closes its idle report connections at
    60 s: one quiet for longer is someone else's, and held a descriptor for good."""
    monkeypatch.setattr(reports, "IDLE_TIMEOUT_S", 0.3)
    desk = ReportDesk()
    await desk.start("127.0.0.1", 0, "127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection(*desk.address.split(":"))
        assert await closed_within(reader, 2.0)
        writer.close()
    finally:
        await desk.stop()


async def test_past_the_connection_cap_the_quietest_connection_is_closed(monkeypatch):
    monkeypatch.setattr(reports, "MAX_CONNECTIONS", 3)
    desk = ReportDesk()
    await desk.start("127.0.0.1", 0, "127.0.0.1")
    host, port = desk.address.split(":")
    try:
        opened = [await asyncio.open_connection(host, port) for _ in range(3)]
        # the oldest connection reports: now the first one quiet is the second
        opened[0][1].write(report("/first/lease-9", desk.key))
        assert (await opened[0][0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 204")
        late = await asyncio.open_connection(host, port)
        assert await closed_within(opened[1][0], 2.0)
        for reader, _ in (opened[0], opened[2], late):
            assert not await closed_within(reader, 0.2)
        for _, writer in (*opened, late):
            writer.close()
    finally:
        await desk.stop()


async def test_the_connection_cap_leaves_most_descriptors_to_the_other_ports(monkeypatch):
    """At an open-files limit of 1024, 1,200 idle report connections took every descriptor:
    the gRPC and admin ports accepted nothing. The cap is now a quarter of the limit."""
    monkeypatch.setattr(reports.resource, "getrlimit", lambda _which: (16, 1 << 20))
    desk = ReportDesk()
    await desk.start("127.0.0.1", 0, "127.0.0.1")
    host, port = desk.address.split(":")
    try:
        opened = [await asyncio.open_connection(host, port) for _ in range(5)]
        assert await closed_within(opened[0][0], 2.0)  # the fifth of a cap of 4 closed it
        for reader, _ in opened[1:]:
            assert not await closed_within(reader, 0.2)
        for _, writer in opened:
            writer.close()
    finally:
        await desk.stop()


def test_the_meter_is_taken_as_silent_only_after_many_responses_without_any_report():
    """A response that ends with no report is one whose client left before its first token
    while the meter reports; a run of them with no report of any other response means the
    meter cannot reach this process, and any report ends that."""
    desk = ReportDesk()
    for _ in range(reports.SILENT_AFTER - 1):
        desk.unreported()
    assert not desk.silent
    desk.unreported()
    assert desk.silent
    assert desk.receive(b"/done/someone-else", desk.key.encode(), b"{}") == reports._NO_CONTENT
    assert not desk.silent
    desk.unreported()
    assert not desk.silent
    desk.receive(b"/done/x", b"not the key", b"{}")  # a stranger's call says nothing
    for _ in range(reports.SILENT_AFTER):
        desk.unreported()
    assert desk.silent


def test_a_stream_without_its_first_token_is_charged_its_reservation_while_the_meter_is_silent():
    from extproc.accounting import ResponseRecord
    from limiter import Cost

    record = ResponseRecord(stream=True)
    assert record.settle(Cost(10, 90)) == (10, 0, "not_started")
    assert record.settle(Cost(10, 90), meter_silent=True) == (100, 90, "cut_off")
