"""One parser, four engines: SGLang, TGI and TensorRT-LLM (Triton) bodies read through their
``EngineNames`` (extproc.datalayer.metrics.ENGINES), and vLLM's through its own.

The bodies in tests/data (``sglang-``, ``tgi-``, ``trtllm-triton-sample-metrics.txt``) are
constructed from each engine's source, named in their first line; every test here also holds
the figures to what prometheus_client's own parser finds in the same body.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from extproc.datalayer.metrics import (
    ENGINES,
    SGLANG,
    TGI,
    TRTLLM,
    VLLM,
    EngineMetrics,
    parse_metrics,
)
from tests.paths import DATA

SAMPLES = {"vllm": DATA / "vllm-sample-metrics.txt",
           "sglang": DATA / "sglang-sample-metrics.txt",
           "tgi": DATA / "tgi-sample-metrics.txt",
           "trtllm": DATA / "trtllm-triton-sample-metrics.txt"}
SG = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0"'


def reference(path: Path) -> dict[tuple[str, str], float]:
    """(sample name, sorted label text) → value, by prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out[(s.name, ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())))] = s.value
    return out


def test_every_engine_has_a_sample_and_the_names_are_distinct() -> None:
    assert set(ENGINES) == set(SAMPLES) == {"vllm", "sglang", "tgi", "trtllm"}
    for engine, names in ENGINES.items():
        assert names.engine == engine and names.wanted
        others = set().union(*(n.wanted for e, n in ENGINES.items() if e != engine))
        assert not names.wanted & others  # a body can only be read by its own engine's map


def test_sglang_sample() -> None:
    metrics = parse_metrics(SAMPLES["sglang"].read_text(), SGLANG)
    assert metrics == EngineMetrics(
        kv_cache_usage=0.25, num_requests_running=3, num_requests_waiting=2,
        num_preemptions_total=1, prompt_tokens_total=1234, generation_tokens_total=5678,
        kv_capacity_tokens=8192, kv_usage_source="sglang:token_usage", models=("tiny-llama",),
        engines=("",))
    ref = reference(SAMPLES["sglang"])
    labels = "engine_type=unified,model_name=tiny-llama,moe_ep_rank=0,pp_rank=0,tp_rank=0"
    assert ref[("sglang:token_usage", labels)] == metrics.kv_cache_usage
    assert ref[("sglang:max_total_num_tokens", labels)] == metrics.kv_capacity_tokens
    assert ref[("sglang:num_queue_reqs", labels)] == metrics.num_requests_waiting
    assert metrics.kv_used_tokens == ref[("sglang:num_used_tokens", labels)]


def test_tgi_sample_usage_is_the_batch_tokens_over_the_warmup_total() -> None:
    metrics = parse_metrics(SAMPLES["tgi"].read_text(), TGI)
    ref = reference(SAMPLES["tgi"])
    assert metrics == EngineMetrics(
        kv_cache_usage=4096 / 16384, num_requests_running=3, num_requests_waiting=2,
        prompt_tokens_total=1234, generation_tokens_total=5678, kv_capacity_tokens=16384,
        kv_usage_source="tgi_batch_current_max_tokens", engines=("",))
    assert ref[("tgi_batch_current_max_tokens", "")] / ref[("tgi_batch_max_total_tokens", "")] \
        == metrics.kv_cache_usage
    assert metrics.num_preemptions_total is None  # TGI exports none


def test_trtllm_triton_sample_reads_the_figure_from_its_label() -> None:
    metrics = parse_metrics(SAMPLES["trtllm"].read_text(), TRTLLM)
    ref = reference(SAMPLES["trtllm"])
    kv = "kv_cache_block_type={},model=tensorrt_llm,version=1"
    assert metrics == EngineMetrics(
        kv_cache_usage=0.25, num_requests_running=3, num_requests_waiting=2,
        prompt_tokens_total=1234, generation_tokens_total=5678, kv_capacity_tokens=4096 * 64,
        kv_block_tokens=64,
        kv_usage_source='nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}',
        models=("tensorrt_llm",), engines=("tensorrt_llm",))
    assert metrics.kv_capacity_tokens == (ref[("nv_trt_llm_kv_cache_block_metrics",
                                               kv.format("max"))]
                                          * ref[("nv_trt_llm_kv_cache_block_metrics",
                                                 kv.format("tokens_per"))])


def test_trtllm_serve_names_are_read_too() -> None:
    body = ("trtllm_kv_cache_utilization 0.5\ntrtllm_num_requests_running 4\n"
            "trtllm_num_requests_waiting 1\ntrtllm_kv_cache_max_blocks 100\n"
            "trtllm_kv_cache_tokens_per_block 32\n")
    metrics = parse_metrics(body, TRTLLM)
    assert (metrics.kv_cache_usage, metrics.num_requests_running,
            metrics.num_requests_waiting, metrics.kv_capacity_tokens) == (0.5, 4, 1, 3200)
    assert metrics.kv_usage_source == "trtllm_kv_cache_utilization"


@pytest.mark.parametrize("engine", list(SAMPLES))
def test_a_body_read_as_another_engine_has_no_data(engine: str) -> None:
    text = SAMPLES[engine].read_text()
    assert parse_metrics(text, ENGINES[engine]).has_data
    for other, names in ENGINES.items():
        if other != engine:
            metrics = parse_metrics(text, names)
            assert not metrics.has_data
            assert f"no {other} metrics in the body" in metrics.problems


# -- SGLang's data parallelism, ranks and older releases ------------------------------------


def sglang(name: str, value: float, dp: str | None = None, tp: str = "0") -> str:
    dp_label = f',dp_rank="{dp}"' if dp is not None else ""
    return f'sglang:{name}{{{SG}{dp_label},tp_rank="{tp}"}} {value}\n'


def test_sglang_data_parallel_ranks_are_engines() -> None:
    body = (sglang("token_usage", 0.2, "0") + sglang("token_usage", 0.6, "1")
            + sglang("max_total_num_tokens", 1000, "0") + sglang("max_total_num_tokens", 3000, "1")
            + sglang("num_running_reqs", 2, "0") + sglang("num_running_reqs", 5, "1"))
    body += 'sglang:prompt_tokens_total{model_name="m"} 99\n'  # the tokenizer's: no rank
    metrics = parse_metrics(body, SGLANG)
    assert metrics.kv_cache_usage == pytest.approx((0.2 * 1 + 0.6 * 3) / 4)
    assert (metrics.kv_capacity_tokens, metrics.num_requests_running) == (4000, 7)
    assert metrics.prompt_tokens_total == 99
    assert metrics.engines == ("0", "1") and metrics.problems == ()


def test_sglang_reporting_from_every_tensor_parallel_rank_is_not_counted_twice() -> None:
    body = "".join(sglang("num_running_reqs", 4, tp=tp) + sglang("token_usage", 0.5, tp=tp)
                   + sglang("max_total_num_tokens", 2048, tp=tp) for tp in ("0", "1"))
    metrics = parse_metrics(body, SGLANG)
    assert (metrics.num_requests_running, metrics.kv_capacity_tokens) == (4, 2048)
    assert metrics.kv_cache_usage == 0.5


def test_sglang_without_token_usage_divides_used_by_capacity() -> None:
    body = sglang("num_used_tokens", 512) + sglang("max_total_num_tokens", 2048)
    metrics = parse_metrics(body, SGLANG)
    assert metrics.kv_cache_usage == 0.25
    assert metrics.kv_usage_source == "sglang:num_used_tokens"


def test_sglang_cache_config_info_gives_pages_times_page_size() -> None:
    body = (f'sglang:cache_config_info{{{SG},num_pages="512",page_size="16",tp_rank="0"}} 1\n'
            + sglang("token_usage", 0.5))
    assert parse_metrics(body, SGLANG).kv_capacity_tokens == 8192


# -- engines that have not finished starting, and junk --------------------------------------


def test_tgi_before_warmup_has_counts_but_no_usage() -> None:
    metrics = parse_metrics("tgi_queue_size 1\ntgi_batch_current_max_tokens 0\n", TGI)
    assert metrics.has_data and metrics.num_requests_waiting == 1
    assert metrics.kv_cache_usage is None and metrics.kv_capacity_tokens is None


def test_a_nonsense_capacity_is_a_problem_not_a_number() -> None:
    metrics = parse_metrics("tgi_batch_current_max_tokens 5\ntgi_batch_max_total_tokens 0\n",
                            TGI)
    assert metrics.kv_capacity_tokens is None and metrics.kv_cache_usage is None
    assert any("not a KV size" in p for p in metrics.problems)


def test_usage_over_capacity_is_clamped() -> None:
    metrics = parse_metrics("tgi_batch_current_max_tokens 500\ntgi_batch_max_total_tokens 400\n",
                            TGI)
    assert metrics.kv_cache_usage == 1.0 and "clamped" in metrics.problems[0]


@given(st.sampled_from(sorted(ENGINES)), st.text())
def test_any_text_parses_without_raising_for_every_engine(engine: str, text: str) -> None:
    metrics = parse_metrics(text, ENGINES[engine])
    assert metrics.kv_cache_usage is None or 0.0 <= metrics.kv_cache_usage <= 1.0


def test_vllm_is_the_default() -> None:
    text = SAMPLES["vllm"].read_text()
    assert parse_metrics(text) == parse_metrics(text, VLLM) == parse_metrics(text, ENGINES["vllm"])
