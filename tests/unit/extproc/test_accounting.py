"""Reading usage off responses: JSON tails, SSE streams split anywhere, bounded memory."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.accounting import TAIL_BYTES, ResponseMeter
from extproc.openai import Usage

USAGE = {"prompt_tokens": 13, "completion_tokens": 4, "total_tokens": 17}


def sse(events: list[dict]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_json_usage_flat_and_nested():
    for usage in (USAGE, {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}}):
        meter = ResponseMeter(stream=False, strip_usage_event=False)
        meter.feed(orjson.dumps({"choices": [{"text": '"usage": {'}], "usage": usage}))
        meter.finish()
        assert meter.usage == Usage(13, 4)


def test_large_json_keeps_only_a_bounded_tail():
    meter = ResponseMeter(stream=False, strip_usage_event=False)
    body = orjson.dumps({"data": [[0.1] * 1000] * 200, "usage": USAGE})
    for i in range(0, len(body), 4096):
        meter.feed(body[i : i + 4096])
    meter.finish()
    assert meter.usage == Usage(13, 4)
    assert len(meter._tail) <= TAIL_BYTES


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), max_size=8))
def test_stream_split_anywhere_counts_events_and_finds_usage(cuts):
    events = [{"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(5)]
    body = sse([*events, {"choices": [], "usage": USAGE}])
    meter = ResponseMeter(stream=True, strip_usage_event=False)
    start = 0
    for cut in [*sorted({min(c, len(body)) for c in cuts}), len(body)]:
        meter.feed(body[start:cut])
        start = cut
    assert meter.usage == Usage(13, 4)
    assert meter.events == 5


def test_injected_usage_event_is_removed_from_its_chunk():
    meter = ResponseMeter(stream=True, strip_usage_event=True)
    chunk = sse([{"choices": [{"delta": {"content": "a"}}]}, {"choices": [], "usage": USAGE}])
    out = meter.feed(chunk)
    assert out is not None and b"usage" not in out and out.endswith(b"data: [DONE]\n\n")
    assert meter.usage == Usage(13, 4)


def test_json_usage_missing_truncated_or_invalid_is_none():
    for body in (b'{"choices": []}', b'{"usage": {"prompt_tokens": 13, "completion',
                 b'{"usage": {"prompt_tokens": 13,}}', b'{"usage": {"prompt_tokens": "13"}}',
                 b'{"usage": {"nested": {"prompt_tokens": 1}'):
        meter = ResponseMeter(stream=False, strip_usage_event=False)
        meter.feed(body)
        meter.finish()
        assert meter.usage is None, body


def test_json_usage_spacing_and_the_last_one_wins():
    meter = ResponseMeter(stream=False, strip_usage_event=False)
    meter.feed(b'{"x": {"usage" :{"prompt_tokens": 1}}, "usage"\n:\t{"prompt_tokens": 13, '
               b'"completion_tokens": 4, "d": {"a": "}"}}}')
    meter.finish()
    assert meter.usage == Usage(13, 4)


def test_a_whole_json_first_chunk_completes_the_response():
    """Nothing valid can follow a complete JSON object: kvgate needs no more of the body."""
    meter = ResponseMeter(stream=False, strip_usage_event=False)
    meter.feed(orjson.dumps({"choices": [], "usage": USAGE, "kv_transfer_params": None}) + b"\n")
    assert meter.complete and meter.usage == Usage(13, 4)


def test_a_partial_or_non_json_body_waits_for_its_end():
    body = orjson.dumps({"choices": [{"text": "}"}], "usage": USAGE})
    for first in (body[:20], body[:-1], b"<html>bad gateway</html>", b"[1, 2]"):
        meter = ResponseMeter(stream=False, strip_usage_event=False)
        meter.feed(first)
        assert not meter.complete, first
    meter = ResponseMeter(stream=False, strip_usage_event=False)
    meter.feed(body[:20])
    meter.feed(body[20:])  # only a first chunk is tried whole: the tail still finds usage
    meter.finish()
    assert not meter.complete and meter.usage == Usage(13, 4)


def test_a_stream_is_complete_at_its_done_event():
    meter = ResponseMeter(stream=True, strip_usage_event=False)
    meter.feed(b'data: {"choices":[]}\n\n')
    assert not meter.complete
    meter.feed(b"data: [DONE]\n\n")
    assert meter.complete


def test_continuous_usage_chunks_keep_their_choices():
    """``stream_options.continuous_usage_stats``: vLLM puts usage on every chunk once kvgate
    asks for the usage chunk; only the final usage-only chunk (``choices: []``), the one
    kvgate asked for, may go — every chunk with choices reaches the client."""
    meter = ResponseMeter(stream=True, strip_usage_event=True)
    chunks = [{"choices": [{"delta": {"content": f"t{i} "}}],
               "usage": {"prompt_tokens": 13, "completion_tokens": i + 1}} for i in range(3)]
    final = {"choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 3}}
    body = sse([*chunks, final])
    passed = meter.feed(body)
    kept = body if passed is None else passed
    assert kept == sse(chunks)
    assert meter.usage == Usage(13, 3) and meter.events == 3 and meter.complete
