"""A pool's ``engine``: its default, the priority each engine is sent, the prefix cache's
salt, and ``kvgate check`` refusing priority scheduling or salting on an engine that has
none."""

from __future__ import annotations

from typing import get_args

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from extproc.cli import main
from extproc.config import ConfigError, Engine, hash_api_key, parse_config
from extproc.datalayer.metrics import ENGINES
from extproc.engine.server import ApiError, check_cache_salt


def config(**pool):
    return parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"], **pool}],
    })


def test_every_configurable_engine_has_metric_names() -> None:
    assert set(get_args(Engine)) == set(ENGINES)
    assert config().pools[0].engine == "vllm"


@pytest.mark.parametrize(("pool", "sent"), [
    ({}, [None, None, None]),  # no priority scheduling: no priority in the body
    ({"priority_scheduling": True}, [0, 1, 2]),  # vLLM: lower runs first
    ({"engine": "sglang", "priority_scheduling": True}, [0, -1, -2]),  # SGLang: higher first
    ({"engine": "sglang", "priority_scheduling": True, "low_priority_first": True}, [0, 1, 2]),
    ({"engine": "tgi"}, [None, None, None]),
    ({"engine": "trtllm"}, [None, None, None]),
])
def test_the_body_priority_each_engine_is_sent(pool: dict, sent: list) -> None:
    cfg = config(**pool)
    classes = [cfg.classes[name].priority for name in ("interactive", "batch", "offline")]
    assert [cfg.pools[0].body_priority(p) for p in classes] == sent


@pytest.mark.parametrize("engine", ["tgi", "trtllm"])
def test_kvgate_check_refuses_priority_scheduling_without_engine_support(
        engine: str, tmp_path, capsys) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"],
                   "engine": engine, "priority_scheduling": True}],
    }))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert (f"pools[0]: priority_scheduling: {engine} does not schedule by a request "
            "priority (engines that do: vllm, sglang); set it to false") in err


def test_low_priority_first_is_sglang_only_and_engines_are_spelled_right(tmp_path,
                                                                         capsys) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"],
                   "low_priority_first": True},
                  {"name": "q", "models": ["n"], "endpoints": ["127.0.0.1:8001"],
                   "engine": "triton"}],
    }))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pools[0]: low_priority_first: only SGLang has a choice of priority order" in err
    assert "pools[1].engine:" in err and "'sglang'" in err


def test_metrics_port_is_a_port() -> None:
    assert config(engine="trtllm", metrics_port=8002).pools[0].metrics_port == 8002
    assert config().pools[0].metrics_port is None
    with pytest.raises(ConfigError) as info:
        config(metrics_port=70000)
    assert info.value.problems[0].startswith("pools[0].metrics_port:")


@pytest.mark.parametrize(("pool", "salted"), [
    ({}, True),  # vLLM reads cache_salt: tenants isolated by default
    ({"engine": "trtllm"}, False),  # may be Triton's frontend: salted only when asked
    ({"engine": "sglang"}, False),
    ({"engine": "tgi"}, False),
    ({"prefix_cache_isolation": "none"}, False),
    ({"engine": "trtllm", "prefix_cache_isolation": "tenant"}, True),
])
def test_which_pools_salt_the_prefix_cache_per_tenant(pool: dict, salted: bool) -> None:
    salt = config(**pool).pools[0].cache_salt("acme", None)
    assert (salt is not None) == salted


def test_salting_on_an_engine_without_cache_salt_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        config(engine="sglang", prefix_cache_isolation="tenant")
    assert info.value.problems == [
        "pools[0]: prefix_cache_isolation: sglang takes no cache_salt (engines that do: "
        "vllm, trtllm); set it to 'none'"]


TENANT = st.text(min_size=1, max_size=12)
CLIENT_SALT = st.none() | st.text(min_size=1, max_size=12)


@given(tenant=TENANT, other=TENANT, salt=CLIENT_SALT, other_salt=CLIENT_SALT)
def test_no_client_can_send_another_tenants_salt(tenant, other, salt, other_salt) -> None:
    """Whatever a client sends as its own ``cache_salt``, the salt upstream is one vLLM
    accepts, and two tenants' salts differ (the same tenant's differ by the client's)."""
    pool = config().pools[0]
    mine, theirs = pool.cache_salt(tenant, salt), pool.cache_salt(other, other_salt)
    check_cache_salt({"cache_salt": mine})  # the simulated engine applies vLLM's rules
    assert (mine == theirs) == ((tenant, salt) == (other, other_salt))


@pytest.mark.parametrize("salt", ["", 5, "a" * 129, "a/b", "a@b", "a\\b", "a\x00b"])
def test_the_simulated_engine_refuses_what_vllm_refuses_as_a_salt(salt) -> None:
    with pytest.raises(ApiError):
        check_cache_salt({"cache_salt": salt})


def test_long_client_salts_are_not_kept_by_the_salt_cache() -> None:
    """The digest cache keeps its keys: a client's long salts (one per request, up to the
    body limit) would hold up to 4,096 of them, gigabytes. They are hashed uncached."""
    from extproc.config import _tenant_salt

    pool = config().pools[0]
    _tenant_salt.cache_clear()
    long_salt = "s" * 100_000
    salted = [pool.cache_salt("acme", f"{n}{long_salt}") for n in range(20)]
    assert _tenant_salt.cache_info().currsize == 0
    assert len(set(salted)) == 20 and all(len(s) <= 128 for s in salted)
    assert pool.cache_salt("acme", "short") == pool.cache_salt("acme", "short")
    assert _tenant_salt.cache_info().currsize == 1
