"""Envoy's Lua response meter (extproc/meter.lua), in the real Envoy, reporting to a real
ReportDesk: usage found in JSON bodies and SSE streams split anywhere, the injected usage
event stripped and nothing else, one report per response whatever its length.

The bootstrap is kvgate's own with ext_proc swapped for a small Lua filter that stamps the
metadata kvgate would have set (from the test's request headers), in front of an upstream
that writes the test's body in the pieces the test chose.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import itertools
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.envoy_config import render_bootstrap
from extproc.envoy_proc import EnvoyProcess
from extproc.openai import Usage
from extproc.reports import ReportDesk
from tests.conftest import free_port, wait_for
from tests.unit.extproc.test_response_meter import (
    BAD_USAGES,
    USAGE_EVENT,
    line_end_cuts,
    line_end_soup,
    metered,
    random_cuts,
    random_stream,
    spread,
)

pytestmark = pytest.mark.e2e

USAGE = {"prompt_tokens": 13, "completion_tokens": 4, "total_tokens": 17}

STAMP = """
function envoy_on_request(handle)
  local h = handle:headers()
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set("envoy.lb", "x-gateway-destination-endpoint", h:get("x-test-upstream"))
  meta:set("kvgate", "lease", h:get("x-test-lease"))
  meta:set("kvgate", "meter", h:get("x-test-meter"))
  meta:set("kvgate", "report", h:get("x-test-report"))
  meta:set("kvgate", "key", h:get("x-test-key"))
  if h:get("x-test-bound") ~= nil then meta:set("kvgate.bound", "usage", h:get("x-test-bound")) end
end
"""
# what the meter publishes for Envoy's rate limit filter, per request
PUBLISHED = ("%REQ(x-test-lease)% %DYNAMIC_METADATA(kvgate.usage:prompt_tokens)% "
             "%DYNAMIC_METADATA(kvgate.usage:completion_tokens)% "
             "%DYNAMIC_METADATA(kvgate.usage:total_tokens)%\n")


@dataclass
class Recorder:
    lease: str = ""
    first: int = 0
    first_at: float = 0.0  # time.monotonic() of the first report
    done: list[tuple[Usage | None, int]] = field(default_factory=list)
    answered: list[bool] = field(default_factory=list)

    def first_reported(self) -> None:
        self.first += 1
        self.first_at = self.first_at or time.monotonic()

    def done_reported(self, usage: Usage | None, events: int, answered: bool) -> None:
        self.done.append((usage, events))
        self.answered.append(answered)


class Harness:
    """A background event loop with the scripted upstream and the report desk."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.desk = ReportDesk()
        # lease → (type, pieces); a number among the pieces: a pause of that many seconds
        self.bodies: dict[str, tuple[bytes, list[bytes | float]]] = {}
        self.written: dict[str, list[float]] = {}  # lease → when each piece was written
        self.statuses: dict[str, bytes] = {}  # lease → status line, when not 200
        self.extra: dict[str, bytes] = {}  # lease → more header lines (and a declared length)
        self.upstream_port = free_port()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> Harness:
        self._thread.start()
        self.call(self.desk.start("127.0.0.1", 0, "127.0.0.1"))
        self.call(asyncio.start_server(self._serve, "127.0.0.1", self.upstream_port))
        return self

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:-2])
                length = int(headers.get(b"content-length", b"0"))
                await reader.readexactly(length)
                lease = headers[b"x-test-lease"].decode()
                content_type, pieces = self.bodies[lease]
                status = self.statuses.get(lease, b"200 OK")
                extra = self.extra.get(lease, b"")
                framing = (b"content-length: %d\r\n"
                           % sum(len(p) for p in pieces if isinstance(p, bytes))
                           if b"content-length" in extra else b"transfer-encoding: chunked\r\n")
                writer.write(b"HTTP/1.1 %s\r\n%scontent-type: %s\r\n%s\r\n"
                             % (status, framing, content_type,
                                extra.replace(b"content-length\r\n", b"")))
                written = self.written.setdefault(lease, [])
                for piece in pieces:
                    if not isinstance(piece, bytes):
                        await asyncio.sleep(piece)
                        written.append(time.monotonic())
                        continue
                    written.append(time.monotonic())
                    writer.write(piece if b"content-length" in extra
                                 else b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    await asyncio.sleep(0.003)  # mostly one piece per chunk at Envoy
                if b"content-length" not in extra:
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def stop(self) -> None:
        self.call(self.desk.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def meter_stack(tmp_path_factory) -> Iterator[tuple[Harness, EnvoyProcess]]:
    harness = Harness().start()
    harness.published = tmp_path_factory.mktemp("meter") / "published.log"
    config = parse_config({
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("sk-a")]}],
        "pools": [{"name": "p", "models": [{"name": "m"}], "endpoints": ["127.0.0.1:1"]}],
    })
    bootstrap = copy.deepcopy(render_bootstrap(config))
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    stamp = copy.deepcopy(next(f for f in filters if f["name"] == "envoy.filters.http.lua"))
    stamp["name"] = "stamp"
    stamp["typed_config"]["default_source_code"] = {"inline_string": STAMP}
    at = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    filters[at] = stamp  # in ext_proc's place
    hcm["typed_config"].setdefault("access_log", []).append({
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(harness.published),
            "log_format": {"text_format_source": {"inline_string": PUBLISHED}}}})
    # the published log is read as each request ends (Envoy writes files every 10 s by default)
    with EnvoyProcess(bootstrap=bootstrap, extra_args=["--file-flush-interval-msec", "50"]
                      ) as envoy:
        yield harness, envoy
    harness.stop()


_leases = iter(range(1_000_000))


def exchange(meter_stack, pieces: list[bytes | float], meter: str,
             content_type: bytes | None = None, status: bytes = b"200 OK",
             extra: bytes = b"", bound: str | None = None,
             first: bool = True) -> tuple[bytes, Recorder]:
    """The body the client gets for an upstream answer in ``pieces``, and the reports.
    ``extra``: more response header lines; ``content-length\r\n`` among them declares the
    body's length instead of chunking it. ``bound``: kvgate's usage bound, prompt:output.
    ``first``: whether a stream has a first token to report (a data line)."""
    harness, envoy = meter_stack
    lease = f"case-{next(_leases)}"
    if content_type is None:
        content_type = b"text/event-stream" if meter.startswith("sse") else b"application/json"
    harness.bodies[lease] = (content_type, pieces)
    harness.statuses[lease] = status
    harness.extra[lease] = extra
    recorder = Recorder()
    harness.desk.expect(lease, recorder)
    response = httpx.post(
        f"http://127.0.0.1:{envoy.listen_port}/v1/chat/completions", content=b"{}",
        headers={"x-test-upstream": f"127.0.0.1:{harness.upstream_port}", "x-test-lease": lease,
                 "x-test-meter": meter, "x-test-report": harness.desk.address,
                 "x-test-key": harness.desk.key,
                 **({"x-test-bound": bound} if bound else {})}, timeout=10)
    assert response.status_code == int(status[:3])
    # the meter does not wait for kvgate's answer: its report may be a moment behind
    assert wait_for(lambda: recorder.done, timeout=5), "no done report"
    if meter.startswith("sse") and content_type == b"text/event-stream" and first:
        assert wait_for(lambda: recorder.first, timeout=5), "no first report"
    recorder.lease = lease
    return response.content, recorder


def published(meter_stack, lease: str) -> list[str]:
    """The usage the meter published for a request (prompt, completion, total)."""
    log = meter_stack[0].published

    def line() -> list[str] | None:
        for row in (log.read_text().splitlines() if log.exists() else []):
            if row.startswith(lease + " "):
                return row.split()[1:]
        return None

    assert wait_for(line, timeout=5), "nothing logged"
    return line() or []


def sse(events: list[dict]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def cut(body: bytes, at: list[int]) -> list[bytes]:
    points = [0, *sorted({min(max(a, 1), len(body) - 1) for a in at}), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(points) if b > a]


def text(i: int) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}


def test_json_usage_flat_and_nested_and_string_braces(meter_stack):
    for usage in (USAGE, {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}}):
        body = orjson.dumps({"choices": [{"text": '"usage": {'}], "usage": usage})
        got, recorder = exchange(meter_stack, cut(body, [7, 30]), "json")
        assert got == body
        assert recorder.done == [(Usage(13, 4), 0)] and recorder.first == 0


def test_large_json_is_read_from_a_bounded_tail(meter_stack):
    body = orjson.dumps({"data": [[0.1] * 1000] * 100, "usage": USAGE})
    got, recorder = exchange(meter_stack, cut(body, list(range(4096, len(body), 4096))), "json")
    assert got == body and recorder.done == [(Usage(13, 4), 0)]


def test_json_usage_before_a_long_tail_is_found(meter_stack):
    """vLLM writes prompt_logprobs, prompt_token_ids and prompt_text after the usage: a
    client asking for them must not push the usage out of what the meter reads."""
    body = orjson.dumps({"choices": [{"text": "x"}], "usage": USAGE,
                         "prompt_logprobs": [{"1": {"logprob": -1.5, "decoded_token": "usage"}}]
                         * 3000, "prompt_text": '"usage": {"prompt_tokens": 1} ' * 500})
    assert len(body) - body.index(b'"usage"') > 100_000
    got, recorder = exchange(meter_stack, cut(body, list(range(4096, len(body), 4096))), "json")
    assert got == body and recorder.done == [(Usage(13, 4), 0)]


def test_json_without_a_valid_usage_reports_none(meter_stack):
    for body in (b'{"choices": []}', b'{"usage": {"prompt_tokens": 13, "completion',
                 b'{"usage": {"prompt_tokens": "13"}}', b"<html>bad gateway</html>",
                 b'{"usage": {"prompt_tokens": -13, "completion_tokens": 4}}',
                 b'{"usage": {"prompt_tokens": 13, "completion_tokens": 99999999999999}}'):
        got, recorder = exchange(meter_stack, [body], "json")
        assert got == body and recorder.done == [(None, 0)], body
        assert recorder.answered == [True]  # the upstream said 200
    error = b'{"error": {"message": "bad", "code": 400}}'
    _, recorder = exchange(meter_stack, [error], "json", status=b"400 Bad Request")
    assert recorder.done == [(None, 0)] and recorder.answered == [False]


def test_a_usage_object_that_is_no_json_loses_only_the_usage(meter_stack):
    """The meter copies the engine's usage object as it found it (its braces balanced): one
    that is no JSON made the whole done report unreadable, and kvgate lost the events and
    took an engine's error for an answer."""
    bad = b'{"prompt_tokens": 13, "completion_tokens": x}'
    body = sse([text(i) for i in range(3)]).removesuffix(b"data: [DONE]\n\n") + (
        b'data: {"choices": [], "usage": ' + bad + b"}\n\ndata: [DONE]\n\n")
    _, recorder = exchange(meter_stack, [body], "sse")
    assert recorder.done == [(None, 3)] and recorder.answered == [True]
    error = b'{"error": {"message": "bad", "code": 400}, "usage": ' + bad + b"}"
    _, recorder = exchange(meter_stack, [error], "json", status=b"400 Bad Request")
    assert recorder.done == [(None, 0)] and recorder.answered == [False]


def test_json_the_last_usage_wins_whatever_the_spacing(meter_stack):
    body = (b'{"x": {"usage" :{"prompt_tokens": 1}}, "usage"\n:\t{"prompt_tokens": 13, '
            b'"completion_tokens": 4, "d": {"a": "}"}}}')
    _, recorder = exchange(meter_stack, [body], "json")
    assert recorder.done == [(Usage(13, 4), 0)]


@pytest.mark.parametrize("meter", ["json", "sse", "sse-strip"])
def test_the_last_usage_object_is_read_valid_or_not_as_the_python_meter_reads_it(
        meter_stack, meter):
    """Several usage objects in an event's data (or a JSON answer): the last complete one is
    the engine's, and one that is no valid usage is none. The Python meter (kvgate's
    full-duplex path) fell back to an earlier valid one where this one reported the last
    (kvgate reads none in it): the same answer was charged its usage on one path and its
    reservation on the other. A later event's usage replaces an earlier one's alike."""
    good = orjson.dumps(USAGE)
    for bad in BAD_USAGES:
        cases = [(b'{"choices": [], "usage": ' + good + b', "usage": ' + bad + b"}", None),
                 (b'{"choices": [], "usage": ' + bad + b', "usage": ' + good + b"}",
                  Usage(13, 4))]
        if meter != "json":  # continuous usage, then the usage event's invalid one
            cases.append((orjson.dumps({**text(0), "usage": USAGE})
                          + b'\n\ndata: {"choices": [], "usage": ' + bad + b"}", None))
        for data, usage in cases:
            body = data if meter == "json" else b"data: " + data + b"\n\ndata: [DONE]\n\n"
            got, recorder = exchange(meter_stack, cut(body, [len(body) - 30]), meter)
            assert recorder.done[0][0] == usage, (meter, data)
            if meter != "json":
                passed, held, python_usage, events, _ = metered(body, [len(body) - 30],
                                                                meter == "sse-strip")
                assert (got, recorder.done) == (passed + held, [(python_usage, events)]), data


@pytest.mark.parametrize("at", [[], [1], [5, 6, 7], [40, 41, 200], [100, 180, 260, 340]])
def test_a_stream_split_anywhere_counts_events_and_finds_usage(meter_stack, at):
    body = sse([*(text(i) for i in range(5)), {"choices": [], "usage": USAGE}])
    got, recorder = exchange(meter_stack, cut(body, at), "sse")
    assert got == body  # the client asked for the usage event: it stays
    assert recorder.first == 1 and recorder.done == [(Usage(13, 4), 5)]


def test_an_event_stream_named_in_capitals_is_read_as_one(meter_stack):
    """A media type is case-insensitive: ``Text/Event-Stream`` was read as JSON (no first
    report, usage looked for at a JSON body's end)."""
    body = sse([*(text(i) for i in range(3)), {"choices": [], "usage": USAGE}])
    got, recorder = exchange(meter_stack, [body], "sse",
                             content_type=b"Text/Event-Stream; charset=utf-8")
    assert got == body
    assert recorder.first == 1 and recorder.done == [(Usage(13, 4), 3)]


def test_the_injected_usage_event_is_stripped_and_nothing_else(meter_stack):
    events = [sse([text(i)]).removesuffix(b"data: [DONE]\n\n") for i in range(3)]
    usage_event = b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n"
    got, recorder = exchange(meter_stack, [*events, usage_event + b"data: [DONE]\n\n"],
                             "sse-strip")
    assert got == b"".join(events) + b"data: [DONE]\n\n"
    assert recorder.done == [(Usage(13, 4), 3)]


def test_continuous_usage_chunks_keep_their_choices(meter_stack):
    """With ``continuous_usage_stats`` every chunk carries usage: only the final usage-only
    event (``choices: []``), the one kvgate asked for, goes."""
    chunks = [{**text(i), "usage": {"prompt_tokens": 13, "completion_tokens": i + 1}}
              for i in range(3)]
    final = {"choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 3}}
    body = sse([*chunks, final])
    pieces = [b"data: " + orjson.dumps(e) + b"\n\n" for e in [*chunks, final]]
    got, recorder = exchange(meter_stack, [*pieces, b"data: [DONE]\n\n"], "sse-strip")
    assert got == sse(chunks) and body != got
    assert recorder.done == [(Usage(13, 3), 3)]


def test_several_choices_take_only_the_usage_only_events_usage(meter_stack):
    """``sse-final`` (n > 1): a chunk's running usage counts its own choice; a stream cut
    before the usage-only event (vLLM's error event, then [DONE]) reports no usage."""
    chunks = [{"choices": [{"index": c, "delta": {"content": f"t{i} "}}],
               "usage": {"prompt_tokens": 13, "completion_tokens": i + 1}}
              for i in range(3) for c in (0, 1)]
    final = {"choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 6}}
    error = {"error": {"message": "engine failed", "code": 500}}
    for last, usage, events in ((final, Usage(13, 6), 6), (error, None, 7)):
        body = sse([*chunks, last])
        got, recorder = exchange(meter_stack, cut(body, [50, 400]), "sse-final")
        assert got == body and recorder.done == [(usage, events)]
    _, recorder = exchange(meter_stack, cut(sse([*chunks, error]), [50]), "sse")
    assert recorder.done == [(Usage(13, 3), 7)]  # one choice: the running count stands


def test_a_long_stream_costs_two_reports(meter_stack):
    body = sse([*(text(i) for i in range(600)), {"choices": [], "usage": USAGE}])
    pieces = cut(body, list(range(50, len(body), 50)))
    got, recorder = exchange(meter_stack, pieces, "sse-strip")
    assert got.count(b"data: ") == 601 and b'"usage"' not in got
    assert recorder.first == 1 and recorder.done == [(Usage(13, 4), 600)]


@pytest.mark.parametrize("at", [[3], [60, 61], [150], [200, 230, 260]])
def test_a_split_usage_event_is_still_stripped_and_text_arrives_whole(meter_stack, at):
    body = sse([*(text(i) for i in range(3)), {"choices": [], "usage": USAGE}])
    got, recorder = exchange(meter_stack, cut(body, at), "sse-strip")
    assert got == sse([text(i) for i in range(3)])
    assert recorder.first == 1 and recorder.done == [(Usage(13, 4), 3)]


def test_an_event_longer_than_the_hold_passes_whole(meter_stack):
    big = {"choices": [{"index": 0, "delta": {"content": "x" * 20000}}]}
    body = sse([big, text(1), {"choices": [], "usage": USAGE}])
    got, recorder = exchange(meter_stack, cut(body, list(range(1000, len(body), 1000))),
                             "sse-strip")
    assert got == sse([big, text(1)])
    assert recorder.done == [(Usage(13, 4), 2)]


def test_a_stream_answered_with_a_json_error_passes_untouched(meter_stack):
    error = b'{"error": {"message": "bad", "code": 400}}'
    got, recorder = exchange(meter_stack, [error], "sse-strip", content_type=b"application/json")
    assert got == error
    assert recorder.first == 0 and recorder.done == [(None, 0)]


def test_a_forged_or_unknown_report_changes_nothing(meter_stack):
    harness, _ = meter_stack
    recorder = Recorder()
    harness.desk.expect("victim", recorder)
    url = f"http://{harness.desk.address}"
    forged = httpx.post(f"{url}/done/victim", content=b'{"usage": null, "events": 0}',
                        headers={"x-kvgate-report-key": "guess"})
    assert forged.status_code == 403
    unknown = httpx.post(f"{url}/done/nobody", content=b"{}",
                         headers={"x-kvgate-report-key": harness.desk.key})
    assert unknown.status_code == 204
    assert recorder.done == [] and recorder.first == 0


def test_an_answer_repeating_the_usage_key_costs_one_scan(meter_stack):
    """An engine writing ``"usage":{`` 56,000 times (504 KB) held an Envoy worker ~30 s:
    every key was read to the body's end. Only the last few keys are read, each a bounded
    stretch: the answer passes at once, with no usage to charge."""
    body = b'{"x":' + b'"usage":{' * 56_000 + b"}"
    started = time.monotonic()
    got, recorder = exchange(meter_stack, cut(body, list(range(64_000, 504_000, 64_000))),
                             "json")
    assert got == body and recorder.done == [(None, 0)]
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("at", [[], [7], [90, 91, 92]])
def test_crlf_events_are_read_and_stripped_like_lf_ones(meter_stack, at):
    """SSE allows CRLF line ends; events ending in a blank CRLF line were never found, so
    with stripping the whole stream was held back: the client got 0 bytes."""
    events = [text(0), text(1), {"choices": [], "usage": USAGE}]
    body = b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events) \
        + b"data: [DONE]\r\n\r\n"
    got, recorder = exchange(meter_stack, cut(body, at), "sse-strip")
    assert got == body.replace(b"data: " + orjson.dumps(events[2]) + b"\r\n\r\n", b"")
    assert recorder.done == [(Usage(13, 4), 2)]


@pytest.mark.parametrize("end", [b"\r\r", b"\n\r\n", b"\r\r\n"])
@pytest.mark.parametrize("at", [[], [60], [90, 91, 92]])
def test_cr_and_mixed_line_ends_are_read_and_stripped(meter_stack, end, at):
    """SSE's line ends are LF, CRLF and CR alone, mixed. With CR alone (or an LF line
    then a CRLF blank line) no event ever ended: the usage event reached a client that did
    not ask for it, and no usage was read (the tenant was charged its reservation)."""
    events = [text(0), text(1), {"choices": [], "usage": USAGE}]
    body = b"".join(b"data: " + orjson.dumps(e) + end for e in events) + b"data: [DONE]" + end
    got, recorder = exchange(meter_stack, cut(body, at), "sse-strip")
    assert got == body.replace(b"data: " + orjson.dumps(events[2]) + end, b"")
    assert recorder.done == [(Usage(13, 4), 2)]


@pytest.mark.parametrize("lead", [b"id: 7\n", b"event: message\n", b": ping\n"])
def test_a_usage_event_opened_by_another_field_is_stripped_wherever_split(meter_stack, lead):
    """An id, event name or comment line may open the usage event: a write that ended
    inside it passed the unfinished event on (only a data line was held), so the usage
    event reached the client whenever the engine's writes split it there."""
    head = sse([text(0), text(1)]).removesuffix(b"data: [DONE]\n\n")
    body = head + lead + b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) \
        + b"\n\ndata: [DONE]\n\n"
    for at in range(len(head) + 1, len(head) + len(lead) + 8):
        got, recorder = exchange(meter_stack, cut(body, [at]), "sse-strip")
        assert got == head + b"data: [DONE]\n\n", at
        assert recorder.done == [(Usage(13, 4), 2)]


def test_a_last_event_without_its_blank_line_still_arrives(meter_stack):
    """A held, unfinished event is one that may be the usage event: [DONE] (or a chunk with
    choices) whose blank line never comes is passed on, not lost at the body's end."""
    body = sse([text(0), {"choices": [], "usage": USAGE}])[:-2]  # "data: [DONE]" unended
    got, _ = exchange(meter_stack, [body], "sse-strip")
    assert got.endswith(b"data: [DONE]") and b'"usage"' not in got


@pytest.mark.parametrize("extra", [b"", b"content-length\r\n"])
@pytest.mark.parametrize("at", [[], [30], [-3]])
def test_an_event_still_held_at_the_bodys_end_goes_on_unless_it_is_the_usage_event(
        meter_stack, extra, at):
    """While stripping, an unfinished event that may be the usage event is held back: one
    whose blank line never came, or (CR line ends) whose last CR may be the first half of a
    CRLF. The body's end dropped it (the client lost the stream's last bytes), where
    kvgate's Python meter passes it on. It goes on in the body's last chunk, unless it is
    the usage-only event (read whole at the end): that is stripped still."""
    head = b"".join(b"data: " + orjson.dumps(text(i)) + b"\r\r" for i in range(2))
    usage_event = b"data: " + orjson.dumps({"choices": [], "usage": USAGE})
    end = orjson.dumps({"choices": [], "id": "end"})
    for tail, kept, usage, events in (
            (b"data: " + end + b"\r\r", True, None, 3),  # its last CR may begin a CRLF
            (b"data: " + end + b"\r", True, None, 3),
            (b": bye\r\r", True, None, 2),
            (b"id: 9\rdata: " + end, True, None, 3),
            (usage_event[:-5], True, None, 2),  # cut off: no usage, and the client's to drop
            (usage_event + b"\r\r", False, Usage(13, 4), 2),
            (usage_event, False, Usage(13, 4), 2)):
        body = head + tail
        cuts = [a % len(body) for a in at]
        got, recorder = exchange(meter_stack, cut(body, cuts) if cuts else [body], "sse-strip",
                                 extra=extra)
        assert got == (body if kept else head), tail
        assert recorder.done == [(usage, events)], tail
        passed, held, *_ = metered(body, sorted(cuts), True)
        assert got == passed + held, tail  # as kvgate's Python meter passes it on


def test_a_declared_length_is_dropped_when_the_usage_event_is_stripped(meter_stack):
    """An engine (or a buffering proxy) that declares its stream's length: the stripped body
    is shorter, and the client waited for bytes that never came."""
    body = sse([text(0), {"choices": [], "usage": USAGE}])
    got, recorder = exchange(meter_stack, cut(body, [40]), "sse-strip",
                             extra=b"content-length\r\n")
    assert got == sse([text(0)]) and recorder.done == [(Usage(13, 4), 1)]


def test_a_compressed_answer_passes_untouched_and_unread(meter_stack):
    """A compressed stream cannot be read or stripped: it passes as it came (kvgate asks
    engines for none: accept-encoding is dropped upstream) and no usage is read."""
    body = gzip.compress(sse([text(0), {"choices": [], "usage": USAGE}]))
    got, recorder = exchange(meter_stack, [body], "sse-strip",
                             extra=b"content-encoding: gzip\r\n")
    assert got == gzip.decompress(body)  # httpx decodes it: every compressed byte arrived
    assert recorder.done == [(None, 0)] and recorder.first == 1


@pytest.mark.parametrize("meter", ["json", "sse"])
def test_the_published_usage_is_held_to_kvgates_bound(meter_stack, meter):
    """Envoy's rate limit filter charges what the meter publishes (hits_addend): an
    engine's absurd count would lock the tenant out of the Rate Limit Service's token
    limits for weeks. It is held to what the request can have used, as kvgate holds its
    own charge; a count within the bound, or a request without one, is published as read."""
    absurd = {"prompt_tokens": 2**31, "completion_tokens": 2**31, "total_tokens": 2**32}
    for usage, bound, expected in (
            (absurd, "100:50", ["100", "50", "150"]),
            (USAGE, "100:50", ["13", "4", "17"]),
            ({"total_tokens": 2**32}, "100:50", ["-", "-", "150"]),
            (absurd, None, [str(2**31), str(2**31), str(2**32)])):
        body = (orjson.dumps({"choices": [{"text": "x"}], "usage": usage}) if meter == "json"
                else sse([text(0), {"choices": [], "usage": usage}]))
        _, recorder = exchange(meter_stack, [body], meter, bound=bound)
        assert published(meter_stack, recorder.lease) == expected, (usage, bound)


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_keep_alive_comments_before_the_first_token_are_no_first_token(meter_stack, meter):
    """An engine (or a proxy) that pings with SSE comments (or sends an event: line) before
    its first token: the meter reported the first token at the first ping, and the
    scheduler took prefill for done. A stream with no data line reports none."""
    pings = [b": ping\n\n", b": ping\r\n\r\n", b"event: message\n", b"id: 1\r\r\n"]
    got, recorder = exchange(meter_stack, pings, meter, first=False)
    assert got == b"".join(pings)
    time.sleep(0.2)  # a first report would be on its way with the done one
    assert recorder.first == 0 and recorder.done == [(None, 0)]


@pytest.mark.parametrize("lead", [b": ping\n\n", b": ping\r", b"event: message\n"])
@pytest.mark.parametrize("split", [0, 1, 2, 5])
def test_the_first_token_is_reported_with_the_chunk_its_data_line_begins_in(
        meter_stack, lead, split):
    """A ping, a pause, then the first token, its data line split after ``split`` bytes
    by another pause: the first report comes after the first pause, before the second."""
    data = b"data: " + orjson.dumps(text(0)) + b"\n\n"
    pieces: list[bytes | float] = [lead, 0.4, *([data[:split], 0.4] if split else []),
                                   data[split:], b"data: [DONE]\n\n"]
    got, recorder = exchange(meter_stack, pieces, "sse-strip")
    assert got == lead + data + b"data: [DONE]\n\n"
    written = meter_stack[0].written[recorder.lease]
    assert recorder.first == 1 and recorder.done[0][0] is None
    assert written[1] <= recorder.first_at  # not at the ping
    if split:
        assert recorder.first_at < written[3]  # at "d", "da" or "data:", not at the rest


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
@pytest.mark.parametrize("end", [b"", b"\n", b"\r", b"\r\n", b"\n\r"])
def test_a_last_usage_event_without_its_blank_line_is_read_at_the_end(meter_stack, meter, end):
    """A stream that ends right after its usage event, without the blank line that ends an
    SSE event: its usage was never read (the tenant was charged its reservation). The
    body's end ends the event, read (and stripped) as if its blank line had come."""
    head = sse([text(0), text(1)]).removesuffix(b"data: [DONE]\n\n")
    body = head + b"id: 9\ndata: " + orjson.dumps({"choices": [], "usage": USAGE}) + end
    for at in ([], [len(head) + 4], [len(body) - 2]):
        got, recorder = exchange(meter_stack, cut(body, at), meter)
        assert recorder.done == [(Usage(13, 4), 2)], at
        assert got == (head if meter == "sse-strip" else body)
        assert published(meter_stack, recorder.lease) == ["13", "4", "17"]


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_a_cut_off_last_usage_event_is_not_read(meter_stack, meter):
    """Only a last event whose data is one whole JSON object is read at the end: one cut
    off (its usage object whole, the document not) is no usage."""
    head = sse([text(0)]).removesuffix(b"data: [DONE]\n\n")
    whole = b"data: " + orjson.dumps({"choices": [], "usage": USAGE, "id": "x"})
    for tail in (whole[:-1], whole[: whole.index(b',"id"') + 2], b"data: [DONE]",
                 b'data: {"usage": ' + orjson.dumps(USAGE) + b"} x"):
        _, recorder = exchange(meter_stack, [head + tail], meter)
        assert recorder.done == [(None, 1)], tail


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_a_last_event_of_balanced_braces_is_read_at_the_end_as_the_python_meter_reads_it(
        meter_stack, meter):
    """The body's end ends a last event whose data is one object, its braces balanced:
    the Lua meter cannot parse JSON, so one that is not quite JSON is read too (its usage
    object, and the event counted), as it is when a blank line ends it. The Python meter
    (kvgate's full-duplex path) parsed the whole data as JSON and read none of it."""
    head = sse([text(0)]).removesuffix(b"data: [DONE]\n\n")
    for tail in (b'data: {"choices": [], "usage": ' + orjson.dumps(USAGE) + b", x}",
                 b'data: {"choices": [{"delta": {"content": "a"}}], "x": 1,}\f'):
        body = head + tail
        passed, _held, usage, events, _started = metered(body, [], meter == "sse-strip")
        got, recorder = exchange(meter_stack, [body], meter)
        assert (got, recorder.done) == (passed, [(usage, events)]), tail


def test_a_last_content_event_without_its_blank_line_counts(meter_stack):
    body = sse([text(0), text(1)]).removesuffix(b"\n\ndata: [DONE]\n\n")
    got, recorder = exchange(meter_stack, cut(body, [30]), "sse-strip")
    assert got == body and recorder.done == [(None, 2)]


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
@pytest.mark.parametrize("lead", [b"event: message\n", b"id: 7\r\n", b": x\rid: 8\n"])
def test_an_event_whose_data_follows_other_fields_counts(meter_stack, meter, lead):
    """An engine that puts an event:, id: or comment line before each data line: only an
    event that began with "data:" counted, so the done report's events (what an error
    answer is charged without usage) were 0. [DONE] and the usage event still count none."""
    events = [text(0), text(1), text(2), {"choices": [], "usage": USAGE}]
    body = b"".join(lead + b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    body += b"event: ping\n\n" + lead + b"data: [DONE]\n\n"
    usage_event = lead + b"data: " + orjson.dumps(events[-1]) + b"\n\n"
    for at in ([], [len(lead) - 1, len(lead) + 3], list(range(20, len(body), 40))):
        got, recorder = exchange(meter_stack, cut(body, at), meter)
        assert recorder.done == [(Usage(13, 4), 3)], at
        assert got == (body.replace(usage_event, b"") if meter == "sse-strip" else body)
    error = b"".join(lead + b"data: " + orjson.dumps(text(i)) + b"\n\n" for i in range(4))
    _, recorder = exchange(meter_stack, [error], meter, status=b"500 Internal Server Error")
    assert recorder.done == [(None, 4)] and recorder.answered == [False]


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_a_long_event_counts_by_its_data_line_wherever_its_carry_was_cut(meter_stack, meter):
    """An event longer than the meter's carry loses its start: whether that start had a
    data line is kept, and the carry's first bytes (cut mid-line) are no line's start."""
    later = b": " + b"x" * 9000 + b"\ndata: " + b"y" * 20000 + b"\n\n"
    # the data line's start in one chunk, or cut between its line end and "data:"
    for at in ([], [9003], [9005], [9008]):
        got, recorder = exchange(
            meter_stack, cut(later, sorted({*range(1000, len(later), 1000), *at})), meter)
        assert got == later and recorder.done == [(None, 1)], at
    # a comment whose last 8192 bytes (the carry) begin "data:", then its blank line
    mid_line = b": " + b"x" * 100 + b"data: " + b"y" * (8192 - 6)
    pieces: list[bytes | float] = [*cut(mid_line, [4000]), 0.05, b"\n\n", text_event(1)]
    got, recorder = exchange(meter_stack, pieces, meter)
    assert got == mid_line + b"\n\n" + text_event(1) and recorder.done == [(None, 1)]


def text_event(i: int) -> bytes:
    return b"data: " + orjson.dumps(text(i)) + b"\n\n"


BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
@pytest.mark.parametrize("at", [[], [1], [2], [3], [4], [1, 2, 3]])
def test_a_byte_order_mark_at_the_streams_start_is_ignored(meter_stack, meter, at):
    """SSE's decoder drops a UTF-8 byte order mark at a stream's start: the first data
    line after one was not recognised (no first token until the end, that event not
    counted). The mark passes on to the client."""
    body = BOM + sse([text(0), text(1), {"choices": [], "usage": USAGE}])
    got, recorder = exchange(meter_stack, cut(body, at), meter)
    assert recorder.first == 1 and recorder.done == [(Usage(13, 4), 2)]
    assert got == (BOM + sse([text(0), text(1)]) if meter == "sse-strip" else body)


def test_the_first_token_after_a_byte_order_mark_is_reported_with_its_chunk(meter_stack):
    pieces: list[bytes | float] = [BOM + text_event(0), 0.4, text_event(1), b"data: [DONE]\n\n"]
    got, recorder = exchange(meter_stack, pieces, "sse-strip")
    written = meter_stack[0].written[recorder.lease]
    assert got == BOM + sse([text(0), text(1)]) and recorder.done == [(None, 2)]
    assert recorder.first == 1 and recorder.first_at < written[1]  # before the pause's end


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_only_a_whole_byte_order_mark_at_the_very_start_is_ignored(meter_stack, meter):
    """A mark later in the stream, or one cut short, is part of its line (then no data
    line), as an SSE client reads it."""
    for body in (text_event(0) + BOM + sse([text(1)]), BOM[:2] + sse([text(0), text(1)]),
                 BOM + BOM + sse([text(0), text(1)])):
        got, recorder = exchange(meter_stack, cut(body, [1, 2]), meter)
        assert got == body and recorder.done == [(None, 1)], body[:8]


def test_a_non_streamed_answer_labelled_an_event_stream_is_read_as_json(meter_stack):
    """A meter of "json" (the request asked for no stream) reads JSON whatever the
    answer's type says (kvgate's full-duplex path now does as this one)."""
    body = orjson.dumps({"choices": [{"message": {"content": "data: x"}}], "usage": USAGE})
    got, recorder = exchange(meter_stack, cut(b"data: " + body, [6, 30]), "json",
                             content_type=b"text/event-stream")
    time.sleep(0.2)  # a first report would be on its way with the done one
    assert got == b"data: " + body
    assert recorder.first == 0 and recorder.done == [(Usage(13, 4), 0)]


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n", b"\r\r"])
@pytest.mark.parametrize("lead", [b"", b"id: 7", b": data: not the data"])
def test_a_usage_object_over_several_data_lines_is_read_and_stripped(meter_stack, meter,
                                                                      end, lead):
    """SSE joins an event's data lines with LF, a legal way to send JSON: the meter read
    the usage off the raw event, "data:" prefixes inside it, and its report was no JSON
    (no usage, no events: the tenant was charged its reservation)."""
    line_end = end[: len(end) // 2]
    events = [text(0), text(1)]
    usage_event = (lead + line_end if lead else b"") + spread(USAGE_EVENT, line_end) + end
    head = b"".join(b"data: " + orjson.dumps(e) + end for e in events)
    body = head + usage_event + b"data: [DONE]" + end
    for at in ([], [len(head) + 30], list(range(20, len(body), 45))):
        got, recorder = exchange(meter_stack, cut(body, at), meter)
        assert recorder.done == [(Usage(13, 4), 2)], at
        assert got == (body.replace(usage_event, b"") if meter == "sse-strip" else body)
        assert published(meter_stack, recorder.lease) == ["13", "4", "17"]


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_usage_text_outside_the_data_lines_is_no_usage(meter_stack, meter):
    """Only an event's data holds its usage: a comment, id: or event: line that mentions
    one was read as the engine's count (and one with "choices": [] made its event the
    usage-only one: stripped, not counted)."""
    for lead in (b': {"usage": {"prompt_tokens": 99, "completion_tokens": 1}}\n',
                 b'id: {"choices": [], "usage": {"prompt_tokens": 99}}\n'):
        body = b"".join(lead + text_event(i) for i in range(3))
        got, recorder = exchange(meter_stack, cut(body, [40]), meter)
        assert got == body and recorder.done == [(None, 3)], lead


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_only_an_event_whose_data_is_done_ends_the_stream(meter_stack, meter):
    """An event counted none when the text [DONE] was anywhere in it (a model quoting it,
    an id: or comment line). Only an event whose data is [DONE] is the end."""
    quoting = [{"choices": [{"delta": {"content": content}}]}
               for content in ("[DONE]", "data: [DONE]\n\n")]
    counted = [b"data: " + orjson.dumps(e) + b"\n\n" for e in quoting] + [
        b"id: [DONE]\n" + text_event(0), b": [DONE]\r\n" + text_event(1),
        b"data:  [DONE]\n\n", b"data: [DONE]\ndata: [DONE]\n\n"]
    ends = [b"data: [DONE]\n\n", b"data:[DONE]\r\r", b"event: end\r\ndata: [DONE]\r\n\r\n",
            b"id: 9\ndata: [DONE]"]
    body = b"".join(counted) + b"".join(ends)
    for at in ([], list(range(11, len(body), 23))):
        got, recorder = exchange(meter_stack, cut(body, at), meter)
        assert got == body and recorder.done == [(None, len(counted))], at


def test_a_usage_event_that_mentions_done_is_held_and_stripped_wherever_split(meter_stack):
    """An unfinished event with [DONE] anywhere in it went on at once, taken for the end:
    a usage-only event that mentions it reached the client when a write split it there."""
    head = sse([text(0)]).removesuffix(b"data: [DONE]\n\n")
    usage_event = b"data: " + orjson.dumps({**USAGE_EVENT, "id": "[DONE]"}) + b"\n\n"
    body = head + usage_event + b"data: [DONE]\n\n"
    for at in (len(head) + 20, len(head) + 40, len(body) - 20):
        got, recorder = exchange(meter_stack, [body[:at], 0.05, body[at:]], "sse-strip")
        assert got == head + b"data: [DONE]\n\n", at
        assert recorder.done == [(Usage(13, 4), 1)], at


@pytest.mark.parametrize("seed", range(80))
def test_a_random_stream_is_metered_as_the_python_meter_meters_it(meter_stack, seed):
    """The Lua meter and its Python twin (kvgate's full-duplex path) agree on random SSE
    streams (tests/unit/extproc/test_response_meter.py's: line ends, lead lines, data over
    several lines, tokens quoting [DONE], a usage event or none, ...) split at random: the
    bytes passed on, the usage, the events, the first token. (Envoy may join the pieces:
    the Python meter's result does not depend on the split, which the unit test checks.)
    An unfinished event still held when the body ends (one that may be the usage event and
    never got its blank line, or whose last CR may have been half a CRLF) goes on in both:
    the Python meter's ``finish`` returns it, the Lua meter adds it to the last chunk."""
    rng = random.Random(seed)
    body, strip = random_stream(rng), rng.random() < 0.5
    final = not strip and seed % 2 == 1  # "sse-final": n > 1
    at = random_cuts(rng, body)
    passed, held, usage, events, started = metered(body, at, strip, final)
    got, recorder = exchange(meter_stack, cut(body, at) if at else [body],
                             "sse-strip" if strip else "sse-final" if final else "sse",
                             first=started)
    assert (got, recorder.done, recorder.first) == (passed + held, [(usage, events)],
                                                    int(started)), body


@pytest.mark.parametrize("seed", range(40))
def test_line_ends_straddling_chunks_are_read_as_the_python_meter_reads_them(meter_stack, seed):
    """The search for an event's end goes on where the last chunk's stopped (less the bytes
    a CRLF or a blank line straddling the chunks may have begun in): streams of LF, CRLF and
    CR line ends and blank lines in any order, some with an event of short lines longer
    than the carry, cut at, one past or two past a line end, are metered as the Python
    meter meters them (its result does not depend on the cuts)."""
    rng = random.Random(seed)
    body, strip = line_end_soup(rng), rng.random() < 0.5
    at = line_end_cuts(rng, body, 30)
    passed, held, usage, events, started = metered(body, at, strip)
    got, recorder = exchange(meter_stack, cut(body, at) if at else [body],
                             "sse-strip" if strip else "sse", first=started)
    assert (got, recorder.done, recorder.first) == (passed + held, [(usage, events)],
                                                    int(started)), (body, at)


def test_an_event_repeating_the_usage_key_costs_one_scan(meter_stack):
    """The bound on "usage":{ keys holds for an SSE event's data too, one data line or one
    per key (the lines joined once, then one scan)."""
    for body in (b'data: {"x":' + b'"usage":{' * 56_000 + b"}\n\n",
                 b'data: {"x":\n' + b'data: "usage":{\n' * 56_000 + b"data: }\n\n"):
        started = time.monotonic()
        got, recorder = exchange(meter_stack, [body], "sse-strip")
        assert got == body and recorder.done == [(None, 1)]
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_a_client_that_hangs_up_at_done_is_charged_its_usage(meter_stack, meter):
    """openai-python closes the connection as soon as it reads ``data: [DONE]``: when the
    engine's end of the body came a moment later, the meter never saw the body end, sent
    no done report, and kvgate charged the whole reservation (cut off) for an answer whose
    usage had passed. The [DONE] event ends an OpenAI stream: the report goes then."""
    harness, envoy = meter_stack
    lease = f"case-{next(_leases)}"
    body = sse([*(text(i) for i in range(3)), {"choices": [], "usage": USAGE}])
    harness.bodies[lease] = (b"text/event-stream", [body, 0.5])  # the end a moment later
    harness.statuses[lease] = b"200 OK"
    harness.extra[lease] = b""
    recorder = Recorder()
    harness.desk.expect(lease, recorder)
    got = b""
    with httpx.stream(
            "POST", f"http://127.0.0.1:{envoy.listen_port}/v1/chat/completions", content=b"{}",
            headers={"x-test-upstream": f"127.0.0.1:{harness.upstream_port}",
                     "x-test-lease": lease, "x-test-meter": meter,
                     "x-test-report": harness.desk.address, "x-test-key": harness.desk.key},
            timeout=10) as response:
        for piece in response.iter_raw():
            got += piece
            if got.endswith(b"data: [DONE]\n\n"):
                break  # and hang up, as openai-python does
    assert wait_for(lambda: recorder.done, timeout=3), "no done report"
    assert recorder.done == [(Usage(13, 4), 3)]
    assert published(meter_stack, lease) == ["13", "4", "17"]
    assert wait_for(lambda: len(harness.written[lease]) == 2)  # the upstream is done too


def worker_cpu_ns(envoy: EnvoyProcess) -> int:
    """CPU time of Envoy's worker threads (where the Lua filter runs), in ns: the meter's
    work, without the main thread's stats and log flushes."""
    assert envoy.process is not None
    total = 0
    for task in Path(f"/proc/{envoy.process.pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().startswith("wrk:"):
                total += int((task / "schedstat").read_text().split()[0])
    return total


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("meter", ["sse", "sse-strip"])
def test_a_long_event_of_short_lines_is_not_rescanned_each_chunk(meter_stack, meter):
    """An engine that writes one long event of short lines in small chunks: the meter
    looked for the event's end from the start of the carried text (up to 8 KiB) at every
    chunk, one pass per line (~0.3 ms a chunk in Envoy's worker). The scan goes on from
    where the last one stopped: such a stream costs about what the same chunks cost when
    each ends an event. (CPU time of Envoy's worker threads, the two streams' ratio.)"""
    chunks = 600
    long_event = [b":\n" * 32] * chunks + [b"data: x\n\n"]  # one event of 19,200 lines
    short_events = [b":" * 62 + b"\n\n"] * chunks + [b"data: x\n\n"]  # each chunk one event
    _, envoy = meter_stack
    costs = []
    for pieces in (short_events, long_event, short_events, long_event):
        before = worker_cpu_ns(envoy)
        got, recorder = exchange(meter_stack, list(pieces), meter)
        costs.append(worker_cpu_ns(envoy) - before)
        assert got == b"".join(pieces) and recorder.done == [(None, 1)]
    short, long = costs[0] + costs[2], costs[1] + costs[3]
    print(f"worker CPU: short events {short / 1e6:.1f} ms, one long event {long / 1e6:.1f} ms")
    assert long < 2 * short, (short, long)
