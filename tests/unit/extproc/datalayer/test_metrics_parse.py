r"""kvgate's own exposition-format parser (extproc.datalayer.metrics) against prometheus_client.

``reference_read_samples`` is the reader kvgate used before: the lines whose metric name is
wanted, each parsed by ``prometheus_client`` (the old code parsed them as one batch and
retried line by line on an error, which reads the same samples). The tests hold the new
parser to it: the same ``EngineMetrics`` for real and generated valid bodies, and on junk,
nothing read that the reference would not read the same way.

Where the reference is laxer than the format (it reads ``name 1 2 3`` as 1, ``{,a="1"}``,
``{a=,b="2"}``, quoted or ``:``-named labels), the new parser rejects the line; those cases
are pinned in ``test_stricter_than_the_reference_on_malformed_lines``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from extproc.datalayer import metrics
from extproc.datalayer.metrics import (
    CACHE_CONFIG,
    KV_USAGE,
    RUNNING,
    WAITING,
    WANTED,
    EngineMetrics,
    Sample,
    parse_vllm_metrics,
    read_samples,
)
from extproc.engine.model import EngineConfig
from extproc.engine.server import EngineServer
from tests.paths import DATA

ENGINE = '{engine="0",model_name="m"}'


def reference_read_samples(text: str, names: Iterable[str]) -> tuple[list[Sample], list[str]]:
    """The previous reader: the same line filter, then prometheus_client line by line."""
    wanted = frozenset(names)
    samples: list[Sample] = []
    problems: list[str] = []
    non_finite: list[str] = []
    for line in (raw.strip() for raw in text.split("\n")):
        if not line.startswith(tuple(wanted)) or _name(line) not in wanted:
            continue
        try:
            parsed = [Sample(s.name, dict(s.labels), float(s.value))
                      for family in text_string_to_metric_families(line + "\n")
                      for s in family.samples]
        except Exception as exc:
            problems.append(f"unparseable line {line!r}: {exc}")
            continue
        for sample in parsed:
            if math.isfinite(sample.value):
                samples.append(sample)
            else:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                non_finite.append(f"{sample.name}{{{labels}}} is {sample.value}"
                                  if labels else f"{sample.name} is {sample.value}")
    return samples, problems + non_finite


def _name(line: str) -> str:
    return line.split("{", 1)[0].split(None, 1)[0]


def reference_parse(text: str) -> EngineMetrics:
    with mock.patch.object(metrics, "read_samples", reference_read_samples):
        return parse_vllm_metrics(text)


def same_metrics(text: str) -> None:
    """New and reference parse agree; problems compared as a multiset (the reference read
    ``*_info`` lines first, so it listed their problems first)."""
    new, old = parse_vllm_metrics(text), reference_parse(text)
    assert not any("unparseable" in p for p in new.problems)
    assert sorted(new.problems) == sorted(old.problems)
    assert replace(new, problems=()) == replace(old, problems=())


def sample_set(samples: list[Sample]) -> Counter[tuple[str, tuple[tuple[str, str], ...], float]]:
    return Counter((s.name, tuple(sorted(s.labels.items())), s.value) for s in samples)


def one(line: str) -> Sample:
    """The one sample a line holds, by the new parser (failing if it is not read)."""
    samples, problems = read_samples(line, WANTED)
    assert problems == [] and len(samples) == 1, problems
    return samples[0]


def rejected(line: str) -> str:
    samples, problems = read_samples(line, WANTED)
    assert samples == [] and len(problems) == 1
    return problems[0]


# -- real bodies: identical EngineMetrics -----------------------------------------------------


def bench_engine_body(engine: str = "0") -> str:
    server = EngineServer(EngineConfig(kv_blocks=100, block_size=16))
    server.metrics.engine_index = engine
    server.metrics.labels["engine"] = engine
    return server.metrics.render().decode()


REAL = {path.name: path.read_text() for path in sorted(DATA.glob("vllm-*metrics.txt"))}
REAL["extproc.engine"] = bench_engine_body()
REAL["data-parallel"] = bench_engine_body("0") + bench_engine_body("1")


def variants(text: str) -> dict[str, str]:
    """The same body as a proxy or another exporter might pass it on."""
    lines = text.splitlines()
    return {
        "as is": text,
        "crlf": "\r\n".join(lines) + "\r\n",
        "indented": "\n".join("  " + line for line in lines),
        "timestamps": "\n".join(line if line.startswith("#") or not line else
                                line + " 1700000000000" for line in lines),
        "tabs": "\n".join(line.replace("} ", "}\t") for line in lines),
        "no trailing newline": text.rstrip("\n"),
        "no comments": "\n".join(line for line in lines if not line.startswith("#")),
    }


@pytest.mark.parametrize("name", list(REAL))
def test_real_bodies_give_identical_engine_metrics(name: str) -> None:
    for variant, text in variants(REAL[name]).items():
        new, old = parse_vllm_metrics(text), reference_parse(text)
        assert new == old, variant
        assert new.has_data and new.problems == (), variant
        new_samples, old_samples = read_samples(text, WANTED), reference_read_samples(text, WANTED)
        assert sample_set(new_samples[0]) == sample_set(old_samples[0]), variant


def test_the_scan_finds_exactly_the_wanted_lines_of_a_captured_body() -> None:
    text = REAL["vllm-0.32-metrics.txt"]
    samples, _ = read_samples(text, WANTED)
    expected = [line for line in text.splitlines()
                if line and not line.startswith("#") and _name(line) in WANTED]
    assert len(samples) == len(expected) > 0


# -- edge cases of the format -----------------------------------------------------------------


def test_escaped_label_values() -> None:
    sample = one(r'vllm:num_requests_running{model_name="a\"b\\c\nd\te",engine="0"} 3')
    assert sample.labels == {"model_name": 'a"b\\c\nd\\te', "engine": "0"}
    assert one(r'vllm:num_requests_running{a="\\"} 1').labels == {"a": "\\"}
    assert one(r'vllm:num_requests_running{a="\\\"}"} 1').labels == {"a": '\\"}'}


def test_label_values_holding_commas_braces_and_metric_names() -> None:
    line = ('vllm:num_requests_running{model_name="x,y}{=\\"z",'
            'engine="vllm:num_requests_running 7"} 3')
    sample = one(line)
    assert sample.labels == {"model_name": 'x,y}{="z', "engine": "vllm:num_requests_running 7"}
    assert sample.value == 3.0


def test_a_wanted_name_inside_another_metrics_labels_is_not_a_sample() -> None:
    body = ('vllm:other{model_name="vllm:num_requests_running"} 5\n'
            'vllm:num_requests_running_total{engine="0"} 9\n'
            "# HELP vllm:num_requests_running 4\n"
            '# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0"} 2\n')
    assert parse_vllm_metrics(body).num_requests_running == 2
    same_metrics(body)


@pytest.mark.parametrize(("text", "value"), [
    ("1", 1.0), ("-2", -2.0), ("+3.5", 3.5), ("2.5e-1", 0.25), ("1E3", 1000.0),
    (".5", 0.5), ("5.", 5.0), ("12345678901234567890", 12345678901234567890.0),
])
def test_values(text: str, value: float) -> None:
    assert one(f"vllm:num_requests_running{ENGINE} {text}").value == value


@pytest.mark.parametrize("text", ["NaN", "nan", "+Inf", "-Inf", "Inf", "inf", "1e999"])
def test_non_finite_values_are_problems_not_samples(text: str) -> None:
    samples, problems = read_samples(f"{KV_USAGE}{ENGINE} {text}", WANTED)
    assert samples == []
    assert problems == [f'{KV_USAGE}{{engine="0",model_name="m"}} is {float(text)}']
    same_metrics(f"{KV_USAGE}{ENGINE} {text}\n{RUNNING}{ENGINE} 1\n")


def test_timestamps_are_checked_and_dropped() -> None:
    assert one(f"{RUNNING}{ENGINE} 4 1700000000000").value == 4.0
    assert one(f"{RUNNING}{ENGINE}\t4\t-1").value == 4.0
    assert one(f"{RUNNING} 4 1.7e12").labels == {}
    assert "not a number" in rejected(f"{RUNNING}{ENGINE} 4 1_000")
    assert "could not convert" in rejected(f"{RUNNING}{ENGINE} 4 yesterday")


def test_whitespace_the_format_allows() -> None:
    assert one(f'  {RUNNING} {{ engine = "0" , model_name="m", }}   5  \r').labels == {
        "engine": "0", "model_name": "m"}
    assert one(f"{RUNNING}{{}} 6").value == 6.0
    assert one(f'{RUNNING}{{engine="0"}}7').value == 7.0  # no space after the brace
    assert one(f"{RUNNING}\t8").value == 8.0


def test_crlf_body() -> None:
    body = f"# TYPE {RUNNING} gauge\r\n{RUNNING}{ENGINE} 3\r\n{KV_USAGE}{ENGINE} 0.5\r\n"
    result = parse_vllm_metrics(body)
    assert (result.num_requests_running, result.kv_cache_usage) == (3, 0.5)
    assert result.problems == ()


def test_missing_metrics_are_none() -> None:
    result = parse_vllm_metrics(f"{RUNNING}{ENGINE} 3\n")
    assert result.num_requests_running == 3
    assert result.num_requests_waiting is None and result.kv_cache_usage is None
    assert result.kv_capacity_tokens is None and result.has_data and result.problems == ()


@pytest.mark.parametrize("line", [
    f"{RUNNING}", f"{RUNNING} ", f"{RUNNING}{ENGINE}", f"{RUNNING}{{engine=\"0\" 1",
    f'{RUNNING}{{engine="0}} 1', f'{RUNNING}{{engine=0}} 1', f"{RUNNING}{{engine}} 1",
    f'{RUNNING}{{engine="0" model_name="m"}} 1', f'{RUNNING}{{engine="0",engine="1"}} 1',
    f'{RUNNING}{{__name__="x"}} 1', f"{RUNNING}{ENGINE} one", f"{RUNNING}{ENGINE} 1_0",
    f"{RUNNING}{ENGINE} 1 2}}", f"{RUNNING}{ENGINE} 0x10", f"{RUNNING}{ENGINE} 1\x0b2",
    f"{RUNNING}\x0b1", f"{RUNNING}{ENGINE} \"1\"", f"{RUNNING}{ENGINE}}} 1",
])
def test_malformed_lines_are_rejected_like_the_reference_does(line: str) -> None:
    assert rejected(line).startswith("unparseable line ")
    ref_samples, ref_problems = reference_read_samples(line, WANTED)
    assert ref_samples == [] and len(ref_problems) == 1


@pytest.mark.parametrize(("line", "reference_reads"), [
    (f"{RUNNING}{ENGINE} 1 2 3", 1.0),  # the reference keeps the first field
    (f'{RUNNING}{{,engine="0"}} 1', 1.0),
    (f'{RUNNING}{{engine=,model_name="m"}} 1', 1.0),
    (f'{RUNNING}{{"engine"="0"}} 1', 1.0),
    (f'{RUNNING}{{a:b="0"}} 1', 1.0),
])
def test_stricter_than_the_reference_on_malformed_lines(line: str,
                                                        reference_reads: float) -> None:
    rejected(line)
    [sample], _ = reference_read_samples(line, WANTED)
    assert sample.value == reference_reads


def test_a_broken_line_costs_only_itself() -> None:
    body = (f"{RUNNING}{ENGINE} 3\n<html>\n{KV_USAGE}{{engine=\"0\" 0.5\n"
            f"{KV_USAGE}{ENGINE} 0.25\n\x00\xff garbage {{}}\n")
    result = parse_vllm_metrics(body)
    assert (result.num_requests_running, result.kv_cache_usage) == (3, 0.25)
    assert len(result.problems) == 1 and result.problems[0].startswith("unparseable line")


def test_label_sets_are_shared_read_only() -> None:
    first, second = one(f"{RUNNING}{ENGINE} 1"), one(f"{RUNNING}{ENGINE} 2")
    assert first.labels is second.labels
    with pytest.raises(TypeError):
        first.labels["engine"] = "9"  # type: ignore[index]


def test_sums_and_capacities_that_would_overflow_are_problems_not_exceptions() -> None:
    body = f'{RUNNING}{{engine="0"}} 1e308\n{RUNNING}{{engine="1"}} 1e308\n'
    result = parse_vllm_metrics(body)
    assert result.num_requests_running is None
    assert any("adds up to inf" in p for p in result.problems)
    huge = "9" * 400
    body = (f'{KV_USAGE}{{engine="0"}} 0.5\n{KV_USAGE}{{engine="1"}} 0.5\n'
            f'{CACHE_CONFIG}{{engine="0",kv_cache_size_tokens="{huge}",block_size="{huge}",'
            f'num_gpu_blocks="2"}} 1\n{CACHE_CONFIG}{{engine="1",kv_cache_size_tokens="8"}} 1\n')
    result = parse_vllm_metrics(body)
    assert result.kv_capacity_tokens == 8 and result.kv_cache_usage == 0.5
    assert result.kv_used_tokens == 4


def test_a_negative_count_is_a_problem_not_a_count() -> None:
    """A gauge that underflowed (-1 waiting, -1 running) made the scheduler's ranking divide
    by zero (its largest count plus one): every placement on two such endpoints failed."""
    body = (f'{RUNNING}{{engine="0"}} -1\n{RUNNING}{{engine="1"}} 2\n'
            f"{WAITING}{ENGINE} -1\n{KV_USAGE}{ENGINE} 0.25\n")
    result = parse_vllm_metrics(body)
    assert (result.num_requests_running, result.num_requests_waiting) == (None, None)
    assert result.kv_cache_usage == 0.25
    assert any(p.endswith("is -1.0, not a count") for p in result.problems)
    assert parse_vllm_metrics(f"{WAITING}{ENGINE} -0\n").num_requests_waiting == 0


def test_no_names_reads_nothing() -> None:
    assert read_samples(f"{RUNNING} 1\n", ()) == ([], [])


# -- generated bodies: valid ones read identically, junk never raises -------------------------

label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True).filter(
    lambda n: not n.startswith("__"))
label_values = st.text(max_size=12) | st.sampled_from(
    ["0", "1", "16", "None", "m", RUNNING, "a,b", "}", "{", '"', "\\", "=", " "])
numbers = (st.integers(-(10**20), 10**20).map(str)
           | st.floats(allow_nan=True, allow_infinity=True).map(repr)
           | st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "0.25", "1e3", "-2.5E-2", ".5",
                              "+1", "0", "-0", "1.0"]))
blanks = st.sampled_from(["", " ", "\t", "  "])


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def valid_lines(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(sorted(WANTED)))
    common = {"engine": st.sampled_from(["0", "1", "2"]), "model_name": label_values,
              "block_size": label_values, "num_gpu_blocks": label_values,
              "kv_cache_size_tokens": st.integers(0, 10**6).map(str) | label_values}
    picked = draw(st.lists(st.sampled_from(sorted(common)), unique=True))
    labels = {key: draw(common[key]) for key in picked}
    labels.update(draw(st.dictionaries(label_names.filter(lambda n: n not in common),
                                       label_values, max_size=3)))
    value = draw(numbers)
    stamp = draw(st.none() | st.integers(-(2**63), 2**63).map(str))
    tail = value if stamp is None else value + draw(st.sampled_from([" ", "\t", " \t "])) + stamp
    indent, end = draw(blanks), draw(st.sampled_from(["", " ", "\r", "\t"]))
    if not labels and draw(st.booleans()):
        separator = draw(st.sampled_from([" ", "\t", "  "]))
        return f"{indent}{name}{separator}{tail}{end}"
    pairs = [f'{draw(blanks)}{k}{draw(blanks)}={draw(blanks)}"{escape(v)}"{draw(blanks)}'
             for k, v in labels.items()]
    comma = "," if pairs and draw(st.booleans()) else ""
    gap, space = draw(st.sampled_from(["", " "])), draw(st.sampled_from(["", " ", "\t"]))
    return f"{indent}{name}{gap}{{{','.join(pairs)}{comma}}}{space}{tail}{end}"


other_lines = st.sampled_from([
    "", "# HELP vllm:num_requests_running Number of requests.",
    "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running_max{ENGINE} 9',
    f'vllm:other{{model_name="{RUNNING}"}} 5',
    'vllm:time_to_first_token_seconds_bucket{le="+Inf",engine="0"} 12', "#", f"# {RUNNING} 3",
])


@settings(max_examples=300)
@given(st.lists(valid_lines() | other_lines, max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_valid_generated_bodies_read_like_the_reference(lines: list[str], newline: str) -> None:
    text = newline.join(lines)
    new_samples, new_problems = read_samples(text, WANTED)
    old_samples, old_problems = reference_read_samples(text, WANTED)
    assert sample_set(new_samples) == sample_set(old_samples)
    assert sorted(new_problems) == sorted(old_problems)
    same_metrics(text)


junk_pieces = st.sampled_from([
    RUNNING, KV_USAGE, CACHE_CONFIG, "{", "}", '"', "\\", "=", ",", " ", "\t", "\r", "\n",
    "\x0b", "engine", '"0"', "1", "NaN", "+Inf", "e9", "_", "#", "__name__", "1 2", "\u2028",
])


@settings(max_examples=500)
@given(st.lists(junk_pieces | st.text(max_size=4), max_size=30).map("".join))
def test_junk_reads_nothing_the_reference_would_not(text: str) -> None:
    new_samples, _ = read_samples(text, WANTED)
    old_samples, _ = reference_read_samples(text, WANTED)
    assert not sample_set(new_samples) - sample_set(old_samples)
    assert isinstance(parse_vllm_metrics(text), EngineMetrics)


def test_shuffled_real_lines_with_junk_between() -> None:
    rng = random.Random(7)
    lines = REAL["vllm-sample-metrics.txt"].splitlines()
    junk = ["<html>", f"{RUNNING}{{", f"{KV_USAGE} NaN", '{"error": 1}', "\x00", f"{RUNNING}"]
    for _ in range(50):
        mixed = lines + rng.sample(junk, 3)
        rng.shuffle(mixed)
        text = "\n".join(mixed)
        new_samples, _ = read_samples(text, WANTED)
        old_samples, _ = reference_read_samples(text, WANTED)
        assert sample_set(new_samples) == sample_set(old_samples)
