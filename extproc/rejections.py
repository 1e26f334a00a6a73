"""What a client sees when kvgate says no: status, OpenAI-style JSON, and retry headers.

The one place a refusal becomes HTTP: :func:`rejection` for every :class:`limiter.Reject`
(the tenant's limits, the scheduler, flow control), :func:`client_error` for bad input,
:func:`unavailable` when the shared limits cannot be reached, :func:`internal_error` for
kvgate's own bugs.

Clients (openai-python and friends) read ``retry-after-ms`` first, then ``retry-after``;
they honour it only up to 60–120 s, so ``retry-after`` is capped at 60 while
``retry-after-ms`` stays exact. ``x-should-retry: false`` stops retries that cannot help.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import orjson

from extproc.headers import RATELIMIT_FAMILIES
from extproc.openai import BadRequest, error_body
from limiter import Reason, Reject, Remaining, format_duration

MAX_RETRY_AFTER_S = 60

_CODES = {
    Reason.REQUESTS: "rate_limit_exceeded",
    Reason.WINDOW: "rate_limit_exceeded",
    Reason.TOKENS: "rate_limit_exceeded",
    Reason.CONCURRENCY: "concurrency_limit_exceeded",
    Reason.TOO_LARGE: "tokens_exceed_capacity",
    Reason.QUOTA: "insufficient_quota",
    Reason.SHAPING: "rate_limit_exceeded",
}


def ratelimit_headers(remaining: Remaining) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` family, for the dimensions this tenant has."""
    headers = admitted_ratelimit_headers(remaining)
    _add_family(headers, _QUOTA_NAMES, remaining.quota_limit, remaining.quota_remaining,
                remaining.quota_reset_ms)
    return headers


def admitted_ratelimit_headers(remaining: Remaining) -> dict[str, str]:
    """What an admitted response carries (requests and tokens; the quota family only on
    its refusals): the headroom right after this admission."""
    headers: dict[str, str] = {}
    _add_family(headers, _REQUEST_NAMES, remaining.request_limit, remaining.requests_remaining,
                remaining.requests_reset_ms)
    _add_family(headers, _TOKEN_NAMES, remaining.token_limit, remaining.tokens_remaining,
                remaining.tokens_reset_ms)
    return headers


def _add_family(headers: dict[str, str], names: tuple[str, ...], limit: int | None,
                left: int | None, reset_ms: int | None) -> None:
    """One dimension's three headers (``names``: limit, remaining, reset), if it has a limit."""
    if limit is not None:
        headers[names[0]] = str(limit)
        headers[names[1]] = str(max(0, left or 0))
        headers[names[2]] = format_duration(reset_ms or 0)


_REQUEST_NAMES, _TOKEN_NAMES, _QUOTA_NAMES = (RATELIMIT_FAMILIES[kind]
                                              for kind in ("requests", "tokens", "quota"))


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    seconds = max(1, math.ceil(retry_after_ms / 1000))
    return {
        "retry-after": str(min(MAX_RETRY_AFTER_S, seconds)),
        "retry-after-ms": str(retry_after_ms),
    }


def rejection(reject: Reject, prompt_param: str = "messages"
              ) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) for a refusal: the status is the refusal's own (400 never
    fits, 429 tenant over its limits or share, 503 pool saturated or without endpoints).
    ``prompt_param``: the body field a too-long prompt came in (``openai.prompt_field``)."""
    status = reject.status
    headers = {"x-kvgate-reject": reject.reason.value, **ratelimit_headers(reject.remaining)}
    if reject.reason is Reason.CONTEXT:
        error = BadRequest(reject.message, code="context_length_exceeded", param=prompt_param)
    else:
        error_type = "rate_limit_error" if status == 429 else (
            "invalid_request_error" if status < 500 else "server_error")
        error = BadRequest(reject.message, status=status,
                           code=_CODES.get(reject.reason, reject.reason.value),
                           error_type=error_type)
    if reject.retry_after_ms is None:
        headers["x-should-retry"] = "false"
    else:
        headers.update(retry_headers(reject.retry_after_ms))
    return status, error_body(error), headers


def client_error(error: BadRequest) -> tuple[int, bytes, dict[str, str]]:
    headers = {"x-kvgate-reject": error.code or "invalid_request", **(error.headers or {})}
    if error.status in (400, 401, 404, 405, 413, 415):
        headers["x-should-retry"] = "false"
    return error.status, error_body(error), headers


def unavailable(message: str) -> tuple[int, bytes, dict[str, str]]:
    """The shared limits cannot be reached (``failure_policy: fail_closed``): 503, retryable."""
    return _server_error(message, "gateway_unavailable")


def overloaded(message: str) -> tuple[int, bytes, dict[str, str]]:
    """kvgate holds as much of clients' request bodies as it may: 503, retryable."""
    return _server_error(message, "gateway_overloaded")


def internal_error(message: str) -> tuple[int, bytes, dict[str, str]]:
    """kvgate's own failure (a bug): 503 (retryable), never a bare 500."""
    return _server_error(message, "internal_error")


def _server_error(message: str, code: str) -> tuple[int, bytes, dict[str, str]]:
    body = orjson.dumps({"error": {"message": message, "type": "server_error",
                                   "param": None, "code": code}})
    return 503, body, {"x-kvgate-reject": code, **retry_headers(1000)}


class RecentRejections:
    """The last refusals, newest last, for the admin status page: a bounded ring (one
    append per refusal, nothing per admission) and a count per reason since start."""

    def __init__(self, size: int = 200, clock: Callable[[], float] = time.time):
        self._ring: deque[tuple[float, int, str, str]] = deque(maxlen=size)
        self.by_reason: dict[str, int] = {}
        self._clock = clock

    def add(self, status: int, reason: str, tenant: str | None) -> None:
        self._ring.append((self._clock(), status, reason, tenant or ""))
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def recent(self) -> list[dict[str, object]]:
        """Newest first, JSON-friendly."""
        return [{"at": at, "status": status, "reason": reason, "tenant": tenant}
                for at, status, reason, tenant in reversed(self._ring)]
