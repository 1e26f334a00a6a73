"""The Redis store's wire format: commands packed as Redis reads them, replies parsed into
the same views the memory store builds (no Redis needed)."""

from __future__ import annotations

import hiredis
import pytest

from limiter import Rate, TenantPolicy
from limiter.calendar import Period
from limiter.outcome import BucketView, ShapingView, WindowView
from limiter.quota import QuotaView
from limiter.stores.redis_codec import (
    bulk,
    pack,
    packed_keys,
    policy_arg,
    script_command,
    snapshot,
    waits,
)


def parsed(command: bytes) -> list[bytes]:
    """What Redis reads: the command as an array of bulk strings."""
    reader = hiredis.Reader()
    reader.feed(command)
    return reader.gets()


def test_a_script_call_is_one_resp_array_of_its_parts() -> None:
    start = b"$7\r\nEVALSHA\r\n" + bulk(b"a" * 40)
    keys = ("kvgate:{kvgate:t}:tb:req", "kvgate:{kvgate:t}:leases")
    command = script_command(start, packed_keys(keys), len(keys), ["", 60_000, b"1,2", "lease-é"])
    assert parsed(command) == [b"EVALSHA", b"a" * 40, b"2", *(k.encode() for k in keys), b"",
                               b"60000", b"1,2", "lease-é".encode()]
    assert parsed(pack(b"SELECT", b"3")) == [b"SELECT", b"3"]


def test_policy_bounds_are_checked_before_lua() -> None:
    ok = TenantPolicy(token_rate=Rate.per_minute(1.5), token_burst=10**7)
    assert policy_arg(ok) == b"0,0,0,1,40000,10000000,0,0,0,1000,0,0,0,0,0"
    with pytest.raises(ValueError, match="2\\^51"):
        policy_arg(TenantPolicy(token_rate=Rate(1, 60_000), token_burst=10**11))


def test_a_reply_view_becomes_the_memory_stores_snapshot() -> None:
    policy = TenantPolicy(window_limit=100, window_ms=60_000, max_concurrency=4,
                          shaping_rate=Rate(10, 1000), shaping_backlog=5)
    view = b"10,9,100,1000,-5,30,7,59000,500,20,3600,1700,,,,,2,1,100"
    snap = snapshot(view, policy)
    assert snap.requests == BucketView(10, 9, 100)
    assert snap.tokens == BucketView(1000, -5, 30)
    assert snap.window == WindowView(100, 60_000, 7, 59_000)
    assert snap.quotas == (QuotaView(Period.DAY, 500, 20, 3600, 1700),)
    assert snap.in_flight == 2 and snap.max_concurrency == 4
    assert snap.shaping == ShapingView(5, 1, 100)
    assert snapshot(view.decode(), policy) == snap  # redis-py's client may answer text
    empty = snapshot(b",,,,,,,,,,,,,,,,0,,", TenantPolicy())
    assert (empty.requests, empty.tokens, empty.window, empty.quotas, empty.shaping) == (
        None, None, None, (), None)


def test_a_view_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="fields"):
        snapshot(b"1,2,3", TenantPolicy())


def test_waits_pair_each_reason_with_its_ms() -> None:
    assert [(r.value, ms) for r, ms in waits([b"tokens", 120, "concurrency", b"5"])] == [
        ("tokens", 120), ("concurrency", 5)]
