"""The scheduler: which endpoint of a pool takes a request, or why none may (EPP-style
filters → scorers → picker, over the data layer's snapshot).

KV-memory-weighted admission: a request needs (prompt + reserved output) tokens of KV. An
endpoint is *eligible* when its usage after this reservation stays under the high
watermark; endpoints that are stale, unhealthy, above the critical watermark, or whose GPU
memory is critical take nothing. Between the high and critical watermarks the pool is
*busy*: interactive (band 0) work may use that headroom, and lower-band work of a tenant
still under its weighted share of the pool's reserved KV; lower-band work over it waits
("busy: share by weight; idle: borrow"). On a priority-scheduled pool band 0 may take an
endpoint under the critical watermark past it, up to a full cache, while its prompt fits the
cache now and the future peak (below) of the band-0 work there with it fits: lower-priority
answers that would outgrow the cache give way, as the engine preempts them
(:meth:`PoolScheduler._candidate`).

The engine's queue stays short: an endpoint takes a request only while fewer than
``max_unstarted`` of the requests kvgate sent it have not started (band 0: one more).
Started means its first token was seen (or its response ended), or a scrape taken after it
was sent reports fewer requests waiting in the engine than kvgate has unstarted there (the
oldest have started). The rest waits in kvgate's fair queue, where tenant shares and
classes order it; in vLLM's waiting queue only priority and arrival would. The limit adapts
per endpoint: each scrape that finds nothing waiting in the engine although the limit held
work back since the one before doubles how far it is raised (1, 2, 4, … up to
``MAX_GATE_GROWTH``: the engine starts requests faster than kvgate can see them start, as
with short non-streamed answers); a scrape that finds more than ``max_unstarted`` waiting
halves it. An engine that keeps work waiting never sees it grow.

Sequences: vLLM runs at most ``--max-num-seqs`` requests at once and its priority
scheduler never preempts for a free sequence, so an interactive request arriving when every
sequence runs a long batch request waits for one of them to end. Once an endpoint's limit is
known (configured ``max_num_seqs``, or learned from its scrapes), lower-band work leaves one
sequence free for band 0 — while band-0 work has arrived in the last ``TOP_IDLE_S``; a pool
that serves only batch work gets every sequence back. That sequence is lent whenever one of
the endpoint's running requests is expected to end within ``SEQ_LEND_WAIT_S`` or has less
than ``SEQ_LEND_SHARE`` of its run left (its expected output at the pool's decode rate): band
0 then waits at most half a request's run for a sequence (without kvgate, up to a whole
one), and lower bands lose a sequence only during the first half of a run. With few
sequences (vLLM on a CPU: 4) a sequence kept idle throughout costs batch work a quarter of
its throughput.

Predictive load: reservations admitted since an endpoint's last scrape are added to its
scraped usage, so a burst spreads across endpoints before the next scrape shows it.

Committed load: a scrape only shows what running requests hold now, and vLLM preempts when
they outgrow its cache. Each request kvgate sent an endpoint is expected to grow to its
prompt + its tenant's :meth:`PoolScheduler.output_ratio` of its reserved output (learned
from the usage of that tenant's finished requests: one client that sets a generous
``max_tokens`` and stops early must not make every other tenant's requests count as short;
one that runs past it counts its whole reservation from then on: :meth:`PoolScheduler.
_overrunning`), one token per engine step, and to free it all when it ends. So they
do not all peak at once: the cache must hold their largest total at any moment ahead, which
is reached just before one of them ends (:func:`future_peak`). Each request's progress is
estimated from when it started (its first token; for a non-streamed answer, the first
scrape that finds the engine admitted it: every scrape round is read as it lands,
:meth:`PoolScheduler.observe`) and the pool's decode rate per sequence (learned from
finished requests whose start was seen; unknown: none made). The peak with a new request
must fit the endpoint's KV capacity; the usage check counts only the new request's prompt
(its output is held as it decodes, which that peak checks). Band 0 on a pool with
``priority_scheduling`` is exempt: should the cache fill, the engine preempts the lower
priority, and interactive work never waits for KV that batch work may need later — it also
goes when its whole reservation fits under the watermark now.

Prefill isolation. vLLM V1 schedules its *running* requests before admitting waiting ones,
and a long prompt is prefilled in chunks that take the whole step budget — so a new
interactive request on an engine that is prefilling a 5,000-token batch prompt waits for
every remaining chunk, whatever its priority. kvgate knows what it sent where: a request is
*in prefill* from its reservation until its first token is seen (:meth:`PoolScheduler.
first_token`; the response's first body chunk) or it ends. Per endpoint it keeps the prompt
tokens in prefill (the ``scoring.prefill`` term: interactive work goes where the least
prefill is ahead of it; in a pool too small to keep an endpoint clear, less what the one at
the head has done since it began, at the pool's learned prefill rate:
:meth:`PoolScheduler.prefill_ahead`), and how many lower-band (band > 0) requests are in
prefill; with
``prefill_clear_share`` lower-band work stacks on endpoints already prefilling such work
rather than spreading over all of them, so some endpoints stay clear for band 0 — except for
lower-band work that has waited ``prefill_clear_hold_s`` in kvgate's queue while no band-0
request is in prefill anywhere in the pool (the clear endpoints' cost to batch throughput is
bounded). Each endpoint takes lower-band work only while its lower-band prefill is below
the engines' step budget (``max_num_batched_tokens``): a new interactive request there
then waits behind about one step of batch prefill and the prompt that joined last rather
than behind every batch prompt sent there, and short batch prompts still share a step.
Batch prompts stacked deeper would be prefilled no sooner (the budget is the engine's per
step); they would only wait in the engine's queue instead of kvgate's, where the fair order
decides. Where endpoints are kept clear, what is left of that prefill counts
(:meth:`PoolScheduler.prefill_ahead`), so the next batch prompt is sent as the last chunk
of the one before is prefilled; a pool too small to keep one clear (fewer than four
endpoints at the default) counts every prompt token in prefill. Band here is
the request's *effective* band (aging included), so every request the fair queue ranks
together sees the same gates. Every update is O(1); placement stays O(endpoints).

Nothing here does I/O; time is passed in (monotonic seconds).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from extproc.config import Pool
from extproc.datalayer.endpoints import EndpointState, StoreSnapshot
from limiter.buckets import ceil_div
from limiter.herd import herd_wait
from limiter.outcome import Reason, Reject, refuse

FALLBACKS = 2  # endpoints after the chosen one, for Envoy's retries
SEQ_PLATEAU_SCRAPES = 5  # scrapes in a row at one running count with work waiting: a seq cap
MAX_GATE_GROWTH = 32  # how far an endpoint's unstarted limit may grow above max_unstarted
# a pool that has seen no band-0 request for this long lends the sequence it keeps free
# for band 0 to lower bands (a batch-only pool would otherwise run one sequence short)
TOP_IDLE_S = 300.0
# the sequence kept free is lent to lower bands once a request running on the endpoint is
# expected to end within SEQ_LEND_WAIT_S, or is in the last SEQ_LEND_SHARE of its run
SEQ_LEND_WAIT_S, SEQ_LEND_SHARE = 1.0, 0.5
DRAIN_WINDOW_S = 10.0
# the expected share of reserved output (``PoolScheduler.output_ratio``, per tenant): how
# fast it rises toward a longer answer and decays toward a shorter one, and its floor
OUTPUT_RATIO_RISE, OUTPUT_RATIO_DECAY, MIN_OUTPUT_RATIO = 0.5, 0.02, 0.05
# the fair order's price of an answer (``PoolScheduler.fair_ratio``, per tenant): the mean of
# the tenant's last FAIR_WINDOW answers' shares of what they reserved, once it has
# FAIR_MIN_ANSWERS of them; a request running is priced again every FAIR_REPRICE_S
FAIR_WINDOW, FAIR_MIN_ANSWERS, FAIR_REPRICE_S = 64, 8, 0.1
DECODE_RATE_WEIGHT = 0.2  # of each finished request in the pool's decode-rate average
MIN_RETRY_MS, MAX_RETRY_MS = 1000, 60_000
# what held an endpoint when a placement found none (``PoolScheduler.holds``), in the order
# the checks run: no fresh scrape; the engine itself full (critical KV or GPU memory, or
# max_waiting); max_in_flight; the sequence kept free for band 0; max_unstarted (the
# engine's own queue); kept clear of batch prefill (or holding a step of it); the tenant
# over its KV share; KV
HOLD_REASONS = ("stale_metrics", "engine_full", "in_flight_cap", "sequence_kept",
                "engine_queue", "prefill_clear", "tenant_share", "kv_cache")


class Answers:
    """A tenant's last ``FAIR_WINDOW`` answers, each as the share of its reserved output it
    made: the distribution the fair order prices a request from (:meth:`PoolScheduler.
    fair_ratio`). Sorted with suffix sums on first use after a change, so each price is
    O(log n) — every running request is priced again each ``FAIR_REPRICE_S``."""

    __slots__ = ("_recent", "_sorted", "_suffix")

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=FAIR_WINDOW)
        self._sorted: list[float] | None = None
        self._suffix: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, share: float) -> None:
        self._recent.append(share)
        self._sorted = None

    def mean_above(self, made: float) -> float | None:
        """The mean share of the answers longer than ``made`` (0: of all of them); None
        when none is."""
        if self._sorted is None:
            self._sorted = sorted(self._recent)
            suffix = [0.0] * (len(self._sorted) + 1)
            for i in range(len(self._sorted) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + self._sorted[i]
            self._suffix = suffix
        first = bisect_right(self._sorted, made) if made > 0 else 0
        longer = len(self._sorted) - first
        return self._suffix[first] / longer if longer else None


@dataclass(slots=True)
class Placement:
    """Endpoints best first; the first is used."""

    endpoints: list[str]


@dataclass(slots=True)
class Reservation:
    lease_id: str
    tenant: str
    endpoint: str
    tokens: int
    at: float
    band: int = 0
    prefill: int = 0  # its prompt tokens (in prefill while ``prefilling``)
    prefilling: bool = False
    started: bool = False  # the engine admitted it (first token seen, or its waiting count)
    streamed: bool = True  # a first token will be seen before the end
    peak: int = 0  # the KV it is expected to grow to: prompt + expected output
    started_at: float = 0.0  # when it started (first token, or a scrape saw it admitted)
    start_seen: bool = False  # started_at is its start, not its end (a non-streamed answer
    # that ended before a scrape saw it admitted: how long it decoded is unknown)


@dataclass(slots=True)
class Candidate:
    state: EndpointState
    usage_after: float  # KV usage once this request's reservation lands (0–1+)
    fits: bool  # usage_after within the high watermark
    # it may still go once the pool is busy: usage_after within the critical watermark —
    # or, for band 0 on a priority-scheduled engine, the endpoint is within it, the prompt
    # fits the cache now and the band-0 work's future peak with it fits the cache
    within_critical: bool


@dataclass(slots=True)
class _Scraped:
    """What one scrape says about an endpoint, worked out once per snapshot rather than
    once per request: the request path only compares ``fresh_until`` with the clock."""

    state: EndpointState
    fresh_until: float  # usable while now <= this (never, when unhealthy or unscraped)
    takes_work: bool  # below the critical KV and GPU watermarks and max_waiting


@dataclass(slots=True)
class _PoolView:
    """A pool's endpoints in one snapshot, as placement reads them."""

    snapshot: StoreSnapshot
    endpoints: list[_Scraped]
    largest: int | None  # the largest KV capacity (tokens), when any endpoint reports one


class DrainRate:
    """KV tokens released per second over the last ``DRAIN_WINDOW_S``: how fast a saturated
    pool frees room, which turns into an honest Retry-After."""

    def __init__(self) -> None:
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, tokens: int, now: float) -> None:
        self._events.append((now, tokens))
        self._total += tokens
        self._trim(now)

    def per_second(self, now: float) -> float:
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(1.0, now - self._events[0][0])
        return self._total / span

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > DRAIN_WINDOW_S:
            self._total -= self._events.popleft()[1]


@dataclass
class PoolScheduler:
    config: Pool
    weights: dict[str, float]  # tenant → tier weight
    staleness_s: float = 2.0
    reservations: dict[str, Reservation] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    prefill_tokens: dict[str, int] = field(default_factory=dict)  # endpoint → in prefill
    # endpoint → when the prefill now at the head of its queue began (the last first token
    # there, or the request that found nothing in prefill): how far it has got
    prefill_marks: dict[str, float] = field(default_factory=dict)
    # prompt tokens per second one endpoint prefills (streamed requests' first tokens;
    # 0 = none seen yet): what is left of the prefill a new request waits behind
    prefill_rate: float = 0.0
    _prefill_sample_tokens: float = field(default=0.0, repr=False)
    _prefill_sample_seconds: float = field(default=0.0, repr=False)
    unstarted: dict[str, int] = field(default_factory=dict)  # endpoint → sent, not started
    # endpoint → the engine's sequence limit (vLLM --max-num-seqs) as learned from its scrapes
    seq_caps: dict[str, int] = field(default_factory=dict)
    _seq_seeded: set[str] = field(default_factory=set, repr=False)  # max_num_seqs applied
    _plateaus: dict[str, tuple[int, float | None, int]] = field(default_factory=dict,
                                                                 repr=False)
    # endpoint → how far its unstarted limit has grown, and the endpoints the limit held work
    # back from since their last scrape
    gate_growth: dict[str, int] = field(default_factory=dict)
    _gated: set[str] = field(default_factory=set, repr=False)
    low_prefills: dict[str, int] = field(default_factory=dict)  # endpoint → band > 0 ones
    low_prefill_tokens: dict[str, int] = field(default_factory=dict)  # … and their prompts
    top_prefills: int = 0  # band-0 requests in prefill, pool-wide
    # endpoint → its reservations, oldest first (times come from a monotonic clock), so the
    # ones newer than a scrape are found from the end without walking every reservation
    by_endpoint: dict[str, dict[str, Reservation]] = field(default_factory=dict)
    drain: DrainRate = field(default_factory=DrainRate)
    # endpoint → the KV its requests in flight are expected to grow to (each reservation's
    # ``peak``)
    committed: dict[str, int] = field(default_factory=dict)
    # tenant → the share of their reserved output its requests are expected to produce
    # (:meth:`output_ratio`; a tenant with no finished request yet: all of it)
    output_ratios: dict[str, float] = field(default_factory=dict)
    # tenant → its recent answers' shares of their reserved output (:meth:`fair_ratio`)
    answers: dict[str, Answers] = field(default_factory=dict)
    # output tokens per second of one running sequence (finished requests' average; 0 =
    # none finished yet): how far a request in flight has got since it started
    decode_rate: float = 0.0
    _decode_tokens: float = field(default=0.0, repr=False)  # averages behind decode_rate
    _decode_seconds: float = field(default=0.0, repr=False)
    retry_slot_ms: int | None = None  # the last retry time promised to a refused client
    # when a band-0 request last asked for an endpoint (None: no request yet; the first one
    # of any band starts the clock, so a kvgate just started keeps the sequence free)
    top_seen_at: float | None = None
    # why placements found no endpoint: for each refused placement, one count per endpoint
    # under the first check it failed (HOLD_REASONS; kvgate_pool_holds_total)
    holds: dict[str, int] = field(default_factory=dict)
    # requests found running past their expected output since :meth:`take_overran`
    overran: list[str] = field(default_factory=list)
    _cached_view: _PoolView | None = field(default=None, repr=False, compare=False)

    # -- the decision ----------------------------------------------------------------------

    def place(
        self, tenant: str, tokens: int, snapshot: StoreSnapshot, now: float, rng: random.Random,
        *, band: int = 0, waited_s: float = 0.0, prompt_tokens: int | None = None,
    ) -> Placement | Reject:
        """``band``: the request's effective band (0 = interactive, or aged into it);
        ``waited_s``: how long it has waited in kvgate's queue; ``prompt_tokens``: of
        ``tokens``, the prompt (unknown: it is counted as holding all of them throughout)."""
        if self.top_seen_at is None or not band:
            self.top_seen_at = now
        if not self.config.kv_aware:
            return self._least_in_flight(snapshot, now, tokens, rng, band)
        view = self._view(snapshot)
        if view.largest is not None and (tokens > view.largest or not self._fits_empty(
                view, tokens, prompt_tokens, band)):
            return refuse(Reason.KV_TOO_LARGE,
                          f"the request needs {tokens} tokens of KV cache; the largest endpoint "
                          f"of pool '{self.config.name}' holds {view.largest}, and an empty one "
                          "takes a request only with a KV block to spare and within its "
                          "critical watermark", None)
        usable = [e for e in view.endpoints if now <= e.fresh_until]
        if not usable:
            self._held("stale_metrics", max(1, len(view.endpoints)))
            return self._none_ready(view)
        limit, ahead = self._slot_limit(band), self._unstarted_limit(band)
        committed_bound = bool(band) or not self.config.priority_scheduling
        candidates = [self._candidate(e.state, tokens, now, committed_bound, prompt_tokens)
                      for e in usable if self._held_by(e, limit, ahead, band, now) is None]
        if band and self.config.prefill_clear_share and (
                waited_s < self.config.prefill_clear_hold_s or self.top_prefills):
            candidates = self._keep_clear(candidates, usable, now)
        eligible = [c for c in candidates if c.fits]
        if not eligible:
            busy = [c for c in candidates if c.within_critical]
            if not busy:
                self._count_holds(usable, candidates, [], limit, ahead, band, now)
                return self._saturated(tokens, now)
            if band and self._over_share(tenant,
                                         self.expected_peak(tenant, tokens, prompt_tokens or 0)):
                self._count_holds(usable, candidates, busy, limit, ahead, band, now)
                return refuse(Reason.KV_SHARE,
                              f"pool '{self.config.name}' is busy and tenant '{tenant}' holds "
                              "more than its weighted share of its KV cache",
                              self.retry_ms(tokens, now))
            eligible = busy
        if len(eligible) == 1:
            return Placement([eligible[0].state.address])
        # where no endpoint is kept clear, every one may be prefilling batch work: what is
        # left of it decides (see prefill_ahead)
        progress = not self._kept_clear(usable)
        return Placement([c.state.address for c in self._ranked(eligible, now if progress
                                                                 else None, rng)]
                         [: 1 + FALLBACKS])

    def _fits_empty(self, view: _PoolView, tokens: int, prompt: int | None, band: int) -> bool:
        """Whether a request could be placed on some endpoint of the pool were it empty (as
        :meth:`_candidate` judges it: no usage, nothing in flight; the busy zone up to the
        critical watermark counts). One that could not never leaves the queue, and a tenant
        whose head fits nowhere holds every other tenant's batch work back at its counter
        and their interactive work a lag past where its head would take it: a
        request of exactly the largest endpoint's capacity (one block over, counting the block
        each request may hold beyond its tokens) froze the whole pool, interactive work
        included, until its class deadline. Only a request over half the largest endpoint is
        looked at (a block is far smaller than that)."""
        if 2 * tokens <= (view.largest or 0):
            return True
        priority_exempt = not band and self.config.priority_scheduling
        for scraped in view.endpoints:
            capacity = scraped.state.kv_capacity_tokens
            if not capacity:
                continue
            block = int(_metric(scraped.state, "kv_block_tokens"))
            whole = tokens / capacity
            after = whole
            if prompt is not None and prompt < tokens:
                after = in_blocks(prompt, block) / capacity
            if tokens + block > capacity:  # its own future peak, alone on the endpoint
                after = max(after, (tokens + block) / capacity)
            if priority_exempt:
                after = min(after, whole)
            if after <= self.config.watermarks.critical:
                return True
        return False

    def place_light(self, snapshot: StoreSnapshot, now: float, rng: random.Random
                    ) -> Placement | Reject:
        """For requests that take no KV (``GET /health``, …): any live endpoint, the least
        busy first, even when the pool is saturated — they never queue. A pool with no
        endpoint at all (its DNS name resolved to none, or not yet) refuses them as it
        refuses inference requests: an empty placement had nowhere to send them."""
        states = snapshot.endpoints(self.config.name)
        live = [s.address for s in states if s.is_usable(now, self.staleness_s)]
        addresses = live or [s.address for s in states] or list(self.config.endpoints)
        if not addresses:
            return refuse(Reason.NO_ENDPOINT,
                          f"pool '{self.config.name}' has no endpoints", MIN_RETRY_MS)
        rng.shuffle(addresses)
        addresses.sort(key=lambda a: self.in_flight.get(a, 0))
        return Placement(addresses[: 1 + FALLBACKS])

    def reserve(self, lease_id: str, tenant: str, endpoint: str, tokens: int, now: float,
                *, band: int = 0, prompt_tokens: int = 0, streamed: bool = True) -> None:
        """Hold ``tokens`` of KV on ``endpoint``; the request is in prefill (``band`` as it
        was placed, ``prompt_tokens`` to prefill) until :meth:`first_token` or release —
        or, when not ``streamed``, until the engine reports it admitted."""
        peak = self.expected_peak(tenant, tokens, prompt_tokens)
        reservation = Reservation(lease_id, tenant, endpoint, tokens, now, band, prompt_tokens,
                                  True, False, streamed, peak)
        self.reservations[lease_id] = reservation
        self.committed[endpoint] = self.committed.get(endpoint, 0) + peak
        self.by_endpoint.setdefault(endpoint, {})[lease_id] = reservation
        self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1
        if prompt_tokens and not self.prefill_tokens.get(endpoint):
            self.prefill_marks[endpoint] = now
        self.prefill_tokens[endpoint] = self.prefill_tokens.get(endpoint, 0) + prompt_tokens
        self.unstarted[endpoint] = self.unstarted.get(endpoint, 0) + 1
        if band:
            self.low_prefills[endpoint] = self.low_prefills.get(endpoint, 0) + 1
            self.low_prefill_tokens[endpoint] = (self.low_prefill_tokens.get(endpoint, 0)
                                                 + prompt_tokens)
        else:
            self.top_prefills += 1

    def first_token(self, lease_id: str, now: float) -> None:
        """The response's first chunk came back: the engine is done prefilling this request
        (for a non-streamed response that is its end). Idempotent; unknown ids are ignored."""
        reservation = self.reservations.get(lease_id)
        if reservation is not None:
            self._started(reservation, now, seen=reservation.streamed)
            if reservation.prefilling and reservation.streamed:
                mark = self.prefill_marks.get(reservation.endpoint, reservation.at)
                self._learn_prefill_rate(reservation.prefill,
                                         now - max(mark, reservation.at))
            self._prefilled(reservation, now)

    def release(self, lease_id: str, now: float, *, completed: bool = True,
                output_tokens: int | None = None) -> None:
        """A finished request frees its KV (and counts toward the drain rate); a reservation
        undone because the tenant's limits said no only disappears. ``output_tokens``: what
        it really produced, which teaches the tenant's :meth:`output_ratio`."""
        reservation = self.reservations.pop(lease_id, None)
        if reservation is None:
            return
        if reservation.start_seen and output_tokens and now > reservation.started_at:
            self._learn_decode_rate(output_tokens, now - reservation.started_at)
        self._started(reservation, now, seen=False)
        self._prefilled(reservation, now)
        del self.by_endpoint[reservation.endpoint][lease_id]
        self.in_flight[reservation.endpoint] = max(0, self.in_flight[reservation.endpoint] - 1)
        self.committed[reservation.endpoint] -= reservation.peak
        if completed:
            self.drain.add(reservation.tokens, now)
        reserved_output = reservation.tokens - reservation.prefill
        if output_tokens is not None and reserved_output > 0:
            share = min(1.0, output_tokens / reserved_output)
            self._learn_output(reservation.tenant, share)
            self.answers.setdefault(reservation.tenant, Answers()).add(share)

    def expected_peak(self, tenant: str, tokens: int, prompt_tokens: int) -> int:
        """The KV a request of ``tokens`` (``prompt_tokens`` of them its prompt) is
        expected to grow to: its prompt and its tenant's expected share of the rest."""
        output = max(0, tokens - prompt_tokens)
        return tokens - output + math.ceil(output * self.output_ratio(tenant))

    def output_ratio(self, tenant: str) -> float:
        """The share of its reserved output a request of ``tenant`` is expected to produce."""
        return self.output_ratios.get(tenant, 1.0)

    def fair_ratio(self, tenant: str, made: float = 0.0, overran: bool = False) -> float:
        """The share of its reserved output the fair order prices a request of ``tenant``
        at, given it has made ``made`` of it (0: not started, or just dispatched): the mean
        of the tenant's recent answers longer than that — its expected length given how far
        it got — or what it has made, when none was as long (all of it there moved the
        shares by up to 8%: a request whose progress at the pool's decode rate runs ahead
        of its own was charged all it reserved until it ended). Not :meth:`output_ratio`:
        that upper envelope keeps the KV safe, and as a price it charged ~0.97 where answers
        used 0.58 on average. Nor a plain mean at dispatch: the requests running at any moment are
        the long ones (the short ones ended), so a tenant running many of them was under-
        charged until they ended, and the shares moved with how many each ran (weighted-
        share error up to 15% against ≤ 7% for the envelope, ``bench.policy_sim --asks
        ceiling``). Priced again as it runs (the director, each ``FAIR_REPRICE_S``), the
        charges of the requests running are right on average whichever they are. A tenant
        with fewer than ``FAIR_MIN_ANSWERS`` answers: the envelope, or all of it for a
        request that ran past it (``overran``)."""
        answers = self.answers.get(tenant)
        if answers is None or len(answers) < FAIR_MIN_ANSWERS:
            return 1.0 if overran else self.output_ratio(tenant)
        mean = answers.mean_above(made)
        return made if mean is None else mean

    def fair_ratio_of(self, lease_id: str, now: float) -> float | None:
        """:meth:`fair_ratio` of a request in flight, from what it has made by ``now`` (at
        the pool's decode rate since it started); None for an unknown lease."""
        r = self.reservations.get(lease_id)
        if r is None:
            return None
        reserved = r.tokens - r.prefill
        made = 0.0
        if r.started and self.decode_rate and reserved > 0:
            made = min(1.0, self.decode_rate * max(0.0, now - r.started_at) / reserved)
        return self.fair_ratio(r.tenant, made, overran=r.peak >= r.tokens > r.prefill)

    def _learn_output(self, tenant: str, ratio: float) -> None:
        """An upper envelope of the tenant's produced ÷ reserved output: a longer answer
        raises it at once halfway, shorter ones lower it slowly — so its requests are
        expected to grow as far as its long ones recently did, and a client that sets a
        generous ``max_tokens`` and stops early does not leave the KV idle (start: 1, every
        reserved token). Per tenant: learned over the pool, one tenant's habit set everyone's
        estimate — a tenant sending ``max_tokens`` 30,000 for 200–1,000-token answers drove
        it to its floor, and other tenants' long answers were counted at a twentieth of
        their length (``bench.inflated_max_tokens``)."""
        current = self.output_ratio(tenant)
        rate = OUTPUT_RATIO_RISE if ratio > current else OUTPUT_RATIO_DECAY
        self.output_ratios[tenant] = max(MIN_OUTPUT_RATIO, current + rate * (ratio - current))

    def forget(self, tenants: list[str]) -> None:
        """Tenants a reload removed and that have nothing left: their learned ratios go."""
        for tenant in tenants:
            self.output_ratios.pop(tenant, None)
            self.answers.pop(tenant, None)

    def _learn_decode_rate(self, tokens: int, seconds: float) -> None:
        """Recent output tokens over recent decoding seconds — a ratio of averages, not an
        average of ratios: a short answer whose first and last chunk arrive together (a
        few tokens in microseconds) would otherwise teach a rate of millions of tokens per
        second, and every request in flight would count as nearly done."""
        weight = DECODE_RATE_WEIGHT if self._decode_seconds else 1.0
        self._decode_tokens += weight * (tokens - self._decode_tokens)
        self._decode_seconds += weight * (seconds - self._decode_seconds)
        self.decode_rate = self._decode_tokens / self._decode_seconds

    def _learn_prefill_rate(self, tokens: int, seconds: float) -> None:
        """Recent prompt tokens over recent prefill seconds (a ratio of averages, as for
        the decode rate: prompts finished in one step together count their tokens, not an
        infinite rate). Each sample is the time from the previous prefill's end there (or
        the request's own start) to this first token: the engine prefills its running
        requests in admission order."""
        weight = DECODE_RATE_WEIGHT if self._prefill_sample_seconds else 1.0
        self._prefill_sample_tokens += weight * (tokens - self._prefill_sample_tokens)
        self._prefill_sample_seconds += weight * (max(0.0, seconds)
                                                  - self._prefill_sample_seconds)
        if self._prefill_sample_seconds > 0:
            self.prefill_rate = self._prefill_sample_tokens / self._prefill_sample_seconds

    def prefill_ahead(self, endpoint: str, now: float) -> float:
        """Prompt tokens a request sent to ``endpoint`` now would wait behind: those in
        prefill there, less what has been prefilled since the head began (at the learned
        rate). The picker counts it so only in a pool that keeps no endpoint clear of batch
        prefill: where one is kept clear, interactive work belongs there, and an estimate
        that sends it behind a batch prompt thought nearly done measured worse (three more
        of the sixty matrix cells missed a bound; bench/README.md). The batch gate counts it
        the other way round: only where endpoints are kept clear (``_keep_clear``)."""
        tokens = self.prefill_tokens.get(endpoint, 0)
        if not tokens or not self.prefill_rate:
            return tokens
        done = self.prefill_rate * (now - self.prefill_marks.get(endpoint, now))
        return max(0.0, tokens - done)

    def _started(self, reservation: Reservation, now: float, *, seen: bool = True) -> None:
        """``seen``: ``now`` is when it started; not when a non-streamed answer is found
        ended (which a learned decode rate must not count as a decode in no time)."""
        if not reservation.started:
            reservation.started = True
            reservation.started_at = now
            reservation.start_seen = seen
            self.unstarted[reservation.endpoint] -= 1

    def _prefilled(self, reservation: Reservation, now: float) -> None:
        if not reservation.prefilling:
            return
        reservation.prefilling = False
        endpoint = reservation.endpoint
        self.prefill_tokens[endpoint] -= reservation.prefill
        if self.prefill_tokens[endpoint]:
            self.prefill_marks[endpoint] = now  # the next one in line begins
        else:
            self.prefill_marks.pop(endpoint, None)
        if reservation.band:
            self.low_prefills[endpoint] -= 1
            self.low_prefill_tokens[endpoint] -= reservation.prefill
        else:
            self.top_prefills -= 1

    # -- why nothing fits --------------------------------------------------------------------

    def _count_holds(self, usable: list[_Scraped], candidates: list[Candidate],
                     shared: list[Candidate], limit: int | None, ahead: float, band: int,
                     now: float) -> None:
        """A placement found no endpoint: count each endpoint under the first check that
        held it, in the order place() applies them (an operator's answer to "why does work
        wait?"). ``candidates``: those the KV check saw; ``shared``: those of them under the
        critical watermark that the tenant's KV share held (the others' KV was full)."""
        seen = {c.state.address for c in candidates}
        share_held = {c.state.address for c in shared}
        for e in usable:
            address = e.state.address
            reason = self._held_by(e, limit, ahead, band, now)
            if reason is None:
                reason = ("prefill_clear" if address not in seen
                          else "tenant_share" if address in share_held else "kv_cache")
            self._held(reason)

    def _held(self, reason: str, count: int = 1) -> None:
        self.holds[reason] = self.holds.get(reason, 0) + count

    def _held_by(self, e: _Scraped, limit: int | None, ahead: float, band: int,
                 now: float) -> str | None:
        """The first of the endpoint checks that holds it back from a request of ``band``
        (``HOLD_REASONS``), before its KV is looked at; None: it is a candidate."""
        address = e.state.address
        if not e.takes_work:
            return "engine_full"
        if not self._has_slot(address, limit):
            return "in_flight_cap"
        if not self._has_seq(address, band, now):
            return "sequence_kept"
        if not self._below_unstarted(address, ahead):
            return "engine_queue"
        return None

    # -- filters ---------------------------------------------------------------------------

    def _slot_limit(self, band: int) -> int | None:
        """Requests in flight per endpoint a request of ``band`` may join: band 0 gets the
        ``reserved_in_flight`` slots on top."""
        limit = self.config.max_in_flight
        if limit is None or not band:
            return limit
        return limit - self.config.reserved_in_flight

    def _unstarted_limit(self, band: int) -> float:
        """Requests an endpoint may have that have not started (sent, and neither a first
        token seen nor the engine reporting them admitted): band 0 may go one beyond."""
        limit = self.config.max_unstarted
        return math.inf if limit is None else limit + (0 if band else 1)

    def _below_unstarted(self, address: str, limit: float) -> bool:
        if self.unstarted.get(address, 0) < limit + self.gate_growth.get(address, 0):
            return True
        self._gated.add(address)
        return False

    def _adapt_gate(self, state: EndpointState) -> None:
        """Nothing waiting in the engine while the unstarted limit held work back: the limit
        doubles its growth (the engine starts work faster than kvgate sees it start); more
        waiting than ``max_unstarted`` (the queue the limit allows the engine): it halves.
        A few waiting is what an engine shows between its steps."""
        if state.metrics is None or not self.config.max_unstarted:
            return
        address = state.address
        waiting = _metric(state, "num_requests_waiting")
        if waiting > self.config.max_unstarted:
            self.gate_growth[address] = self.gate_growth.get(address, 0) // 2
        elif not waiting and address in self._gated:
            self.gate_growth[address] = min(MAX_GATE_GROWTH,
                                            2 * self.gate_growth.get(address, 0) or 1)
        self._gated.discard(address)

    def _has_seq(self, address: str, band: int, now: float) -> bool:
        """Lower-band work leaves one of the engine's sequences (when its limit is known)
        free for band 0, which would otherwise wait for a long request to finish — while
        a band-0 request has asked for an endpoint in the last ``TOP_IDLE_S`` — and lends
        it once a request running there is near its end (:meth:`_ends_soon`)."""
        cap = self.seq_caps.get(address)
        if cap is None or not band or now - (self.top_seen_at or now) > TOP_IDLE_S:
            return True
        running = self.in_flight.get(address, 0)
        if running < max(1, cap - 1):
            return True
        return running < cap and self._ends_soon(address, now)

    def _ends_soon(self, address: str, now: float) -> bool:
        """Whether one of the endpoint's started requests is expected to end within
        ``SEQ_LEND_WAIT_S`` or within the last ``SEQ_LEND_SHARE`` of its run (its expected
        output at the pool's decode rate; never, before that rate is known): a band-0
        request then waits at most that long for a sequence."""
        rate = self.decode_rate
        if not rate:
            return False
        for r in self.by_endpoint.get(address, {}).values():
            if r.started:
                run = (r.peak - r.prefill) / rate
                if r.started_at + run - now <= max(SEQ_LEND_WAIT_S, SEQ_LEND_SHARE * run):
                    return True
        return False

    def _has_slot(self, address: str, limit: int | None) -> bool:
        return limit is None or self.in_flight.get(address, 0) < limit

    def observe(self, snapshot: StoreSnapshot) -> None:
        """A scrape round ended: read what it says about the requests sent (started, the
        engine's sequence limit, its queue) now rather than at the next placement, which
        may come long after (the last of a burst would otherwise be seen started only at
        its end, and a start read late makes the learned decode rate too fast). A pool
        that is not KV-aware builds no view, so it forgets endpoints gone here."""
        if self.config.kv_aware:
            self._view(snapshot)
        else:
            self._forget_gone({s.address for s in snapshot.endpoints(self.config.name)})

    def _view(self, snapshot: StoreSnapshot) -> _PoolView:
        """The pool's endpoints as of ``snapshot``, built once per snapshot (a scrape round
        swaps in a new one) and kept while requests keep reading the same one."""
        view = self._cached_view
        if view is not None and view.snapshot is snapshot:
            return view
        states = snapshot.endpoints(self.config.name)
        for state in states:
            self._started_by_engine(state)
            self._learn_seq_cap(state)
            self._adapt_gate(state)
        self._overrunning(max((s.scraped_at or 0.0 for s in states), default=0.0))
        self._forget_gone({s.address for s in states})
        capacities = [s.kv_capacity_tokens for s in states if s.kv_capacity_tokens]
        endpoints = [_Scraped(s, s.usable_until(self.staleness_s), self._takes_work(s))
                     for s in states]
        self._cached_view = view = _PoolView(snapshot, endpoints, max(capacities, default=None))
        return view

    def _forget_gone(self, live: set[str]) -> None:
        """What was learnt of endpoints the pool no longer has (DNS dropped them: a pod
        replaced, with a new address), once nothing sent there is in flight: every rollout
        would otherwise leave its old addresses in each per-endpoint table for good."""
        tables: list[dict[str, Any]] = [
            self.by_endpoint, self.in_flight, self.unstarted, self.committed,
            self.prefill_tokens, self.prefill_marks, self.low_prefills,
            self.low_prefill_tokens, self.seq_caps, self.gate_growth, self._plateaus]
        gone = {address for table in tables for address in table
                if address not in live and not self.by_endpoint.get(address)}
        for address in gone:
            for table in tables:
                table.pop(address, None)
            self._seq_seeded.discard(address)
            self._gated.discard(address)

    def _started_by_engine(self, state: EndpointState) -> None:
        """The engine's waiting count says how many of the requests sent before its scrape
        it has not admitted yet, so the others (oldest first) have started — the only sign
        a non-streamed request gives before it ends (it is then no longer counted as in
        prefill either; a streamed one is, until its first token)."""
        if state.metrics is None or state.scraped_at is None:
            return
        sent = [r for r in self.by_endpoint.get(state.address, {}).values()
                if not r.started and r.at <= state.scraped_at]
        waiting = int(_metric(state, "num_requests_waiting"))
        for reservation in sent[: max(0, len(sent) - waiting)]:
            self._started(reservation, state.scraped_at)
            if not reservation.streamed:
                self._prefilled(reservation, state.scraped_at)

    def _learn_seq_cap(self, state: EndpointState) -> None:
        """vLLM runs at most ``--max-num-seqs`` requests at once and does not export it. When
        the engine keeps requests waiting at one running count, scrape after scrape, while it
        is prefilling none of kvgate's requests (a long prefill also keeps work waiting) and
        its free KV would hold every prompt kvgate has waiting there (else it is short of KV,
        not of sequences), that count is its limit. Running more later unlearns it. A
        configured ``max_num_seqs`` is the limit an endpoint starts with."""
        address = state.address
        if address not in self._seq_seeded:
            self._seq_seeded.add(address)
            if self.config.max_num_seqs:
                self.seq_caps[address] = self.config.max_num_seqs
        if state.metrics is None or not self.config.max_unstarted:
            return
        running = int(_metric(state, "num_requests_running"))
        cap = self.seq_caps.get(address)
        if cap is not None and running > cap:
            del self.seq_caps[address]
        if not running or not _metric(state, "num_requests_waiting") or (
                not self._short_of_seqs_only(state)):
            self._plateaus.pop(address, None)
            return
        seen, scraped_at, count = self._plateaus.get(address, (running, None, 0))
        if scraped_at == state.scraped_at:
            return  # the same scrape, seen again
        count = count + 1 if seen == running else 1
        self._plateaus[address] = (running, state.scraped_at, count)
        if count >= SEQ_PLATEAU_SCRAPES:
            self.seq_caps[address] = running

    def _short_of_seqs_only(self, state: EndpointState) -> bool:
        """Whether the engine is prefilling none of kvgate's requests (admitted, first token
        not seen) and its free KV would hold every prompt kvgate sent it that has not
        started (unknown capacity: only below the high watermark)."""
        waiting = 0
        for r in self.by_endpoint.get(state.address, {}).values():
            if r.started and r.prefilling:
                return False
            if not r.started:
                waiting += r.prefill
        usage = state.kv_cache_usage or 0.0
        capacity = state.kv_capacity_tokens
        if not capacity:
            return usage < self.config.watermarks.high
        return (1 - usage) * capacity >= 2 * waiting  # vLLM admits by blocks: leave slack

    def _takes_work(self, state: EndpointState) -> bool:
        marks = self.config.watermarks
        usage = state.kv_cache_usage
        if usage is not None and usage >= marks.critical:
            return False
        gpu = state.current_gpu_memory_used_ratio(self.staleness_s)
        if gpu is not None and gpu >= marks.gpu_memory_critical:
            return False
        return marks.max_waiting is None or _metric(state, "num_requests_waiting") <= (
            marks.max_waiting)

    def _kept_clear(self, usable: list[_Scraped]) -> int:
        """How many endpoints ``prefill_clear_share`` keeps clear of lower-band prefill
        (none in a pool too small for it)."""
        return int(self.config.prefill_clear_share * len(usable))

    def _keep_clear(self, candidates: list[Candidate], usable: list[_Scraped], now: float
                    ) -> list[Candidate]:
        """Lower-band work: each endpoint takes it only while about one step of lower-band
        prefill is ahead there (``max_num_batched_tokens``): band 0 then waits behind that
        much, not behind every batch prompt sent there. Where endpoints are kept clear, what
        is left of that prefill counts (``prefill_ahead``: an endpoint whose batch prompt is
        in its last chunk takes the next), and once only ``prefill_clear_share`` of the
        usable endpoints are left with no lower-band prefill, only endpoints already
        prefilling such work take more — or none, and it waits (an endpoint kept clear stays
        clear). A pool too small to keep one clear counts every lower-band prompt token in
        prefill (counting what is left there measured worse: interactive work has no clear
        endpoint to go to)."""
        keep = self._kept_clear(usable)
        budget = self.config.max_num_batched_tokens
        if budget is not None:
            candidates = [c for c in candidates
                          if self._low_prefill_ahead(c.state.address, now, bool(keep)) < budget]
        if not keep:
            return candidates
        clear = sum(1 for e in usable if not self.low_prefills.get(e.state.address, 0))
        if clear > keep:
            return candidates
        return [c for c in candidates if self.low_prefills.get(c.state.address, 0)]

    def _low_prefill_ahead(self, endpoint: str, now: float, left_only: bool) -> float:
        """Lower-band prompt tokens in prefill at ``endpoint``; ``left_only``: less what has
        been prefilled there since the head began (``prefill_ahead``)."""
        tokens = self.low_prefill_tokens.get(endpoint, 0)
        return min(tokens, self.prefill_ahead(endpoint, now)) if left_only else tokens

    def _candidate(self, state: EndpointState, tokens: int, now: float,
                   committed_bound: bool = True, prompt: int | None = None) -> Candidate:
        """``committed_bound``: the KV committed to requests in flight binds (not for band 0
        on a priority-scheduled engine: if the cache fills before they end, the engine
        preempts lower-priority work, and an interactive request should not wait for KV a
        batch request may only need later; it goes when its whole reservation fits now, or
        when it passes as bound work does). ``prompt``: of ``tokens``, if known."""
        capacity = state.kv_capacity_tokens
        usage = state.kv_cache_usage or 0.0
        marks = self.config.watermarks
        if not capacity:
            return Candidate(state, usage, usage < marks.high, usage <= marks.critical)
        pending, scraped_at = 0, state.scraped_at or 0
        for r in reversed(self.by_endpoint.get(state.address, {}).values()):
            if r.at <= scraped_at:
                break  # this one and all older ones are in the scraped usage already
            pending += r.tokens
        # Usage after: as if those sent since the scrape held their whole reservations at
        # once, which keeps a burst from filling the engine's own queue and cache faster
        # than kvgate's fair order decides. The new request counts only the blocks its
        # prompt takes when the engine admits it: its output is checked where it will be
        # held, at the future peak below (counting it now as well held 1,024-token caches at
        # ~0.7 used while the peak had room, a tenth of the batch throughput in the
        # real-time benchmark). Without a known prompt it counts whole.
        block = int(_metric(state, "kv_block_tokens"))
        held = usage * capacity + pending
        whole = (held + tokens) / capacity
        admitted = whole  # what the engine needs to admit it
        if prompt is not None and prompt < tokens:
            admitted = (held + in_blocks(prompt, block)) / capacity
        after = admitted
        # The scrape shows what running requests hold now; they keep growing as they decode.
        # Past the cache's capacity the engine may run out of blocks and preempt before they
        # end: that takes nothing, however low the scraped usage.
        blocks = (len(self.by_endpoint.get(state.address, {})) + 1) * block
        if (self.committed.get(state.address, 0) + tokens + blocks
                + usage * capacity > capacity):
            committed = self._future_peak(state, now, tokens, prompt) / capacity
            if committed > 1.0:
                after = max(after, committed)
        if not committed_bound:  # or, free of the bound, as a whole now
            after = min(after, whole)
        within = after <= marks.critical
        if not committed_bound and not within and held / capacity <= marks.critical:
            # an endpoint within the critical watermark takes it past it while its prompt's
            # blocks are free now and the future peak of the band-0 work there with it fits:
            # the engine preempts lower-priority work as the cache fills. A critical
            # watermark smaller than one prompt (a 1,024-token cache: 5% is 51 tokens) held
            # interactive work in kvgate's queue for seconds while the engine had the blocks.
            within = admitted <= 1.0 and self._future_peak(
                state, now, tokens, prompt, top_only=True) <= capacity
        return Candidate(state, after, after <= marks.high, within)

    def _future_peak(self, state: EndpointState, now: float, tokens: int,
                     prompt: int | None, top_only: bool = False) -> int:
        """The most KV the endpoint's requests in flight (``top_only``: its band-0 ones,
        which its engine does not preempt for a new band-0 request) and a new one of
        ``tokens`` (``prompt`` of them) are expected to hold at once, with what the scrape
        shows that kvgate's requests do not explain. A request whose prompt and output are
        not known apart is counted as holding all its KV until every other one ends."""
        block = int(_metric(state, "kv_block_tokens"))
        scraped_at = state.scraped_at or 0.0
        held: list[tuple[int, int]] = []
        # what the scrape shows that kvgate's requests do not explain (another replica's or
        # a client's straight to the engine): held throughout
        unexplained = (state.kv_cache_usage or 0.0) * (state.kv_capacity_tokens or 0)
        throughout = 0
        if prompt is None or prompt >= tokens:
            throughout += tokens + block
        else:
            held.append((tokens - prompt, prompt))
        for r in self.by_endpoint.get(state.address, {}).values():
            whole = r.peak <= r.prefill or not r.prefill  # prompt and output not known apart
            if r.started and r.started_at <= scraped_at:  # in the scrape: explained, in the
                # whole blocks the engine holds for it (its block is counted below as well)
                unexplained -= in_blocks(
                    r.peak if whole else r.prefill + self._made(r, scraped_at), block)
            if top_only and r.band:
                continue
            if whole:
                throughout += r.peak + block
            else:
                made = self._made(r, now)
                held.append((r.peak - r.prefill - made, r.prefill + made))
        return throughout + max(0, int(unexplained)) + future_peak(held, block)

    def _overrunning(self, now: float) -> None:
        """Requests that have run past the output their tenant's answers were expected to
        make (at the pool's decode rate): each now counts its whole reservation, and the
        tenant's expected share rises toward what it has made so far — at once, not when
        it ends. A tenant whose answers were short for minutes and then turned long was
        otherwise expected short (its KV under-committed, and its new requests charged a
        twentieth of their output in the fair order) until its first long answer ended:
        the engines preempted, and it got ahead of the others' share meanwhile."""
        if not self.decode_rate:
            return
        for r in self.reservations.values():
            reserved = r.tokens - r.prefill
            if not r.started or not r.prefill or r.peak >= r.tokens or reserved <= 0:
                continue
            made = min(reserved, int(self.decode_rate * max(0.0, now - r.started_at)))
            if made > r.peak - r.prefill:
                self.committed[r.endpoint] += r.tokens - r.peak
                r.peak = r.tokens
                self._learn_output(r.tenant, made / reserved)
                self.overran.append(r.lease_id)

    def take_overran(self) -> list[str]:
        """The requests found running past their expected output since the last call (the
        director charges their tenants' fair order for it)."""
        taken, self.overran = self.overran, []
        return taken

    def _made(self, r: Reservation, at: float) -> int:
        """Output tokens a started request is estimated to have made by ``at`` (0 before the
        pool's decode rate is known), at most its expected output."""
        if not r.started or not self.decode_rate:
            return 0
        return min(r.peak - r.prefill, int(self.decode_rate * max(0.0, at - r.started_at)))

    def _over_share(self, tenant: str, peak: int) -> bool:
        """Whether ``tenant``, with a new request expected to grow to ``peak``, would hold
        more than its weighted share of the KV the pool's requests are expected to grow to.
        Expected, not reserved: counted by ``max_tokens``, a tenant that sets it far above
        its answers was over its share whenever it ran at all, while the fair order (which
        charges what requests are expected to use) had it behind — and a tenant behind
        holds the others back, so their interactive work waited for its batch work."""
        held: dict[str, int] = {tenant: peak}
        for r in self.reservations.values():
            held[r.tenant] = held.get(r.tenant, 0) + r.peak
        if len(held) == 1:
            return False  # alone in the pool: nobody to share with
        total_weight = sum(self.weights.get(t, 1.0) for t in held)
        share = self.weights.get(tenant, 1.0) / total_weight
        return held[tenant] / sum(held.values()) > share

    # -- scorers and picker ----------------------------------------------------------------

    def _ranked(self, candidates: list[Candidate], now: float | None, rng: random.Random
                ) -> list[Candidate]:
        """``now``: count only what is left of the prefill under way (else all of it)."""
        weights = self.config.scoring
        waiting = [_metric(c.state, "num_requests_waiting") for c in candidates]
        running = [_metric(c.state, "num_requests_running") for c in candidates]
        prefill = [float(self.prefill_tokens.get(c.state.address, 0)) if now is None
                   else self.prefill_ahead(c.state.address, now) for c in candidates]
        most_waiting, most_running = max(waiting) + 1, max(running) + 1
        most_prefill = max(prefill) + 1
        scored = [
            (weights.kv_usage * min(c.usage_after, 1.0)
             + weights.waiting * w / most_waiting
             + weights.running * r / most_running
             + weights.prefill * p / most_prefill, rng.random(), c)
            for c, w, r, p in zip(candidates, waiting, running, prefill, strict=True)
        ]
        return [c for _, _, c in sorted(scored, key=lambda item: item[:2])]

    def _least_in_flight(
        self, snapshot: StoreSnapshot, now: float, tokens: int, rng: random.Random, band: int
    ) -> Placement | Reject:
        states = snapshot.endpoints(self.config.name)
        addresses = [s.address for s in states] or list(self.config.endpoints)
        if not addresses:
            return refuse(Reason.NO_ENDPOINT,
                          f"pool '{self.config.name}' has no endpoints", MIN_RETRY_MS)
        limit = self._slot_limit(band)
        free = [a for a in addresses if self._has_slot(a, limit)]
        if not free:
            self._held("in_flight_cap", len(addresses))
            return self._saturated(tokens, now)
        addresses = free
        rng.shuffle(addresses)
        addresses.sort(key=lambda a: self.in_flight.get(a, 0))
        return Placement(addresses[: 1 + FALLBACKS])

    # -- when to come back -----------------------------------------------------------------

    def _none_ready(self, view: _PoolView) -> Reject:
        """No endpoint is fresh. Reachable ones whose numbers only aged (an engine too busy
        to answer its ``/metrics`` in time) make the request wait in the queue for the next
        scrape, like a full pool; none reachable, or none scraped yet, is a 503 at once."""
        if any(e.fresh_until > -math.inf for e in view.endpoints):
            return refuse(Reason.SATURATED,
                          f"pool '{self.config.name}': no endpoint's metrics are fresh "
                          "(busy engines answer their scrapes late)", MIN_RETRY_MS)
        return refuse(Reason.NO_ENDPOINT,
                      f"no endpoint of pool '{self.config.name}' is ready", MIN_RETRY_MS)

    def _saturated(self, tokens: int, now: float) -> Reject:
        return refuse(Reason.SATURATED,
                      f"pool '{self.config.name}' is saturated (no endpoint has room)",
                      self.retry_ms(tokens, now))

    def retry_ms(self, tokens: int, now: float, *, promise: bool = False) -> int:
        """Time for the pool to drain this request's worth of KV at the recent drain rate.
        ``promise``: the answer goes to a client, so it takes the next slot of the pool's
        schedule (``limiter.herd``): refused clients come back one drain-time apart."""
        rate = self.drain.per_second(now)
        if rate <= 0:
            return MIN_RETRY_MS
        need = max(1, math.ceil(1000 * tokens / rate))
        wait = max(MIN_RETRY_MS, need)
        if promise:
            now_ms = int(now * 1000)
            wait = herd_wait(now_ms, wait, self.retry_slot_ms, need)
            self.retry_slot_ms = now_ms + min(MAX_RETRY_MS, wait)
        return min(MAX_RETRY_MS, wait)


def _metric(state: EndpointState, name: str) -> float:
    value = getattr(state.metrics, name, None) if state.metrics else None
    return float(value or 0)


def in_blocks(tokens: int, block: int) -> int:
    """The KV an engine holds for ``tokens``: whole blocks of ``block`` tokens (0: exact)."""
    return ceil_div(tokens, block) * block if block > 0 else tokens


def future_peak(held: list[tuple[int, int]], block: int = 0) -> int:
    """The largest total KV of requests that each hold ``now`` tokens and will make
    ``remaining`` more, one per engine step all together (``held``: ``(remaining, now)``
    pairs), each freeing all of it when it ends. The total only grows until a request ends,
    so it peaks just before one does: when the one with ``remaining`` r ends, every request
    with at least r left holds its ``now`` + r. ``block``: the engine's KV block size; each
    request may hold up to one block more than its tokens."""
    peak = total = 0
    for count, (remaining, now) in enumerate(sorted(held, reverse=True), start=1):
        total += now + block
        peak = max(peak, total + remaining * count)
    return peak
