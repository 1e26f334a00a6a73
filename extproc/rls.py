"""The Envoy Rate Limit Service (``envoy.service.ratelimit.v3.RateLimitService``) on kvgate's
gRPC port, for Envoy's ``ratelimit`` filter.

The rules are the ``ratelimit:`` section (descriptor trees per domain, matched by
:mod:`limiter.ratelimit`); the counters live where admission's do (this process, or Redis
for limits shared by every replica). One ``ShouldRateLimit`` is one store call: every
descriptor of it is checked and charged at once, all or nothing.

Costs follow Envoy's proto: a descriptor's own ``hits_addend`` wins, else the request's,
where 0 (unset) means 1; a descriptor's explicit 0 only checks (it is refused when not even
one unit is left). An answer lost to a timeout is undone (:meth:`RateCounters.cancel`) and
reported to Envoy as UNAVAILABLE, whose ``failure_mode_deny`` then decides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf.duration_pb2 import Duration

from extproc.config import RateLimitSettings, RlsDescriptor
from extproc.metrics import Metrics
from extproc.protowire import parse_lenient
from limiter.breaker import Breakers, CircuitBreaker, Transition
from limiter.buckets import ceil_div
from limiter.clock import monotonic_ms
from limiter.ratelimit import (
    Algorithm,
    Hit,
    Limit,
    Node,
    Rule,
    Verdict,
    counter_key,
    match,
)
from limiter.stores.base import StoreUnavailable
from limiter.stores.failover import BREAKER_IDLE_MS
from limiter.stores.ratelimit import RateCounters

log = logging.getLogger(__name__)
SERVICE = "envoy.service.ratelimit.v3.RateLimitService"

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
MAX_UINT32 = 2**32 - 1
# The most a proto Duration may hold (10,000 years, google/protobuf/duration.proto): a reset
# further away (a debt rule charged an absurd usage) is answered as this.
MAX_DURATION_MS = 315_576_000_000 * 1000
# a cancel is retried until the store confirms it: a call queued in a Redis paused for
# longer than any fixed number of tries runs when Redis resumes, and its charge stayed. The
# pause between tries doubles up to the longest, far below the call's record (CALL_TTL_MS,
# 10 s), so a cancel lands while the record of a late call that just ran still lives.
CANCEL_PAUSE_S = 0.25
CANCEL_MAX_PAUSE_S = 2.0
# cancels retried at once, at most: past it (a long outage under load) a failed call's
# charge may stay in the store, which only errs on the strict side (Envoy denied the
# request already, under failure_mode_deny); without a bound each failed call kept a task
# and a connection attempt alive for as long as the outage
MAX_PENDING_CANCELS = 1024
# the most descriptors one call may carry, and entries one descriptor: Envoy sends one per
# rate limit action of the route (a handful); without a bound one hostile call of 100,000
# held the event loop, every tenant's admissions with it, for 1–2 s
MAX_DESCRIPTORS = 256
MAX_ENTRIES = 64
_UNITS = {name.lower(): number for name, number in rls_pb2.RateLimitResponse.RateLimit.Unit.items()}


def build_domains(settings: RateLimitSettings) -> dict[str, Node]:
    """The ``ratelimit:`` section as one descriptor tree per domain."""
    domains = {}
    for d, domain in enumerate(settings.domains):
        root = Node()
        _add(root, domain.descriptors, f"ratelimit.domains[{d}]")
        domains[domain.domain] = root
    return domains


def _add(parent: Node, descriptors: Sequence[RlsDescriptor], path: str) -> None:
    for i, desc in enumerate(descriptors):
        here = f"{path}.descriptors[{i}]"
        node = parent.child(desc.key, desc.value)
        spec = desc.rate_limit
        if spec is not None:
            limit = None if spec.unlimited else Limit(
                spec.requests_per_unit or 0, spec.unit or "second", Algorithm(spec.algorithm),
                spec.burst, spec.debt)
            node.rule = Rule(limit, spec.name, tuple(r.name for r in spec.replaces),
                             desc.shadow_mode, here)
        _add(node, desc.descriptors, here)


@dataclass
class _Entry:
    """One request descriptor on its way to an answer."""

    rule: Rule | None
    hit: Hit | None = None
    verdict: Verdict | None = None


def _cost(descriptor: ratelimit_pb2.RateLimitDescriptor, request_hits: int) -> int:
    """The descriptor's ``hits_addend`` (a wrapper: an explicit 0 is a check), else the
    request's. A descriptor's is a uint64 and is capped at the request's range (uint32):
    no limit can hold more, and a larger charge would lose exactness in Redis's Lua
    numbers."""
    if descriptor.HasField("hits_addend"):
        return min(int(descriptor.hits_addend.value), MAX_UINT32)
    return request_hits


def _only_look(entries: list[_Entry]) -> None:
    """The call is refused already (a ``requests_per_unit: 0`` limit, which never reaches
    the store): its other hits become shadow checks, so the store reports their state and
    charges nothing — a refused call costs nothing. Sent as they were, the store saw every
    one of them fit and charged them all: a client refused outright spent its other limits.
    ``debt`` hits stay as they are (always charged)."""
    for entry in entries:
        if entry.hit is not None and not entry.hit.limit.debt:
            entry.hit = dataclasses.replace(entry.hit, cost=0, shadow=True)


def _override(descriptor: ratelimit_pb2.RateLimitDescriptor) -> Rule | None:
    """A limit sent by Envoy with the descriptor (route ``limit`` override): counted in a
    token bucket of its own (a fixed window when it is too slow for one)."""
    if not descriptor.HasField("limit"):
        return None
    override = descriptor.limit
    units = rls_pb2.RateLimitResponse.RateLimit.Unit
    if override.unit not in units.values():  # a unit this proto does not know: as UNKNOWN
        return None
    unit = units.Name(override.unit).lower()
    if unit not in _UNITS or unit == "unknown":
        return None
    limit = Limit(override.requests_per_unit, unit)
    try:
        if limit.requests_per_unit:
            limit.rate()
    except ValueError:
        limit = Limit(override.requests_per_unit, unit, Algorithm.FIXED_WINDOW)
    return Rule(limit, path="override")


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):
    def __init__(
        self, settings: RateLimitSettings, counters: RateCounters, *, timeout_s: float | None,
        metrics: Metrics | None = None, breaker: CircuitBreaker | None = None,
        clock_ms: Callable[[], int] = monotonic_ms,
    ) -> None:
        """``breaker``: the settings of each domain's circuit breaker (Redis: a domain's
        counters share one hash tag, so one Redis Cluster node); None: the counters never
        fail (memory)."""
        self.domains = build_domains(settings)
        self.counters = counters
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._breakers = None if breaker is None else Breakers(breaker)
        self.clock_ms = clock_ms
        self._prefix = secrets.token_hex(6)
        self._ids = itertools.count()
        self._cancels: set[asyncio.Task[None]] = set()
        self._failing = False  # the store's last call failed: logged once per outage
        self._uncancelled = 0  # calls left uncancelled in this outage (past the bound)

    def attach(self, server: grpc.aio.Server) -> None:
        """Serve on ``server`` (kvgate's gRPC port, beside ext_proc): the generated
        ``add_RateLimitServiceServicer_to_server``, with descriptor values that are not
        UTF-8 repaired rather than failing the call (which Envoy would let through)."""
        handlers = {"ShouldRateLimit": grpc.unary_unary_rpc_method_handler(
            self.ShouldRateLimit,
            request_deserializer=functools.partial(parse_lenient, rls_pb2.RateLimitRequest),
            response_serializer=rls_pb2.RateLimitResponse.SerializeToString,
        )}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest | None, context: grpc.aio.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        if request is None:  # bytes that do not parse (parse_lenient)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the request does not parse as a RateLimitRequest")
        assert request is not None
        if not request.domain or not request.descriptors:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a rate limit request needs a domain and descriptors")
        if len(request.descriptors) > MAX_DESCRIPTORS or any(
                len(d.entries) > MAX_ENTRIES for d in request.descriptors):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a rate limit request may carry at most {MAX_DESCRIPTORS} "
                                f"descriptors of at most {MAX_ENTRIES} entries each")
        entries = self._plan(request)
        # a descriptor sent twice is one counter charged once with both costs
        hits: dict[str, Hit] = {}
        for entry in entries:
            if entry.hit is not None:
                seen = hits.get(entry.hit.key)
                hits[entry.hit.key] = entry.hit if seen is None else dataclasses.replace(
                    seen, cost=seen.cost + entry.hit.cost)
        if hits:
            verdicts = await self._charge(request.domain, list(hits.values()), context)
            by_key = dict(zip(hits, verdicts, strict=True))
            for entry in entries:
                if entry.hit is not None:
                    entry.verdict = by_key[entry.hit.key]
        response = _response(entries)
        self._count(request.domain, entries, response)
        return response

    def _count(
        self, domain: str, entries: list[_Entry], response: rls_pb2.RateLimitResponse
    ) -> None:
        if self.metrics is None:
            return
        label = domain if domain in self.domains else "other"
        for entry, status in zip(entries, response.statuses, strict=True):
            self.metrics.ratelimit.add((label, _code(entry, status)))

    def _plan(self, request: rls_pb2.RateLimitRequest) -> list[_Entry]:
        """Each descriptor's rule (most specific match; replaced ones dropped) and hit."""
        root = self.domains.get(request.domain)
        request_hits = request.hits_addend or 1
        entries = []
        for descriptor in request.descriptors:
            pairs = [(e.key, e.value) for e in descriptor.entries]
            override = _override(descriptor) if root is not None else None
            rule = override or (match(root, pairs) if root is not None else None)
            entry = _Entry(rule)
            if rule is not None and rule.limit is not None:
                key = counter_key(request.domain, pairs, override and override.limit)
                entry.hit = Hit(key, rule.limit, _cost(descriptor, request_hits),
                                rule.shadow_mode)
            entries.append(entry)
        replaced = {name for e in entries if e.rule for name in e.rule.replaces}
        for entry in entries:
            if entry.rule is not None and entry.rule.name and entry.rule.name in replaced:
                entry.rule = entry.hit = None
            elif entry.hit is not None and entry.hit.limit.requests_per_unit == 0:
                entry.verdict, entry.hit = Verdict(False, 0, entry.hit.limit.unit_ms, None), None
        if any(e.verdict is not None and e.rule is not None and not e.rule.shadow_mode
               for e in entries):
            _only_look(entries)
        return entries

    async def _charge(
        self, domain: str, hits: list[Hit], context: grpc.aio.ServicerContext
    ) -> list[Verdict]:
        call_id = f"{self._prefix}{next(self._ids)}"
        breaker, allowed = self._allow(domain)
        if not allowed:  # Redis is failing: answered at once, nothing sent to cancel
            self._failed(domain, hits, None, "its circuit breaker is open")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "rate limit store unavailable")
        try:
            async with asyncio.timeout(self.timeout_s):
                verdicts = await self.counters.hit(domain, hits, call_id)
        except asyncio.CancelledError:
            # Envoy gave up first (its ratelimit timeout, 100 ms, is below a redis.timeout_ms
            # above it): the call may still run in Redis, so it is undone like one that timed
            # out. Uncancelled, some such charges stayed and others never ran, none counted.
            self._failed(domain, hits, call_id, "the call was abandoned by Envoy", breaker)
            raise
        except (StoreUnavailable, TimeoutError, OSError) as exc:
            self._failed(domain, hits, call_id, exc if str(exc) else repr(exc), breaker)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "rate limit store unavailable")
            raise  # abort raises; this keeps the type checker informed
        if breaker is not None:
            _log_transition(domain, breaker.success())
        if self._failing:
            self._failing = False
            log.info("ratelimit store answers again (%d call(s) could not be cancelled "
                     "meanwhile)", self._uncancelled)
            self._uncancelled = 0
        return verdicts

    def _allow(self, domain: str) -> tuple[CircuitBreaker | None, bool]:
        """``domain``'s breaker (None without one) and whether this call may go to Redis."""
        if self._breakers is None:
            return None, True
        breaker, allowed, transition = self._breakers.allow(domain, self.clock_ms())
        _log_transition(domain, transition)
        return breaker, allowed

    def breakers_open(self) -> int:
        """``kvgate_ratelimit_breaker_open``, read at each scrape: domains whose breaker is
        open or half-open and was asked within ``BREAKER_IDLE_MS``."""
        if self._breakers is None:
            return 0
        return self._breakers.open_count(self.clock_ms(), BREAKER_IDLE_MS)

    def _failed(self, domain: str, hits: list[Hit], call_id: str | None, why: object,
                breaker: CircuitBreaker | None = None) -> None:
        """A call without an answer: its cancel sent (``call_id`` None: it never left), the
        breaker told, the outage logged and counted."""
        if breaker is not None:
            _log_transition(domain, breaker.failure(self.clock_ms()))
        if call_id is not None:
            self._cancel_soon(domain, hits, call_id)
        if not self._failing:  # one line per outage: every call of a busy one failed
            self._failing = True
            log.warning("ratelimit store failed (%s); Envoy's failure_mode_deny decides "
                        "until it answers (kvgate_ratelimit_descriptors_total{code=\"error\"} "
                        "counts the calls)", why)
        if self.metrics is not None:
            label = domain if domain in self.domains else "other"
            self.metrics.ratelimit.add((label, "error"), len(hits))

    def _cancel_soon(self, domain: str, hits: list[Hit], call_id: str) -> None:
        if len(self._cancels) < MAX_PENDING_CANCELS:
            task = asyncio.create_task(self._cancel(domain, hits, call_id))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            return
        self._uncancelled += 1
        if self._uncancelled == 1:  # one line per outage (a busy one skips thousands)
            log.error("ratelimit call %s cannot be cancelled (%d cancels already wait for the "
                      "store): its charge may stay; further ones are counted, not logged, "
                      "until the store answers", call_id, MAX_PENDING_CANCELS)

    async def _cancel(self, domain: str, hits: list[Hit], call_id: str) -> None:
        """Undo a call that may still run in the store, until the store confirms: however
        long Redis stays paused, the late call runs when it resumes (see CANCEL_PAUSE_S)."""
        pause = CANCEL_PAUSE_S
        while True:
            try:
                async with asyncio.timeout(max(self.timeout_s or 0, 0.5)):
                    await self.counters.cancel(domain, hits, call_id)
                return
            except (StoreUnavailable, TimeoutError, OSError):
                await asyncio.sleep(pause)
                pause = min(2 * pause, CANCEL_MAX_PAUSE_S)

    async def close(self) -> None:
        for task in list(self._cancels):
            task.cancel()
        await self.counters.close()


def _log_transition(domain: str, transition: Transition | None) -> None:
    if transition is not None:
        log.warning("ratelimit domain %s: Redis circuit breaker %s → %s", domain,
                    transition.old.value, transition.new.value)


def _code(entry: _Entry, status: rls_pb2.RateLimitResponse.DescriptorStatus) -> str:
    """The metric's code for one descriptor."""
    if entry.rule is None:
        return "no_rule"
    if entry.rule.limit is None:
        return "unlimited"
    if status.code == OVER_LIMIT:
        return "over_limit"
    return "shadow_over_limit" if entry.verdict and not entry.verdict.fits else "ok"


def _status(entry: _Entry) -> rls_pb2.RateLimitResponse.DescriptorStatus:
    rule, verdict = entry.rule, entry.verdict
    if rule is None or rule.limit is None or verdict is None:
        # no rule, or unlimited: envoyproxy/ratelimit answers OK without a limit
        remaining = MAX_UINT32 if rule is not None else 0
        return rls_pb2.RateLimitResponse.DescriptorStatus(code=OK, limit_remaining=remaining)
    over = not verdict.fits and not rule.shadow_mode
    return rls_pb2.RateLimitResponse.DescriptorStatus(
        code=OVER_LIMIT if over else OK,
        current_limit=rls_pb2.RateLimitResponse.RateLimit(
            name=rule.name, requests_per_unit=rule.limit.requests_per_unit,
            unit=_UNITS[rule.limit.unit]),
        limit_remaining=min(verdict.remaining, MAX_UINT32),
        duration_until_reset=_duration(verdict.reset_ms),
    )


def _duration(ms: int) -> Duration:
    ms = min(max(ms, 0), MAX_DURATION_MS)
    return Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def _response(entries: list[_Entry]) -> rls_pb2.RateLimitResponse:
    statuses = [_status(e) for e in entries]
    over = any(s.code == OVER_LIMIT for s in statuses)
    return rls_pb2.RateLimitResponse(
        overall_code=OVER_LIMIT if over else OK,
        statuses=statuses,
        response_headers_to_add=[base_pb2.HeaderValue(key=k, value=v)
                                 for k, v in _headers(entries, statuses)],
    )


def _headers(
    entries: list[_Entry], statuses: list[rls_pb2.RateLimitResponse.DescriptorStatus]
) -> list[tuple[str, str]]:
    """``x-ratelimit-limit/remaining/reset`` of the tightest limit (refusing ones first,
    then the fewest remaining), and on a refusal ``retry-after(-ms)``: this client's slot in
    the herd's schedule (:func:`limiter.ratelimit.schedule`; alone, when every refusing
    limit has room again), or ``x-should-retry: false`` if one never will."""
    limited = [(s, e) for s, e in zip(statuses, entries, strict=True)
               if s.HasField("current_limit")]
    if not limited:
        return []
    tightest, _ = min(limited, key=lambda p: (p[0].code != OVER_LIMIT, p[0].limit_remaining))
    reset_ms = tightest.duration_until_reset.ToMilliseconds()
    headers = [("x-ratelimit-limit", str(tightest.current_limit.requests_per_unit)),
               ("x-ratelimit-remaining", str(tightest.limit_remaining)),
               ("x-ratelimit-reset", str(ceil_div(reset_ms, 1000)))]
    waits = [e.verdict.wait_ms for s, e in limited if s.code == OVER_LIMIT and e.verdict]
    if not waits:
        return headers
    if None in waits:
        return [*headers, ("x-should-retry", "false")]
    wait_ms = min(max(w for w in waits if w is not None), MAX_DURATION_MS)  # as the reset
    return [*headers, ("retry-after", str(max(1, ceil_div(wait_ms, 1000)))),
            ("retry-after-ms", str(wait_ms))]
