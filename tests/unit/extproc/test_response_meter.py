"""meter.py: reading usage off responses kvgate passes on itself (full-duplex mode), split
anywhere, bounded memory, the injected usage event stripped and nothing else."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.meter import HOLD, TAIL, ResponseMeter
from extproc.openai import Usage

USAGE = {"prompt_tokens": 13, "completion_tokens": 4, "total_tokens": 17}


def sse(events: list[dict], end: bytes = b"\n\n") -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + end for e in events) + b"data: [DONE]" + end


def run(meter: ResponseMeter, body: bytes, cuts: list[int]) -> bytes:
    out, start = [], 0
    for cut in [*sorted({min(c, len(body)) for c in cuts}), len(body)]:
        out.append(meter.feed(body[start:cut]))
        start = cut
    out.append(meter.finish())
    return b"".join(out)


EVENTS = [{"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(5)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 600), max_size=10), st.booleans(),
       st.sampled_from([b"\n\n", b"\r\n\r\n"]))
def test_a_stream_split_anywhere_is_read_and_only_the_usage_event_stripped(cuts, strip, end):
    """LF or CRLF line ends (SSE allows both; the Lua meter reads both)."""
    body = sse([*EVENTS, {"choices": [], "usage": USAGE}], end)
    meter = ResponseMeter(sse=True, strip=strip)
    passed = run(meter, body, cuts)
    assert passed == (sse(EVENTS, end) if strip else body)
    assert meter.usage == Usage(13, 4) and meter.events == 5


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3 * TAIL), max_size=6))
def test_a_long_event_passes_at_once_and_is_never_lost(cuts):
    long = {"choices": [{"delta": {"content": "y" * (HOLD + TAIL)}}]}
    body = sse([long, *EVENTS, {"choices": [], "usage": USAGE}])
    meter = ResponseMeter(sse=True, strip=True)
    assert run(meter, body, cuts) == sse([long, *EVENTS])
    assert meter.events == 6 and meter.usage == Usage(13, 4)
    assert len(meter._carry) <= TAIL


def test_an_unfinished_event_is_held_only_while_short():
    meter = ResponseMeter(sse=True, strip=True)
    assert meter.feed(b'data: {"choices": []') == b""  # might be the usage event: held
    assert meter.feed(b', "usage": {"prompt_tokens": 1}}\n\n') == b""
    assert meter.usage == Usage(1, 0)
    assert meter.feed(b"data: " + b"z" * HOLD) == b"data: " + b"z" * HOLD  # too long: on
    assert meter.finish() == b""


def test_a_cut_off_stream_passes_its_half_event_on_at_the_end():
    meter = ResponseMeter(sse=True, strip=True)
    assert meter.feed(b'data: {"choices": [], "usa') == b""
    assert meter.finish() == b'data: {"choices": [], "usa'


def test_only_what_may_be_the_usage_event_is_held():
    """An unfinished event with a choice in it, [DONE], or what is no SSE field cannot be
    the usage-only event: it goes on at once, as in the Lua meter (a stream whose last
    event never gets its blank line loses nothing but that event)."""
    for partial in (b'data: {"choices": [{"delta"', b"data: [DONE]", b"<html>bad gateway",
                    b'{"error": "x"}'):
        meter = ResponseMeter(sse=True, strip=True)
        assert meter.feed(partial) == partial
        assert meter.finish() == b""
    meter = ResponseMeter(sse=True, strip=True)
    assert meter.feed(b"da") == b""  # may still become "data:"
    assert meter.feed(b'ta: {"choices": [{"x') == b'data: {"choices": [{"x'
    # an id, event name or comment line may open the usage event: held to its end
    for partial in (b": keep-alive", b"event: message", b"id: 7", b"\nid: 7\nda"):
        meter = ResponseMeter(sse=True, strip=True)
        assert meter.feed(partial) == b""
        assert meter.finish() == partial


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 600), max_size=10), st.booleans(),
       st.sampled_from([b"\r\r", b"\n\r\n", b"\r\n\n", b"\r\r\n"]),
       st.sampled_from([b"", b"id: 7\n", b"event: message\r", b": ping\r\n"]))
def test_cr_and_mixed_line_ends_and_lead_lines_are_read_split_anywhere(cuts, strip, end, lead):
    """SSE's line ends are LF, CRLF and CR alone, mixed: with CR alone no event ever
    ended (the usage event reached a client that did not ask for it, and no usage was
    read); an id, event name or comment line before the usage event let it through
    whenever a write ended inside it."""
    usage_event = lead + b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + end
    body = sse(EVENTS, end).replace(b"data: [DONE]", usage_event + b"data: [DONE]")
    meter = ResponseMeter(sse=True, strip=strip)
    passed = run(meter, body, cuts)
    assert passed == (sse(EVENTS, end) if strip else body)
    assert meter.usage == Usage(13, 4) and meter.events == 5


def test_json_usage_flat_nested_tail_bounded_and_the_last_one_wins():
    for usage in (USAGE, {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}}):
        meter = ResponseMeter(sse=False)
        body = orjson.dumps({"choices": [{"text": '"usage": {'}], "usage": usage})
        assert run(meter, body, [7, 30]) == body
        assert meter.usage == Usage(13, 4)
    meter = ResponseMeter(sse=False)
    big = orjson.dumps({"data": [[0.1] * 1000] * 50, "usage": USAGE})
    run(meter, big, list(range(0, len(big), 4096)))
    assert meter.usage == Usage(13, 4) and len(meter._carry) <= TAIL
    meter = ResponseMeter(sse=False)
    run(meter, b'{"x": {"usage": {"prompt_tokens": 1}}, "usage": {"prompt_tokens": 13, '
               b'"completion_tokens": 4, "d": {"a": "}"}}}', [])
    assert meter.usage == Usage(13, 4)


def test_an_answer_repeating_the_usage_key_costs_one_scan():
    """56,000 ``"usage":{`` keys (504 KB) took kvgate's event loop seconds per chunk in the
    full-duplex mode: every key was read to the chunk's end. Only the last few keys are
    read, each a bounded stretch; a real usage after junk keys is still found."""
    import time

    junk = b'{"x":' + b'"usage":{' * 56_000
    started = time.monotonic()
    meter = ResponseMeter(sse=False)
    run(meter, junk + b"}", list(range(0, len(junk), 65_536)))
    assert meter.usage is None and time.monotonic() - started < 2
    meter = ResponseMeter(sse=False)
    run(meter, junk[:900] + b'"usage": ' + orjson.dumps(USAGE) + b"}", [])
    assert meter.usage == Usage(13, 4)


def test_a_usage_only_event_with_null_usage_is_stripped_as_the_lua_meter_strips_it():
    meter = ResponseMeter(sse=True, strip=True)
    body = sse([{"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": None}])
    assert run(meter, body, []) == sse([{"choices": [{"delta": {"content": "hi"}}]}])
    assert meter.usage is None


def test_json_usage_missing_truncated_or_invalid_is_none():
    for body in (b'{"choices": []}', b'{"usage": {"prompt_tokens": 13, "completion',
                 b'{"usage": {"prompt_tokens": "13"}}', b"<html>bad gateway</html>"):
        meter = ResponseMeter(sse=False)
        run(meter, body, [])
        assert meter.usage is None, body


def test_continuous_usage_chunks_keep_their_choices():
    chunks = [{"choices": [{"delta": {"content": f"t{i} "}}],
               "usage": {"prompt_tokens": 13, "completion_tokens": i + 1}} for i in range(3)]
    final = {"choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 3}}
    meter = ResponseMeter(sse=True, strip=True)
    assert run(meter, sse([*chunks, final]), [40]) == sse(chunks)
    assert meter.usage == Usage(13, 3) and meter.events == 3


def _two_choices_with_running_usage() -> tuple[list[dict], dict]:
    """n = 2 with ``continuous_usage_stats``, as vLLM streams it: each chunk's usage counts
    its own choice; the usage-only event counts both."""
    chunks = [{"choices": [{"index": c, "delta": {"content": f"t{i} "}}],
               "usage": {"prompt_tokens": 13, "completion_tokens": i + 1}}
              for i in range(3) for c in (0, 1)]
    return chunks, {"choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 6}}


@pytest.mark.parametrize("cuts", [[], [45], [7, 300, 301]])
def test_several_choices_take_only_the_usage_only_events_usage(cuts):
    chunks, final = _two_choices_with_running_usage()
    meter = ResponseMeter(sse=True, final=True)
    assert run(meter, sse([*chunks, final]), cuts) == sse([*chunks, final])
    assert meter.usage == Usage(13, 6) and meter.events == 6
    # cut before the usage-only event (vLLM's error event, then [DONE]): no usage, so the
    # answer is charged its reservation, not the last chunk's count of one choice
    error = {"error": {"message": "engine failed", "code": 500}}
    meter = ResponseMeter(sse=True, final=True)
    run(meter, sse([*chunks, error]), cuts)
    assert meter.usage is None and meter.ended
    plain = ResponseMeter(sse=True)  # one choice: its running count is the answer's
    run(plain, sse([*chunks, error]), cuts)
    assert plain.usage == Usage(13, 3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 60_000), max_size=12))
def test_json_usage_before_long_fields_is_found_wherever_cut(cuts):
    """vLLM writes prompt_logprobs, prompt_token_ids and prompt_text after the usage, as
    long as the client makes them: the usage is still read, memory still bounded."""
    body = orjson.dumps({"choices": [{"text": "x"}], "usage": USAGE,
                         "prompt_token_ids": list(range(10_000)),
                         "prompt_text": '"usage": {"prompt_tokens": 1} ' * 300})
    meter = ResponseMeter(sse=False)
    assert run(meter, body, cuts) == body
    assert meter.usage == Usage(13, 4) and len(meter._carry) <= TAIL


def started_at(meter: ResponseMeter, pieces: list[bytes]) -> int | None:
    """The index of the piece after which the meter saw a stream's first token."""
    for i, piece in enumerate(pieces):
        meter.feed(piece)
        if meter.started:
            return i
    return None


def test_keep_alive_comments_and_lead_fields_are_no_first_token():
    """An engine (or a proxy) pings with SSE comments before the first token: the first
    chunk used to count, so the scheduler took prefill for done at the first ping. Only a
    data line starts the answer; comments, blank lines, id:/event:/retry: lines do not."""
    for pieces, first in (
            ([b": ping\n\n", b": ping\n\n", b'data: {"choices": []}\n\n'], 2),
            ([b"\n", b"\r\n", b"event: message\n", b"id: 7\r", b"retry: 10\n", b"data: {}"], 5),
            ([b": ping\n\nevent: message\ndata: {}\n\n"], 0),
            ([b": data: not a token\n\n", b"xdata: no\n", b"data: {}"], 2),
            ([b"data: {}\n\n"], 0)):
        for strip in (False, True):
            assert started_at(ResponseMeter(sse=True, strip=strip), pieces) == first, pieces
    meter = ResponseMeter(sse=True)
    assert started_at(meter, [b": ping\n\n", b": ping\n\n"]) is None
    meter.finish()
    assert not meter.started


def test_a_data_line_split_across_chunks_starts_the_answer_where_it_begins():
    """The first token is seen no later than the chunk in which its data line begins,
    wherever a write cuts "data:" (LF, CRLF or CR line ends, a CRLF itself cut)."""
    for lead in (b"", b": ping\n\n", b": ping\r\n\r\n", b": ping\r\r", b"event: x\n"):
        body = lead + b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
        begins = len(lead)
        for cut in range(1, len(body)):
            meter = ResponseMeter(sse=True)
            first = started_at(meter, [body[:cut], body[cut:]])
            assert first == (0 if cut > begins else 1), (lead, cut)
    # a chunk ending inside a line that is no data line does not start it
    assert started_at(ResponseMeter(sse=True), [b": pi", b"ng\n\n", b"da", b"ta: {}"]) == 2
    assert started_at(ResponseMeter(sse=True), [b": da", b"ta: x\n\n"]) is None


def test_a_json_answer_is_no_stream_and_starts_nothing():
    meter = ResponseMeter(sse=False)
    assert started_at(meter, [b'{"data: ": 1}', b"\ndata: x"]) is None


@pytest.mark.parametrize("end", [b"", b"\n", b"\r", b"\r\n", b"\n\r"])
@pytest.mark.parametrize("lead", [b"", b": ping\n", b"id: 7\r\n"])
def test_a_last_usage_event_without_its_blank_line_is_read_at_the_end(end, lead):
    """A stream that ended (end of stream) right after its usage event, without the blank
    line that ends an SSE event: the usage was never read (the tenant was charged its
    reservation). The body's end ends the event, read as if its blank line had come."""
    usage_event = lead + b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + end
    body = sse(EVENTS).removesuffix(b"data: [DONE]\n\n") + usage_event
    for strip in (False, True):
        for cut in (len(body) // 2, len(body) - len(end) - 3, len(body) - 1):
            meter = ResponseMeter(sse=True, strip=strip)
            passed = run(meter, body, [cut])
            assert meter.usage == Usage(13, 4) and meter.events == 5, (strip, cut)
            # stripped as it would have been with its blank line (as the Lua meter drops it)
            assert passed == (sse(EVENTS).removesuffix(b"data: [DONE]\n\n") if strip else body)


def test_a_last_content_event_without_its_blank_line_counts():
    body = sse(EVENTS).removesuffix(b"\n\ndata: [DONE]\n\n")
    meter = ResponseMeter(sse=True)
    run(meter, body, [len(body) - 4])
    assert meter.events == 5 and meter.usage is None


def test_a_cut_off_last_usage_event_is_not_read():
    """Conservative: only an event whose data is one whole JSON object is read at the
    end; a truncated one (a usage object whole, the document not) reads as no usage."""
    whole = b"data: " + orjson.dumps({"choices": [], "usage": USAGE, "id": "x"})
    for cut_at in (len(whole) - 1, len(whole) - 8, whole.index(b',"id"') + 2):
        for strip in (False, True):
            meter = ResponseMeter(sse=True, strip=strip)
            body = sse(EVENTS).removesuffix(b"data: [DONE]\n\n") + whole[:cut_at]
            passed = run(meter, body, [])
            assert meter.usage is None and meter.events == 5, (cut_at, strip)
            assert passed == body  # a half event the meter held goes on, as before
    for tail in (b"data: [DONE]", b"data: not json", b'data: {"usage": {}} trailing',
                 b"event: x\nid: 1", b": ping"):
        meter = ResponseMeter(sse=True)
        run(meter, sse(EVENTS).removesuffix(b"data: [DONE]\n\n") + tail, [])
        assert meter.usage is None and meter.events == 5, tail


LEADS = [b"event: message\n", b"id: 7\r\n", b": ping\r", b"id: 1\nevent: message\n: x\n"]


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("strip", [False, True])
def test_an_event_whose_data_follows_other_fields_counts(lead, strip):
    """An engine that puts an event:, id: or comment line before each event's data line:
    only an event that began with "data:" counted, so the estimate without usage (an
    error's charge) was 0. An event counts when any of its lines is a data line; [DONE]
    and the usage-only event still do not, nor an event with no data line."""
    events = [*EVENTS, {"choices": [], "usage": USAGE}]
    body = b"".join(lead + b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    body += b": ping\n\nevent: ping\n\n" + lead + b"data: [DONE]\n\n"
    for cut in range(0, len(body), 7):
        meter = ResponseMeter(sse=True, strip=strip)
        passed = run(meter, body, [cut, cut + 3])
        assert meter.events == 5 and meter.usage == Usage(13, 4), cut
        usage_event = lead + b"data: " + orjson.dumps(events[-1]) + b"\n\n"
        assert passed == (body.replace(usage_event, b"") if strip else body)


def test_data_on_a_later_line_of_a_long_event_counts_and_a_cut_carry_is_no_line_start():
    """An event longer than TAIL loses its start from the carry: whether that start had a
    data line is kept (read again at each cut until one is found); the carry's first
    bytes, cut mid-line, are no line's start."""
    later = b": " + b"x" * TAIL + b"\ndata: " + b"y" * (2 * TAIL) + b"\n\n"
    long_lead = b"event: message\ndata: " + b"y" * (2 * TAIL) + b"\n\n"
    # a comment line whose last TAIL bytes begin "data:": the carry starts there, mid-line
    mid_line = b": " + b"x" * 100 + b"data: " + b"y" * (TAIL - 6)
    for body, events in ((later, 1), (long_lead, 1), (mid_line + b"\n\n", 0)):
        for strip in (False, True):
            for step in (1000, 4096, TAIL + 1):
                meter = ResponseMeter(sse=True, strip=strip)
                cuts = list(range(step, len(body), step))
                if body.startswith(mid_line):
                    cuts = [len(mid_line)]  # all of it, then its blank line
                assert run(meter, body, cuts) == body
                assert meter.events == events, (body[:20], strip, step)


BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("strip", [False, True])
def test_a_byte_order_mark_at_the_streams_start_is_ignored_wherever_cut(strip):
    """SSE's decoder drops a UTF-8 byte order mark at the stream's start: the first data
    line after one was not recognised (no first token until the end, the event not
    counted). It passes on to the client, unread."""
    for lead in (b"", b": ping\n\n", b"event: message\n"):
        body = BOM + lead + sse([*EVENTS, {"choices": [], "usage": USAGE}])
        want = BOM + lead + sse(EVENTS) if strip else body
        for cut in range(1, 12):
            meter = ResponseMeter(sse=True, strip=strip)
            pieces = [body[:1], body[1:cut], body[cut:]]
            outs = []
            for piece in pieces:
                outs.append(meter.feed(piece))
                # started with the chunk in which the data line begins
                assert meter.started == (len(b"".join(pieces[: len(outs)]))
                                         > len(BOM + lead)), (lead, cut)
            assert b"".join(outs) + meter.finish() == want, (lead, cut)
            assert meter.events == 5 and meter.usage == Usage(13, 4), (lead, cut)
    # a stream that is one unterminated usage event after the mark: read at the end
    meter = ResponseMeter(sse=True, strip=strip)
    body = BOM + b"data: " + orjson.dumps({"choices": [], "usage": USAGE})
    assert run(meter, body, [2]) == (BOM if strip else body)
    assert meter.usage == Usage(13, 4)


@pytest.mark.parametrize("strip", [False, True])
def test_only_a_whole_byte_order_mark_at_the_very_start_is_ignored(strip):
    """A mark later in the stream, or the start of one that does not go on, is part of its
    line (which is then no data line), as an SSE client reads it."""
    one = sse([EVENTS[0]]).removesuffix(b"data: [DONE]\n\n")
    for body, events in ((one + BOM + sse([EVENTS[1]]), 1),
                         (BOM[:2] + sse(EVENTS[:2]), 1),
                         (BOM[:1] + b"\n" + sse(EVENTS[:2]), 2),
                         (BOM + BOM + sse(EVENTS[:2]), 1)):
        # where the first data line begins: the first line's, or the next event's
        begins = 0 if body.startswith(b"data:") else body.index(b"\ndata:") + 1
        for cut in range(1, 8):
            meter = ResponseMeter(sse=True, strip=strip)
            assert run(meter, body, [1, cut]) == body, (body[:8], cut)
            assert meter.events == events, (body[:8], cut)
            pieces = [body[:1], body[1:cut], body[cut:]]
            first = started_at(ResponseMeter(sse=True, strip=strip), pieces)
            assert first == (0 if begins < 1 else 1 if begins < cut else 2), (body[:8], cut)


# --- the usage read from the event's data (its data lines joined by LF); [DONE] as data ---

USAGE_EVENT = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [],
               "usage": USAGE}


def spread(document: dict, end: bytes = b"\n") -> bytes:
    """``document`` as one SSE event's data lines, a line per JSON member (an SSE client
    joins an event's data lines with LF: the same JSON, whitespace between its tokens).
    No line end after the last line."""
    parts = orjson.dumps(document).replace(b",", b",\n").split(b"\n")
    return end.join(b"data: " + part for part in parts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 700), max_size=8), st.booleans(),
       st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"]),
       st.sampled_from([b"", b"id: 7", b": data: not the data", b"event: data: x"]))
def test_a_usage_object_over_several_data_lines_is_read_and_stripped(cuts, strip, end, lead):
    """SSE joins an event's data lines with LF, a legal way to send JSON: the usage was
    read only from the first ``data:`` text anywhere in the event (then also one inside a
    comment, id: or event: line before it), so none was found and the tenant was charged
    its reservation."""
    line_end = end[: len(end) // 2]
    usage_event = (lead + line_end if lead else b"") + spread(USAGE_EVENT, line_end) + end
    body = sse(EVENTS, end).replace(b"data: [DONE]", usage_event + b"data: [DONE]")
    meter = ResponseMeter(sse=True, strip=strip)
    passed = run(meter, body, cuts)
    assert passed == (sse(EVENTS, end) if strip else body)
    assert meter.usage == Usage(13, 4) and meter.events == 5


@pytest.mark.parametrize("strip", [False, True])
def test_usage_text_outside_the_data_lines_is_no_usage(strip):
    """Only the event's data holds its usage: a comment, id: or event: line that mentions
    one is no usage (nor makes its event the usage-only one, stripped)."""
    for lead in (b': {"usage": {"prompt_tokens": 99, "completion_tokens": 1}}\n',
                 b'id: {"choices": [], "usage": {"prompt_tokens": 99}}\n',
                 b'event: "usage": {"prompt_tokens": 99}\r\n'):
        body = b"".join(lead + b"data: " + orjson.dumps(e) + b"\n\n" for e in EVENTS)
        meter = ResponseMeter(sse=True, strip=strip)
        assert run(meter, body, [len(body) // 2]) == body, lead
        assert meter.usage is None and meter.events == 5, lead
    # a usage object cut by a comment line between two data lines: still one object
    usage_event = spread(USAGE_EVENT).replace(b'\ndata: "usage"', b'\n: ping\ndata: "usage"')
    meter = ResponseMeter(sse=True, strip=strip)
    body = sse(EVENTS).replace(b"data: [DONE]", usage_event + b"\n\ndata: [DONE]")
    assert run(meter, body, []) == (sse(EVENTS) if strip else body)
    assert meter.usage == Usage(13, 4)


@pytest.mark.parametrize("strip", [False, True])
def test_only_an_event_whose_data_is_done_ends_the_stream(strip):
    """An event counted none when the text ``[DONE]`` was anywhere in it: a model quoting
    it, an id: or comment line. Only an event whose data is ``[DONE]`` (after the one
    optional space) is the end; one with more data counts as any data event."""
    quoting = [{"choices": [{"delta": {"content": text}}]}
               for text in ("[DONE]", "data: [DONE]\n\n", " [DONE] ")]
    counted = [b"data: " + orjson.dumps(e) + b"\n\n" for e in quoting] + [
        b"id: [DONE]\ndata: " + orjson.dumps(EVENTS[0]) + b"\n\n",
        b": [DONE]\r\ndata: " + orjson.dumps(EVENTS[1]) + b"\r\n\r\n",
        b"data:  [DONE]\n\n",  # its data is " [DONE]": one space only is dropped
        b"data: [DONE]\ndata: [DONE]\n\n"]  # "[DONE]\n[DONE]"
    ends = [b"data: [DONE]\n\n", b"data:[DONE]\r\r", b"event: end\r\ndata: [DONE]\r\n\r\n",
            b"id: 9\ndata: [DONE]"]  # the last without its blank line
    body = b"".join(counted) + b"".join(ends)
    for cut in range(0, len(body), 11):
        meter = ResponseMeter(sse=True, strip=strip)
        assert run(meter, body, [cut, cut + 5]) == body, cut
        assert meter.events == len(counted), cut


BAD_USAGES = [b'{"prompt_tokens": 7, "completion_tokens": x}',  # no JSON
              b'{"prompt_tokens": -7, "completion_tokens": 2}',  # no valid count
              b'{"prompt_tokens": "7"}']


@pytest.mark.parametrize("strip", [False, True])
def test_the_last_usage_object_read_is_the_engines_valid_or_not(strip):
    """An event (or a JSON answer) with several usage objects: the last complete one is the
    engine's (a JSON parser keeps the last of repeated keys), and one that is no valid
    usage is none: the meter fell back to an earlier valid one, where the Lua meter reports
    the last (kvgate reads none in it), so the two charged the same answer differently. A
    later event's usage replaces an earlier event's the same way."""
    good = orjson.dumps(USAGE)
    for bad in BAD_USAGES:
        for data, usage in ((b'{"choices": [], "usage": ' + good + b', "usage": ' + bad + b"}",
                             None),
                            (b'{"choices": [], "usage": ' + bad + b', "usage": ' + good + b"}",
                             Usage(13, 4))):
            body = sse(EVENTS).replace(b"data: [DONE]", b"data: " + data + b"\n\ndata: [DONE]")
            meter = ResponseMeter(sse=True, strip=strip)
            assert run(meter, body, [len(body) // 2]) == (sse(EVENTS) if strip else body)
            assert meter.usage == usage and meter.events == 5, data
            meter = ResponseMeter(sse=False)
            run(meter, data, [len(data) - 40])
            assert meter.usage == usage, data
        # an event's valid usage (continuous usage), then the usage event's invalid one
        later = [{**EVENTS[0], "usage": USAGE}]
        body = sse(later).replace(b"data: [DONE]", b'data: {"choices": [], "usage": ' + bad
                                  + b"}\n\ndata: [DONE]")
        meter = ResponseMeter(sse=True, strip=strip)
        run(meter, body, [])
        assert meter.usage is None and meter.events == 1, bad


def test_a_usage_event_that_mentions_done_is_held_and_stripped_wherever_split():
    """An unfinished event with ``[DONE]`` anywhere in it went on at once, taken for the
    end: a usage-only event that mentions it reached the client whenever the engine's
    writes split it past the mention. Only an event whose data is ``[DONE]`` is the end."""
    head = sse(EVENTS).removesuffix(b"data: [DONE]\n\n")
    usage_event = b"data: " + orjson.dumps({**USAGE_EVENT, "id": "[DONE]"}) + b"\n\n"
    body = head + usage_event + b"data: [DONE]\n\n"
    for cut in range(len(head) + 1, len(head) + len(usage_event)):
        meter = ResponseMeter(sse=True, strip=True)
        assert run(meter, body, [cut]) == head + b"data: [DONE]\n\n", cut
        assert meter.usage == Usage(13, 4) and meter.events == 5, cut
    meter = ResponseMeter(sse=True, strip=True)
    assert meter.feed(b"data: [DONE]\r") == b"data: [DONE]\r"  # the end: on at once


def test_the_usage_at_the_end_of_an_event_longer_than_the_carry_is_read():
    """A data line longer than the carry (continuous usage with a long chunk) loses its
    start, "data:" included: its usage, at its end, is still in the data read (as the Lua
    meter reads it)."""
    long = {"choices": [{"delta": {"content": "y" * (2 * TAIL)}}], "usage": USAGE}
    for lead in (b"", b"id: 7\n"):
        for body in (lead + sse([long]), lead + spread(long) + b"\n\n"):
            for strip in (False, True):
                for step in (1000, 4096, TAIL + 1, len(body)):
                    meter = ResponseMeter(sse=True, strip=strip)
                    assert run(meter, body, list(range(step, len(body), step))) == body
                    assert meter.usage == Usage(13, 4), (lead, strip, step)
                    assert meter.events == 1, (lead, strip, step)


# --- random streams: the Python meter's result does not depend on where writes split them
# (the e2e suite feeds the same streams to Envoy's Lua meter and compares the two) ---

STREAM_LEADS = [b"id: 7", b"event: message", b": ping", b"retry: 10", b": data: x",
                b'id: data: {"usage": {"prompt_tokens": 99, "completion_tokens": 1}}',
                b': {"choices": [], "usage": {"prompt_tokens": 99, "completion_tokens": 1}}',
                b"id: [DONE]", b": [DONE]"]
# a usage object after the usage event's own: no JSON, no valid counts, a valid one
LATER_USAGES = [b'{"prompt_tokens":7,"completion_tokens":x}',
                b'{"prompt_tokens":-7,"completion_tokens":2}',
                b'{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}']
CONTENTS = ["t ", "[DONE]", "data: [DONE]", '"usage": {"prompt_tokens": 1}', "a\nb", "",
            "data: x\n\n"]


def random_stream(rng) -> bytes:
    """An SSE stream as an engine, or a proxy in front of it, may write one: LF, CRLF or
    CR line ends (one kind, or mixed), id:, event:, retry: and comment lines (some that
    mention data:, a usage or [DONE]), data over several lines, tokens that quote
    ``[DONE]``, a long event now and then, the usage event or none (now and then with a
    second usage object after its own: invalid or not, it is the one read), the end
    sentinel or none, a last event without its blank line, a byte order mark."""
    style = rng.choice([b"\n", b"\r\n", b"\r", None])
    last = [b""]

    def end() -> bytes:
        """A line end; mixed ones never CR then LF (that is one CRLF: two events joined)."""
        last[0] = style or rng.choice([b"\r\n", b"\r"] if last[0] == b"\r"
                                      else [b"\n", b"\r\n", b"\r"])
        return last[0]

    def event(document: dict | bytes) -> bytes:
        lines = [rng.choice(STREAM_LEADS) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
        data = document if isinstance(document, bytes) else orjson.dumps(document)
        parts = data.replace(b",", b",\n").split(b"\n")  # JSON: commas inside no string
        if rng.random() < 0.6:
            parts = [b"".join(parts)]
        else:  # a line per member, some lines joined again
            joined = [parts[0]]
            for part in parts[1:]:
                if rng.random() < 0.5:
                    joined[-1] += part
                else:
                    joined.append(part)
            parts = joined
        data_lines = [b"data:" + rng.choice([b" ", b" ", b""]) + part for part in parts]
        if len(data_lines) > 1 and rng.random() < 0.3:  # a comment between data lines
            data_lines.insert(rng.randrange(1, len(data_lines)), b": between")
        return b"".join(line + end() for line in lines + data_lines) + end()

    usage = {"prompt_tokens": rng.randint(0, 5000), "completion_tokens": rng.randint(0, 500)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if rng.random() < 0.3:
        usage["prompt_tokens_details"] = {"cached_tokens": 0}
    out = [b"\xef\xbb\xbf"] if rng.random() < 0.1 else []
    for i in range(rng.randint(0, 5)):
        content = rng.choice(CONTENTS) + str(i)
        if rng.random() < 0.05:
            content += "y" * rng.choice([5000, 20000])
        document: dict = {"id": "c", "choices": [{"index": 0, "delta": {"content": content}}]}
        if rng.random() < 0.15:  # continuous usage stats
            document["usage"] = dict(usage, completion_tokens=i + 1)
        out.append(event(document))
    if rng.random() < 0.7:
        final = orjson.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [],
                              "usage": usage})
        if rng.random() < 0.2:  # the key again: the last one is the engine's, valid or not
            final = final[:-1] + b',"usage":' + rng.choice(LATER_USAGES) + b"}"
        out.append(event(final))
    if rng.random() < 0.8:
        out.append(event(rng.choice([b"[DONE]", b"[DONE]", b" [DONE]", b"[DONE] x"])))
    body = b"".join(out) or b": ping\n\n"
    if rng.random() < 0.2:  # the last event without its blank line (or its line's end)
        body = body.rstrip(b"\r\n") + rng.choice([b"", b"\n", b"\r"])
    return body or b": ping"


def random_cuts(rng, body: bytes) -> list[int]:
    return sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 6))))


def metered(body: bytes, cuts: list[int], strip: bool, final: bool = False) -> tuple:
    """What the Python meter makes of ``body`` written in pieces split at ``cuts``: the
    bytes passed on as the pieces came, those ``finish`` passes on at the end (the Lua
    meter cannot: it drops them), the usage, the events, whether a first token was seen."""
    meter = ResponseMeter(sse=True, strip=strip, final=final)
    edges = [0, *cuts, len(body)]
    passed = b"".join(meter.feed(body[a:b]) for a, b in itertools.pairwise(edges))
    return passed, meter.finish(), meter.usage, meter.events, meter.started


@pytest.mark.parametrize("seed", range(300))
def test_a_random_stream_is_metered_alike_however_split(seed):
    import random

    rng = random.Random(seed)
    body, strip = random_stream(rng), rng.random() < 0.5
    whole = metered(body, [], strip)
    for _ in range(3):
        assert metered(body, random_cuts(rng, body), strip) == whole, body
    if not strip:
        assert whole[0] + whole[1] == body


def test_an_event_repeating_the_usage_key_costs_one_scan():
    """The bound on ``"usage":{`` keys holds for an SSE event's data too, one data line or
    one per key (the lines joined once, then one scan), whole or in pieces."""
    import time

    for body in (b'data: {"x":' + b'"usage":{' * 56_000 + b"}\n\n",
                 b'data: {"x":\n' + b'data: "usage":{\n' * 56_000 + b"data: }\n\n"):
        for cuts in ([], list(range(65_536, len(body), 65_536))):
            for strip in (False, True):
                started = time.monotonic()
                meter = ResponseMeter(sse=True, strip=strip)
                assert run(meter, body, cuts) == body
                assert meter.usage is None and time.monotonic() - started < 2


# --- line ends split across writes: the search for an event's end goes on where the last
# one left off (a long event of short lines is scanned once, not once a write) ---

SOUP = [b"\r", b"\n", b"\r\n", b"data: a", b": c", b"id: 1"]
SOUP_USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}'
SHORT_LINES = [b": c\r", b": c\n", b"id: 1\r\n", b"data: a\r"]


def line_end_soup(rng) -> bytes:
    """Lines and line ends (LF, CRLF, CR, blank lines of each, mixed) in any order, now and
    then an event of short lines longer than the meter's carry: where a CRLF or a blank line
    straddles a write, a scan that goes on where the last one stopped must find what a scan
    of the whole carry finds. What the meter makes of one does not depend on the writes (the
    e2e suite compares Envoy's meter, which may join writes): a long event holds no usage
    (which a long event's cut carry may lose)."""
    long = rng.random() < 0.3
    parts = [rng.choice(SOUP if long else [*SOUP, SOUP_USAGE])
             for _ in range(rng.randint(1, 40))]
    if long:
        parts.insert(rng.randrange(len(parts) + 1),
                     rng.choice(SHORT_LINES) * rng.choice([800, 2500]))
    return b"".join(parts)


def line_end_cuts(rng, body: bytes, most: int = 8) -> list[int]:
    """Writes cut at, one past or two past a line end of ``body``."""
    ends = [i for i, c in enumerate(body) if c in b"\r\n"] or [1]
    at = {i + rng.choice([0, 1, 2]) for i in rng.sample(ends, min(len(ends), rng.randint(1, most)))}
    return sorted(at & set(range(1, len(body))))


@pytest.mark.parametrize("seed", range(200))
def test_a_scan_that_goes_on_finds_what_a_rescan_finds(seed, monkeypatch):
    """Whatever the writes, the meter's result is the one it had when every write's scan
    began at its carry's start (``_resume_at`` giving the event's start: the old rescan):
    one-byte writes, and writes cut at, one past or two past a line end. Lines no SSE
    field begins and lines longer than the carry are in the soup too."""
    import random

    import extproc.meter

    rng = random.Random(seed)
    body, strip = line_end_soup(rng), rng.random() < 0.5
    if rng.random() < 0.5:
        at = rng.randrange(len(body) + 1)
        body = body[:at] + rng.choice([b"x", b"x\r", b"y" * (HOLD + 10), b"y" * (TAIL + 10)]) \
            + body[at:]
    # one-byte writes (of a short body: a long one, 200 writes next to line ends)
    splits = [list(range(1, len(body))) if len(body) < 2000 else line_end_cuts(rng, body, 200),
              []]
    splits += [line_end_cuts(rng, body) for _ in range(3)]
    resume_at = extproc.meter._resume_at
    for cuts in splits:
        monkeypatch.setattr(extproc.meter, "_resume_at", lambda text, pos: pos)
        rescanned = metered(body, cuts, strip)
        monkeypatch.setattr(extproc.meter, "_resume_at", resume_at)
        assert metered(body, cuts, strip) == rescanned, (body, cuts)


@pytest.mark.parametrize("seed", range(200))
def test_a_line_end_soup_is_metered_alike_however_split(seed):
    import random

    rng = random.Random(seed)
    body, strip = line_end_soup(rng), rng.random() < 0.5
    whole = metered(body, [], strip)
    for cuts in (line_end_cuts(rng, body, 30), random_cuts(rng, body)):
        assert metered(body, cuts, strip) == whole, (body, cuts)
