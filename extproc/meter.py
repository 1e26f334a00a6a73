"""Reading a response as it passes through kvgate itself: ``meter.lua``'s twin in Python.

In kvgate's own Envoy configuration the response never reaches kvgate (the Lua meter reads
it inside Envoy). Behind a Gateway API Inference Extension gateway there is no Lua meter:
the gateway sends kvgate every response chunk (``FULL_DUPLEX_STREAMED``) and kvgate sends
each one back (``extproc/duplex.py``), reading it on the way with this meter: the first
chunk of a stream that carries a token (the start of a data line: SSE comments such as a
proxy's ``: ping`` keep-alives are none), the engine's usage, the data events, the end.
Memory stays bounded (a tail of the body, never all of it).

With ``strip`` it also removes the usage-only event kvgate asked the engine for when the
client did not ask for it. With ``final`` (a request for several choices, ``n`` > 1) only
the usage-only event's usage counts: a chunk's running usage counts its own choice. An
unfinished event is held back only while stripping, only up to its end (what an SSE client
waits for anyway), and only while it may still be that small usage event (short, SSE field
lines, no choice in it yet). Events end at a blank line, with
LF, CRLF or CR line ends, as in the Lua meter, and at the body's end: a last event whose
blank line never came is read as if it had, when its data is one whole JSON object. An
event counts (``events``) when any of its lines is a data line, whatever id:, event: or
comment lines come before it, unless its data is ``[DONE]`` (the end: a token that quotes
it counts). An event's usage is read from its data (its data lines' values joined by LF, as
an SSE client joins them: a usage object may span lines; comment, id: and event: lines hold
none), as in the Lua meter. The engine's usage is the last complete usage object read (of
an event's data, of the stream, of a JSON body): one that is no valid usage leaves none (as
if none had come), never an earlier object's count, as the Lua meter's report of it does.
A UTF-8 byte order mark at the stream's very start is no part of its first line (an SSE
client drops it): it passes on, unread. The search for an event's end
goes on where the last chunk's stopped (a long event of short lines is scanned once).
"""

from __future__ import annotations

import re
from collections import deque

import orjson

from extproc.openai import Usage, usage_of

TAIL = 8192  # bytes of an unfinished SSE event, or of the JSON read so far, kept
HOLD = 4096  # an unfinished event longer than this is no usage event: never held
# a usage object's bytes at most, and the "usage" keys read per piece of text (the last ones)
USAGE_MAX, USAGE_TRIES = 4096, 4
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_SOME_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*[^\]\s]')
# an event ends at a blank line: a line end right after another, SSE's line ends being LF,
# CRLF and CR alone (mixed); a CR that ends the text read so far may be half a CRLF: no end yet
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?=[^\n])|\n)")
# the lines an event may open with: its data, and the id, event name, retry or comment lines
# an engine may put before it
_FIELDS = (b"data:", b"id:", b"event:", b"retry:", b":")
_DATA = b"data:"
_DONE = b"[DONE]"  # the data of the event that ends an OpenAI stream
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark: SSE's decoder drops one at the stream's start
_LINES = re.compile(rb"\r\n|\r|\n")


class ResponseMeter:
    """Follows one response body: ``feed`` each chunk (it returns the bytes to pass on),
    then ``finish`` (the bytes still held back). ``usage`` is the engine's own count once
    it gave one; ``events`` the SSE data events with tokens (the estimate without it);
    ``started`` whether a stream's first data line has begun (the engine has prefilled);
    ``ended`` whether its ``[DONE]`` event has passed (a client may hang up at once, before
    the body's end: openai-python does). ``readable=False`` (a compressed answer, as the
    Lua meter takes one): nothing is read or stripped, and a stream's first chunk stands for
    its first token."""

    __slots__ = ("_bom", "_carry", "_fresh", "_lost", "_scan", "_sent", "ended", "events",
                 "final", "readable", "sse", "started", "strip", "usage")

    def __init__(self, *, sse: bool, strip: bool = False, readable: bool = True,
                 final: bool = False):
        self.sse = sse
        self.readable = readable
        self.strip = sse and strip and readable
        # several choices (n > 1): only the usage-only event's usage is the whole answer's
        self.final = final
        self.usage: Usage | None = None
        self.events = 0
        self._carry = b""  # the unfinished event (SSE), or the body's last TAIL bytes (JSON)
        self._sent = 0  # leading bytes of the carry already passed on (stripping)
        self._scan = 0  # where in the carry the search for its event's end goes on
        # once an unfinished event's carry was cut: whether the start it lost had a data line
        self._lost: bool | None = None
        self.started = False
        self.ended = False
        self._fresh = True  # the next chunk starts a line (until started)
        self._bom: int | None = 0  # a byte order mark's bytes seen (None: the start is past)

    def feed(self, chunk: bytes) -> bytes:
        if not self.readable:
            self.started = self.started or (self.sse and bool(chunk))
            return chunk
        if not self.sse:
            # vLLM writes fields after the usage (prompt_logprobs, prompt_text, token ids)
            # that a client can make far longer than TAIL: read every chunk, not the end
            text = self._carry + chunk
            self._note_usage(text)
            self._carry = text[-TAIL:]
            return chunk
        lead = b""  # a byte order mark's bytes in this chunk: passed on, never read
        if self._bom is not None and chunk:
            lead, chunk = self._skip_bom(chunk)
        if not self.started and chunk:
            self.started = _opens_data(chunk, self._fresh)
            self._fresh = chunk[-1] in b"\r\n"
        text = self._carry + chunk
        sent = self._sent  # leading bytes of ``text`` the client already has
        out: list[bytes] = [lead]
        pos = 0
        # the carry was looked at up to _scan: the first event's end is not before it
        for blank in _EVENT_END.finditer(text, self._scan):
            event = text[pos : blank.start()]
            usage_only = self._read_event(event, self._lost if pos == 0 else None)
            if self.strip and not (usage_only and sent <= pos):
                out.append(text[max(pos, sent) : blank.end()])
            pos = blank.end()
        partial = text[pos:]
        scan = _resume_at(text, pos) - pos  # in ``partial``; less what a cut takes
        if pos:
            self._lost = None
        if len(partial) > TAIL and not self._lost:  # its carry loses its start: note a data line
            self._lost = _has_data(partial, whole=self._lost is None)
        if not self.strip:
            self._carry = partial[-TAIL:]
            self._scan = max(0, scan - (len(partial) - len(self._carry)))
            return lead + chunk
        partial_sent = max(0, sent - pos)
        if len(partial) > HOLD or not _may_be_usage(partial):  # on at once
            out.append(partial[partial_sent:])
            partial_sent = len(partial)
            if len(partial) > TAIL:
                scan = max(0, scan - (len(partial) - TAIL))
                partial, partial_sent = partial[-TAIL:], TAIL
        self._carry, self._sent, self._scan = partial, partial_sent, scan
        return b"".join(out)

    def _skip_bom(self, chunk: bytes) -> tuple[bytes, bytes]:
        """The stream's first bytes: a byte order mark there (which an SSE client drops) is
        no part of its first line. ``chunk`` split into the mark's bytes and the rest."""
        seen = self._bom or 0
        n = min(len(chunk), len(_BOM) - seen)
        if chunk[:n] != _BOM[seen : seen + n]:
            self._bom = None
            # no mark after all: the bytes taken for one begin the first line, passed on
            self._carry, self._scan = _BOM[:seen], 0
            self._sent = seen if self.strip else 0
            self._fresh = not seen
            return b"", chunk
        self._bom = seen + n if seen + n < len(_BOM) else None
        return chunk[:n], chunk[n:]

    def _read_event(self, event: bytes, lost: bool | None) -> bool:
        """Note one whole event; True when it is the usage-only event to strip. ``lost``:
        None when ``event`` is whole, else whether the start its carry lost had a data line.
        """
        usage_only, data = False, None
        if b'"usage"' in event:  # else its data has none either: read no further
            data = _data(event, lost)
            if b'"usage"' in data:
                # the usage-only event as the Lua meter knows it: no choices, whatever its
                # usage; the usage read as a JSON answer's is (its last few keys, bounded)
                usage_only = _NO_CHOICES.search(data) is not None
                if usage_only or not self.final:  # else one choice's running count
                    self._note_usage(data)
        if not usage_only and (lost or _has_data(event, whole=lost is None)):
            if _is_done(event, lost, data):
                self.ended = True
            else:
                self.events += 1
        return usage_only

    def _note_usage(self, text: bytes) -> None:
        """The last complete usage object in ``text`` (if any) is the engine's count, and
        replaces any read before: one that is no valid usage leaves none (the request is
        charged as if none came), as the Lua meter's report of it does: no earlier one,
        which a JSON parser would have overwritten, or the engine's later count replaced."""
        found = _last_usage(text)
        if found is not None:
            self.usage = _usage(found)

    def finish(self) -> bytes:
        """The end of the body. It ends the last event too: an engine's usage event with no
        blank line after it is read (and stripped) as if it had one, provided its data is
        one whole JSON object (a cut-off one is no usage). Otherwise a held-back fragment
        goes on (an SSE client drops half an event, as it would have)."""
        if not self.sse or not self.readable:
            return b""
        event, sent = self._carry, self._sent
        held = event[sent:] if self.strip else b""
        # an event longer than TAIL lost its start: it cannot be told whole
        if event and self._lost is None and _whole_object(event):
            usage_only = self._read_event(event, None)
            if usage_only and self.strip and sent == 0:
                held = b""
        self._carry, self._sent, self._scan = b"", 0, 0
        return held


def _resume_at(text: bytes, pos: int) -> int:
    """Where the search for an event's end goes on once more bytes follow ``text``, in
    which none was found from ``pos``: a blank line the next bytes complete begins at one of
    its last three bytes at the earliest (its first line end a CRLF, its second a CR that may
    be half of one), so a long event of short lines is scanned once, not once a chunk (as
    in the Lua meter). A CRLF is never split there (its LF would match as a line end)."""
    at = max(pos, len(text) - 3)
    if at > pos and text[at - 1 : at + 1] == b"\r\n":
        at -= 1
    return at


def _may_be_usage(partial: bytes) -> bool:
    """Whether an unfinished event may still turn out to be the usage-only event (SSE field
    lines, its data not begun with ``[DONE]``, no choice in it yet): only such an event is
    held back, so a stream whose last event never gets its blank line loses nothing but that
    event. (One that merely mentions ``[DONE]`` may be the usage event: held. Each test, once
    failed, fails for every longer partial: what is held does not depend on the splits.)"""
    lines = partial.lstrip(b"\r\n")
    return (any(name.startswith(lines[:len(name)]) for name in _FIELDS)
            and not (_DONE in partial and _data(partial, None).startswith(_DONE))
            and _SOME_CHOICE.search(partial) is None)


def _has_data(event: bytes, *, whole: bool) -> bool:
    """Whether an event has a data line (SSE: a line that begins ``data:``), the sign of
    a token, whatever id:, event: or comment lines come first. ``whole``: ``event`` starts
    at its start (not a carry cut mid-line)."""
    return ((whole and event.startswith(_DATA)) or b"\ndata:" in event
            or b"\rdata:" in event)


def _opens_data(chunk: bytes, fresh: bool) -> bool:
    """Whether ``chunk`` (not empty) begins a data line, the first token's sign: comments
    (keep-alive pings), blank lines, and id, event or retry lines carry none. ``fresh``:
    the chunk starts a line. A data line cut by the chunk's end counts from its first
    byte (``d``): the chunk in which it begins reports it."""
    if fresh and _DATA.startswith(chunk[:5]):
        return True
    if b"\ndata:" in chunk or b"\rdata:" in chunk:
        return True
    # the chunk's last line, when it is short enough to be the start of "data:"
    return any(chunk[i] in b"\r\n" and _DATA.startswith(chunk[i + 1 :])
               for i in range(max(0, len(chunk) - 5), len(chunk) - 1))


def _data(event: bytes, lost: bool | None) -> bytes:
    """An event's data: its data lines' values (each less one leading space) joined by LF,
    as an SSE client joins them; what its usage and ``[DONE]`` are read from (a comment,
    id: or event: line is none of it). The usual event, one data line, is sliced, not split
    into lines. ``lost``: None when ``event`` is whole, else whether the start its carry lost
    had a data line: its first line, cut, is then taken as data (a long event is a long data
    line), else as none."""
    if lost is None and event.startswith(_DATA) and b"\n" not in event and b"\r" not in event:
        return event[6:] if event[5:6] == b" " else event[5:]
    lines = _LINES.split(event)
    values = []
    if lost is not None:
        cut = lines.pop(0)
        if lost:
            values.append(cut)
    for line in lines:
        if line.startswith(_DATA):
            values.append(line[6:] if line[5:6] == b" " else line[5:])
    return b"\n".join(values)


def _is_done(event: bytes, lost: bool | None, data: bytes | None = None) -> bool:
    """Whether an event is the end of an OpenAI stream: its data is ``[DONE]`` (an event that
    only mentions it, a token quoting it, is not). ``data``: the event's, when already read.
    """
    if _DONE not in event:
        return False
    return (_data(event, lost) if data is None else data) == _DONE


def _whole_object(event: bytes) -> bool:
    """Whether an event's data is one whole object (whitespace around it, its braces
    balanced, strings honoured): only such an event is read when the body's end, not a
    blank line, ends it (one cut off never closes its first brace). As the Lua meter tells
    it, which cannot parse JSON: one that is not quite JSON is read as a blank line would
    have had it read."""
    data = _data(event, None)
    start = len(data) - len(data.lstrip())
    if data[start : start + 1] != b"{":
        return False
    found = _object_at(data, start, len(data))
    return found is not None and not data[start + len(found) :].strip()


def _last_usage(text: bytes) -> bytes | None:
    """The last complete ``"usage": {…}`` object in ``text``, of its last ``USAGE_TRIES``
    (as the Lua meter reads it: an engine that writes the key thousands of times costs one
    scan, not one per key, on kvgate's event loop). Complete: its braces balanced (a key
    whose object is cut off by the text's end is passed over); whether it is valid is not
    asked here (``_usage``), as the Lua meter, which cannot parse JSON, does not."""
    starts = deque((match.end() - 1 for match in _USAGE.finditer(text)), maxlen=USAGE_TRIES)
    for start in reversed(starts):
        obj = _object_at(text, start)
        if obj is not None:
            return obj
    return None


def _usage(obj: bytes) -> Usage | None:
    """A usage object's counts, or None when it is no JSON or no valid usage (as kvgate
    reads the one the Lua meter reports)."""
    try:
        return usage_of(orjson.loads(obj))
    except orjson.JSONDecodeError:
        return None


def _object_at(text: bytes, start: int, most: int = USAGE_MAX) -> bytes | None:
    """``text[start:]`` up to the brace that closes the one at ``start`` (strings honoured),
    within ``most`` bytes (``USAGE_MAX`` unless told)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, min(len(text), start + most + 1)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None
