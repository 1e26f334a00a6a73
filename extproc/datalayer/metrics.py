r"""vLLM ``/metrics`` text → ``EngineMetrics``: pure parsing, no I/O, never raises.

A scrape body is untrusted input (a proxy's HTML error page, a truncated read, a future
vLLM that renamed a family), and it arrives ten times a second per endpoint. So parsing
returns whatever it could read plus a list of problems, and the caller decides what a
partial reading is worth.

Speed: a vLLM body is mostly histogram buckets nobody here reads. One regex scan picks out
the lines of the wanted metric names (7 of ~450 sample lines in a real vLLM 0.32 body), and
a small parser of the text exposition format reads just those, caching each distinct label
set (they are the same on every scrape). With ``prometheus_client``'s parser on the same
lines, which this replaced, a parse cost 4-5x as much. Values are read by *sample* name, so
``# HELP`` and ``# TYPE`` lines play no part.

The parser reads what the format allows — ``\\``, ``\"`` and ``\n`` escapes in label
values (which may hold commas, braces and metric names), ``NaN``, ``+Inf``, exponents, an
optional timestamp, CRLF line ends, a trailing comma after the last label — and rejects
a malformed line as a whole: any line it reads, ``prometheus_client`` reads the same way.

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

WANTED = frozenset({KV_USAGE, KV_USAGE_LEGACY, RUNNING, WAITING, PREEMPTIONS, PROMPT_TOKENS,
                    GENERATION_TOKENS, CACHE_CONFIG})
MAX_PROBLEMS = 20  # a body of pure junk must not become a megabyte of log text
MAX_COUNT = 2**53  # the largest block size, block count or token count taken from a label


class Sample(NamedTuple):
    """One exposition line: name, labels, value (a tuple: cheaper to build than a frozen
    dataclass, and every scrape builds several)."""

    name: str
    labels: Mapping[str, str]
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
    named: dict[str, list[Sample]] = {}
    for sample in samples:
        named.setdefault(sample.name, []).append(sample)
    usage_name = KV_USAGE if KV_USAGE in named else KV_USAGE_LEGACY
    capacities = _engine_capacities(named.get(CACHE_CONFIG, []), problems)
    usage = _combined_usage(named.get(usage_name, []), usage_name, capacities, problems)
    engines = {_engine(s) for s in samples if s.name != CACHE_CONFIG}
    if not samples:
        problems.append("no vLLM metrics in the body")
    return EngineMetrics(
        kv_cache_usage=usage,
        num_requests_running=_summed(named.get(RUNNING), problems),
        num_requests_waiting=_summed(named.get(WAITING), problems),
        num_preemptions_total=_summed(named.get(PREEMPTIONS), problems),
        prompt_tokens_total=_summed(named.get(PROMPT_TOKENS), problems),
        generation_tokens_total=_summed(named.get(GENERATION_TOKENS), problems),
        kv_capacity_tokens=_capacity_total(capacities, engines, problems),
        kv_usage_source=usage_name if usage is not None else None,
        models=tuple(sorted({model for s in samples if (model := s.labels.get("model_name"))})),
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


# -- combining engines ---------------------------------------------------------------------


def _engine(sample: Sample) -> str:
    return sample.labels.get("engine", "")


def _summed(samples: list[Sample] | None, problems: list[str]) -> int | None:
    """The total over engines of one family; None when the body had none.

    Finite values can still add up to infinity, which ``round`` would raise on.
    """
    if samples is None:
        return None
    total = sum(s.value for s in samples)
    if math.isfinite(total):
        return round(total)
    problems.append(f"{samples[0].name} adds up to {total}")
    return None


def _engine_capacities(infos: list[Sample], problems: list[str]) -> dict[str, int]:
    """KV capacity in tokens per engine, from the ``cache_config_info`` samples' labels.

    Newer vLLM exports ``kv_cache_size_tokens``, which is right for hybrid models where
    block_size × num_gpu_blocks is not; older ones only the two factors.
    """
    capacities: dict[str, int] = {}
    for sample in infos:
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
    """A label value as a positive integer; vLLM writes ``"None"`` before profiling.

    Above ``MAX_COUNT`` is junk, not a cache size: it would overflow the float arithmetic.
    """
    try:
        number = int(value) if value is not None else 0
    except ValueError:
        return None
    return number if 0 < number <= MAX_COUNT else None


def _combined_usage(usages: list[Sample], name: str, capacities: dict[str, int],
                    problems: list[str]) -> float | None:
    """Usage over engines (``usages`` are ``name``'s samples); see the module docstring."""
    per_engine: dict[str, float] = {}
    for sample in usages:
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


def _label_text(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
