"""What one admitted request really used, as Envoy's Lua meter reports it.

The meter (``meter.lua``) reads the response inside Envoy; kvgate hears of it twice at most
(``reports.py``): when a stream's first token passes, and when the response ends, with the
engine's usage object. The charge settled on release follows from what arrived.
"""

from __future__ import annotations

from extproc.openai import Usage
from limiter import Cost

# What a request can have used, however its engine reports it: no more output than the cap
# kvgate sent it (max_tokens, or the model's default, times its choices), and a prompt of at
# most this many times kvgate's estimate, or this many tokens past it. The estimate counts
# four characters a token (exact with a tokenizer); a character is at most four UTF-8 bytes
# and a byte-level tokenizer makes at most one token of a byte, so no real prompt passes
# 16× (text of CJK or emoji, estimated without a tokenizer, can pass 4×). A usage past
# either — a buggy engine, a duplicated key — is charged at the bound, not as counted: one
# absurd report would lock the tenant out for weeks.
PROMPT_BOUND_FACTOR, PROMPT_BOUND_SLACK = 16, 4096


class ResponseRecord:
    __slots__ = ("answered", "done", "events", "started", "stream", "usage")

    def __init__(self, *, stream: bool):
        self.stream = stream
        self.started = False  # the first token has passed (streams)
        self.done = False  # the response ended and its report arrived
        self.usage: Usage | None = None  # the engine's own count, when it gave one
        self.events = 0  # SSE data events with text: ~ one token each
        self.answered = False  # the engine answered (2xx), as opposed to an error

    def finish(self, usage: Usage | None, events: int, answered: bool) -> None:
        self.done, self.usage, self.events, self.answered = True, usage, events, answered

    def settle(self, cost: Cost, *, meter_silent: bool = False) -> tuple[int, int, str]:
        """(tokens used, of which output, on what basis) to charge on release; the basis
        is ``kvgate_charges_total``'s label.

        The engine's usage when it reported one, held to what the request can have used
        (``_bounded``). An answer (2xx) that ended without a usage
        kvgate could read — a whole JSON body without one, or a stream without the usage
        event kvgate asks every engine for — is charged what was reserved: what kvgate
        cannot meter is never cheaper than what it admitted (a streamed event may carry
        several tokens, so counting events would undercharge). An engine's error answer is
        charged its prompt plus one token per streamed event, at most the output cap. A
        request that ended before its response began (the client left while it was
        prefilled: the engine aborts it) is charged its prompt. A response cut off after
        that (the client left mid-answer, or the meter could not report) is charged what
        was reserved: kvgate never saw how far it got, and a reservation is never less than
        what was used. ``meter_silent``: the meter reports nothing at all (its reports
        cannot reach kvgate: ``ReportDesk.silent``), so a stream with no first token seen
        may have been answered whole, and is charged what was reserved too (as its prompt
        only, every streamed answer was free of its output while the meter was down). (A
        request whose routing reply never left kvgate is not settled here:
        ``RequestStream.close`` charges it nothing, as ``not_sent``.)
        """
        if self.usage is not None:
            return _bounded(self.usage, cost)
        if self.done and self.answered:
            return cost.tokens, cost.max_output_tokens, "no_usage"
        if self.done:  # no more events than the output cap kvgate sent could make
            events = min(self.events, cost.max_output_tokens)
            return cost.prompt_tokens + events, events, "engine_error"
        if self.stream and not self.started and not meter_silent:
            return cost.prompt_tokens, 0, "not_started"
        return cost.tokens, cost.max_output_tokens, "cut_off"


def usage_ceiling(cost: Cost) -> tuple[int, int]:
    """The most prompt and output tokens a request of ``cost`` can have used."""
    return (max(PROMPT_BOUND_FACTOR * cost.prompt_tokens, cost.prompt_tokens + PROMPT_BOUND_SLACK),
            cost.max_output_tokens)


def _bounded(usage: Usage, cost: Cost) -> tuple[int, int, str]:
    """The engine's usage, each count held to what the request can have used
    (``usage_bounded`` when that changed it)."""
    prompt_max, output_max = usage_ceiling(cost)
    output = min(usage.completion_tokens, output_max)
    prompt = min(usage.prompt_tokens, prompt_max)
    if output == usage.completion_tokens and prompt == usage.prompt_tokens:
        return usage.total, output, "usage"
    return prompt + output, output, "usage_bounded"
