"""vLLM ``/metrics`` text → ``EngineMetrics``: pure parsing, no I/O, never raises.

A scrape body is untrusted input (a proxy's HTML error page, a truncated read, a future
vLLM that renamed a family), and it arrives ten times a second per endpoint. So parsing
returns whatever it could read plus a list of problems, and the caller decides what a
partial reading is worth.

Speed: ``prometheus_client``'s parser is pure Python and a vLLM body is dominated by
histogram buckets nobody here reads, so sample lines are first filtered by name with plain
string operations and only the handful that matter go through
``text_string_to_metric_families``. Values are read by *sample* name, so it does not matter
whether the body carried ``# TYPE`` lines (the filter drops them) or how the parser groups
counters into families.

Data-parallel engines: one vLLM server with ``--data-parallel-size N`` reports every family
once per ``engine`` label value. Counts and counters are summed over engines. KV usage is
averaged weighted by each engine's KV capacity when the capacity of every reporting engine
is known — that is the fraction of the *server's* KV cache in use, which is what admission
compares with its watermarks — and otherwise the maximum is taken: without weights the
conservative reading is the fullest engine, since an unweighted mean could hide one engine
that is about to preempt.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # before vLLM's V1 engine renamed it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_CONFIG = "vllm:cache_config_info"

WANTED = frozenset({KV_USAGE, KV_USAGE_LEGACY, RUNNING, WAITING, PREEMPTIONS, PROMPT_TOKENS,
                    GENERATION_TOKENS, CACHE_CONFIG})
MAX_PROBLEMS = 20  # a body of pure junk must not become a megabyte of log text


@dataclass(frozen=True, slots=True)
class Sample:
    """One exposition line: name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape of one vLLM server said; ``None`` where it said nothing usable.

    ``kv_cache_usage`` is a fraction in [0, 1]. ``kv_capacity_tokens`` is the server's KV
    cache size in tokens (summed over data-parallel engines), from ``vllm:cache_config_info``.
    ``kv_usage_source`` names the family the usage came from, so an old engine that only has
    the deprecated name is visible. ``problems`` says what was wrong with the body.
    """

    kv_cache_usage: float | None = None
    num_requests_running: int | None = None
    num_requests_waiting: int | None = None
    num_preemptions_total: int | None = None
    prompt_tokens_total: int | None = None
    generation_tokens_total: int | None = None
    kv_capacity_tokens: int | None = None
    kv_usage_source: str | None = None
    models: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def has_data(self) -> bool:
        """Whether the body held any vLLM metric at all (a junk body holds none)."""
        return bool(self.engines) or self.kv_capacity_tokens is not None

    @property
    def kv_used_tokens(self) -> int | None:
        """Tokens' worth of KV in use, when both usage and capacity are known."""
        if self.kv_cache_usage is None or self.kv_capacity_tokens is None:
            return None
        return round(self.kv_cache_usage * self.kv_capacity_tokens)


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Read the metrics kvgate schedules on from a vLLM ``/metrics`` body."""
    samples, problems = read_samples(text, WANTED)
    usage_name = KV_USAGE if any(s.name == KV_USAGE for s in samples) else KV_USAGE_LEGACY
    capacities = _engine_capacities(samples, problems)
    usage = _combined_usage(samples, usage_name, capacities, problems)
    engines = {_engine(s) for s in samples if s.name != CACHE_CONFIG}
    if not samples:
        problems.append("no vLLM metrics in the body")
    return EngineMetrics(
        kv_cache_usage=usage,
        num_requests_running=_summed(samples, RUNNING),
        num_requests_waiting=_summed(samples, WAITING),
        num_preemptions_total=_summed(samples, PREEMPTIONS),
        prompt_tokens_total=_summed(samples, PROMPT_TOKENS),
        generation_tokens_total=_summed(samples, GENERATION_TOKENS),
        kv_capacity_tokens=_capacity_total(capacities, engines, problems),
        kv_usage_source=usage_name if usage is not None else None,
        models=tuple(sorted({s.labels["model_name"] for s in samples
                             if s.labels.get("model_name")})),
        engines=tuple(sorted(engines)),
        problems=_capped(problems),
    )


# -- reading samples -----------------------------------------------------------------------


def read_samples(text: str, names: Iterable[str] | None = None
                 ) -> tuple[list[Sample], list[str]]:
    """Finite-valued samples (only those named in ``names``, if given) and the problems met.

    The (filtered) lines are parsed at once; only if that fails are they parsed one by one,
    so a broken line costs that line and not the rest of the body. ``*_info`` lines are
    parsed through a cache: their labels are an engine's fixed configuration (vLLM's
    ``cache_config_info`` has ~40 labels and costs more to parse than all other wanted lines
    together), so the same line comes back on every scrape.
    """
    problems: list[str] = []
    samples: list[Sample] = []
    batch = []
    for line in _candidate_lines(text, names):
        if _name(line).endswith("_info"):
            samples.extend(_parse_each([line], problems, _parse_constant_line))
        else:
            batch.append(line)
    try:
        samples.extend(_parse("\n".join(batch) + "\n"))
    except Exception:
        samples.extend(_parse_each(batch, problems, _parse))
    finite = []
    for sample in samples:
        if math.isfinite(sample.value):
            finite.append(sample)
        else:
            problems.append(f"{sample.name}{_label_text(sample.labels)} is {sample.value}")
    return finite, problems


def _candidate_lines(text: str, names: Iterable[str] | None) -> list[str]:
    """Sample lines (no comments, no blanks), only those of ``names`` when given.

    ``str.startswith`` with a tuple runs in C and rejects most lines at once; the exact name
    check then drops lines that merely share a prefix (``vllm:prompt_tokens_total`` vs
    ``vllm:prompt_tokens_total_by_…``).
    """
    stripped = (line.strip() for line in text.split("\n"))
    if names is None:
        return [line for line in stripped if line and not line.startswith("#")]
    wanted = frozenset(names)
    prefixes = tuple(wanted)
    return [line for line in stripped if line.startswith(prefixes) and _name(line) in wanted]


def _name(line: str) -> str:
    return line.split("{", 1)[0].split(None, 1)[0]


def _parse(text: str) -> tuple[Sample, ...]:
    return tuple(Sample(s.name, dict(s.labels), float(s.value))
                 for family in text_string_to_metric_families(text) for s in family.samples)


@functools.lru_cache(maxsize=1024)
def _parse_constant_line(line: str) -> tuple[Sample, ...]:
    return _parse(line)


def _parse_each(lines: list[str], problems: list[str],
                parse: Callable[[str], tuple[Sample, ...]]) -> list[Sample]:
    samples: list[Sample] = []
    for line in lines:
        try:
            samples.extend(parse(line))
        except Exception as exc:
            problems.append(f"unparseable line {_shorten(line)!r}: {exc}")
    return samples


# -- combining engines ---------------------------------------------------------------------


def _engine(sample: Sample) -> str:
    return sample.labels.get("engine", "")


def _summed(samples: list[Sample], name: str) -> int | None:
    values = [s.value for s in samples if s.name == name]
    return round(sum(values)) if values else None


def _engine_capacities(samples: list[Sample], problems: list[str]) -> dict[str, int]:
    """KV capacity in tokens per engine, from the ``cache_config_info`` labels.

    Newer vLLM exports ``kv_cache_size_tokens``, which is right for hybrid models where
    block_size × num_gpu_blocks is not; older ones only the two factors.
    """
    capacities: dict[str, int] = {}
    for sample in (s for s in samples if s.name == CACHE_CONFIG):
        labels = sample.labels
        tokens = _positive_int(labels.get("kv_cache_size_tokens"))
        if tokens is None:
            block_size = _positive_int(labels.get("block_size"))
            blocks = _positive_int(labels.get("num_gpu_blocks"))
            if block_size is None or blocks is None:
                problems.append(
                    f"{CACHE_CONFIG} without usable block_size/num_gpu_blocks "
                    f"({labels.get('block_size')!r}, {labels.get('num_gpu_blocks')!r})")
                continue
            tokens = block_size * blocks
        engine = _engine(sample)
        capacities[engine] = max(tokens, capacities.get(engine, 0))
    return capacities


def _positive_int(value: str | None) -> int | None:
    """A label value as a positive integer; vLLM writes ``"None"`` before profiling."""
    try:
        number = int(value) if value is not None else 0
    except ValueError:
        return None
    return number if number > 0 else None


def _combined_usage(samples: list[Sample], name: str, capacities: dict[str, int],
                    problems: list[str]) -> float | None:
    per_engine: dict[str, float] = {}
    for sample in (s for s in samples if s.name == name):
        value = sample.value
        if not 0.0 <= value <= 1.0:
            problems.append(f"{name} out of [0, 1]: {value}; clamped")
            value = min(1.0, max(0.0, value))
        engine = _engine(sample)
        per_engine[engine] = max(value, per_engine.get(engine, 0.0))
    if not per_engine:
        return None
    weights = [capacities.get(engine, 0) for engine in per_engine]
    if all(weights):
        total = sum(u * w for u, w in zip(per_engine.values(), weights, strict=True))
        return total / sum(weights)
    return max(per_engine.values())


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


def _label_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
