"""The simulated engine's scheduler and KV cache, without any HTTP.

Kept apart from the server (``bench.engine``) so it can grow into a continuous-batching
simulator without touching the wire format. The model is deliberately small and follows
vLLM's V1 scheduler where kvgate can observe the difference:

- at most ``max_num_seqs`` requests run at once; the rest wait, ordered by arrival (``fcfs``)
  or by ``(priority, arrival)`` (``priority``; lower value first, as in vLLM), and the head
  of the queue blocks the others when it does not fit (no skipping ahead);
- a running request holds ``ceil((prompt + generated) / block_size)`` KV blocks; when a new
  token needs a block and none is free, the running request with the largest
  ``(priority, arrival)`` is preempted: its blocks are freed, it goes back to waiting and is
  prefilled again (prompt + tokens generated so far) when readmitted;
- a request is prefilled ``prefill_us_per_token`` per token after admission, then emits one
  token every ``ms_per_token``. Requests do not slow each other down (yet).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass
class EngineConfig:
    """Everything that shapes the simulated engine; the CLI flags map one to one."""

    model: str = "tiny-llama"
    scheduling_policy: SchedulingPolicy = "fcfs"
    ms_per_token: float = 20.0
    prefill_us_per_token: float = 50.0
    kv_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    # Longest prompt + completion accepted; None means the whole KV cache, so that every
    # accepted request can eventually run alone.
    max_model_len: int | None = None

    @property
    def context_limit(self) -> int:
        capacity = self.kv_blocks * self.block_size
        return capacity if self.max_model_len is None else min(self.max_model_len, capacity)


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SimRequest:
    """One generation request as the scheduler sees it."""

    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    request_id: str = ""
    seq: int = 0  # arrival order, the tie-breaker everywhere
    arrival: float = 0.0
    state: State = State.WAITING
    generated: int = 0
    blocks: int = 0
    admitted_at: float | None = None  # first admission, for the queue-time histogram
    first_token_at: float | None = None
    preemptions: int = 0
    needs_prefill: bool = True
    _admitted: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)


class EngineModel:
    """Admission, KV blocks and token pacing for one simulated engine."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.used_blocks = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished: Counter[str] = Counter()  # finish reason -> count ("length", "abort")
        self._seq = itertools.count()
        # Hooks for metrics: called with (request, seconds).
        self.on_admitted: Callable[[SimRequest, float], None] = lambda r, s: None
        self.on_first_token: Callable[[SimRequest, float], None] = lambda r, s: None
        self.on_finished: Callable[[SimRequest, float, str], None] = lambda r, s, why: None

    # -- what the HTTP layer calls ---------------------------------------------------------

    def new_request(self, prompt_tokens: int, max_tokens: int, priority: int = 0,
                    request_id: str = "") -> SimRequest:
        seq = next(self._seq)
        return SimRequest(prompt_tokens=prompt_tokens, max_tokens=max_tokens, priority=priority,
                          request_id=request_id or f"req-{seq}", seq=seq, arrival=self.clock())

    async def generate(self, req: SimRequest) -> AsyncIterator[int]:
        """Queue ``req``, then yield token indices 0..max_tokens-1 at the engine's pace.

        Whatever ends the iteration (completion, an exception, ``aclose()`` or cancellation
        when the client goes away) frees the request's slot and blocks exactly once.
        """
        self._enqueue(req)
        try:
            while req.generated < req.max_tokens:
                epoch = req.preemptions
                if req.needs_prefill:
                    await req._admitted.wait()
                    epoch, req.needs_prefill = req.preemptions, False
                    # (Re)compute the KV of everything so far: the prompt, plus the tokens
                    # already generated when this is a readmission after preemption.
                    await self._sleep_us(self.config.prefill_us_per_token
                                         * (req.prompt_tokens + req.generated))
                else:
                    await asyncio.sleep(self.config.ms_per_token / 1000)
                if req.preemptions != epoch:  # preempted while sleeping: queue again
                    continue
                self._emit_token(req)
                yield req.generated - 1
        finally:
            self._finish(req, "length" if req.generated >= req.max_tokens else "abort")

    def record_pooling(self, prompt_tokens: int) -> None:
        """Embeddings are answered at once, outside the scheduler, but still count as prefill."""
        self.prompt_tokens_total += prompt_tokens

    @property
    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.config.kv_blocks

    def snapshot(self) -> dict:
        """Plain-data view of the scheduler, for ``/debug/state``."""

        def row(r: SimRequest) -> dict:
            return {"id": r.request_id, "priority": r.priority, "prompt_tokens": r.prompt_tokens,
                    "generated": r.generated, "max_tokens": r.max_tokens, "blocks": r.blocks,
                    "preemptions": r.preemptions}

        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": self.used_blocks,
            "kv_blocks_total": self.config.kv_blocks,
            "kv_cache_usage_perc": self.kv_cache_usage,
            "num_preemptions": self.num_preemptions,
            "finished": dict(self.finished),
            "aborted": self.finished["abort"],
            "running_requests": [row(r) for r in self.running],
            "waiting_requests": [row(r) for r in sorted(self.waiting, key=self._queue_key)],
        }

    # -- scheduling ------------------------------------------------------------------------

    def _queue_key(self, req: SimRequest) -> tuple[int, int]:
        return req.order if self.config.scheduling_policy == "priority" else (0, req.seq)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _enqueue(self, req: SimRequest) -> None:
        req.state = State.WAITING
        req._admitted.clear()
        self.waiting.append(req)
        self._schedule()

    def _schedule(self) -> None:
        """Admit from the head of the queue while a slot and its KV blocks are free."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            head = min(self.waiting, key=self._queue_key)
            need = self._blocks_for(head.prompt_tokens + head.generated)
            if self.used_blocks + need > self.config.kv_blocks:
                return
            self.waiting.remove(head)
            self.running.append(head)
            head.state, head.blocks = State.RUNNING, need
            self.used_blocks += need
            if head.admitted_at is None:
                head.admitted_at = self.clock()
                self.on_admitted(head, head.admitted_at - head.arrival)
            head._admitted.set()

    def _emit_token(self, req: SimRequest) -> None:
        if req.first_token_at is None:
            self.prompt_tokens_total += req.prompt_tokens
            req.first_token_at = self.clock()
            self.on_first_token(req, req.first_token_at - req.arrival)
        req.generated += 1
        self.generation_tokens_total += 1
        self._grow(req)

    def _grow(self, req: SimRequest) -> None:
        """Give ``req`` the blocks its new token needs, preempting others if none are free."""
        need = self._blocks_for(req.prompt_tokens + req.generated) - req.blocks
        while need > 0:
            if self.used_blocks + need <= self.config.kv_blocks:
                req.blocks += need
                self.used_blocks += need
                return
            victim = max(self.running, key=self._queue_key)
            self._preempt(victim)
            if victim is req:  # it was the least important itself: others may fit now
                self._schedule()
                return

    def _preempt(self, victim: SimRequest) -> None:
        self._release(victim)
        victim.preemptions += 1
        self.num_preemptions += 1
        victim.state, victim.needs_prefill = State.WAITING, True
        victim._admitted.clear()
        self.waiting.append(victim)

    def _release(self, req: SimRequest) -> None:
        if req in self.running:
            self.running.remove(req)
            self.used_blocks -= req.blocks
        elif req in self.waiting:
            self.waiting.remove(req)
        req.blocks = 0

    def _finish(self, req: SimRequest, reason: str) -> None:
        if req.state is State.FINISHED:
            return
        self._release(req)
        req.state = State.FINISHED
        self.finished[reason] += 1
        self.on_finished(req, self.clock() - req.arrival, reason)
        self._schedule()

    @staticmethod
    async def _sleep_us(us: float) -> None:
        await asyncio.sleep(us / 1_000_000)
