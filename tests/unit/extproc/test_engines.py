"""A pool's ``engine``: its default, the priority each engine is sent, and ``kvgate check``
refusing priority scheduling on an engine that has none."""

from __future__ import annotations

from typing import get_args

import pytest
import yaml

from extproc.cli import main
from extproc.config import ConfigError, Engine, hash_api_key, parse_config
from extproc.datalayer.metrics import ENGINES


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
