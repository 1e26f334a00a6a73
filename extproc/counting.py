"""Long prompts are counted off the event loop.

Counting a prompt with a model's tokenizer costs about a microsecond a character (a 1 MiB
prompt: one to three seconds), and every tenant's admission shares the one event loop: a
long prompt counted there would hold everyone's for as long. So a prompt of more than
:data:`LONG_PROMPT_CHARS` characters is rendered and encoded on a thread of its own — the
tokenizer releases the GIL while it encodes — while the loop admits the others. Short ones
(almost all of them) are counted in place: a thread hop costs more than they do.

One thread: counting never takes more than one core from Envoy and the engines it shares
the machine with. When it is behind by more than :data:`MAX_BACKLOG_CHARS` characters (a
burst of long prompts, or a client sending them to stall the gateway), a long prompt is
counted by the chars-per-token estimate instead — the engine's usage corrects the charge
when the request ends — so no request waits seconds to be counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

from extproc.config import Model
from extproc.metrics import Tally
from extproc.openai import InferenceRequest
from extproc.pricing import Pricer
from limiter.outcome import Cost

LONG_PROMPT_CHARS = 8_192  # counted in place below this: ≲2 ms of the loop
MAX_BACKLOG_CHARS = 4 * 1_048_576  # a few seconds of one core's counting


class PromptCosts:
    """``Pricer.price``, with long prompts counted on the counting thread."""

    def __init__(self, pricer: Pricer, counted: Tally | None = None):
        self.pricer = pricer
        self.counted = counted  # kvgate_long_prompts_total, by how they were counted
        self.backlog_chars = 0  # handed to the thread and not yet counted
        self._thread: ThreadPoolExecutor | None = None  # started by the first long prompt

    def at_once(self, model: Model, request: InferenceRequest) -> Cost | None:
        """The cost of a request whose prompt is short enough to count in place (almost
        all of them: no coroutine for those), else None: ``await price(...)``."""
        if self.pricer.long_prompt_chars(model, request, LONG_PROMPT_CHARS):
            return None
        return self.pricer.price(model, request)

    async def price(self, model: Model, request: InferenceRequest) -> Cost:
        pricer = self.pricer
        chars = pricer.long_prompt_chars(model, request, LONG_PROMPT_CHARS)
        if not chars:
            return pricer.price(model, request)
        if self.backlog_chars + chars > MAX_BACKLOG_CHARS:
            self._count("estimate")
            return pricer.price(model, request, estimate=True)
        self._count("tokenizer")
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvgate-counting")
        loop = asyncio.get_running_loop()
        self.backlog_chars += chars
        counting = self._thread.submit(pricer.price, model, request)

        def counted(_: Future[Cost]) -> None:  # on the counting thread, also if abandoned
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
                loop.call_soon_threadsafe(self._counted, chars)

        counting.add_done_callback(counted)
        return await asyncio.wrap_future(counting)

    def _counted(self, chars: int) -> None:
        self.backlog_chars -= chars

    def _count(self, how: str) -> None:
        if self.counted is not None:
            self.counted.add((how,))

    def close(self) -> None:
        """Stop the counting thread (what it is counting, it finishes)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
