"""The simulated engine's scheduler and KV cache: vLLM V1's step loop, without any HTTP.

One model, two drivers:

- :class:`EngineModel` runs it in **real time** under asyncio (the HTTP engine,
  ``extproc.engine``): a background task plans a step, sleeps its duration × ``time_scale``,
  applies it, and wakes the requests that got a token;
- :class:`VirtualEngine` runs it in **virtual time** as a library: a deterministic
  discrete-event engine that a simulator advances step by step (``bench.sim``), thousands of
  requests in seconds.

What a step does (vLLM V1's ``Scheduler.schedule``, ``vllm/v1/core/sched/scheduler.py``):

1. every running request is scheduled, in admission order: a decoding one for 1 token, one
   still prefilling for its next chunk, all within ``max_num_batched_tokens`` (**chunked
   prefill**, as V1 always does);
2. then waiting requests are admitted, head of the queue first, while a sequence slot
   (``max_num_seqs``), token budget and KV blocks remain; the queue is ordered by arrival
   (``fcfs``; a preempted request goes back to its *front*) or by ``(priority, arrival)``
   (``priority``; lower value first). A head that does not fit blocks the others (no
   skipping ahead);
3. the step takes ``base_ms + prefill_us_per_token × prefill_tokens + decode_us_per_seq ×
   batch_size`` (:class:`EngineProfile`); at its end every request whose prefill completed
   or that decoded emits one token (the first token comes out of the last prefill chunk).

KV: a request is admitted only when the blocks for its whole prompt (plus tokens already
generated, after a preemption) are free — a simplification of V1, which allocates per chunk
— and holds ``ceil((prompt + generated) / block_size)`` blocks while it runs: the blocks the
next step writes are allocated at the step boundary, in admission order. When none is free,
the running request with the largest ``(priority, arrival)`` (``priority``) or the most
recently admitted one (``fcfs``: V1's ``running.pop()``) is preempted: its blocks are freed,
it goes back to waiting, and is prefilled again (prompt + generated) when readmitted, which
ends with its next token. No prefix caching: every prompt is unique.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]
FcfsPriority = Literal["reject", "ignore"]
MetricsFlavour = Literal["vllm", "sglang", "tgi", "trtllm"]


@dataclass(frozen=True)
class EngineProfile:
    """How long one engine step takes; defaults mimic Llama-3-8B (fp16) on one A100-80GB.

    - ``base_ms`` 7: a decode step reads every weight once; 8B in fp16 is ~16 GB, at the
      ~2 TB/s of an A100-80GB that is ~8 ms (vLLM's batch-of-one inter-token latency for a
      7–8B model on an A100 is 7–10 ms).
    - ``decode_us_per_seq`` 60: each extra sequence adds its KV reads (Llama-3-8B, GQA: 128
      KiB per token; ~1k tokens of context → 128 MB → ~0.06 ms at 2 TB/s) and ~16 GFLOP of
      matmuls (~0.05 ms, overlapped). Independent of context length here (a simplification).
    - ``prefill_us_per_token`` 90: prefill is compute-bound, ~2 × 8e9 FLOP per token; at ~55%
      of the A100's 312 TFLOP/s (bf16) that is ~90 µs per token (~11k prompt tokens/s, a
      1000-token prompt in ~90 ms). Note: ~0.1 ms per *token*, not per 1000 tokens.
    - ``time_scale`` multiplies real sleeps only (the HTTP engine); virtual time ignores it.
    """

    base_ms: float = 7.0
    decode_us_per_seq: float = 60.0
    prefill_us_per_token: float = 90.0
    time_scale: float = 1.0

    def step_s(self, prefill_tokens: int, batch_size: int) -> float:
        """Model seconds for one step (unscaled)."""
        us = self.prefill_us_per_token * prefill_tokens + self.decode_us_per_seq * batch_size
        return (self.base_ms * 1000 + us) / 1e6


@dataclass
class EngineConfig:
    """Everything that shapes the simulated engine; the CLI flags map one to one.

    ``ms_per_token`` is the older knob (one token per request every N ms); when set it
    overrides ``base_ms``, so a lone request still gets a token about every N ms.
    ``fcfs_priority``: what a non-zero ``priority`` does on an ``fcfs`` engine — vLLM 0.32
    silently ignores it (``ignore``, the default; see ``bench/vllm_cpu/README.md``), older
    releases answered 400 (``reject``).
    """

    model: str = "tiny-llama"
    scheduling_policy: SchedulingPolicy = "fcfs"
    fcfs_priority: FcfsPriority = "ignore"
    base_ms: float = 7.0
    decode_us_per_seq: float = 60.0
    prefill_us_per_token: float = 90.0
    time_scale: float = 1.0
    ms_per_token: float | None = None
    # vLLM 0.32's default for the OpenAI server on an A100 (vllm/engine/arg_utils.py: the
    # 8192 default is for ≥70 GiB GPUs other than the A100, whose throughput it hurt).
    max_num_batched_tokens: int = 2048
    kv_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    # Longest prompt + completion accepted; None means the whole KV cache, so that every
    # accepted request can eventually run alone.
    max_model_len: int | None = None
    # Whose /metrics names the engine exports (extproc.engine.server.EngineMetrics); an
    # "sglang" engine also reads the body's priority as SGLang does by default, higher first.
    metrics_flavour: MetricsFlavour = "vllm"

    @property
    def context_limit(self) -> int:
        capacity = self.kv_blocks * self.block_size
        return capacity if self.max_model_len is None else min(self.max_model_len, capacity)

    @property
    def profile(self) -> EngineProfile:
        base = self.base_ms if self.ms_per_token is None else self.ms_per_token
        return EngineProfile(base, self.decode_us_per_seq, self.prefill_us_per_token,
                             self.time_scale)


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"  # all tokens out; KV still held until released (real-time driver only)
    FINISHED = "finished"


@dataclass(eq=False)
class SimRequest:
    """One generation request as the scheduler sees it (compared by identity)."""

    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    request_id: str = ""
    seq: int = 0  # arrival order, the tie-breaker everywhere
    arrival: float = 0.0
    state: State = State.WAITING
    generated: int = 0
    blocks: int = 0
    prefill_left: int = 0  # tokens still to prefill in this residency
    admitted_at: float | None = None  # first admission, for the queue-time histogram
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    wake: asyncio.Event | None = field(default=None, repr=False)

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


@dataclass
class Step:
    """One scheduled engine step: who decodes, who prefills how much, and for how long."""

    started: float
    duration_s: float
    decodes: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]

    @property
    def requests(self) -> Iterator[SimRequest]:
        yield from self.decodes
        yield from (req for req, _ in self.prefills)


class WaitingQueue:
    """FCFS deque or ``(priority, arrival)`` heap; removal (abort) is lazy in the heap."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[SimRequest] = deque()
        self._heap: list[tuple[int, int, SimRequest]] = []
        self._gone: set[int] = set()  # ids of requests removed while in the heap

    def __len__(self) -> int:
        return len(self._fifo) if not self.by_priority else len(self._heap) - len(self._gone)

    def push(self, req: SimRequest) -> None:
        if self.by_priority:
            heapq.heappush(self._heap, (req.priority, req.seq, req))
        else:
            self._fifo.append(req)

    def prepend(self, req: SimRequest) -> None:
        """A preempted request: front of the FCFS queue (V1), its rank in the heap."""
        if self.by_priority:
            self.push(req)
        else:
            self._fifo.appendleft(req)

    def peek(self) -> SimRequest | None:
        if not self.by_priority:
            return self._fifo[0] if self._fifo else None
        while self._heap and id(self._heap[0][2]) in self._gone:
            self._gone.discard(id(heapq.heappop(self._heap)[2]))
        return self._heap[0][2] if self._heap else None

    def pop(self) -> SimRequest:
        head = self.peek()
        assert head is not None
        if self.by_priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        return head

    def remove(self, req: SimRequest) -> None:
        if self.by_priority:
            self._gone.add(id(req))
        else:
            self._fifo.remove(req)

    def ordered(self) -> list[SimRequest]:
        """Queue order, for ``/debug/state``."""
        if not self.by_priority:
            return list(self._fifo)
        return [r for _, _, r in sorted(self._heap, key=lambda e: e[:2])
                if id(r) not in self._gone]


class StepScheduler:
    """vLLM V1's scheduling and KV rules, sans-IO: the caller passes ``now`` and runs steps.

    ``hold_finished``: a finished request keeps its KV until :meth:`release` (the real-time
    driver frees it when the client has read the last token); otherwise it is freed at once.
    """

    def __init__(self, config: EngineConfig, *, hold_finished: bool = False) -> None:
        self.config = config
        self.profile = config.profile
        self.hold_finished = hold_finished
        self.waiting = WaitingQueue(config.scheduling_policy == "priority")
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

    # -- requests in and out ---------------------------------------------------------------

    def make_request(self, prompt_tokens: int, max_tokens: int, priority: int, arrival: float,
                     request_id: str = "") -> SimRequest:
        seq = next(self._seq)
        return SimRequest(prompt_tokens=prompt_tokens, max_tokens=max_tokens, priority=priority,
                          request_id=request_id or f"req-{seq}", seq=seq, arrival=arrival)

    def add(self, req: SimRequest) -> None:
        req.state = State.WAITING
        self.waiting.push(req)

    def release(self, req: SimRequest, reason: str, now: float) -> None:
        """End ``req`` (completion or abort) and free what it holds, exactly once."""
        if req.state is State.FINISHED:
            return
        if req.state is State.RUNNING:
            self.running.remove(req)
        elif req.state is State.WAITING:
            self.waiting.remove(req)
        self.used_blocks -= req.blocks
        req.blocks, req.state, req.finished_at = 0, State.FINISHED, now
        self.finished[reason] += 1
        self.on_finished(req, now - req.arrival, reason)

    @property
    def kv_cache_usage(self) -> float:
        return self.used_blocks / self.config.kv_blocks

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # -- one step --------------------------------------------------------------------------

    def plan(self, now: float) -> Step | None:
        """Schedule the next step (running first, then admissions); None if nothing runs."""
        budget = self.config.max_num_batched_tokens
        decodes: list[SimRequest] = []
        prefills: list[tuple[SimRequest, int]] = []
        for req in self.running:
            if budget <= 0:
                break
            if req.prefill_left:
                chunk = min(req.prefill_left, budget)
                prefills.append((req, chunk))
                budget -= chunk
            else:
                decodes.append(req)
                budget -= 1
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._admit(now)
            if req is None:
                break
            chunk = min(req.prefill_left, budget)
            prefills.append((req, chunk))
            budget -= chunk
        if not decodes and not prefills:
            return None
        tokens = sum(chunk for _, chunk in prefills)
        duration = self.profile.step_s(tokens, len(decodes) + len(prefills))
        return Step(now, duration, decodes, prefills)

    def complete(self, step: Step, now: float) -> None:
        """Apply a step at its end: tokens out, finished requests out, KV for the next step."""
        for req, chunk in step.prefills:
            if req.state is State.RUNNING:
                req.prefill_left -= chunk
                if not req.prefill_left:
                    self._emit(req, now)
        for req in step.decodes:
            if req.state is State.RUNNING:
                self._emit(req, now)
        self._grow_all()

    def _admit(self, now: float) -> SimRequest | None:
        head = self.waiting.peek()
        if head is None:
            return None
        need = self._blocks_for(head.prompt_tokens + head.generated)
        if self.used_blocks + need > self.config.kv_blocks:
            return None
        self.waiting.pop()
        self.running.append(head)
        head.state, head.blocks = State.RUNNING, need
        head.prefill_left = head.prompt_tokens + head.generated
        self.used_blocks += need
        if head.admitted_at is None:
            head.admitted_at = now
            self.on_admitted(head, now - head.arrival)
        return head

    def _emit(self, req: SimRequest, now: float) -> None:
        if req.first_token_at is None:
            self.prompt_tokens_total += req.prompt_tokens
            req.first_token_at = now
            self.on_first_token(req, now - req.arrival)
        req.generated += 1
        self.generation_tokens_total += 1
        if req.generated < req.max_tokens:
            return
        if self.hold_finished:
            self.running.remove(req)
            req.state = State.DONE
        else:
            self.release(req, "length", now)

    # -- KV --------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _grow_all(self) -> None:
        """Allocate the blocks the next step writes, in admission order, preempting if full."""
        for req in list(self.running):
            if req.state is State.RUNNING and not req.prefill_left:
                self._grow(req)

    def _grow(self, req: SimRequest) -> None:
        need = self._blocks_for(req.prompt_tokens + req.generated) - req.blocks
        while need > 0 and self.used_blocks + need > self.config.kv_blocks:
            victim = self._victim()
            self._preempt(victim)
            if victim is req:
                return
        if need > 0:
            req.blocks += need
            self.used_blocks += need

    def _victim(self) -> SimRequest:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: r.order)
        return self.running[-1]

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self.used_blocks -= victim.blocks
        victim.blocks, victim.prefill_left, victim.state = 0, 0, State.WAITING
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)

    # -- introspection ---------------------------------------------------------------------

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
            "waiting_requests": [row(r) for r in self.waiting.ordered()],
        }


class EngineModel(StepScheduler):
    """The step loop in real time, for the HTTP engine: one asyncio task runs steps while
    there is work; each request's ``generate`` yields its tokens as steps produce them."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, hold_finished=True)
        self.clock = clock
        self._driver: asyncio.Task[None] | None = None

    def new_request(self, prompt_tokens: int, max_tokens: int, priority: int = 0,
                    request_id: str = "") -> SimRequest:
        return self.make_request(prompt_tokens, max_tokens, priority, self.clock(), request_id)

    async def generate(self, req: SimRequest) -> AsyncIterator[int]:
        """Queue ``req``, then yield token indices 0..max_tokens-1 as steps make them.

        Whatever ends the iteration (completion, an exception, ``aclose()`` or cancellation
        when the client goes away) frees the request's slot and blocks exactly once.
        """
        async with contextlib.aclosing(self.generate_many([req])) as tokens:
            async for _, index in tokens:
                yield index

    async def generate_many(self, reqs: list[SimRequest]) -> AsyncIterator[tuple[int, int]]:
        """The sequences of one API request (``n`` > 1: one per choice, as vLLM V1 runs a
        child request per choice, each its own sequence in the scheduler): queue them all,
        then yield ``(choice, token index)`` as steps make the tokens, in choice order
        within a step.

        A sequence's slot and blocks are freed once its last token has been taken (the
        client has read it); whatever ends the iteration early frees the rest, each exactly
        once (``abort`` for those not finished).
        """
        wake = asyncio.Event()  # one for all: any of them got a token
        for req in reqs:
            req.wake = wake
            self.add(req)
        self._kick()
        sent = [0] * len(reqs)
        try:
            while any(n < req.max_tokens for n, req in zip(sent, reqs, strict=True)):
                progressed = False
                for choice, req in enumerate(reqs):
                    if req.generated > sent[choice]:
                        sent[choice] += 1
                        progressed = True
                        yield choice, sent[choice] - 1
                        if sent[choice] == req.max_tokens:
                            self.release(req, "length", self.clock())
                            self._kick()
                if not progressed:
                    wake.clear()
                    await wake.wait()
        finally:
            now = self.clock()
            for req in reqs:  # (release is once: those already released are left alone)
                self.release(req, "length" if req.generated >= req.max_tokens else "abort",
                             now)
            self._kick()

    def record_pooling(self, prompt_tokens: int) -> None:
        """Embeddings are answered at once, outside the scheduler, but still count as prefill."""
        self.prompt_tokens_total += prompt_tokens

    def _kick(self) -> None:
        if self.has_work() and (self._driver is None or self._driver.done()):
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        """Plan, sleep the step's duration, apply, wake; stop when nothing can run."""
        while (step := self.plan(self.clock())) is not None:
            await asyncio.sleep(step.duration_s * self.profile.time_scale)
            self.complete(step, self.clock())
            for req in step.requests:
                if req.wake is not None:
                    req.wake.set()
        self._driver = None


class VirtualEngine(StepScheduler):
    """The step loop in virtual time: deterministic, no asyncio, no wall clock.

    ``submit`` queues a request at a virtual time; ``advance(t)`` applies every step that
    ends at or before ``t`` and returns the requests that finished. ``next_time`` is when
    the engine next has something to do (the current step's end, or the start of a step
    for requests submitted to an idle engine), None when idle, for a simulator's event
    loop. An idle engine starts its step at ``advance`` time, so requests submitted at the
    same instant share it; a request that arrives during a step waits for the next one, as
    in vLLM.
    """

    def __init__(self, config: EngineConfig, name: str = "") -> None:
        super().__init__(config, hold_finished=False)
        self.name = name
        self.now = 0.0
        self.step: Step | None = None
        self.busy_s = 0.0  # total time spent in steps
        self._wake_at: float | None = None

    def submit(self, prompt_tokens: int, max_tokens: int, priority: int = 0,
               at: float | None = None, request_id: str = "") -> SimRequest:
        at = self.now if at is None else at
        if at < self.now or ((due := self.next_time()) is not None and due < at):
            raise ValueError(f"submit at {at}: advance the engine to it first")
        self.now = at
        req = self.make_request(prompt_tokens, max_tokens, priority, at, request_id)
        self.add(req)
        if self.step is None and self._wake_at is None:
            self._wake_at = at
        return req

    def next_time(self) -> float | None:
        if self.step is None:
            return self._wake_at
        return self.step.started + self.step.duration_s

    def advance(self, until: float) -> list[SimRequest]:
        """Run every step ending at or before ``until``; the requests that finished."""
        done: list[SimRequest] = []
        while (end := self.next_time()) is not None and end <= until:
            self.now = end
            if self.step is None:  # an idle engine got work
                self._wake_at = None
                self._start(end)
                continue
            step = self.step
            self.complete(step, end)
            done.extend(r for r in step.requests if r.state is State.FINISHED)
            self._start(end)
        self.now = max(self.now, until)
        return done

    def run(self) -> list[SimRequest]:
        """Run until idle; the requests that finished."""
        done: list[SimRequest] = []
        while (end := self.next_time()) is not None:
            done.extend(self.advance(end))
        return done

    def _start(self, now: float) -> None:
        self.step = self.plan(now)
        if self.step is not None:
            self.busy_s += self.step.duration_s


def simulate(config: EngineConfig,
             arrivals: Iterable[tuple[float, int, int, int]]) -> list[SimRequest]:
    """One engine, requests ``(at, prompt_tokens, max_tokens, priority)``; every request,
    in submission order, once all have finished."""
    engine = VirtualEngine(config)
    reqs = []
    for at, prompt, max_tokens, priority in sorted(arrivals, key=lambda a: a[0]):
        engine.advance(at)
        reqs.append(engine.submit(prompt, max_tokens, priority, at))
    engine.run()
    return reqs
