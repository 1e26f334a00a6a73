r"""An engine's ``/metrics`` text → ``EngineMetrics``: pure parsing, no I/O, never raises.

One parser reads every engine kvgate knows (vLLM, SGLang, TGI, TensorRT-LLM under Triton):
what differs between them is only *where* each figure is exported, and that is data — an
``EngineNames`` per engine in ``ENGINES`` — not code. Each name there was taken from the
engine's own source (the file is named beside it).

A scrape body is untrusted input (a proxy's HTML error page, a truncated read, a future
release that renamed a family), and it arrives ten times a second per endpoint. So parsing
returns whatever it could read plus a list of problems, and the caller decides what a
partial reading is worth.

Speed: a body is mostly histogram buckets nobody here reads. One regex scan picks out the
lines of the wanted metric names (7 of ~450 sample lines in a real vLLM 0.32 body), and a
small parser of the text exposition format reads just those, caching each distinct label
set (they are the same on every scrape). With ``prometheus_client``'s parser on the same
lines, which this replaced, a parse cost 4-5x as much. Values are read by *sample* name, so
``# HELP`` and ``# TYPE`` lines play no part.

The parser reads what the format allows — ``\\``, ``\"`` and ``\n`` escapes in label
values (which may hold commas, braces and metric names), ``NaN``, ``+Inf``, exponents, an
optional timestamp, CRLF line ends, a trailing comma after the last label — and rejects
a malformed line as a whole: any line it reads, ``prometheus_client`` reads the same way.

Data-parallel engines: one server can report every family once per engine (vLLM's
``engine`` label with ``--data-parallel-size N``, SGLang's ``dp_rank``): the engine's
``group_label``. Counts and counters are summed over engines (within one engine the largest
sample counts: SGLang can report the same engine from every tensor-parallel rank). KV usage
is averaged weighted by each engine's KV capacity when the capacity of every reporting
engine is known — that is the fraction of the *server's* KV cache in use, which is what
admission compares with its watermarks — and otherwise the maximum is taken: without weights
the conservative reading is the fullest engine, since an unweighted mean could hide one
engine that is about to preempt.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # before vLLM's V1 engine renamed it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_CONFIG = "vllm:cache_config_info"

MAX_PROBLEMS = 20  # a body of pure junk must not become a megabyte of log text
MAX_COUNT = 2**53  # the largest block size, block count or token count taken from a label


class Sample(NamedTuple):
    """One exposition line: name, labels, value (a tuple: cheaper to build than a frozen
    dataclass, and every scrape builds several)."""

    name: str
    labels: Mapping[str, str]
    value: float


# -- where each engine exports what --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """A series one figure is read from: a sample name and, where an engine puts several
    figures in one family (Triton's ``nv_trt_llm_*``), the label value that selects it."""

    name: str
    label: str = ""
    value: str = ""

    def matches(self, sample: Sample) -> bool:
        return sample.name == self.name and (
            not self.label or sample.labels.get(self.label) == self.value)

    def __str__(self) -> str:
        return f'{self.name}{{{self.label}="{self.value}"}}' if self.label else self.name


Families = tuple[Family, ...]  # alternatives: the first one the body has is read


def _f(*names: str) -> Families:
    return tuple(Family(name) for name in names)


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """An info family (value 1) whose labels give the KV capacity: in tokens directly
    (``tokens_label``), else as block size × block count — less ``reserved_blocks`` that
    the engine counts but never gives a request (vLLM keeps one "null" block)."""

    name: str
    block_size_label: str
    blocks_label: str
    tokens_label: str = ""
    reserved_blocks: int = 0


@dataclass(frozen=True, slots=True)
class EngineNames:
    """Where one engine exports the figures kvgate schedules on.

    KV usage is ``kv_usage`` (a 0–1 gauge) or, where the engine has none, ``kv_used_tokens``
    ÷ capacity. Capacity in tokens comes from ``cache_info``'s labels, else a
    ``kv_capacity_tokens`` gauge, else ``kv_blocks`` × ``kv_block_size`` gauges.
    ``group_label`` tells data-parallel engines of one server apart; ``model_label`` names
    the served model.
    """

    engine: str
    kv_usage: Families = ()
    kv_used_tokens: Families = ()
    running: Families = ()
    waiting: Families = ()
    preemptions: Families = ()
    prompt_tokens: Families = ()
    generation_tokens: Families = ()
    cache_info: CacheInfo | None = None
    kv_capacity_tokens: Families = ()
    kv_blocks: Families = ()
    kv_block_size: Families = ()
    group_label: str = ""
    model_label: str = ""

    @property
    def wanted(self) -> frozenset[str]:
        """Every sample name this engine's figures may come from."""
        return _wanted(self)


@functools.lru_cache(maxsize=16)
def _wanted(names: EngineNames) -> frozenset[str]:
    families = (*names.kv_usage, *names.kv_used_tokens, *names.running, *names.waiting,
                *names.preemptions, *names.prompt_tokens, *names.generation_tokens,
                *names.kv_capacity_tokens, *names.kv_blocks, *names.kv_block_size)
    info = () if names.cache_info is None else (names.cache_info.name,)
    return frozenset({family.name for family in families} | set(info))


# vLLM: vllm/v1/metrics/loggers.py (the families), vllm/config/cache.py (cache_config_info's
# labels; kv_cache_size_tokens in newer releases). Read the V1 name, fall back to the V0 one.
VLLM = EngineNames(
    "vllm",
    kv_usage=_f(KV_USAGE, KV_USAGE_LEGACY),
    running=_f(RUNNING), waiting=_f(WAITING), preemptions=_f(PREEMPTIONS),
    prompt_tokens=_f(PROMPT_TOKENS), generation_tokens=_f(GENERATION_TOKENS),
    cache_info=CacheInfo(CACHE_CONFIG, "block_size", "num_gpu_blocks", "kv_cache_size_tokens",
                         reserved_blocks=1),  # vllm/v1/core/block_pool.py: the null block
    group_label="engine", model_label="model_name",
)

# SGLang: python/sglang/srt/observability/metrics_collector.py (SchedulerMetricsCollector,
# TokenizerMetricsCollector; python/sglang/srt/metrics/collector.py before the move), labels
# from observability/scheduler_metrics_mixin.py (model_name, engine_type, tp_rank, pp_rank,
# moe_ep_rank, and dp_rank with data-parallel attention). token_usage is used ÷
# max_total_num_tokens; a retraction is SGLang's preemption. Releases that export
# sglang:cache_config_info carry the capacity as page_size × num_pages (llm-d-router's
# sglang mapping reads those labels).
SGLANG = EngineNames(
    "sglang",
    kv_usage=_f("sglang:token_usage"),
    kv_used_tokens=_f("sglang:num_used_tokens"),
    running=_f("sglang:num_running_reqs"), waiting=_f("sglang:num_queue_reqs"),
    preemptions=_f("sglang:num_retracted_requests_total"),
    prompt_tokens=_f("sglang:prompt_tokens_total"),
    generation_tokens=_f("sglang:generation_tokens_total"),
    cache_info=CacheInfo("sglang:cache_config_info", "page_size", "num_pages"),
    kv_capacity_tokens=_f("sglang:max_total_num_tokens"),
    group_label="dp_rank", model_label="model_name",
)

# TGI: backends/v3/src/backend.rs, queue.rs, lib.rs and router/src/server.rs (3.x). TGI has
# no usage gauge: the running batch's tokens (tgi_batch_current_max_tokens, the KV slots it
# holds) over max_batch_total_tokens (tgi_batch_max_total_tokens, what warmup found fits).
# Token totals are the _sum of its per-request histograms. No labels, no model name.
TGI = EngineNames(
    "tgi",
    kv_used_tokens=_f("tgi_batch_current_max_tokens"),
    running=_f("tgi_batch_current_size"), waiting=_f("tgi_queue_size"),
    prompt_tokens=_f("tgi_request_input_length_sum"),
    generation_tokens=_f("tgi_request_generated_tokens_sum"),
    kv_capacity_tokens=_f("tgi_batch_max_total_tokens"),
)

# TensorRT-LLM under Triton: triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/
# custom_metrics_reporter.cc (NVIDIA/TensorRT-LLM; formerly tensorrtllm_backend): one family
# per group, the figure in a label (request_type, kv_cache_block_type), plus model and version
# labels. "scheduled" requests are the running ones, as llm-d-router maps them. The trtllm_*
# alternatives are trtllm-serve's names as llm-d-router's metrics factory maps them
# (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go).
_TRITON_REQUESTS = "nv_trt_llm_request_metrics"
_TRITON_KV = "nv_trt_llm_kv_cache_block_metrics"
TRTLLM = EngineNames(
    "trtllm",
    kv_usage=(Family(_TRITON_KV, "kv_cache_block_type", "fraction"),
              Family("trtllm_kv_cache_utilization")),
    running=(Family(_TRITON_REQUESTS, "request_type", "scheduled"),
             Family("trtllm_num_requests_running")),
    waiting=(Family(_TRITON_REQUESTS, "request_type", "waiting"),
             Family("trtllm_num_requests_waiting")),
    prompt_tokens=(Family("nv_llm_input_token_len_sum"),),
    generation_tokens=(Family("nv_llm_output_token_len_sum"),),
    kv_blocks=(Family(_TRITON_KV, "kv_cache_block_type", "max"),
               Family("trtllm_kv_cache_max_blocks")),
    kv_block_size=(Family(_TRITON_KV, "kv_cache_block_type", "tokens_per"),
                   Family("trtllm_kv_cache_tokens_per_block")),
    group_label="model", model_label="model",
)

ENGINES: Mapping[str, EngineNames] = MappingProxyType(
    {names.engine: names for names in (VLLM, SGLANG, TGI, TRTLLM)})
WANTED = VLLM.wanted


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape of one engine said; ``None`` where it said nothing usable.

    ``kv_cache_usage`` is a fraction in [0, 1]. ``kv_capacity_tokens`` is the server's KV
    cache size in tokens (summed over data-parallel engines). ``kv_usage_source`` names the
    series the usage came from, so an old engine that only has a deprecated name is visible.
    ``engines`` are the data-parallel engines seen (``""`` where the engine has no such
    label). ``problems`` says what was wrong with the body.
    """

    kv_cache_usage: float | None = None
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    num_preemptions_total: int | None = None
    prompt_tokens_total: int | None = None
    generation_tokens_total: int | None = None
    kv_capacity_tokens: int | None = None
    kv_block_tokens: int | None = None  # tokens per KV block, where the engine says
    kv_usage_source: str | None = None
    models: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def has_data(self) -> bool:
        """Whether the body held any of the engine's metrics (a junk body holds none)."""
        return bool(self.engines) or self.kv_capacity_tokens is not None

    @property
    def kv_used_tokens(self) -> int | None:
        """Tokens' worth of KV in use, when both usage and capacity are known."""
        if self.kv_cache_usage is None or self.kv_capacity_tokens is None:
            return None
        return round(self.kv_cache_usage * self.kv_capacity_tokens)


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Read the metrics kvgate schedules on from a vLLM ``/metrics`` body."""
    return parse_metrics(text, VLLM)


def parse_metrics(text: str, names: EngineNames = VLLM) -> EngineMetrics:
    """Read the metrics kvgate schedules on from one engine's ``/metrics`` body."""
    samples, problems = read_samples(text, names.wanted)
    reading = _Reading(names, samples, problems)
    capacities = reading.capacities()
    usage, source = reading.usage(capacities)
    if not samples:
        problems.append(f"no {names.engine} metrics in the body")
    engines = reading.engines()
    return EngineMetrics(
        kv_cache_usage=usage,
        num_requests_running=reading.total(names.running),
        num_requests_waiting=reading.total(names.waiting),
        num_preemptions_total=reading.total(names.preemptions),
        prompt_tokens_total=reading.total(names.prompt_tokens),
        generation_tokens_total=reading.total(names.generation_tokens),
        kv_capacity_tokens=_capacity_total(capacities, engines, problems),
        kv_block_tokens=reading.block_tokens(),
        kv_usage_source=source if usage is not None else None,
        models=_models(samples, names.model_label),
        engines=tuple(sorted(engines)),
        problems=_capped(problems),
    )


# -- reading samples -----------------------------------------------------------------------


def read_samples(text: str, names: Iterable[str]) -> tuple[list[Sample], list[str]]:
    """The finite-valued samples named in ``names``, and the problems met.

    A broken line costs that line and not the rest of the body; a non-finite value is a
    problem, not a sample (no caller can use NaN or Inf).
    """
    samples: list[Sample] = []
    problems: list[str] = []
    non_finite: list[str] = []
    for name, rest in _sample_lines(text, frozenset(names)):
        try:
            sample = _parse_line(name, rest)
        except ValueError as exc:
            problems.append(f"unparseable line {_shorten(name + rest.rstrip())!r}: {exc}")
            continue
        if math.isfinite(sample.value):
            samples.append(sample)
        else:
            non_finite.append(f"{name}{_label_text(sample.labels)} is {sample.value}")
    return samples, problems + non_finite


def _sample_lines(text: str, names: frozenset[str]) -> list[tuple[str, str]]:
    """(name, rest of the line) of every sample line whose metric name is in ``names``.

    One regex scan over the body in C: a line qualifies when, after leading whitespace, it
    starts with one of the names followed by ``{``, whitespace or its end (so
    ``vllm:prompt_tokens_total_by_…`` and ``# HELP`` lines do not).
    """
    if not names:
        return []
    first, following = _line_patterns(names)
    lines = following.findall(text)
    if head := first.match(text):
        lines.insert(0, head.groups())
    return lines


@functools.lru_cache(maxsize=16)
def _line_patterns(names: frozenset[str]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Patterns for the first line and for every later one (which starts after a ``\\n``).

    Two patterns, not ``(?:^|\\n)``: a pattern that starts with a literal ``\\n`` lets the
    regex engine skip ahead to the next newline instead of trying every position.
    """
    alternatives = "|".join(re.escape(name) for name in sorted(names))
    line = rf"[^\S\n]*({alternatives})(?=[{{\s]|\Z)([^\n]*)"
    return re.compile(line), re.compile("\n" + line)


def _parse_line(name: str, rest: str) -> Sample:
    """One sample line (``rest`` follows the name): optional ``{labels}``, value, timestamp.

    The closing brace is the line's last ``}``: values and timestamps cannot contain one,
    label values can, and whatever is wrong around it the label or value parser rejects.
    """
    rest = rest.rstrip()
    head = rest.lstrip()
    if head.startswith("{"):
        close = head.rfind("}")
        if close < 0:
            raise ValueError("no closing '}'")
        return Sample(name, _labels(head[1:close]), _value(head[close + 1:]))
    if rest[:1] not in (" ", "\t"):
        raise ValueError("no value")
    return Sample(name, _NO_LABELS, _value(rest))


_NO_LABELS: Mapping[str, str] = MappingProxyType({})
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|\Z)', re.S)
_ESCAPE = re.compile(r"\\(.)", re.S)
_UNESCAPED = {"\\": "\\", "n": "\n", '"': '"'}


@functools.lru_cache(maxsize=1024)
def _labels(text: str) -> Mapping[str, str]:
    """The labels between the braces, read-only because the cache shares them.

    Cached: an endpoint's label sets are the same on every scrape (vLLM's
    ``cache_config_info`` alone has ~40 labels). ``name="value", …``, a trailing comma
    allowed; in values ``\\\\``, ``\\"`` and ``\\n`` are escapes, any other backslash is kept.
    """
    labels: dict[str, str] = {}
    text, pos = text.rstrip(), 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise ValueError(f"bad labels at {_shorten(text[pos:], 40)!r}")
        key, value = match.groups()
        if key in labels or key.startswith("__"):
            raise ValueError(f"label name {key!r} repeated or reserved")
        labels[key] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = match.end()
    return MappingProxyType(labels)


def _unescape(match: re.Match[str]) -> str:
    char = match.group(1)
    return _UNESCAPED.get(char, "\\" + char)


def _value(text: str) -> float:
    """The value of ``value [timestamp]``; the timestamp must be a number but is not kept.

    Separated by spaces or tabs only (another whitespace alone does not separate them).
    """
    text = text.strip()
    tokens = text.split()
    if len(tokens) == 2 and " " not in text and "\t" not in text:
        raise ValueError("value and timestamp not separated by a space or tab")
    if not 1 <= len(tokens) <= 2:
        raise ValueError(f"expected a value and maybe a timestamp, got {len(tokens)} fields")
    if len(tokens) == 2:
        _number(tokens[1])
    return _number(tokens[0])


def _number(token: str) -> float:
    """``float`` of a value: ``NaN``, ``+Inf``, ``-Inf``, exponents; no ``_`` separators."""
    if "_" in token:
        raise ValueError(f"not a number: {token!r}")
    return float(token)


def _models(samples: list[Sample], label: str) -> tuple[str, ...]:
    if not label:
        return ()
    return tuple(sorted({model for s in samples if (model := s.labels.get(label))}))


# -- combining engines ---------------------------------------------------------------------


class _Reading:
    """One body's samples, read through one engine's names."""

    def __init__(self, names: EngineNames, samples: list[Sample], problems: list[str]):
        self.names, self.problems = names, problems
        self.named: dict[str, list[Sample]] = {}
        for sample in samples:
            self.named.setdefault(sample.name, []).append(sample)

    def group(self, sample: Sample) -> str:
        """The data-parallel engine a sample belongs to ("" without such a label)."""
        return sample.labels.get(self.names.group_label, "") if self.names.group_label else ""

    def engines(self) -> set[str]:
        """The data-parallel engines the body reports. Samples without the engine label in
        a body whose others have it are server-wide (SGLang's token counters come from its
        tokenizer process, not a scheduler): no engine of their own."""
        info = self.names.cache_info.name if self.names.cache_info else ""
        groups = {self.group(s) for samples in self.named.values() for s in samples
                  if s.name != info}
        return groups - {""} if len(groups) > 1 else groups

    def pick(self, families: Families) -> tuple[Family, list[Sample]] | None:
        """The first of ``families`` the body has, and its samples."""
        for family in families:
            samples = [s for s in self.named.get(family.name, ()) if family.matches(s)]
            if samples:
                return family, samples
        return None

    def per_group(self, families: Families) -> tuple[Family, dict[str, float]] | None:
        """The first present family's value per engine: the largest where one engine
        reports the same family several times (once per tensor-parallel rank)."""
        picked = self.pick(families)
        if picked is None:
            return None
        values: dict[str, float] = {}
        for sample in picked[1]:
            group = self.group(sample)
            values[group] = max(sample.value, values.get(group, -math.inf))
        return picked[0], values

    def total(self, families: Families) -> int | None:
        """A count's total over engines; None when the body had none.

        Finite values can still add up to infinity, which ``round`` would raise on. A
        negative count (a gauge that underflowed) is a problem, not a count: the scheduler
        divides by the largest waiting or running count plus one, which -1 makes zero.
        """
        picked = self.per_group(families)
        if picked is None:
            return None
        if (least := min(picked[1].values())) < 0:
            self.problems.append(f"{picked[0]} is {least}, not a count")
            return None
        total = sum(picked[1].values())
        if math.isfinite(total):
            return round(total)
        self.problems.append(f"{picked[0]} adds up to {total}")
        return None

    def capacities(self) -> dict[str, int]:
        """KV capacity in tokens per engine: info labels, a gauge, or blocks × block size."""
        names = self.names
        if names.cache_info is not None and names.cache_info.name in self.named:
            return self._info_capacities(names.cache_info)
        if gauge := self.per_group(names.kv_capacity_tokens):
            return self._positive(gauge[1], str(gauge[0]))
        blocks, size = self.per_group(names.kv_blocks), self.per_group(names.kv_block_size)
        if blocks is None or size is None:
            return {}
        counts = self._positive(blocks[1], str(blocks[0]))
        sizes = self._positive(size[1], str(size[0]))
        return {g: n * sizes[g] for g, n in counts.items() if g in sizes}

    def block_tokens(self) -> int | None:
        """Tokens per KV block (the largest an engine reports): a request's KV is whole
        blocks, up to one block more than its tokens."""
        names = self.names
        if names.cache_info is not None and names.cache_info.name in self.named:
            sizes = [_positive_int(s.labels.get(names.cache_info.block_size_label))
                     for s in self.named[names.cache_info.name]]
            return max((n for n in sizes if n is not None), default=None)
        size = self.per_group(names.kv_block_size)
        if size is None:
            return None
        return max((round(v) for v in size[1].values() if 0 < v <= MAX_COUNT), default=None)

    def _info_capacities(self, info: CacheInfo) -> dict[str, int]:
        """Newer vLLM exports ``kv_cache_size_tokens``, which is right for hybrid models
        where block_size × num_gpu_blocks is not; older ones only the two factors. Either
        counts the engine's reserved blocks, which no request can use."""
        capacities: dict[str, int] = {}
        for sample in self.named[info.name]:
            labels = sample.labels
            tokens = _positive_int(labels.get(info.tokens_label)) if info.tokens_label else None
            block_size = _positive_int(labels.get(info.block_size_label))
            if tokens is not None and block_size is not None and info.reserved_blocks:
                tokens = max(block_size, tokens - info.reserved_blocks * block_size)
            if tokens is None:
                blocks = _positive_int(labels.get(info.blocks_label))
                if block_size is None or blocks is None:
                    self.problems.append(
                        f"{info.name} without usable {info.block_size_label}/{info.blocks_label}"
                        f" ({labels.get(info.block_size_label)!r}, "
                        f"{labels.get(info.blocks_label)!r})")
                    continue
                tokens = block_size * max(1, blocks - info.reserved_blocks)
            group = self.group(sample)
            capacities[group] = max(tokens, capacities.get(group, 0))
        return capacities

    def _positive(self, values: dict[str, float], name: str) -> dict[str, int]:
        out = {}
        for group, value in values.items():
            if 0 < value <= MAX_COUNT:
                out[group] = round(value)
            else:
                self.problems.append(f"{name} is {value}, not a KV size")
        return out

    def usage(self, capacities: dict[str, int]) -> tuple[float | None, str | None]:
        """The server's KV usage and the series it came from (see the module docstring)."""
        picked = self.per_group(self.names.kv_usage)
        if picked is not None:
            family, per_group = picked
        elif used := self.per_group(self.names.kv_used_tokens):
            family = used[0]
            per_group = {g: v / capacities[g] for g, v in used[1].items() if capacities.get(g)}
        else:
            return None, None
        name = str(family)
        for group, value in per_group.items():
            if not 0.0 <= value <= 1.0:
                self.problems.append(f"{name} out of [0, 1]: {value}; clamped")
                per_group[group] = min(1.0, max(0.0, value))
        if not per_group:
            return None, None
        weights = [capacities.get(group, 0) for group in per_group]
        if all(weights):
            total = sum(u * w for u, w in zip(per_group.values(), weights, strict=True))
            return total / sum(weights), name
        return max(per_group.values()), name


def _positive_int(value: str | None) -> int | None:
    """A label value as a positive integer; vLLM writes ``"None"`` before profiling.

    Above ``MAX_COUNT`` is junk, not a cache size: it would overflow the float arithmetic.
    """
    try:
        number = int(value) if value is not None else 0
    except ValueError:
        return None
    return number if 0 < number <= MAX_COUNT else None


def _capacity_total(capacities: dict[str, int], engines: set[str],
                    problems: list[str]) -> int | None:
    if not capacities:
        return None
    if missing := sorted(engines - set(capacities)):
        problems.append(f"KV capacity unknown for engines {missing}; the total leaves them out")
    return sum(capacities.values())


# -- problem text --------------------------------------------------------------------------


def _capped(problems: list[str]) -> tuple[str, ...]:
    if len(problems) <= MAX_PROBLEMS:
        return tuple(problems)
    extra = len(problems) - MAX_PROBLEMS
    return (*problems[:MAX_PROBLEMS], f"... and {extra} more")


def _shorten(line: str, limit: int = 80) -> str:
    return line if len(line) <= limit else line[:limit] + "…"


def _label_text(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
