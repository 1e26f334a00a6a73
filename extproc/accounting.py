"""Reading the real token usage off a response as it streams past.

Envoy hands kvgate the response body chunk by chunk (STREAMED mode). kvgate keeps only a
bounded tail, never the whole body, and parses JSON only for the one piece that carries
``usage``: an embeddings response can be megabytes, a chat stream thousands of chunks.
"""

from __future__ import annotations

import re

import orjson

from extproc.openai import Usage, usage_from

TAIL_BYTES = 8192
_USAGE_PRESENT = re.compile(rb'"usage"\s*:\s*\{')


class ResponseMeter:
    """Follows one response body; ``usage`` is set once the engine reports it.

    For streams whose usage chunk kvgate itself asked for, ``feed`` returns the chunk with
    that event removed so the client sees exactly the stream it requested.
    """

    def __init__(self, *, stream: bool, strip_usage_event: bool):
        self.stream = stream
        self.strip_usage_event = strip_usage_event
        self.usage: Usage | None = None
        self.events = 0  # SSE data events seen: ~ one token each, used if usage never arrives
        self.bytes = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes | None:
        """Account for one chunk; returns replacement bytes when the chunk must change."""
        self.bytes += len(chunk)
        if self.stream:
            return self._feed_sse(chunk)
        self._tail = (self._tail + chunk)[-TAIL_BYTES:]
        return None

    def finish(self) -> None:
        """End of body: a JSON response carries its usage near the end."""
        if not self.stream and self.usage is None:
            # the last one: the response's own usage, after any nested documents
            start = _last_usage_object(self._tail)
            if start is not None:
                obj = _flat_object(self._tail, start) or _balanced_object(self._tail, start)
                self.usage = obj and _parse_usage(b'{"usage":' + obj + b"}")

    def _feed_sse(self, chunk: bytes) -> bytes | None:
        data = self._tail + chunk
        complete, sep, partial = data.rpartition(b"\n\n")
        self._tail = partial[-TAIL_BYTES:]
        if not sep:
            return None
        events = complete.split(b"\n\n")
        usage_events = [e for e in events if _USAGE_PRESENT.search(e)]
        self.events += sum(
            1 for e in events if e.startswith(b"data:") and b"[DONE]" not in e
        ) - len(usage_events)
        for event in usage_events:
            self.usage = _parse_usage(event.removeprefix(b"data:").strip()) or self.usage
        if not (usage_events and self.strip_usage_event):
            return None
        return _without(chunk, usage_events)


def _last_usage_object(data: bytes) -> int | None:
    """Where the last ``"usage": {`` object starts (searching back from the end)."""
    at = data.rfind(b'"usage"')
    while at != -1:
        match = _USAGE_PRESENT.match(data, at)
        if match:
            return match.end() - 1
        at = data.rfind(b'"usage"', 0, at)
    return None


def _parse_usage(document: bytes) -> Usage | None:
    try:
        return usage_from(orjson.loads(document))
    except orjson.JSONDecodeError:
        return None


def _flat_object(data: bytes, start: int) -> bytes | None:
    """The object at ``start`` when it holds no nested object (the usual ``usage``)."""
    end = data.find(b"}", start)
    inner = data.find(b"{", start + 1)
    if end == -1 or -1 < inner < end:
        return None
    return data[start : end + 1]


def _balanced_object(data: bytes, start: int) -> bytes | None:
    """``data[start:]`` up to the brace that closes the one at ``start`` (strings honoured)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(data)):
        c = data[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == 0x5C, c != 0x22)
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return data[start : i + 1]
    return None


def _without(chunk: bytes, events: list[bytes]) -> bytes | None:
    """The chunk minus the usage events that lie wholly inside it."""
    for event in events:
        whole = event + b"\n\n"
        if whole in chunk:
            chunk = chunk.replace(whole, b"", 1)
    return chunk
