"""Config validation: every error reported with the path of the offending value."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import typing

import pytest
import yaml
from pydantic import BaseModel

from extproc.cli import main
from extproc.config import (
    EXAMPLE_CONFIG,
    Config,
    ConfigError,
    hash_api_key,
    load_config,
    parse_config,
)
from tests.paths import REPO

GOOD = {
    "tiers": {"gold": {"weight": 3, "limits": {"requests_per_second": 2}}},
    "tenants": [{"name": "a", "tier": "gold", "api_keys": [hash_api_key("k")]}],
    "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"]}],
}


def problems(data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_example_config_is_valid():
    config = load_config(EXAMPLE_CONFIG)
    assert {t.name for t in config.tenants} == {"acme", "globex", "hobbyist"}


def test_defaults_fill_the_gaps():
    config = parse_config(GOOD)
    limits = config.limits_for(config.tenants[0])
    assert limits.effective_request_burst == 4  # 2 × rate
    assert limits.tokens_per_minute is None  # unlimited unless configured
    assert config.classes["interactive"].priority == 0
    assert config.pools[0].models[0].default_max_tokens == 1024


def test_a_tenant_named_twice_is_a_problem_at_each_repeat():
    tenant = GOOD["tenants"][0]
    data = {**GOOD, "tenants": [tenant, {**tenant, "api_keys": [hash_api_key("k2")]},
                                {**tenant, "api_keys": [hash_api_key("k3")]}]}
    duplicates = [p for p in problems(data) if "duplicate tenant" in p]
    assert duplicates == ["tenants[1].name: duplicate tenant 'a'",
                          "tenants[2].name: duplicate tenant 'a'"]


def test_errors_name_their_paths():
    bad = yaml.safe_load(yaml.safe_dump(GOOD))
    bad["tiers"]["gold"]["limits"]["requests_per_second"] = -1
    bad["tiers"]["gold"]["limits"]["tokens_per_minuet"] = 5
    bad["pools"][0]["endpoints"] = ["vllm.svc:8000"]
    bad["tenants"][0]["api_keys"] = ["plain-text-key"]
    found = problems(bad)
    assert any(p.startswith("tiers.gold.limits.requests_per_second:") for p in found)
    assert any(p.startswith("tiers.gold.limits.tokens_per_minuet:") for p in found)
    assert any(p.startswith("pools[0].endpoints[0]:") and "ip:port" in p for p in found)
    assert any(p.startswith("tenants[0].api_keys:") and "hash-key" in p for p in found)


def test_cross_references_are_checked():
    bad = yaml.safe_load(yaml.safe_dump(GOOD))
    bad["tenants"].append({"name": "a", "tier": "platinum", "default_class": "vip",
                           "api_keys": [hash_api_key("k")]})
    found = problems(bad)
    assert "tenants[1].tier: unknown tier 'platinum' (known: gold)" in found
    assert any(p.startswith("tenants[1].default_class:") for p in found)
    assert any(p.startswith("tenants[1].api_keys: key already belongs") for p in found)
    assert any(p.startswith("tenants[1].name: duplicate") for p in found)


def test_tenant_limits_override_the_tier():
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["tenants"][0]["limits"] = {"max_concurrency": 3}
    config = parse_config(data)
    limits = config.limits_for(config.tenants[0])
    assert (limits.max_concurrency, limits.requests_per_second) == (3, 2)


def test_kvgate_check_prints_every_problem(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers: {}\ntenants: []\npools: []\nserver: {grpc_port: 99999}\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "4 problem(s)" in err
    assert "server.grpc_port:" in err and "tiers:" in err
    assert main(["check", str(EXAMPLE_CONFIG)]) == 0


def test_kvgate_check_reports_unreadable_and_bad_yaml(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing.yaml")]) == 2
    (tmp_path / "x.yaml").write_text("tiers: [\n")
    assert main(["check", str(tmp_path / "x.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_hash_key_command():
    out = subprocess.run(
        [sys.executable, "-m", "extproc.cli", "hash-key", "sk-demo-acme"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert out == hash_api_key("sk-demo-acme")
    assert out in EXAMPLE_CONFIG.read_text()


def test_aging_is_off_by_default_and_auto_is_half_each_class_deadline():
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["classes"] = {"interactive": {"priority": 0, "deadline_s": 30},
                       "batch": {"priority": 1, "deadline_s": 120},
                       "offline": {"priority": 2, "deadline_s": 600, "aging_s": None}}
    config = parse_config(data)
    assert config.queue.aging_s is None and config.aging_s("batch") is None
    data["queue"] = {"aging_s": "auto"}
    config = parse_config(data)
    assert [config.aging_s(c) for c in ("batch", "offline")] == [60.0, None]
    data["queue"] = {"aging_s": 5}
    assert parse_config(data).aging_s("batch") == 5.0
    data["queue"] = {"aging_s": None}
    assert parse_config(data).aging_s("batch") is None


def test_bad_aging_and_reserved_slots_name_their_paths():
    bad = yaml.safe_load(yaml.safe_dump(GOOD))
    bad["queue"] = {"aging_s": "soon"}
    bad["pools"][0]["reserved_in_flight"] = 4
    found = problems(bad)
    assert found == ["queue.aging_s: must be a number of seconds > 0, 'auto' or null, got 'soon'",
                     "pools[0].reserved_in_flight: 4 must be below max_in_flight (None)"]
    bad["queue"] = {}
    assert problems(bad) == ["pools[0].reserved_in_flight: 4 must be below max_in_flight (None)"]
    bad["pools"][0]["max_in_flight"] = 4
    assert problems(bad) == ["pools[0].reserved_in_flight: 4 must be below max_in_flight (4)"]
    bad["pools"][0]["max_in_flight"] = 5
    assert parse_config(bad).pools[0].reserved_in_flight == 4


def test_keys_of_the_removed_dynamic_order_say_what_became_of_them():
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["queue"] = {"order": "dynamic", "beta": 1.0}
    data["classes"] = {"interactive": {"priority": 0, "sla_ms": 2000}}
    found = problems(data)
    assert any(p.startswith("queue.order: removed, the hierarchical fair order") for p in found)
    assert any(p.startswith("queue.beta: removed") for p in found)
    assert any(p.startswith("classes.interactive.sla_ms: removed") for p in found)


def test_shaping_defaults_overrides_and_the_message_timeout():
    from extproc.tenants import policy_from_limits
    from limiter import Rate

    data = {**GOOD, "tiers": {"gold": {"limits": {"shaping": {"requests_per_second": 2.5}}}}}
    tier = parse_config(data).tiers["gold"].limits.shaping
    assert tier is not None and tier.effective_backlog == 25  # ten seconds' worth
    data["tenants"] = [{**GOOD["tenants"][0], "limits": {
        "shaping": {"requests_per_second": 4, "backlog": 0},
        "sliding_window": {"requests": 3}}}]
    config = parse_config(data)
    policy = policy_from_limits(config.limits_for(config.tenants[0]))
    assert (policy.shaping_rate, policy.shaping_backlog) == (Rate(1, 250), 0)
    assert (policy.window_limit, policy.window_ms) == (3, 1000)  # nested overrides are models
    slow = {**GOOD, "tiers": {"gold": {"limits": {
        "shaping": {"requests_per_second": 0.1, "backlog": 100}}}}}
    assert problems(slow) == [
        "tiers.gold.limits.shaping: a full backlog waits 1000 s and then up to 900 s in the "
        "queue (the longest class deadline_s), which must end at least 1 s before "
        "envoy.message_timeout_s "
        "(1000)"]
    # the class deadline counts from the hold's end: each fits alone, not both in a row
    both = {**GOOD, "envoy": {"message_timeout_s": 40},
            "classes": {name: {"priority": i, "deadline_s": 30}
                        for i, name in enumerate(("interactive", "batch", "offline"))},
            "tiers": {"gold": {"limits": {"shaping": {"requests_per_second": 1,
                                                      "backlog": 30}}}}}
    assert problems(both) == [
        "tiers.gold.limits.shaping: a full backlog waits 30 s and then up to 30 s in the "
        "queue (the longest class deadline_s), which must end at least 1 s before "
        "envoy.message_timeout_s "
        "(40)"]
    assert any("requests_per_second" in p for p in problems(
        {**GOOD, "tiers": {"gold": {"limits": {"shaping": {"requests_per_second": 5000}}}}}))


# -- what a config file may hold before it is validated --------------------------------------

HEAD = ("tiers: {gold: {limits: {requests_per_second: 1}}}\n"
        f"tenants: [{{name: a, tier: gold, api_keys: ['{hash_api_key('k')}']}}]\n"
        "pools: [{name: p, models: [m], endpoints: ['127.0.0.1:8000']}]\n")


def file_problems(tmp_path, text: str) -> list[str]:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    return info.value.problems


def alias_bomb(levels: int, width: int = 10) -> str:
    """A descriptor holding ``width`` aliases of the one below, ``levels`` deep: each level
    a short line, the tree ``width`` ** ``levels`` descriptors."""
    lines = [HEAD + "ratelimit:\n  domains:\n  - domain: d\n    descriptors:",
             "    - &l0 {key: k0, value: v, rate_limit: {unit: second, requests_per_unit: 1}}"]
    for n in range(1, levels + 1):
        below = ", ".join([f"*l{n - 1}"] * width)
        lines.append(f"    - &l{n} {{key: k{n}, value: v, descriptors: [{below}]}}")
    return "\n".join(lines) + "\n"


def test_a_config_nested_too_deeply_is_one_problem_not_a_recursion_error(tmp_path):
    assert file_problems(tmp_path, "tiers: " + "[" * 500 + "]" * 500 + "\n") == [
        "line 1, column 107: nested too deeply (more than 100 levels)"]


def test_an_alias_chain_deep_only_once_expanded_is_refused(tmp_path):
    chain = "\n".join(["tiers:", "  - &a0 []",
                       *(f"  - &a{i} [*a{i - 1}]" for i in range(1, 300))])
    [problem] = file_problems(tmp_path, chain + "\n")
    assert "nested too deeply (more than 100 levels) once aliases expand" in problem


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    started = time.monotonic()
    [problem] = file_problems(tmp_path, alias_bomb(5))  # 10**5 descriptors: 10 s, 240 MB before
    assert time.monotonic() - started < 5
    assert problem == ("line 13, column 44: ratelimit.domains[0].descriptors[5].descriptors "
                       "expands to more than 1,000,000 values once aliases are expanded")


def test_anchors_aliases_and_merge_keys_still_load(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "tiers:\n"
        "  gold: &gold {weight: 3, limits: &limits {requests_per_second: 2, max_concurrency: 4}}\n"
        "  silver: {<<: *gold, weight: 1}\n"
        f"tenants: [{{name: a, tier: silver, api_keys: ['{hash_api_key('k')}'], "
        "limits: *limits}]\n"
        "pools: [{name: p, models: [m], endpoints: ['127.0.0.1:8000']}]\n")
    config = load_config(path)
    assert config.tiers["silver"].weight == 1
    assert config.tiers["silver"].limits == config.tiers["gold"].limits
    assert config.limits_for(config.tenants[0]).max_concurrency == 4


def test_duplicate_keys_are_problems_beside_the_others(tmp_path):
    text = ("tiers:\n  gold: {limits: {requests_per_second: 1}}\n"
            "  gold: {limits: {requests_per_second: 0}}\n" + HEAD)
    assert file_problems(tmp_path, text) == [  # the second tiers: wins, the first is checked
        "tiers: duplicate key at line 4, column 1 (first at line 1, column 1; YAML would keep "
        "only the last)",
        "tiers.gold: duplicate key at line 3, column 3 (first at line 2, column 3; YAML would "
        "keep only the last)",
    ]
    broken = HEAD + "server: {grpc_port: 1, grpc_port: 99999}\n"
    assert file_problems(tmp_path, broken) == [
        "server.grpc_port: duplicate key at line 4, column 24 (first at line 4, column 10; YAML "
        "would keep only the last)", "server.grpc_port: Input should be less than 65536"]


def test_a_file_over_the_size_cap_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_bytes(HEAD.encode() + b"#" * (8 * 1024 * 1024))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == ["larger than 8 MiB, too large for a config"]


def test_the_error_message_stays_short_while_problems_keep_every_one():
    error = ConfigError("kvgate.yaml", [f"tenants[{i}]: " + "x" * 10_000 for i in range(50)])
    assert len(error.problems) == 50
    assert len(str(error)) < 4000
    assert str(error).endswith("; and 40 more (`kvgate check` lists them all)")


def test_knobs_that_would_do_nothing_or_misroute_are_problems():
    """Each of these was accepted and then silently did nothing (or the wrong thing)."""
    pool = GOOD["pools"][0]
    data = {**GOOD,
            "tiers": {"gold": {"limits": {"request_burst": 5, "token_burst": 100}}},
            "tenants": [{**GOOD["tenants"][0], "max_class": "batch"}],
            "pools": [{**pool, "gpus": ["0"], "degradation": {}},
                      {**pool, "models": ["m2"], "endpoints": ["127.0.0.1:8002"]}]}
    burst_problems = [
        "tiers.gold.limits.request_burst: needs requests_per_second (a burst of no rate "
        "limits nothing)",
        "tiers.gold.limits.token_burst: needs tokens_per_minute (a burst of no rate limits "
        "nothing)",
        "tenants[0].max_class: 'batch' is less important than its default_class "
        "'interactive': every request would be lowered to 'batch'"]
    duplicate = "pools[1].name: duplicate pool 'p'"  # reported beside the broken pool too
    assert problems(data) == [
        "pools[0].degradation: set fallback_model or max_tokens_cap: a plan with neither "
        "serves nothing a cheaper way (and counts as no plan)", *burst_problems, duplicate]
    del data["pools"][0]["degradation"]
    assert problems(data) == [
        "pools[0]: gpus: set gpu_source ('local' or a kvgate agent URL) to read them from",
        *burst_problems, duplicate]
    del data["pools"][0]["gpus"]
    assert problems(data) == [*burst_problems, duplicate]
    # a tier's burst for the tenants that set the rate themselves is fine
    data["tenants"][0] = {**GOOD["tenants"][0], "limits": {"requests_per_second": 1,
                                                            "tokens_per_minute": 10}}
    data["pools"][1]["name"] = "q"
    parse_config(data)


def test_kv_settings_on_a_pool_that_is_not_kv_aware_are_problems():
    """A pool with kv_aware: false picks by requests in flight and reads no /metrics: a KV,
    prefill or GPU setting there did nothing; so did low_priority_first without a priority
    sent. Its defaults stay fine, and so do the in-flight caps it does read."""
    pool = {**GOOD["pools"][0], "kv_aware": False}
    assert problems({**GOOD, "pools": [{**pool, "max_unstarted": 4,
                                         "watermarks": {"high": 0.7}}]}) == [
        "pools[0]: max_unstarted, watermarks: only a kv_aware pool reads them (this one "
        "picks the endpoint with the fewest requests in flight); remove them or set "
        "kv_aware: true"]
    assert problems({**GOOD, "pools": [{**pool, "gpu_source": "local"}]}) == [
        "pools[0]: gpu_source: only a kv_aware pool reads it (this one picks the endpoint "
        "with the fewest requests in flight); remove it or set kv_aware: true"]
    parse_config({**GOOD, "pools": [{**pool, "max_in_flight": 2, "reserved_in_flight": 1}]})
    # written back whole (defaults and all: KvgateProcess.write_config), it still loads
    whole = parse_config({**GOOD, "pools": [pool]}).pools[0].model_dump(exclude_none=True)
    parse_config({**GOOD, "pools": [whole]})
    sglang = {**GOOD["pools"][0], "engine": "sglang", "low_priority_first": True}
    assert problems({**GOOD, "pools": [sglang]}) == [
        "pools[0]: low_priority_first: kvgate sends a priority only with "
        "priority_scheduling: true, so it would do nothing"]
    parse_config({**GOOD, "pools": [{**sglang, "priority_scheduling": True}]})


def test_removed_server_keys_say_what_became_of_them():
    assert problems({**GOOD, "server": {"max_stream_seconds": 60}}) == [
        "server.max_stream_seconds: removed, it did nothing (kvgate never extends a "
        "message's timeout: every wait it holds stays under envoy.message_timeout_s)"]


def test_a_removed_key_hides_nothing_else_in_its_section():
    """The removed key was refused before its section was validated, so a typo or a bad
    value beside it surfaced only once it was deleted: one deploy cycle per layer."""
    found = problems({**GOOD, "server": {"max_stream_seconds": 60, "grpc_prot": 9001,
                                         "admin_port": -1}})
    assert "server.grpc_prot: unknown key 'grpc_prot': did you mean 'grpc_port'?" in found
    assert any(p.startswith("server.max_stream_seconds: removed, it did nothing")
               for p in found)
    assert any(p.startswith("server.admin_port: ") for p in found), found
    assert len(found) == 3, found


def test_a_class_deadline_ends_a_margin_before_envoys_message_timeout():
    """kvgate's deadline counts from when the request is queued, Envoy's timer from when it
    sent the body: a deadline of 1.97 s against a 2 s timeout gave 17 of 30 clients Envoy's
    504 (no Retry-After) instead of kvgate's 503."""
    classes = {name: {"priority": i, "deadline_s": 1.97}
               for i, name in enumerate(("interactive", "batch", "offline"))}
    found = problems({**GOOD, "envoy": {"message_timeout_s": 2}, "classes": classes})
    assert found[0] == ("classes.interactive.deadline_s: 1.97 must be at least 1 s below "
                        "envoy.message_timeout_s (2), or Envoy fails the request (504, no "
                        "Retry-After) while kvgate still holds it")
    assert len(found) == 3
    parse_config({**GOOD, "envoy": {"message_timeout_s": 2.97}, "classes": classes})


def test_a_redis_prefix_with_a_brace_is_refused():
    """The prefix is part of each tenant's hash tag: a brace in it put every tenant's keys
    on one Redis Cluster slot (one shard carried everyone)."""
    found = problems({**GOOD, "redis": {"url": "redis://10.0.0.1:6379", "prefix": "{x}"}})
    assert found == ["redis.prefix: '{x}' has a brace: the prefix is part of each tenant's "
                     "hash tag ({prefix:tenant}), and a brace in it would put every tenant's "
                     "keys on one Redis Cluster slot"]


def test_infinite_and_out_of_range_numbers_are_problems_not_tracebacks(tmp_path):
    """YAML's .inf passed every gt/ge bound: `kvgate check` said OK, then `kvgate serve`
    failed building the rate and `kvgate render-envoy` making a timedelta (tracebacks); a
    finite duration past Envoy's range rendered a bootstrap Envoy refused."""
    data = {**GOOD, "tiers": {"gold": {"weight": float("inf"),
                                       "limits": {"requests_per_second": float("inf")}}},
            "envoy": {"message_timeout_s": float("inf"), "route_timeout_s": 4e11,
                      "connect_timeout_s": 1e300}}
    assert problems(data) == [
        "envoy.message_timeout_s: Input should be a finite number",
        "envoy.route_timeout_s: Input should be less than or equal to 315360000",
        "envoy.connect_timeout_s: Input should be less than or equal to 315360000",
        "tiers.gold.weight: Input should be a finite number",
        "tiers.gold.limits.requests_per_second: Input should be a finite number",
    ]
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(GOOD) + "envoy: {route_timeout_s: .inf}\n")
    assert main(["render-envoy", str(path), "-o", str(tmp_path / "envoy.yaml")]) == 2
    assert not (tmp_path / "envoy.yaml").exists()


def test_a_tier_weight_too_small_for_the_fair_counters_is_a_problem():
    data = {**GOOD, "tiers": {"gold": {"weight": 1e-9}}}
    assert problems(data) == ["tiers.gold.weight: Input should be greater than or equal to "
                              "0.000001"]


def test_envoys_listen_host_must_be_an_ip_address():
    """Envoy refuses a name there ("malformed IP address"): `kvgate check` said OK and
    `kvgate render-envoy` wrote a bootstrap Envoy would not start on."""
    assert problems({**GOOD, "envoy": {"listen_host": "localhost"}}) == [
        "envoy.listen_host: 'localhost' is not an IP address: Envoy's listener binds an "
        "address, not a name (127.0.0.1, 0.0.0.0, ::)"]
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        assert parse_config({**GOOD, "envoy": {"listen_host": host}}).envoy.listen_host == host


def test_envoys_listener_and_admin_port_are_apart():
    """Envoy's admin listens on 127.0.0.1: a listener on that address or on 0.0.0.0 with
    the admin's port passed `kvgate check`, rendered a bootstrap `envoy --mode validate`
    accepts, and Envoy then refused to start ("cannot bind ... Address already in use")."""
    for host in ("127.0.0.1", "0.0.0.0"):
        envoy = {"listen_host": host, "listen_port": 9901, "admin_port": 9901}
        assert problems({**GOOD, "envoy": envoy}) == [
            f"envoy: listen_port 9901 is admin_port too (the admin listens on 127.0.0.1), so "
            f"Envoy could not bind its listener on {host}"]
    for host in ("127.0.0.2", "::"):  # another address: both bind
        envoy = {"listen_host": host, "listen_port": 9901, "admin_port": 9901}
        assert parse_config({**GOOD, "envoy": envoy}).envoy.listen_port == 9901
    assert parse_config({**GOOD, "envoy": {"listen_port": 0, "admin_port": 0}})


def test_a_boolean_is_no_number():
    """YAML reads yes/on/true as true and pydantic read true as 1: `max_concurrency: yes`
    was a limit of 1, `kvgate check` saying OK. Boolean fields still take booleans."""
    data = {**GOOD, "tiers": {"gold": {"limits": {"max_concurrency": True}}},
            "server": {"reload_poll_s": False},
            "pools": [{**GOOD["pools"][0], "priority_scheduling": True, "max_in_flight": True}]}
    assert problems(data) == [
        f"{path}: {value} is a boolean (YAML reads yes, no, on and off as booleans); give a "
        "number" for path, value in (("server.reload_poll_s", "false"),
                                     ("tiers.gold.limits.max_concurrency", "true"),
                                     ("pools[0].max_in_flight", "true"))]


def test_a_pool_takes_endpoints_or_dns_not_both():
    """With both, discovery, routing and the rendered Envoy cluster used the DNS answers
    alone: the listed engines never got a request, and `kvgate check` said OK."""
    pool = {**GOOD["pools"][0], "dns": {"hostname": "vllm.svc", "port": 8000}}
    assert problems({**GOOD, "pools": [pool]}) == [
        "pools[0]: give endpoints or dns, not both: with dns the endpoints listed would "
        "never be used"]
    del pool["endpoints"]
    assert parse_config({**GOOD, "pools": [pool]}).pools[0].dns is not None


def test_envoys_ratelimit_domain_must_have_rules():
    """The rendered ratelimit filter asks kvgate's own RLS, which answers a domain it has no
    rules for OK: a typo in either name limited nothing, and `kvgate check` said OK."""
    rules = {"domains": [{"domain": "kvgte", "descriptors": [
        {"key": "tenant", "rate_limit": {"unit": "minute", "requests_per_unit": 1}}]}]}
    data = {**GOOD, "envoy": {"ratelimit_domain": "kvgate"}, "ratelimit": rules}
    assert problems(data) == [
        "envoy.ratelimit_domain: 'kvgate' is not a domain of ratelimit.domains (known: "
        "kvgte): kvgate's Rate Limit Service answers every call of a domain it has no rules "
        "for OK, so the rendered filter would limit nothing"]
    assert "(known: none)" in problems({**GOOD, "envoy": {"ratelimit_domain": "kvgate"}})[0]
    rules["domains"][0]["domain"] = "kvgate"
    assert parse_config(data).envoy.ratelimit_domain == "kvgate"


def test_a_path_class_rule_names_a_path_requests_carry():
    """Rules are matched against the path as kvgate routes it: a key with a trailing slash,
    no leading one, or a path kvgate answers 404 matched no request (embeddings ran as
    interactive work through the real Envoy), and `kvgate check` said OK."""
    rules = {"/v1/embeddings/": "batch", "/v1/responses": "batch"}
    assert problems({**GOOD, "classification": {"path_classes": rules}}) == [
        "classification.path_classes: '/v1/embeddings/' is never a request's path, so this "
        "rule would do nothing (did you mean '/v1/embeddings'?); '/v1/responses' is never a "
        "request's path, so this rule would do nothing (kvgate lets through only "
        "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, /health)"]
    rules = {"/v1/embeddings": "batch", "/v1/models": "offline"}
    config = parse_config({**GOOD, "classification": {"path_classes": rules}})
    assert config.classification.path_classes == rules


def test_the_class_header_is_a_header_name_requests_can_carry():
    """Envoy hands kvgate header names in lower case, and forwards only those its rendered
    rules name exactly: ``header: X-Request-Class``, as HTTP headers are usually written,
    was never read (the client's class ignored, without a word) while `kvgate check` said
    OK; an empty name, one with a space or a colon, or an ``x-kvgate-`` one (dropped from
    every request before ext_proc) never reached kvgate at all."""
    from extproc.envoy_config import render_yaml
    from extproc.messages import header_map
    from extproc.stream import _wanted
    from tests.unit.extproc.test_stream import headers_msg

    config = parse_config({**GOOD, "classification": {"header": "X-Request-Class"}})
    assert config.classification.header == "x-request-class"
    values, _ = header_map(headers_msg(**{"x-request-class": "batch"}).request_headers,
                           _wanted(config.classification.header))
    assert values[config.classification.header] == "batch"
    assert "exact: x-request-class" in render_yaml(config)
    bad = ["", "x request class", ":path", "x-kvgate-class"]
    assert [problems({**GOOD, "classification": {"header": name}}) for name in bad] == [
        ["classification.header: '' is not an HTTP header name (letters, digits and "
         "!#$%&'*+-.^_`|~)"],
        ["classification.header: 'x request class' is not an HTTP header name (letters, "
         "digits and !#$%&'*+-.^_`|~)"],
        ["classification.header: ':path' is not an HTTP header name (letters, digits and "
         "!#$%&'*+-.^_`|~)"],
        ["classification.header: 'x-kvgate-class': Envoy drops every x-kvgate- header a "
         "client sends before kvgate sees it"]]


def test_a_pool_named_twice_is_reported_while_one_of_the_two_is_broken():
    """A pool whose own check fails is taken out before the cross-references: a second pool
    of its name, or serving its model, was reported only once the first problem was fixed
    (README: fixing one layer never uncovers the next)."""
    pool = GOOD["pools"][0]
    data = {**GOOD, "pools": [pool, {**pool, "endpoints": [], "models": ["m", "m2"]},
                              {**pool, "name": "q", "models": ["m2"]}]}
    assert problems(data) == [
        "pools[1]: give endpoints (ip:port list) or dns",
        "pools[1].name: duplicate pool 'p'",
        "pools[1].models[0]: 'm' already served by 'p'",
        "pools[2].models[0]: 'm2' already served by 'p'"]
    data["pools"][1]["endpoints"] = ["127.0.0.1:8001"]  # the same problems, in the same words
    assert problems(data) == [
        "pools[1].name: duplicate pool 'p'",
        "pools[1].models[0]: 'm' already served by 'p'",
        "pools[2].models[0]: 'm2' already served by 'p'"]


def test_a_pools_models_that_are_not_a_list_are_one_field_error():
    """``models: 5`` ended ``kvgate check`` (and ``serve``, and a reload) in a TypeError
    traceback, exit 1, and ``models: tiny-llama`` (a bare name, not a list) was read letter
    by letter: "pools[0].models[6]: 'l' already served by 'tiny'" beside the real problem."""
    pool = GOOD["pools"][0]
    for models in (5, True, 2.5, "tiny-llama", {"name": "m"}):
        assert problems({**GOOD, "pools": [{**pool, "models": models}]}) == [
            "pools[0].models: Input should be a valid list"], models


def test_a_host_envoy_or_kvgate_resolves_is_an_ip_or_a_dns_name():
    """`envoy.ext_proc_host: kvgate:9001` (or `[::1]`, or "") passed `kvgate check` and
    `envoy --mode validate`, then Envoy's ext_proc cluster resolved it to no host at all
    (membership_total 0, update_failure 1): every request failed. A DNS pool's hostname
    likewise."""
    pool = {**GOOD["pools"][0], "dns": {"hostname": "vllm:8000", "port": 8000}}
    del pool["endpoints"]
    assert problems({**GOOD, "pools": [pool]}) == [
        "pools[0].dns.hostname: 'vllm:8000' is not an IP address or a DNS name (no port: "
        "that is dns.port; no brackets, no scheme)"]
    for host in ("kvgate:9001", "[::1]", "", "kv gate", "http://kvgate", "a" * 64 + ".svc"):
        assert problems({**GOOD, "envoy": {"ext_proc_host": host}}) == [
            f"envoy.ext_proc_host: {host!r} is not an IP address or a DNS name (no port: "
            "that is server.grpc_port; no brackets, no scheme)"], host
    for host in ("127.0.0.1", "::1", "kvgate", "kvgate-headless.ns.svc.cluster.local.",
                 "kvgate_0.internal"):
        assert parse_config({**GOOD, "envoy": {"ext_proc_host": host}}).envoy.ext_proc_host \
            == host


def test_the_report_address_is_an_ip():
    """Envoy's meter reports through an original-destination cluster, which takes an IP:
    `report_host: localhost` (or a `host` that is a name, with no report_host) passed
    `kvgate check`, and no report ever arrived (each answer charged `cut_off`)."""
    assert problems({**GOOD, "server": {"report_host": "localhost"}}) == [
        "server.report_host: 'localhost' is not an IP address: Envoy's meter reaches this "
        "port by IP (the pod IP), not by name; or 'auto'"]
    assert problems({**GOOD, "server": {"host": "localhost"}}) == [
        "server: host 'localhost' is a name, and the meter reaches the report port by IP: "
        "set report_host (an IP, or auto)"]
    for server in ({"report_host": "10.0.0.5"}, {"report_host": "fd00::5"},
                   {"report_host": "auto"}, {"host": "localhost", "report_host": "auto"},
                   {"host": "0.0.0.0"}, {"host": "::"}, {"host": "10.0.0.5"}):
        parse_config({**GOOD, "server": server})


def test_every_duration_is_at_most_ten_years():
    """The README says so, but only Envoy's timeouts and the DNS interval were bounded: a
    `redis.lease_ttl_s` of 1e300 passed `kvgate check`, and then every Redis admission
    failed (PEXPIRE out of range), serving every tenant by the failure policy for good."""
    huge, huge_ms = 1e300, 10**20
    data = {**GOOD,
            "server": {"shutdown_grace_s": huge, "drain_delay_s": huge, "reload_poll_s": huge},
            "scrape": {"interval_s": huge, "timeout_s": huge, "staleness_s": huge},
            "agent": {"interval_s": huge},
            "redis": {"url": "redis://10.0.0.1:6379", "timeout_ms": huge_ms,
                      "breaker_open_ms": huge_ms, "lease_ttl_s": huge},
            "queue": {"aging_s": huge},
            "classes": {"interactive": {"aging_s": huge, "deadline_s": huge}},
            "tiers": {"gold": {"limits": {"sliding_window": {"requests": 1,
                                                             "window_ms": huge_ms}}}},
            "pools": [{**GOOD["pools"][0], "prefill_clear_hold_s": huge}]}
    found = problems(data)
    bounded = [p.partition(":")[0] for p in found
               if "less than or equal to 315360000" in p or "(ten years)" in p]
    assert bounded == [
        "server.shutdown_grace_s", "server.drain_delay_s", "server.reload_poll_s",
        "redis.timeout_ms", "redis.breaker_open_ms", "redis.lease_ttl_s", "scrape.interval_s",
        "scrape.timeout_s", "scrape.staleness_s", "queue.aging_s", "agent.interval_s",
        "tiers.gold.limits.sliding_window.window_ms", "classes.interactive.deadline_s",
        "classes.interactive.aging_s", "pools[0].prefill_clear_hold_s"]


def _config_keys(model: type[BaseModel], seen: set[type[BaseModel]]) -> typing.Iterator[str]:
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        yield name
        hints = [field.annotation]
        while hints:
            hint = hints.pop()
            if isinstance(hint, type) and issubclass(hint, BaseModel):
                yield from _config_keys(hint, seen)
            else:
                hints.extend(typing.get_args(hint))


def test_the_readme_names_every_config_key():
    """Every key the config takes is in the README, in backticks or as a YAML key: a key
    only extproc/config.py knows is one no operator will set."""
    readme = (REPO / "README.md").read_text()
    missing = sorted(key for key in set(_config_keys(Config, set())) if not re.search(
        rf"`[^`\n]*\b{key}\b[^`\n]*`|^[ -]*{key}:|[{{,] *{key}\??[,}}:]", readme, re.M))
    assert not missing, f"not in the README: {missing}"
