"""The Rate Limit Service's rules (extproc.rls over limiter.ratelimit), called in-process
with a fake clock: envoyproxy/ratelimit's matching (most specific node wins, a limit only at
the last entry's level, key-only and ``*`` values), replaces, shadow mode, unlimited,
unknown domains, hits_addend, and kvgate's algorithms and headers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, RateLimitSettings, parse_config
from extproc.metrics import Metrics
from extproc.rls import OK, OVER_LIMIT, RateLimitService
from limiter.stores.ratelimit import MemoryRateCounters
from tests.rls_support import descriptor

MINUTE = 60_000


def rl(n: int, unit: str = "minute", **extra: object) -> dict:
    return {"unit": unit, "requests_per_unit": n, **extra}


RULES = {"domains": [{"domain": "edge", "descriptors": [
    {"key": "user", "rate_limit": rl(5)},  # any user: 5/min each
    {"key": "user", "value": "vip", "rate_limit": rl(100)},
    {"key": "user", "value": "bot-*", "rate_limit": rl(1)},
    {"key": "user", "value": "free", "rate_limit": {"unlimited": True}},
    {"key": "org", "value": "acme", "rate_limit": rl(50), "descriptors": [
        {"key": "path", "rate_limit": rl(2, name="acme_path")},
        {"key": "path", "value": "/v1/chat", "rate_limit": rl(3)},
    ]},
    {"key": "plan", "value": "gold", "rate_limit": rl(10, replaces=[{"name": "acme_path"}])},
    {"key": "shadow", "rate_limit": rl(1), "shadow_mode": True},
    {"key": "banned", "rate_limit": rl(0)},
    {"key": "tokens", "rate_limit": rl(100, debt=True)},
    {"key": "fixed", "rate_limit": rl(2, algorithm="fixed_window")},
    {"key": "sliding", "rate_limit": rl(2, algorithm="sliding_window")},
    {"key": "bursty", "rate_limit": rl(60, burst=3)},
]}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(clock: Clock) -> RateLimitService:
    settings = RateLimitSettings.model_validate(RULES)
    return RateLimitService(settings, MemoryRateCounters(clock), timeout_s=None)



def ask(service: RateLimitService, *descriptors, domain: str = "edge", hits: int = 0):
    request = rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)
    return asyncio.run(service.ShouldRateLimit(request, None))  # type: ignore[arg-type]


def codes(service: RateLimitService, n: int, *descriptors, **kw) -> list[int]:
    return [ask(service, *descriptors, **kw).overall_code for _ in range(n)]


def limit_of(response) -> int:
    return response.statuses[0].current_limit.requests_per_unit


def headers(response) -> dict[str, str]:
    return {h.key: h.value for h in response.response_headers_to_add}


def test_exact_value_beats_pattern_beats_key_only(service):
    assert limit_of(ask(service, descriptor(("user", "vip")))) == 100
    assert limit_of(ask(service, descriptor(("user", "bot-7")))) == 1
    assert limit_of(ask(service, descriptor(("user", "alice")))) == 5


def test_a_key_only_rule_counts_each_value_apart(service):
    assert codes(service, 6, descriptor(("user", "alice")))[-2:] == [OK, OVER_LIMIT]
    assert ask(service, descriptor(("user", "bob"))).overall_code == OK


def test_a_limit_applies_only_at_the_level_of_the_last_entry(service):
    # org=acme alone: its own limit; with a path: the nested one; deeper or unknown: none
    assert limit_of(ask(service, descriptor(("org", "acme")))) == 50
    assert limit_of(ask(service, descriptor(("org", "acme"), ("path", "/x")))) == 2
    assert limit_of(ask(service, descriptor(("org", "acme"), ("path", "/v1/chat")))) == 3
    for pairs in ([("org", "acme"), ("path", "/x"), ("more", "1")], [("org", "other")],
                  [("nobody", "x")]):
        response = ask(service, descriptor(*pairs))
        assert response.overall_code == OK and not response.statuses[0].HasField("current_limit")


def test_unlimited_is_ok_and_never_counted(service):
    assert codes(service, 50, descriptor(("user", "free"))) == [OK] * 50
    status = ask(service, descriptor(("user", "free"))).statuses[0]
    assert status.limit_remaining == 2**32 - 1 and not status.HasField("current_limit")


def test_replaces_switches_off_the_named_limit_when_both_match(service):
    path = descriptor(("org", "acme"), ("path", "/x"))
    assert codes(service, 3, path)[-1] == OVER_LIMIT  # acme_path: 2/min
    response = ask(service, path, descriptor(("plan", "gold")))
    assert response.overall_code == OK
    assert not response.statuses[0].HasField("current_limit")  # replaced
    assert response.statuses[1].current_limit.requests_per_unit == 10


def test_shadow_mode_reports_but_never_refuses(service):
    responses = [ask(service, descriptor(("shadow", "x"))) for _ in range(3)]
    assert [r.overall_code for r in responses] == [OK] * 3
    assert responses[-1].statuses[0].limit_remaining == 0
    assert "retry-after" not in headers(responses[-1])


def test_a_shadow_limit_does_not_block_a_real_one_and_vice_versa(service):
    both = (descriptor(("shadow", "y")), descriptor(("user", "carol")))
    assert codes(service, 6, *both) == [OK] * 5 + [OVER_LIMIT]


def test_zero_per_unit_refuses_everything_and_retry_cannot_help(service):
    response = ask(service, descriptor(("banned", "x")))
    assert response.overall_code == OVER_LIMIT
    assert headers(response)["x-should-retry"] == "false"


def test_a_call_refused_by_a_zero_limit_charges_its_other_descriptors_nothing(service):
    # the zero limit refuses without asking the counters; they were asked for the rest
    # as if the call passed, and charged it: three refused calls spent a 5/min user's limit
    for _ in range(3):
        response = ask(service, descriptor(("banned", "x")), descriptor(("user", "zed")))
        assert response.overall_code == OVER_LIMIT
        assert response.statuses[1].code == OK and response.statuses[1].limit_remaining == 5
    assert ask(service, descriptor(("user", "zed"))).statuses[0].limit_remaining == 4
    # a debt rule is charged whatever the answer, as on any refused call
    ask(service, descriptor(("banned", "x")), descriptor(("tokens", "zed"), hits=30))
    assert ask(service, descriptor(("tokens", "zed"), hits=0)).statuses[0].limit_remaining == 70


def test_keys_with_an_equals_sign_count_apart(service):
    settings = RateLimitSettings.model_validate({"domains": [{"domain": "edge", "descriptors": [
        {"key": "a", "rate_limit": rl(1)}, {"key": "a=b", "rate_limit": rl(1)}]}]})
    service = RateLimitService(settings, service.counters, timeout_s=None)
    assert ask(service, descriptor(("a", "b=c"))).overall_code == OK
    assert ask(service, descriptor(("a=b", "c"))).overall_code == OK  # was OVER_LIMIT


def test_unknown_domain_answers_ok(service):
    response = ask(service, descriptor(("user", "vip")), domain="elsewhere")
    assert response.overall_code == OK and len(response.statuses) == 1


def test_a_refused_call_charges_no_descriptor(service):
    one, tight = descriptor(("user", "dave")), descriptor(("user", "bot-1"))
    assert ask(service, one, tight).overall_code == OK
    assert ask(service, one, tight).overall_code == OVER_LIMIT  # bot-1: 1/min
    assert ask(service, one).statuses[0].limit_remaining == 3  # only the first call counted


def test_hits_addend_request_level_and_descriptor_level(service):
    # request 0 = 1; request 3; a descriptor's own value wins; an explicit 0 only checks
    assert ask(service, descriptor(("user", "erin"))).statuses[0].limit_remaining == 4
    assert ask(service, descriptor(("user", "erin")), hits=3).statuses[0].limit_remaining == 1
    response = ask(service, descriptor(("user", "erin"), hits=0), hits=3)
    assert response.overall_code == OK and response.statuses[0].limit_remaining == 1
    assert ask(service, descriptor(("user", "erin"), hits=2)).overall_code == OVER_LIMIT


def test_usage_charged_after_the_fact_blocks_the_next_check(service, clock):
    check, usage = descriptor(("tokens", "t"), hits=0), descriptor(("tokens", "t"), hits=250)
    assert ask(service, check).overall_code == OK
    ask(service, usage)  # 250 of 100: into debt, whatever the answer
    response = ask(service, check)
    assert response.overall_code == OVER_LIMIT
    # 150 tokens of debt + 1 to check, at 100/min
    assert headers(response)["retry-after-ms"] == str(151 * MINUTE // 100)
    clock.now += 151 * MINUTE // 100
    assert ask(service, check).overall_code == OK


def test_token_bucket_retry_after_is_exact(service, clock):
    d = descriptor(("bursty", "x"))  # 60/min, burst 3
    assert codes(service, 3, d) == [OK, OK, OK]
    response = ask(service, d)  # a client alone: the exact wait
    assert headers(response)["retry-after-ms"] == "1000"
    assert headers(response)["retry-after"] == "1"
    assert headers(response)["x-ratelimit-limit"] == "60"
    # a second client refused in the same ms gets the slot after it (limiter.herd)
    assert headers(ask(service, d))["retry-after-ms"] == "2000"
    clock.now += 999
    assert ask(service, d).overall_code == OVER_LIMIT
    clock.now += 1
    assert ask(service, d).overall_code == OK


def test_fixed_window_resets_on_the_minute_and_sliding_window_does_not(service, clock):
    clock.now = clock.now - clock.now % MINUTE + MINUTE - 10  # 10 ms before a boundary
    assert codes(service, 3, descriptor(("fixed", "x"))) == [OK, OK, OVER_LIMIT]
    assert codes(service, 3, descriptor(("sliding", "x"))) == [OK, OK, OVER_LIMIT]
    clock.now += 10
    assert codes(service, 3, descriptor(("fixed", "x"))) == [OK, OK, OVER_LIMIT]
    response = ask(service, descriptor(("sliding", "x")))
    assert response.overall_code == OVER_LIMIT
    assert headers(response)["retry-after-ms"] == str(MINUTE - 10)


def test_ok_answers_carry_x_ratelimit_headers_of_the_tightest_limit(service):
    response = ask(service, descriptor(("user", "vip")), descriptor(("user", "frank")))
    assert headers(response) == {"x-ratelimit-limit": "5", "x-ratelimit-remaining": "4",
                                 "x-ratelimit-reset": "12"}


def config_with(ratelimit: dict):
    return parse_config({
        "ratelimit": ratelimit,
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": ["sha256:" + "0" * 64]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:1"]}],
    })


def one(*descriptors: dict) -> dict:
    return {"domains": [{"domain": "d", "descriptors": list(descriptors)}]}


@pytest.mark.parametrize(("section", "problem"), [
    (one({"key": "k", "rate_limit": {"unit": "minute"}}),
     "ratelimit.domains[0].descriptors[0].rate_limit: give unit and requests_per_unit"),
    (one({"key": "k"}, {"key": "k"}),
     "ratelimit.domains[0].descriptors: duplicate descriptor: key 'k' with any value"),
    ({"domains": [{"domain": "d"}, {"domain": "d"}]}, "ratelimit.domains: duplicate domain 'd'"),
    (one({"key": "k", "rate_limit": rl(1, algorithm="fixed_window", burst=2)}),
     "burst is a token_bucket's capacity"),
    (one({"key": "k", "rate_limit": rl(1, algorithm="sliding_window", debt=True)}),
     "debt needs token_bucket or fixed_window"),
    (one({"key": "k", "rate_limit": rl(1, "day")}), "too slow for a token bucket"),
    (one({"key": "k", "rate_limit": rl(1, "fortnight")}),
     "ratelimit.domains[0].descriptors[0].rate_limit.unit"),
])
def test_config_errors_name_the_path(section, problem):
    with pytest.raises(ConfigError) as caught:
        config_with(section)
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_an_empty_section_is_the_default():
    assert config_with({}).ratelimit.domains == []


def test_a_descriptor_sent_twice_is_charged_both_hits_once(service):
    twice = (descriptor(("user", "gina")), descriptor(("user", "gina"), hits=2))
    response = ask(service, *twice)
    assert [s.limit_remaining for s in response.statuses] == [2, 2]
    assert ask(service, *twice).overall_code == OVER_LIMIT


def test_idle_counters_are_forgotten(clock):
    counters = MemoryRateCounters(clock, sweep_every=10)
    service = RateLimitService(RateLimitSettings.model_validate(RULES), counters, timeout_s=None)
    for i in range(9):
        ask(service, descriptor(("user", f"u{i}")), descriptor(("fixed", f"f{i}")),
            descriptor(("sliding", f"s{i}")))
    assert len(counters) == 27
    clock.now += MINUTE
    ask(service, descriptor(("user", "last")))  # the 10th call sweeps, then counts its own
    assert len(counters) == 1


def test_a_counter_is_kept_until_the_retry_slots_it_promised_are_past(clock):
    """A herd's schedule lives with its counter: swept once the counter is idle and its last
    slot is past (a bucket back to full with slots still ahead keeps them). A bucket's
    virtual full time, which may lie beyond its last slot, no longer keeps it: once its
    last client is back, the promise changes no answer (limiter.herd.live_promise)."""
    counters = MemoryRateCounters(clock, sweep_every=1)
    service = RateLimitService(RateLimitSettings.model_validate(RULES), counters, timeout_s=None)
    d = descriptor(("bursty", "x"))  # 60/min, burst 3
    assert codes(service, 8, d) == [OK] * 3 + [OVER_LIMIT] * 5  # told 1 s, 2 s, ... 5 s
    clock.now += 3500  # full again (nobody came back), two slots still ahead
    ask(service, descriptor(("user", "u")))
    assert len(counters) == 2
    clock.now += 1500  # the last slot now (the bucket's virtual full time is 8 s out)
    ask(service, descriptor(("user", "u")))
    assert len(counters) == 2
    clock.now += 1
    ask(service, descriptor(("user", "u")))
    assert len(counters) == 1


def test_counters_are_bounded_the_least_recently_used_going_first(clock):
    """A descriptor whose value a client chooses (an address) with a long window kept one
    counter per value until the window ended: 500,000 values held 130 MB all day."""
    counters = MemoryRateCounters(clock, max_counters=5)
    service = RateLimitService(RateLimitSettings.model_validate(RULES), counters, timeout_s=None)
    ask(service, descriptor(("fixed", "hot")))
    for i in range(8):  # each charged: none is idle, so none is swept
        ask(service, descriptor(("fixed", f"f{i}")))
        ask(service, descriptor(("fixed", "hot"), hits=0))  # used: the most recent
    assert len(counters) == 5
    assert ask(service, descriptor(("fixed", "hot"), hits=0)).statuses[0].limit_remaining == 1
    assert ask(service, descriptor(("fixed", "f0"), hits=0)).statuses[0].limit_remaining == 2


def test_long_descriptor_values_are_not_kept_whole(clock):
    """A counter's key carries its descriptor's values, which a client may choose (a header,
    up to Envoy's 60 KB): 5,000 calls of 16 KB values grew kvgate by 80 MB, on the way to
    gigabytes at the 100,000-counter bound. A long key is kept as its digest; it still
    counts as itself."""
    counters = MemoryRateCounters(clock)
    service = RateLimitService(RateLimitSettings.model_validate(RULES), counters, timeout_s=None)
    values = [f"{i}-" + "x" * 16_000 for i in range(20)]
    for value in values:
        ask(service, descriptor(("fixed", value)))
    ask(service, descriptor(("fixed", values[0])))
    assert len(counters) == 20
    assert sum(len(key) for key in counters._slots) < 20 * 100
    assert ask(service, descriptor(("fixed", values[0]))).overall_code == OVER_LIMIT
    assert ask(service, descriptor(("fixed", values[1]), hits=0)).statuses[0].limit_remaining == 1


def test_a_full_table_evicts_without_scanning(clock, monkeypatch):
    """Evicting swept the whole table first: past the cap every new value scanned 100,000
    counters (~20 ms each), and a client choosing values kept the event loop busy."""
    counters = MemoryRateCounters(clock, max_counters=5, sweep_every=10_000)
    sweeps = []
    monkeypatch.setattr(counters, "_sweep", lambda now: sweeps.append(now))
    service = RateLimitService(RateLimitSettings.model_validate(RULES), counters, timeout_s=None)
    for i in range(50):
        ask(service, descriptor(("fixed", f"v{i}")))
    assert len(counters) == 5 and sweeps == []


def test_every_descriptor_is_counted_by_domain_and_code(clock):
    metrics = Metrics()
    service = RateLimitService(RateLimitSettings.model_validate(RULES),
                               MemoryRateCounters(clock), timeout_s=None, metrics=metrics)
    for _ in range(2):
        ask(service, descriptor(("shadow", "m")), descriptor(("user", "free")),
            descriptor(("banned", "m")), descriptor(("nothing", "m")))
    # the banned calls were refused: they charged the shadow limit (1/min) nothing
    for _ in range(2):
        ask(service, descriptor(("shadow", "m")))
    ask(service, descriptor(("user", "vip")), domain="elsewhere")
    assert metrics.ratelimit.values == {
        ("edge", "ok"): 3, ("edge", "shadow_over_limit"): 1, ("edge", "unlimited"): 2,
        ("edge", "over_limit"): 2, ("edge", "no_rule"): 2, ("other", "no_rule"): 1}


def test_a_limit_sent_by_envoy_overrides_the_rules(service):
    override = descriptor(("user", "vip"))
    override.limit.requests_per_unit = 1
    override.limit.unit = rls_pb2.RateLimitResponse.RateLimit.DAY  # too slow for a bucket
    assert [ask(service, override).overall_code for _ in range(2)] == [OK, OVER_LIMIT]
    assert limit_of(ask(service, override)) == 1


@pytest.mark.parametrize("unit", [rls_pb2.RateLimitResponse.RateLimit.SECOND,
                                  rls_pb2.RateLimitResponse.RateLimit.MINUTE])
def test_a_limit_sent_by_envoy_counts_apart_and_never_resets_the_rules_counter(service, unit):
    """A descriptor with a limit override used to share the rule's counter, which was
    rebuilt whenever the limit it saw changed: alternating calls with and without one
    admitted every plain call past the rule's limit."""
    plain = descriptor(("user", "bot-1"))  # "bot-*": 1 a minute
    override = descriptor(("user", "bot-1"))
    override.limit.requests_per_unit, override.limit.unit = 1000, unit
    assert [ask(service, plain).overall_code for _ in range(2)] == [OK, OVER_LIMIT]
    for _ in range(5):
        assert ask(service, override).overall_code == OK
        assert ask(service, plain).overall_code == OVER_LIMIT


def test_statuses_carry_the_limit_what_is_left_and_when_it_resets(service, clock):
    """duration_until_reset: a token bucket until it is full again, a fixed window until its
    boundary, a sliding window until it is empty again (its newest entry has left)."""
    clock.now = clock.now - clock.now % MINUTE + 12_345  # 12.345 s into a minute
    bucket = ask(service, descriptor(("user", "reset")), hits=2).statuses[0]
    assert (bucket.code, bucket.limit_remaining) == (OK, 3)
    assert bucket.current_limit.requests_per_unit == 5
    assert bucket.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.MINUTE
    assert bucket.duration_until_reset.ToMilliseconds() == 2 * MINUTE // 5  # 2 hits to refill
    fixed = ask(service, descriptor(("fixed", "reset")), hits=2).statuses[0]
    assert (fixed.code, fixed.limit_remaining) == (OK, 0)
    assert fixed.duration_until_reset.ToMilliseconds() == MINUTE - 12_345
    sliding = descriptor(("sliding", "reset"))
    assert ask(service, sliding).statuses[0].duration_until_reset.ToMilliseconds() == MINUTE
    clock.now += 1_000
    status = ask(service, sliding).statuses[0]
    assert (status.code, status.limit_remaining) == (OK, 0)
    assert status.duration_until_reset.ToMilliseconds() == MINUTE
    clock.now += 1_000
    response = ask(service, sliding)
    assert response.overall_code == OVER_LIMIT == response.statuses[0].code
    assert response.statuses[0].duration_until_reset.ToMilliseconds() == MINUTE - 1_000
    assert headers(response)["retry-after-ms"] == str(MINUTE - 2_000)  # the oldest leaves


def test_a_zero_hit_check_is_refused_once_nothing_is_left_and_charges_nothing(service, clock):
    check = descriptor(("user", "ivan"), hits=0)
    for left in (5, 5):  # checks do not count
        assert ask(service, check).statuses[0].limit_remaining == left
    assert codes(service, 5, descriptor(("user", "ivan"))) == [OK] * 5
    refused = ask(service, check)
    assert refused.overall_code == OVER_LIMIT  # not even one unit left
    assert headers(refused)["retry-after-ms"] == str(MINUTE // 5)
    clock.now += MINUTE // 5
    assert [ask(service, check).overall_code for _ in range(3)] == [OK] * 3
    assert ask(service, descriptor(("user", "ivan"))).overall_code == OK  # the unit is still there


def test_an_override_with_a_unit_envoy_does_not_define_is_ignored(service):
    override = descriptor(("user", "vip"))
    override.limit.requests_per_unit = 1
    override.limit.unit = 99  # not in the proto: as UNKNOWN, the rules decide
    assert codes(service, 2, override) == [OK, OK]
    assert limit_of(ask(service, override)) == 100


class Aborted(Exception):
    pass


class AbortingContext:
    async def abort(self, code, details):
        raise Aborted(code, details)


@pytest.mark.parametrize("request_", [
    rls_pb2.RateLimitRequest(descriptors=[descriptor(("user", "a"))]),
    rls_pb2.RateLimitRequest(domain="edge"),
])
def test_a_request_without_a_domain_or_descriptors_is_invalid(service, request_):
    with pytest.raises(Aborted) as caught:
        asyncio.run(service.ShouldRateLimit(request_, AbortingContext()))  # type: ignore[arg-type]
    code, details = caught.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "a rate limit request needs a domain and descriptors"


@pytest.mark.parametrize("request_", [
    rls_pb2.RateLimitRequest(domain="edge", descriptors=[
        descriptor(("user", f"u{n}")) for n in range(257)]),
    rls_pb2.RateLimitRequest(domain="edge", descriptors=[
        descriptor(*[(f"k{n}", "v") for n in range(65)])]),
], ids=["descriptors", "entries"])
def test_a_request_past_the_bounds_is_invalid_and_charges_nothing(service, request_):
    """One hostile call of 100,000 descriptors held the event loop for 1–2 s: Envoy sends a
    handful, so a call past the bounds is refused before any work."""
    with pytest.raises(Aborted) as caught:
        asyncio.run(service.ShouldRateLimit(request_, AbortingContext()))  # type: ignore[arg-type]
    code, details = caught.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 256 descriptors of at most 64 entries" in details
    # nothing was charged: u1's first call leaves 4 of its 5 a minute
    assert ask(service, descriptor(("user", "u1"))).statuses[0].limit_remaining == 4


def test_a_descriptor_value_that_is_not_utf8_is_judged_not_failed(service):
    """Envoy copies header values into descriptor entries as they came. Bytes that are not
    UTF-8 would fail the call's parse, and Envoy lets a failed call through: served over
    gRPC, the value is read with them replaced and limited like any other."""
    request = rls_pb2.RateLimitRequest(domain="edge", descriptors=[descriptor(("user", "bot-Z"))])
    data = request.SerializeToString().replace(b"bot-Z", b"bot-\xff")

    answers = asyncio.run(over_grpc(service, [data, data]))
    assert [a.overall_code for a in answers] == [OK, OVER_LIMIT]  # "bot-*": 1 a minute


async def over_grpc(service: RateLimitService, calls: list[bytes]) -> list:
    """Each of ``calls`` (serialized requests, as Envoy sends them) over a real gRPC server:
    its answer, or the ``AioRpcError`` it failed with."""
    server = grpc.aio.server()
    service.attach(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            should = channel.unary_unary(
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                request_serializer=lambda raw: raw,
                response_deserializer=rls_pb2.RateLimitResponse.FromString)
            answers = []
            for data in calls:
                try:
                    answers.append(await should(data))
                except grpc.aio.AioRpcError as error:
                    answers.append(error)
            return answers
    finally:
        await server.stop(None)


@pytest.mark.parametrize("data", [b"\xff\xff\xff\xff", b"\x0a\x10edge",
                                  b"\x0b" * 1000 + b"\x0c" * 1000],
                         ids=["varint", "truncated", "groups"])
def test_bytes_that_do_not_parse_are_invalid_argument_not_an_internal_error(service, data,
                                                                            caplog):
    """Whoever reaches kvgate's gRPC port may send anything: a clear INVALID_ARGUMENT, not
    gRPC's UNKNOWN with a traceback in kvgate's log for every call."""
    [error] = asyncio.run(over_grpc(service, [data]))
    assert isinstance(error, grpc.aio.AioRpcError), error
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "does not parse" in (error.details() or "")
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_an_absurd_debt_is_capped_and_answered_with_a_valid_reset(service):
    """A debt rule charged a uint64 hits_addend far beyond any limit: the charge is capped at
    the request's uint32 range, and the reset, however far, fits a proto Duration."""
    huge = ask(service, descriptor(("tokens", "a"), hits=2**64 - 1))
    status = huge.statuses[0]
    assert huge.overall_code == OVER_LIMIT
    assert 0 < status.duration_until_reset.ToMilliseconds() <= 315_576_000_000 * 1000
    assert headers(huge)["x-ratelimit-remaining"] == "0"
    for _ in range(130):  # 130 × 81 years of debt at 100 tokens a minute: past the cap
        deep = ask(service, descriptor(("tokens", "c"), hits=2**32 - 1))
    assert deep.statuses[0].duration_until_reset.ToMilliseconds() == 315_576_000_000 * 1000
    later = headers(ask(service, descriptor(("tokens", "c"), hits=1)))  # its wait, capped
    assert int(later["retry-after"]) <= int(later["x-ratelimit-reset"]) == 315_576_000_000
    capped = ask(service, descriptor(("tokens", "b"), hits=2**32 - 1))
    assert capped.statuses[0].duration_until_reset == status.duration_until_reset


_keys = st.sampled_from(["user", "org", "path", "plan", "shadow", "banned", "tokens", "fixed",
                         "sliding", "bursty", "", "nope"])
_values = st.one_of(st.sampled_from(["vip", "bot-1", "free", "acme", "/v1/chat", "gold", "*"]),
                    st.text(max_size=20))
_hits = st.one_of(st.none(), st.integers(0, 3), st.integers(0, 2**64 - 1),
                  st.sampled_from([2**32 - 1, 2**32, 2**53 + 1, 2**64 - 1]))
_units = st.integers(-1, 9)


@st.composite
def _descriptors(draw):
    d = descriptor(*draw(st.lists(st.tuples(_keys, _values), max_size=4)), hits=draw(_hits))
    if draw(st.booleans()):
        d.limit.requests_per_unit = draw(st.integers(0, 2**32 - 1))
        d.limit.unit = draw(_units)
    return d


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["edge", "other"]),
                          st.lists(_descriptors(), min_size=1, max_size=4),
                          st.integers(0, 2**32 - 1), st.integers(0, 3_600_000)),
                min_size=1, max_size=8))
def test_any_request_sequence_is_answered_with_valid_statuses(calls):
    """Hostile descriptors (unknown keys, odd values, absurd hits, overrides with any unit):
    each call answers one status per descriptor, and every reset fits a proto Duration."""
    clock = Clock()
    service = RateLimitService(RateLimitSettings.model_validate(RULES),
                               MemoryRateCounters(clock), timeout_s=None)
    for domain, descriptors, hits, advance in calls:
        clock.now += advance
        response = ask(service, *descriptors, domain=domain, hits=hits)
        assert len(response.statuses) == len(descriptors)
        assert response.overall_code in (OK, OVER_LIMIT)
        for status in response.statuses:
            assert 0 <= status.duration_until_reset.ToMilliseconds() <= 315_576_000_000_000
