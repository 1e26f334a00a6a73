"""Reading the real token usage off a response as it streams past.

Envoy hands kvgate the response body chunk by chunk (STREAMED mode). kvgate keeps only a
bounded tail, never the whole body, and parses JSON only for the one piece that carries
``usage``: an embeddings response can be megabytes, a chat stream thousands of chunks.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from extproc.openai import Usage, usage_from, usage_of

TAIL_BYTES = 8192
WHOLE_BODY_BYTES = 16384  # a first chunk up to this size is tried as the whole body
_USAGE_PRESENT = re.compile(rb'"usage"\s*:\s*\{')


class ResponseMeter:
    """Follows one response body; ``usage`` is set once the engine reports it.

    For streams whose usage chunk kvgate itself asked for, ``feed`` returns the chunk with
    that event (usage only, ``choices: []``) removed so the client sees the stream it
    requested; chunks with choices always pass (with ``continuous_usage_stats`` each carries
    usage too: the client asked for that).
    """

    __slots__ = ("_tail", "bytes", "complete", "events", "stream", "strip_usage_event", "usage")

    def __init__(self, *, stream: bool, strip_usage_event: bool):
        self.stream = stream
        self.strip_usage_event = strip_usage_event
        self.usage: Usage | None = None
        self.events = 0  # SSE data events seen: ~ one token each, used if usage never arrives
        self.bytes = 0
        self.complete = False  # the whole body has been seen: kvgate needs no more of it
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes | None:
        """Account for one chunk; returns replacement bytes when the chunk must change."""
        first = not self.bytes
        self.bytes += len(chunk)
        if self.stream:
            return self._feed_sse(chunk)
        if first and len(chunk) <= WHOLE_BODY_BYTES and chunk.rstrip().endswith(b"}"):
            self._read_whole(chunk)
            if self.complete:
                return None
        self._tail = (self._tail + chunk)[-TAIL_BYTES:]
        return None

    def _read_whole(self, chunk: bytes) -> None:
        """A first chunk that is a whole JSON object is the whole body (nothing valid can
        follow one): its usage is final, and kvgate can stop reading the response."""
        try:
            document = orjson.loads(chunk)
        except orjson.JSONDecodeError:
            return
        if isinstance(document, dict):
            self.complete = True
            self.usage = usage_from(document)

    def finish(self) -> None:
        """End of body: a JSON response carries its usage near the end."""
        if not self.stream and self.usage is None:
            # the last one: the response's own usage, after any nested documents
            obj = _last_usage_object(self._tail)
            if obj is not None:
                self.usage = _parse_usage_object(obj)

    def _feed_sse(self, chunk: bytes) -> bytes | None:
        data = self._tail + chunk
        complete, sep, partial = data.rpartition(b"\n\n")
        self._tail = partial[-TAIL_BYTES:]
        if not sep:
            return None
        events = complete.split(b"\n\n")
        usage_only: list[bytes] = []  # the final chunk of include_usage: choices []
        for event in events:
            if _USAGE_PRESENT.search(event):
                document = _document(event.removeprefix(b"data:").strip())
                self.usage = usage_from(document) or self.usage
                if isinstance(document, dict) and document.get("choices") == []:
                    usage_only.append(event)
        # with continuous_usage_stats every chunk carries usage: those are tokens too
        self.events += sum(
            1 for e in events if e.startswith(b"data:") and b"[DONE]" not in e
        ) - len(usage_only)
        if events[-1].startswith(b"data: [DONE]"):
            self.complete = True  # the stream's last event
        if not (usage_only and self.strip_usage_event):
            return None
        return _without(chunk, usage_only)


def _last_usage_object(data: bytes) -> bytes | None:
    """The last ``"usage": {…}`` object (searching back from the end), if it is complete."""
    at = data.rfind(b'"usage"')
    while at != -1:
        match = _USAGE_PRESENT.match(data, at)
        if match:
            start = match.end() - 1
            # the usual usage object holds no nested object: it ends at the first brace
            end = data.find(b"}", start)
            inner = data.find(b"{", start + 1)
            if end != -1 and not -1 < inner < end:
                return data[start : end + 1]
            return _balanced_object(data, start)
        at = data.rfind(b'"usage"', 0, at)
    return None


def _document(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _parse_usage_object(obj: bytes) -> Usage | None:
    """The ``usage`` object itself (no need to wrap it in a document to reuse usage_from)."""
    try:
        return usage_of(orjson.loads(obj))
    except orjson.JSONDecodeError:
        return None


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
