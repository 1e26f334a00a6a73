"""The Redis store's wire format, without I/O: RESP commands packed, script replies parsed.

Pure functions over bytes and the core's types, so that ``make native`` compiles them (the
store's own modules hold coroutines and stay interpreted): every admission packs one
``EVALSHA`` and parses one reply, a few µs of Python each on the request path.

**Numbers.** Lua numbers are doubles, exact for integers below 2^53; the policy is checked
here before it is sent (the bounds are listed in :mod:`limiter.stores.redis_scripts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from limiter.calendar import Period
from limiter.decision import TenantPolicy
from limiter.outcome import BucketView, Reason, ShapingView, Snapshot, WindowView
from limiter.quota import QuotaView
from limiter.rates import Rate

MAX_FULL = 2**51
MAX_PERIOD_MS = 2**26
MAX_COUNT = 2**50
MAX_BACKLOG = 2**20
VIEW_FIELDS = 19
"""Comma-separated numbers in a reply's view (``finish`` in the scripts)."""

# -- RESP ----------------------------------------------------------------------------------


def pack(*parts: bytes) -> bytes:
    """One RESP command from already-encoded arguments."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n" % len(part))
        out.append(part)
        out.append(b"\r\n")
    return b"".join(out)


def bulk(value: bytes) -> bytes:
    """One argument in RESP (to splice into a command packed ahead of time)."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def packed_keys(keys: Sequence[str]) -> bytes:
    """``numkeys key…`` of a script call, packed once per tenant."""
    return bulk(b"%d" % len(keys)) + b"".join(bulk(key.encode()) for key in keys)


def script_command(start: bytes, keys: bytes, key_count: int,
                   args: Sequence[int | str | bytes]) -> bytes:
    """``EVALSHA sha numkeys keys… args…``: ``start`` is the command and script (``$7``
    ``EVALSHA`` and the sha, or ``EVAL`` and the source), ``keys`` from :func:`packed_keys`."""
    parts = [b"*%d\r\n" % (3 + key_count + len(args)), start, keys]
    for arg in args:
        if isinstance(arg, int):
            value = b"%d" % arg
        elif isinstance(arg, str):
            value = arg.encode()
        else:
            value = arg
        parts.append(b"$%d\r\n%b\r\n" % (len(value), value))
    return b"".join(parts)


# -- the policy, as the scripts read it ----------------------------------------------------


def check_bucket(name: str, rate: Rate | None, capacity: int | None) -> list[int]:
    """A bucket's ARGV, after checking it stays exact in Lua doubles."""
    if rate is None or capacity is None:
        return [0, 0, 0]
    if rate.period_ms > MAX_PERIOD_MS or rate.amount > MAX_FULL:
        raise ValueError(f"{name}: rate {rate} is too fine-grained for exact Lua arithmetic")
    if capacity * rate.period_ms > MAX_FULL:
        raise ValueError(f"{name}: capacity × period_ms must be ≤ 2^51 for exact Lua math")
    return [rate.amount, rate.period_ms, capacity]


def small(name: str, value: int | None) -> int:
    if value is not None and value > MAX_COUNT:
        raise ValueError(f"{name} must be ≤ 2^50 for exact Lua arithmetic, got {value}")
    return value or 0


@lru_cache(maxsize=1024)
def policy_arg(policy: TenantPolicy) -> bytes:
    """ARGV[4]: the policy as 15 comma-separated integers, 0 for "not configured"
    (encoded once: it goes with every call)."""
    return ",".join(map(str, policy_fields(policy))).encode()


def policy_fields(policy: TenantPolicy) -> tuple[int, ...]:
    """The policy as the scripts read it, checked to stay exact in Lua doubles."""
    return (
        *check_bucket("request bucket", policy.request_rate, policy.request_burst),
        *check_bucket("token bucket", policy.token_rate, policy.token_burst),
        small("window_limit", policy.window_limit),
        small("window_ms", policy.window_ms),
        small("max_concurrency", policy.max_concurrency),
        small("concurrency_retry_ms", policy.concurrency_retry_ms),
        small("daily_token_quota", policy.daily_token_quota),
        small("monthly_token_quota", policy.monthly_token_quota),
        *check_shaper(policy.shaping_rate, policy.shaping_backlog),
    )


def check_shaper(rate: Rate | None, backlog: int | None) -> list[int]:
    """The shaper's ARGV: every slot sum and rescale then stays below 2^53 in Lua."""
    if rate is None or backlog is None:
        return [0, 0, 0]
    if rate.amount > MAX_PERIOD_MS or rate.period_ms > MAX_PERIOD_MS:
        raise ValueError(f"shaper: rate {rate} is too fine-grained for exact Lua arithmetic")
    if backlog > MAX_BACKLOG:
        raise ValueError(f"shaping backlog must be ≤ {MAX_BACKLOG}, got {backlog}")
    return [rate.amount, rate.period_ms, backlog]


# -- replies -------------------------------------------------------------------------------


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def snapshot(packed: bytes | str, policy: TenantPolicy) -> Snapshot:
    """The reply's packed view fields as the same :class:`Snapshot` the memory store builds."""
    raw = packed if isinstance(packed, bytes) else packed.encode()
    fields: list[int | None] = [int(f) if f else None for f in raw.split(b",")]
    if len(fields) != VIEW_FIELDS:
        raise ValueError(f"a script's view has {len(fields)} fields, not {VIEW_FIELDS}")
    window = None
    win_n, win_reset = fields[6], fields[7]
    if win_n is not None and win_reset is not None and policy.window_limit:
        window = WindowView(policy.window_limit, policy.window_ms or 0, win_n, win_reset)
    held, drain = fields[17], fields[18]
    shaping = None
    if held is not None and drain is not None and policy.shaping_backlog is not None:
        shaping = ShapingView(policy.shaping_backlog, held, drain)
    return Snapshot(
        requests=_bucket(fields[0], fields[1], fields[2]),
        tokens=_bucket(fields[3], fields[4], fields[5]),
        window=window,
        quotas=_quotas(fields),
        in_flight=fields[16] or 0,
        max_concurrency=policy.max_concurrency,
        shaping=shaping,
    )


def _bucket(limit: int | None, available: int | None, reset: int | None) -> BucketView | None:
    if limit is None or available is None or reset is None:
        return None
    return BucketView(limit, available, reset)


def _quotas(fields: list[int | None]) -> tuple[QuotaView, ...]:
    """Fields 8–11 (the day's quota) and 12–15 (the month's): limit, used, reset, start."""
    views = []
    for period, at in ((Period.DAY, 8), (Period.MONTH, 12)):
        limit, used, reset, start = fields[at], fields[at + 1], fields[at + 2], fields[at + 3]
        if limit is not None and used is not None and reset is not None and start is not None:
            views.append(QuotaView(period, limit, used, reset, start))
    return tuple(views)


def waits(extra: Sequence[Any]) -> list[tuple[Reason, int]]:
    """A ``wait`` reply's {reason, ms, …} pairs."""
    return [(Reason(text(extra[i])), int(extra[i + 1])) for i in range(0, len(extra), 2)]
