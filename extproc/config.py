"""kvgate's one configuration file, validated by pydantic v2.

Every knob has a default, so the smallest useful file names one tier, one tenant and one
pool. Errors are reported with the path of the offending value (``tiers.gold.limits.
requests_per_second: …``) so ``kvgate check`` can print them all at once.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from extproc import yaml_input
from extproc.config_check import explain
from extproc.headers import KVGATE_HEADER_PREFIX
from limiter.fairness import DEFAULT_LAG, MIN_WEIGHT

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


# the longest duration a config may give: Envoy's own end at 10,000 years, and a larger
# timedelta cannot be made at all (`kvgate render-envoy` failed with a traceback)
MAX_DURATION_S = 10 * 365 * 86400  # ten years
MAX_DURATION_MS = MAX_DURATION_S * 1000  # … for the settings given in milliseconds

# how long before Envoy's message timeout every wait kvgate holds must end: Envoy's timer
# starts when it sends the message, kvgate's deadline when the request is queued, and
# kvgate's refusal (503 or 429 with Retry-After) must reach Envoy before Envoy's own 504
TIMEOUT_MARGIN_S = 1.0


class _Strict(BaseModel):
    """Unknown keys are errors: a typo in a limit must not silently mean 'unlimited'. A key
    an earlier release had is one too, and says what became of it (``REMOVED``, read by
    config_check: an error of its own, so the section's other keys are still checked).
    Numbers are finite: YAML's ``.inf`` passed every ``gt``/``ge`` bound and then failed
    `kvgate serve` (a traceback building the rate) or `kvgate render-envoy`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    REMOVED: ClassVar[dict[str, str]] = {}

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic reads true as 1 for a number, and YAML reads yes, on and true as true:
        ``max_concurrency: yes`` was a limit of 1, without a word."""
        if isinstance(value, bool) and info.field_name is not None and _numeric_only(
                cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is a boolean (YAML reads yes, no, on and "
                             "off as booleans); give a number")
        return value


@functools.cache
def _numeric_only(annotation: Any) -> bool:
    """Whether a field takes numbers but no boolean (``int | None`` does, ``bool`` not)."""
    def kinds(hint: Any) -> set[Any]:
        return {hint} | {kind for arg in get_args(hint) for kind in kinds(arg)}

    found = kinds(annotation)
    return bool(found & {int, float}) and bool not in found


class SlidingWindow(_Strict):
    """A second shaping stage: at most ``requests`` in any window of ``window_ms``."""

    requests: PositiveInt
    window_ms: PositiveInt = Field(1000, le=MAX_DURATION_MS)


class Shaping(_Strict):
    """Pacing instead of refusing: admitted requests leave at most ``requests_per_second``,
    evenly spaced, and up to ``backlog`` wait for their turn (the stream stays open); more
    than that get 429 ``shaping_backlog_full`` with an exact Retry-After."""

    requests_per_second: Annotated[float, Field(ge=0.001, le=1000)]
    backlog: int | None = Field(
        None, ge=0, le=1_048_576, description="requests that may wait at once; default ten "
        "seconds' worth (at least 1); 0 = none wait: the shaper only spaces"
    )

    @property
    def effective_backlog(self) -> int:
        if self.backlog is not None:
            return self.backlog
        return max(1, round(10 * self.requests_per_second))

    @property
    def longest_hold_s(self) -> float:
        """How long the last request of a full backlog waits."""
        return self.effective_backlog / self.requests_per_second


class Limits(_Strict):
    """One tenant's limits. ``None`` means that dimension is not limited."""

    requests_per_second: Annotated[float, Field(ge=0.001)] | None = None
    request_burst: PositiveInt | None = Field(
        None, description="bucket capacity; default 2 × requests_per_second (at least 1)"
    )
    tokens_per_minute: PositiveInt | None = None
    token_burst: PositiveInt | None = Field(
        None, description="bucket capacity in tokens; default one minute's worth"
    )
    max_concurrency: PositiveInt | None = None
    max_context_tokens: PositiveInt | None = None
    sliding_window: SlidingWindow | None = None
    daily_token_quota: PositiveInt | None = Field(None, description="tokens per UTC day")
    monthly_token_quota: PositiveInt | None = Field(None, description="tokens per UTC month")
    shaping: Shaping | None = Field(
        None, description="pace admitted requests (a leaky bucket) instead of refusing them"
    )

    @property
    def effective_request_burst(self) -> int | None:
        if self.requests_per_second is None:
            return None
        return self.request_burst or max(1, round(2 * self.requests_per_second))

    @property
    def effective_token_burst(self) -> int | None:
        if self.tokens_per_minute is None:
            return None
        return self.token_burst or self.tokens_per_minute

    def merged(self, override: Limits | None) -> Limits:
        """This tier's limits with a tenant's explicitly set fields on top."""
        if override is None:
            return self
        # validated again, so nested sections (sliding_window, shaping) stay models
        return Limits.model_validate({**self.model_dump(exclude_unset=True),
                                      **override.model_dump(exclude_unset=True)})


Overflow = Literal["queue", "reject", "degrade"]
"""What happens to a tenant's request that a busy pool cannot place now (see the README's
"Shaping and overflow")."""


class Tier(_Strict):
    weight: float = Field(1.0, ge=MIN_WEIGHT, description="share under contention (fair "
                          "queue); at least 0.000001")
    limits: Limits = Limits()
    overflow: Overflow = Field(
        "queue", description="a request the busy pool cannot place now: 'queue' waits in the "
        "fair queue up to its class deadline; 'reject' is refused at once (429 over its "
        "share, 503 saturated) with Retry-After; 'degrade' gets the pool's degradation plan "
        "whatever its class, and waits as 'queue' if no degraded form fits"
    )
    long_prompt_tokens: PositiveInt | None = Field(
        None, description="this tier's long-prompt rule: prompts longer than this drop one "
        "class (default: classification.long_prompt_tokens; set null explicitly for never)"
    )


class RequestClass(_Strict):
    """A request class: its vLLM priority, and how long it may wait in kvgate's queue."""

    REMOVED: ClassVar[dict[str, str]] = {
        "sla_ms": "it only fed the dynamic order, which the hierarchical fair order replaced"}

    priority: int = Field(0, description="vLLM priority: lower is served earlier")
    deadline_s: PositiveFloat = Field(
        30, le=MAX_DURATION_S,
        description="longest wait in the queue; then 503 (pool) or 429 (tenant's share)"
    )
    aging_s: Annotated[float, Field(gt=0, le=MAX_DURATION_S)] | None = Field(
        None, description="this class's aging period (default: from queue.aging_s); set it "
        "explicitly to null to never promote this class"
    )


# The shipped classes. A configured class of one of these names keeps the fields it leaves
# out: batch work tolerates minutes in the queue, interactive work does not.
BUILT_IN_CLASSES: dict[str, dict[str, Any]] = {
    "interactive": {"priority": 0, "deadline_s": 30},
    "batch": {"priority": 1, "deadline_s": 300},
    "offline": {"priority": 2, "deadline_s": 900},
}


class Classification(_Strict):
    """How a request gets its class (and so its band and vLLM priority)."""

    header: str = Field("x-request-class", description="client's requested class")
    path_classes: dict[str, str] = Field(
        default_factory=lambda: {"/v1/embeddings": "batch"},
        description="path → class, for requests without the header",
    )
    long_prompt_tokens: PositiveInt | None = Field(
        8192, description="prompts longer than this drop one class (null = never)"
    )

    @field_validator("header")
    @classmethod
    def _header_name(cls, name: str) -> str:
        """In lower case, as Envoy hands kvgate header names and as the rendered forwarding
        rule must name it (it matches exactly): ``X-Request-Class`` was never read, the
        client's class ignored without a word. A name no request can carry is refused."""
        if not name or any(c not in _TOKEN_CHARS for c in name):
            raise ValueError(f"{name!r} is not an HTTP header name (letters, digits and "
                             "!#$%&'*+-.^_`|~)")
        name = name.lower()
        if name.startswith(KVGATE_HEADER_PREFIX):
            raise ValueError(f"{name!r}: Envoy drops every {KVGATE_HEADER_PREFIX} header a "
                             "client sends before kvgate sees it")
        return name

    @field_validator("path_classes")
    @classmethod
    def _routed_paths(cls, rules: dict[str, str]) -> dict[str, str]:
        """A rule is matched against the path as kvgate routes it (one of the paths it lets
        through: no query, no trailing slash). Any other key — ``/v1/embeddings/``, a path
        kvgate answers 404 — matched no request: the rule did nothing, without a word."""
        from extproc.openai import ROUTES, route_path

        bad = [path for path in rules if path not in ROUTES]
        if bad:
            raise ValueError("; ".join(_unrouted(path, route_path(path), ROUTES)
                                       for path in bad))
        return rules


# what an HTTP field name is made of (RFC 9110's token)
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                         "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _unrouted(path: str, routed: str, routes: Iterable[str]) -> str:
    """Why a ``path_classes`` key never matches, and the key that would."""
    hint = (f"did you mean {routed!r}?" if routed in routes
            else f"kvgate lets through only {', '.join(routes)}")
    return f"{path!r} is never a request's path, so this rule would do nothing ({hint})"


class QueueSettings(_Strict):
    """The fair queue that holds requests while the pool is saturated."""

    REMOVED: ClassVar[dict[str, str]] = {key: "the hierarchical fair order replaced the "
                                         "dynamic one (see the README's fair queueing)"
                                         for key in ("order", "alpha", "beta", "gamma")}

    enabled: bool = Field(True, description="false: answer 503/429 at once instead of queueing")
    max_size: PositiveInt = Field(1024, description="per pool; then the least important go")
    aging_s: PositiveFloat | Literal["auto"] | None = Field(
        None, description="waiting this long promotes a request one band inside its "
        "tenant's work; 'auto': half its class's deadline_s; null (default) = never: shares "
        "between tenants need no aging, and a promoted batch request would hold back its "
        "tenant's own interactive work"
    )

    @field_validator("aging_s", mode="before")
    @classmethod
    def _aging(cls, value: Any) -> Any:
        """One clear message instead of one per member of the union."""
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"must be a number of seconds > 0, 'auto' or null, got {value!r}")
        if value > MAX_DURATION_S:
            raise ValueError(f"must be at most {MAX_DURATION_S} s (ten years), got {value!r}")
        return value

    prompt_price: float = Field(
        1.0, ge=0, description="what one prompt token costs a tenant's share (fair order)"
    )
    output_price: float = Field(
        2.0, ge=0, description="what one output token costs it: charged for max_tokens when "
        "the request is dispatched, corrected to the real output when it ends"
    )
    share_lag_tokens: int = Field(
        DEFAULT_LAG, ge=0, description="tokens per unit of weight a tenant may be ahead of the "
        "least-served waiting tenant and still go first with more important work; bounds "
        "how far shares drift to let interactive work through (0: strict shares)"
    )

    def price(self, prompt_tokens: int, output_tokens: int) -> int:
        """A request's price in token units, as the fair order charges it."""
        return round(prompt_tokens * self.prompt_price + output_tokens * self.output_price)


def hash_api_key(key: str) -> str:
    """The form API keys are stored in: ``sha256:<hex>``. Plain keys never sit in config."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class Tenant(_Strict):
    name: str = Field(min_length=1)
    tier: str
    api_keys: list[str] = Field(min_length=1, description="sha256:<64 hex> hashes of the keys")
    default_class: str = "interactive"
    max_class: str | None = Field(
        None, description="the most important class this tenant may ask for (default: its "
        "default_class); a client can lower its priority, never raise it above this"
    )
    class_header: bool = Field(True, description="honour the client's x-request-class")
    limits: Limits | None = Field(None, description="overrides of the tier's limits")
    overflow: Overflow | None = Field(None, description="overrides the tier's overflow mode")

    @field_validator("api_keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        out = []
        for key in keys:
            digest = key.removeprefix("sha256:").lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(
                    "API keys are stored as sha256 hashes ('sha256:<64 hex digits>'); "
                    "make one with `kvgate hash-key`"
                )
            out.append("sha256:" + digest)
        return out


class Model(_Strict):
    name: str = Field(min_length=1)
    tokenizer: Path | None = Field(None, description="local HF tokenizer.json for exact counts")
    chat_template: Path | None = Field(
        None, description="a .jinja chat template file (needs `tokenizer`) overriding the one "
        "beside the tokenizer (`chat_template.jinja`, or `chat_template` in "
        "`tokenizer_config.json`): chat prompts are rendered with it, as vLLM does, before "
        "they are counted; give the engine's --chat-template here if it was started with one",
    )
    default_max_tokens: PositiveInt = Field(
        1024, description="output tokens reserved when a chat request sets no max_tokens, and "
        "sent to the engine as its max_tokens (the engine's own default is the rest of the "
        "context, which kvgate did not reserve); a completions request without one gets the "
        "API's default of 16 (this, when lower)"
    )
    tokens_per_media_part: PositiveInt | None = Field(
        None, description="prompt tokens counted for each chat content part that is not "
        "text (an image, audio, video or file), whose tokens no text shows: set the most one "
        "takes on this model; null (default): such requests are refused (400), since kvgate "
        "cannot meter them"
    )

    @model_validator(mode="after")
    def _template_needs_tokenizer(self) -> Model:
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("chat_template needs a tokenizer: it is used for exact counts")
        return self


_DNS_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def ip_or_dns_name(value: str, port_from: str) -> str:
    """``value`` if it is an IP address or a DNS name, as Envoy's clusters and kvgate's
    resolver take a host; else a ValueError that says why. A host written with its port
    (``kvgate:9001``), in brackets (``[::1]``) or as a URL passed `kvgate check` and
    `envoy --mode validate` both, and resolved to nothing: a cluster of no hosts."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.removesuffix(".").split(".")
    if len(value) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels):
        return value
    raise ValueError(f"{value!r} is not an IP address or a DNS name (no port: that is "
                     f"{port_from}; no brackets, no scheme)")


class Dns(_Strict):
    """Endpoints from DNS, e.g. a Kubernetes headless service (one A record per pod)."""

    hostname: str = Field(min_length=1)
    port: int = Field(gt=0, lt=65536)

    @field_validator("hostname")
    @classmethod
    def _a_name(cls, value: str) -> str:
        return ip_or_dns_name(value, "dns.port")
    interval_s: PositiveFloat = Field(5.0, le=MAX_DURATION_S,
                                      description="how often to re-resolve")


class Watermarks(_Strict):
    """KV-cache fill levels (0–1) that gate new work per endpoint."""

    high: float = Field(0.80, gt=0, le=1, description="new work must keep usage under this "
                        "with its prompt (its output is checked at the committed KV's future "
                        "peak); interactive work, and lower-band work under its tenant's KV "
                        "share, may go up to critical")
    critical: float = Field(0.95, gt=0, le=1, description="above this an endpoint takes "
                            "nothing, and new work must keep usage under it — except "
                            "interactive work on a priority_scheduling pool, whose prompt may "
                            "take an endpoint under it past it, up to a full cache, while the "
                            "interactive work there still fits at its peak (the engine "
                            "preempts lower-priority work as the cache fills)")
    gpu_memory_critical: float = Field(
        0.98, gt=0, le=1, description="NVML memory used ratio above which an endpoint is skipped"
    )
    max_waiting: int | None = Field(
        None, ge=0, description="an endpoint whose own waiting queue is longer takes nothing: "
        "the work waits in kvgate's fair queue instead, where bands and weights order it"
    )

    @model_validator(mode="after")
    def _ordered(self) -> Watermarks:
        if self.high > self.critical:
            raise ValueError("high must not exceed critical")
        return self


class Scoring(_Strict):
    """Picker weights: lower score wins; each term is normalised to 0–1."""

    kv_usage: float = Field(1.0, ge=0, description="KV usage after this request's reservation")
    waiting: float = Field(0.5, ge=0, description="the engine's waiting queue")
    running: float = Field(0.2, ge=0, description="requests the engine is running")
    prefill: float = Field(
        2.0, ge=0, description="prompt tokens kvgate sent the engine whose first token has "
        "not come back (in a pool that keeps no endpoint clear, less what the oldest has "
        "prefilled since it began, at the rate learned from first tokens): vLLM finishes "
        "running prefills before new ones, so this is what a new request waits behind"
    )


class Degradation(_Strict):
    """Under saturation, serve low-priority classes a cheaper way instead of rejecting them."""

    classes: list[str] = Field(default_factory=lambda: ["batch", "offline"])
    fallback_model: str | None = Field(None, description="rewrite the model to this one")
    max_tokens_cap: PositiveInt | None = Field(
        None, description="cap max_tokens (each answer's, with n > 1) to this")

    @model_validator(mode="after")
    def _does_something(self) -> Degradation:
        if self.fallback_model is None and self.max_tokens_cap is None:
            raise ValueError("set fallback_model or max_tokens_cap: a plan with neither "
                             "serves nothing a cheaper way (and counts as no plan)")
        return self


class SecretRef(_Strict):
    """A secret kept out of the YAML: the name of an environment variable, or a file (a
    mounted Kubernetes secret, say). Read once, when kvgate starts."""

    env: str | None = Field(None, min_length=1)
    file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env, file")
        return self

    def read(self) -> str:
        if self.env is not None:
            value = os.environ.get(self.env, "").strip()
            where = f"environment variable {self.env}"
        else:
            assert self.file is not None
            value = _read_secret(self.file)
            where = str(self.file)
        if not value:
            raise ValueError(f"{where} is empty or not set")
        if not value.isprintable():
            raise ValueError(f"{where} holds characters a header cannot carry")
        return value


def _read_secret(path: Path) -> str:
    """A key file's text, read as a config is (bounded, a pipe not waited on forever): a
    FIFO named as the file hung `kvgate check` and `kvgate serve`, and ``/dev/zero`` read
    until memory ran out."""
    try:
        raw = yaml_input.read_capped(path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > yaml_input.MAX_BYTES:
        raise ValueError(f"{path} is larger than {yaml_input.MAX_BYTES // 2**20} MiB: not a key")
    return raw.decode("utf-8").strip()


def _endpoint(endpoint: str) -> str:
    """Each endpoint checked on its own, so every bad one is reported with its index."""
    parse_endpoint(endpoint)
    return endpoint


Engine = Literal["vllm", "sglang", "tgi", "trtllm"]

# Engines that schedule by a ``priority`` field in the OpenAI request body, and whether a
# lower value runs first. vLLM: ``priority`` (int, default 0) with ``--scheduling-policy
# priority``, lower first (vllm/entrypoints/openai/protocol.py, vllm/v1/core/sched/).
# SGLang: ``priority`` (int, optional) with ``--enable-priority-scheduling``, *higher* first
# unless started with ``--schedule-low-priority-values-first`` (python/sglang/srt/
# server_args.py, entrypoints/openai/protocol.py). TGI's request has no priority
# (router/src/lib.rs); TensorRT-LLM's executor has a per-request float priority but no
# OpenAI body field for it, under Triton or trtllm-serve, that kvgate could set.
PRIORITY_LOW_FIRST: dict[str, bool] = {"vllm": True, "sglang": False}
# Engines whose OpenAI server salts its prefix cache with the body's ``cache_salt`` (vLLM
# 0.9+, TensorRT-LLM's trtllm-serve): a salted request reuses only cached blocks computed
# with the same salt. SGLang's and TGI's requests have no such field. Salted by default on
# vLLM only: a ``trtllm`` pool may be Triton's OpenAI frontend, which may not take the field.
CACHE_SALT_ENGINES = ("vllm", "trtllm")
SALTED_BY_DEFAULT = ("vllm",)
CACHE_SALT_PREFIX = "kvgate-"


# the pool settings only a KV-aware pool reads (scraping, KV admission, prefill, GPUs)
KV_AWARE_ONLY = ("metrics_port", "kv_capacity_tokens", "max_unstarted", "max_num_seqs",
                 "prefill_clear_share", "max_num_batched_tokens", "prefill_clear_hold_s",
                 "gpu_source", "gpus", "endpoint_gpus", "watermarks", "scoring")


class Pool(_Strict):
    name: str = Field(min_length=1)
    models: list[Model] = Field(min_length=1)
    endpoints: list[Annotated[str, AfterValidator(_endpoint)]] = Field(
        default_factory=list, description="ip:port of each engine")
    dns: Dns | None = Field(None, description="discover endpoints by DNS instead")
    engine: Engine = Field(
        "vllm", description="what serves the pool: which /metrics names kvgate reads, and "
        "whether and how the body's priority is set"
    )
    priority_scheduling: bool = Field(
        False, description="the engines schedule by the body's priority (vLLM "
        "--scheduling-policy priority, SGLang --enable-priority-scheduling)"
    )
    metrics_port: int | None = Field(
        None, gt=0, lt=65536, description="the port the engines serve /metrics on, where it "
        "is not their serving port (Triton: 8002); null = the endpoint's own port"
    )
    low_priority_first: bool | None = Field(
        None, description="SGLang only: true if started with --schedule-low-priority-values-"
        "first; null = the engine's default order (kvgate negates its priorities for SGLang's "
        "higher-first default)"
    )
    prefix_cache_isolation: Literal["tenant", "none"] | None = Field(
        None, description="'tenant': kvgate sets every request's cache_salt from its tenant "
        "(and the salt the client sent, if any), so a tenant's requests never reuse prefixes "
        "another tenant's requests cached, whose faster first token would tell it what they "
        "sent; 'none': tenants share the engines' prefix cache and a client's cache_salt "
        "goes through as sent; null = 'tenant' on vLLM, 'none' on the others ('tenant' "
        "also works on trtllm-serve)"
    )
    upstream_api_key: SecretRef | None = Field(
        None, description="the key the engines expect (vLLM --api-key), sent as the "
        "Bearer token; the client's own key never goes upstream either way"
    )
    kv_aware: bool = Field(
        True, description="scrape vLLM /metrics and admit by KV; false = least-in-flight only"
    )
    kv_capacity_tokens: PositiveInt | None = Field(
        None, description="per-endpoint KV capacity when vLLM exports no cache_config_info"
    )
    max_in_flight: PositiveInt | None = Field(
        None, description="per endpoint and kvgate process: requests in flight at most "
        "(beyond that they queue); null = bounded by KV only"
    )
    max_unstarted: PositiveInt | None = Field(
        2, description="per endpoint: requests sent that have not started (no first token "
        "yet, and the engine still reports them waiting) at most, interactive one more; the "
        "rest wait in kvgate's queue, where share and class order them, instead of the "
        "engine's; null = no such gate"
    )
    max_num_seqs: PositiveInt | None = Field(
        None, description="the engines' own limit on requests running at once (vLLM "
        "--max-num-seqs), which they do not export: kvgate's starting value for the limit it "
        "otherwise learns from scrapes, so one sequence is kept free for interactive work "
        "from the first request; null = learned only"
    )
    reserved_in_flight: int = Field(
        0, ge=0, description="of max_in_flight, slots only the best band (interactive, or "
        "work aged into it) may use, so it never waits for a slot behind batch work"
    )
    prefill_clear_share: float = Field(
        0.25, ge=0, lt=1, description="share of the usable endpoints (rounded down) kept free "
        "of lower-band prefill: band > 0 requests stack on endpoints already prefilling such "
        "work once only that many are left without (at least one always takes it); band 0 is "
        "never limited by it"
    )
    max_num_batched_tokens: PositiveInt | None = Field(
        2048, description="the engines' token budget per step (vLLM "
        "--max-num-batched-tokens), which they do not export. A lower-band request joins an "
        "endpoint only while the lower-band prefill there is below it (what is left of it "
        "where endpoints are kept clear; every prompt token in prefill in a pool too small "
        "for prefill_clear_share to keep one), so interactive work waits behind about one "
        "step of batch prefill; null = no such limit"
    )
    prefill_clear_hold_s: float = Field(
        3.0, ge=0, le=MAX_DURATION_S, description="lower-band work that has waited this long "
        "in kvgate's queue may use an endpoint kept clear by prefill_clear_share while no "
        "band-0 request is prefilling anywhere in the pool: keeping endpoints clear then costs "
        "no batch throughput once batch prefill outgrows the other endpoints"
    )
    gpu_source: str | None = Field(
        None, description="'local' (NVML in this process) or a kvgate agent URL, {ip} allowed"
    )
    gpus: list[str] = Field(default_factory=list, description="GPU keys/UUIDs; empty = all")
    endpoint_gpus: dict[str, list[str]] = Field(
        default_factory=dict, description="ip:port → the GPUs or MIG slices that endpoint "
        "runs on (UUID, or 'gpu' / 'gpu:mig' index key): its memory watermark reads only "
        "those, instead of the pool's gpus"
    )
    watermarks: Watermarks = Watermarks()
    scoring: Scoring = Scoring()
    degradation: Degradation | None = None

    @field_validator("models", mode="before")
    @classmethod
    def _names_as_models(cls, models: Any) -> Any:
        if isinstance(models, list):
            return [{"name": m} if isinstance(m, str) else m for m in models]
        return models

    @model_validator(mode="after")
    def _some_endpoints(self) -> Pool:
        """Exactly one source of endpoints. With both, discovery, routing and the rendered
        Envoy cluster used the DNS answers alone: the listed engines never got a request
        (every request a 503 while the DNS name had no engine), without a word."""
        if not self.endpoints and self.dns is None:
            raise ValueError("give endpoints (ip:port list) or dns")
        if self.endpoints and self.dns is not None:
            raise ValueError("give endpoints or dns, not both: with dns the endpoints listed "
                             "would never be used")
        return self

    @field_validator("gpu_source")
    @classmethod
    def _gpu_source(cls, value: str | None) -> str | None:
        # what GpuSource.parse accepts when `kvgate serve` builds its scraper
        scheme, _, rest = (value or "").partition("://")
        if value not in (None, "local") and (scheme not in ("http", "https") or not rest):
            raise ValueError(f"{value!r} is neither 'local' nor an http(s) URL "
                             "(a kvgate agent's, e.g. 'http://{ip}:9400')")
        return value

    @field_validator("endpoint_gpus", mode="before")
    @classmethod
    def _one_gpu_as_a_list(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: [v] if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _endpoint_gpus(self) -> Pool:
        problems = []
        for address, gpus in self.endpoint_gpus.items():
            if self.endpoints and address not in self.endpoints:
                problems.append(f"endpoint_gpus: {address!r} is not one of the endpoints")
            elif not self.endpoints:  # found by DNS: any ip:port may turn up
                try:
                    parse_endpoint(address)
                except ValueError as exc:
                    problems.append(f"endpoint_gpus: {exc}")
            problems += [f"endpoint_gpus.{address}: {gpu!r} is neither a GPU/MIG UUID nor "
                         "a 'gpu' or 'gpu:mig' index key" for gpu in gpus if not _gpu_id(gpu)]
            if not gpus:
                problems.append(f"endpoint_gpus.{address}: name at least one GPU")
        problems += [f"gpus: {gpu!r} is neither a GPU/MIG UUID nor a 'gpu' or 'gpu:mig' index "
                     "key" for gpu in self.gpus if not _gpu_id(gpu)]
        for name in ("endpoint_gpus", "gpus"):
            if getattr(self, name) and self.gpu_source is None:
                problems.append(f"{name}: set gpu_source ('local' or a kvgate agent URL) "
                                "to read them from")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _kv_settings_need_kv_aware(self) -> Pool:
        """A pool with ``kv_aware: false`` reads no ``/metrics`` and picks the endpoint with
        the fewest requests in flight: a KV, prefill or GPU setting given there did nothing,
        without a word. (Compared with the defaults, not the keys given: a config written
        back whole, defaults and all, still loads.)"""
        if not self.kv_aware:
            fields = type(self).model_fields
            unused = [name for name in KV_AWARE_ONLY if getattr(self, name)
                      != fields[name].get_default(call_default_factory=True)]
            if unused:
                raise ValueError(f"{', '.join(unused)}: only a kv_aware pool reads "
                                 f"{'it' if len(unused) == 1 else 'them'} (this one picks the "
                                 "endpoint with the fewest requests in flight); remove "
                                 f"{'it' if len(unused) == 1 else 'them'} or set kv_aware: true")
        return self

    @model_validator(mode="after")
    def _engine_priority(self) -> Pool:
        if self.priority_scheduling and self.engine not in PRIORITY_LOW_FIRST:
            raise ValueError(
                f"priority_scheduling: {self.engine} does not schedule by a request priority "
                f"(engines that do: {', '.join(PRIORITY_LOW_FIRST)}); set it to false")
        if self.low_priority_first is not None and self.engine != "sglang":
            raise ValueError("low_priority_first: only SGLang has a choice of priority order")
        if self.low_priority_first is not None and not self.priority_scheduling:
            raise ValueError("low_priority_first: kvgate sends a priority only with "
                             "priority_scheduling: true, so it would do nothing")
        if self.prefix_cache_isolation == "tenant" and self.engine not in CACHE_SALT_ENGINES:
            raise ValueError(
                f"prefix_cache_isolation: {self.engine} takes no cache_salt (engines that do: "
                f"{', '.join(CACHE_SALT_ENGINES)}); set it to 'none'")
        return self

    @property
    def isolates_prefix_cache(self) -> bool:
        """Whether requests to this pool are salted per tenant (``prefix_cache_isolation``)."""
        if self.prefix_cache_isolation is None:
            return self.engine in SALTED_BY_DEFAULT
        return self.prefix_cache_isolation == "tenant"

    def cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The ``cache_salt`` sent upstream, or None to leave the body's as it is.

        A digest of the tenant's name and the client's own salt (a client may still isolate
        its users from each other): no client can send a value that yields another tenant's
        salt, and the digest meets vLLM's rules (at most 128 characters, no ``@ / \\``)."""
        if not self.isolates_prefix_cache:
            return None
        if client_salt is not None and len(client_salt) > MAX_CACHED_CLIENT_SALT:
            return _tenant_salt.__wrapped__(tenant, client_salt)  # hashed, not kept
        return _tenant_salt(tenant, client_salt)

    def body_priority(self, priority: int) -> int | None:
        """A class's priority (lower runs first) as this pool's engines read it from the
        body; None where they do not schedule by it, so none is sent."""
        if not self.priority_scheduling:
            return None
        low_first = self.low_priority_first
        if low_first is None:
            low_first = PRIORITY_LOW_FIRST[self.engine]
        return priority if low_first else -priority


# A client's own salt is cached with its digest only up to this length: the cache holds its
# key, and 4,096 distinct salts near the body limit (1 MiB) kept ~4 GiB (192 KB salts: +770
# MB in 4,500 requests). A longer one is hashed on each request, as its body is parsed anyway.
MAX_CACHED_CLIENT_SALT = 256


@functools.lru_cache(maxsize=4096)
def _tenant_salt(tenant: str, client_salt: str | None) -> str:
    """``Pool.cache_salt``'s digest, computed once per tenant (and client salt), not per
    request."""
    seed = f"{len(tenant)}:{tenant}"  # the length: no tenant's seed starts another's
    if client_salt is not None:
        seed += ":" + client_salt
    return CACHE_SALT_PREFIX + hashlib.sha256(seed.encode("utf-8", "surrogatepass")).hexdigest()


_GPU_KEY = re.compile(r"\d+(:\d+)?")


def _gpu_id(gpu: str) -> bool:
    """A GPU as NVML names it: its UUID (``GPU-…``, a MIG slice's ``MIG-…``) or the index
    key ``GpuReading.key`` gives (``"0"``, ``"0:2"`` for MIG slot 2 of GPU 0)."""
    return gpu.startswith(("GPU-", "MIG-")) or _GPU_KEY.fullmatch(gpu) is not None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``ip:port`` → (ip, port). Envoy's ORIGINAL_DST cluster needs a literal IP."""
    host, sep, port = endpoint.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        port_number = int(port)
    except ValueError:
        raise ValueError(f"{endpoint!r} is not ip:port (a literal IP address and a port)") from None
    if not sep or not 0 < port_number < 65536:
        raise ValueError(f"{endpoint!r} is not ip:port (a literal IP address and a port)")
    if ":" in host and not bracketed:  # as Envoy reads a destination, and a URL holds it
        raise ValueError(f"{endpoint!r}: write an IPv6 address in brackets, [{host}]:{port}")
    return host, port_number


class GrpcTls(_Strict):
    """TLS on the ext_proc gRPC listener; with a client CA, Envoy must present a certificate
    it signed (mutual TLS)."""

    cert_file: str = Field(description="PEM certificate chain kvgate presents")
    key_file: str = Field(description="PEM private key of that certificate")
    client_ca_file: str | None = Field(
        None, description="PEM CA bundle: require and verify client certificates (mTLS)"
    )


_ANY_ADDRESS = {"0.0.0.0", "::", ""}
"""Listening addresses that take a port on every address (``server.host``/``admin_host``)."""


class Server(_Strict):
    REMOVED: ClassVar[dict[str, str]] = {
        "max_stream_seconds": "it did nothing (kvgate never extends a message's timeout: "
        "every wait it holds stays under envoy.message_timeout_s)"}

    host: str = Field("127.0.0.1", description="where the ext_proc gRPC port listens")
    grpc_port: int = Field(9001, ge=0, lt=65536, description="0 = any free port")
    tls: GrpcTls | None = Field(None, description="TLS for the gRPC port; null = plaintext")
    admin_host: str = Field(
        "127.0.0.1", description="where the admin port listens: its /admin and /debug pages "
        "are unauthenticated, so loopback unless set (0.0.0.0 to let Prometheus in)"
    )
    admin_port: int | None = Field(
        9002, ge=0, lt=65536, description="/metrics, /healthz; null = off, 0 = any free port"
    )
    report_port: int = Field(
        0, ge=0, lt=65536, description="where Envoy's Lua meter reports each response "
        "(on server.host); 0 = any free port; with --workers N, worker i takes report_port + i "
        "(as admin_port + i): keep the two ranges apart"
    )
    report_host: str | None = Field(
        None, description="the address Envoy reaches this process's report port at (an IP: "
        "the pod IP with several replicas; 'auto' = this host's own address, the pod IP in "
        "Kubernetes); null = server.host, 127.0.0.1 if that is 0.0.0.0 (::1 if ::)"
    )

    @field_validator("report_host")
    @classmethod
    def _report_ip(cls, value: str | None) -> str | None:
        """Envoy's meter reaches the report port through an original-destination cluster,
        whose address header takes an IP: a name (``localhost``, a Service) passed `kvgate
        check`, and every report then went nowhere (each answer charged its reservation,
        ``cut_off``, never the engine's usage)."""
        if value is None or value == "auto":
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address: Envoy's meter reaches this "
                             "port by IP (the pod IP), not by name; or 'auto'") from None
        return value

    max_body_bytes: PositiveInt = Field(1_048_576, description="larger request bodies get 413")
    chars_per_token: PositiveFloat = Field(4.0, description="prompt estimate without tokenizer")
    shutdown_grace_s: float = Field(
        30, ge=0, le=MAX_DURATION_S, description="on SIGTERM, how long open streams may finish"
    )
    drain_delay_s: float = Field(
        0, ge=0, le=MAX_DURATION_S, description="on SIGTERM, how long kvgate still takes new "
        "streams after it reports not ready (/readyz 503, gRPC health NOT_SERVING), so load "
        "balancers and Envoy's health checks see it first; the grace counts from its end"
    )
    reload_poll_s: float = Field(
        2.0, ge=0, le=MAX_DURATION_S, description="how often `kvgate serve` checks its config "
        "file for changes and reloads it (SIGHUP reloads at once); 0 = on SIGHUP only"
    )
    log_format: Literal["plain", "json"] = Field(
        "plain", description="log lines as text, or one JSON object per line "
        "(`kvgate --log-format` overrides)"
    )
    body_mode: Literal["auto", "full_duplex"] = Field(
        "auto", description="how Envoy sends request bodies: 'auto' reads it off each "
        "stream's first message (Envoy 1.34+ states it there); 'full_duplex' treats every "
        "stream as FULL_DUPLEX_STREAMED, for a data plane that does not say (an Inference "
        "Extension gateway on an older Envoy); never with kvgate's own rendered Envoy"
    )
    worker_stall_s: float = Field(
        30, ge=3, le=MAX_DURATION_S, description="with `kvgate serve --workers N`: a worker "
        "whose event loop has not run for this long (stuck, or stopped) is killed, and the "
        "parent exits 1 as when a worker dies, so the orchestrator restarts the whole; the "
        "pod's liveness probe asks worker 0 only (keep the two alike: deploy/ probes every "
        "10 s, 3 failures); at least 3 (workers beat every second)"
    )
    worker_start_s: float = Field(
        60, ge=5, le=MAX_DURATION_S, description="with `kvgate serve --workers N`: a worker "
        "not serving this long after it was started (stuck loading a tokenizer, or in the "
        "GPU driver) is killed and the parent exits 1, as for worker_stall_s; the pod's "
        "startup probe reaches whichever worker answers on the shared gRPC port, so it "
        "passes while one worker never gets ready (keep the two alike: deploy/ gives 60 s)"
    )
    cpu_policy: Literal["batch", "normal"] = Field(
        "batch", description="Linux scheduling of the server process: 'batch' (SCHED_BATCH) "
        "keeps gRPC's poller thread from preempting the event loop on every completion"
    )

    @model_validator(mode="after")
    def _ports_apart(self) -> Server:
        """Two of kvgate's own listeners on one port passed `kvgate check`, and `kvgate
        serve` then refused the file ("--workers 1: … both take port", though no --workers
        was given). The gRPC and report ports share ``host``; the admin port clashes with
        them unless ``admin_host`` and ``host`` are two distinct specific addresses."""
        ports = [("grpc_port", self.host, self.grpc_port),
                 ("report_port", self.host, self.report_port)]
        if self.admin_port is not None:
            ports.append(("admin_port", self.admin_host, self.admin_port))
        for i, (name, host, port) in enumerate(ports):
            for other, other_host, other_port in ports[:i]:
                if port and port == other_port and (
                        host == other_host or {host, other_host} & _ANY_ADDRESS):
                    raise ValueError(f"{name} {port} is {other} too: kvgate listens on each "
                                     "of them, so it could not start; give each its own port")
        if self.report_host is None and self.host not in _ANY_ADDRESS:
            try:  # report_host defaults to host: the meter's reports need an IP (_report_ip)
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ValueError(f"host {self.host!r} is a name, and the meter reaches the "
                                 "report port by IP: set report_host (an IP, or auto)") from None
        return self


class ExtProcTls(_Strict):
    """How Envoy talks TLS to kvgate's gRPC port (``server.tls``); paths as Envoy sees them."""

    ca_file: str = Field(description="PEM CA bundle that signed kvgate's certificate")
    server_name: str | None = Field(
        None, description="SNI, and the DNS name kvgate's certificate must carry; "
        "null = chain checked only"
    )
    cert_file: str | None = Field(None, description="Envoy's client certificate (mTLS)")
    key_file: str | None = Field(None, description="its private key")

    @model_validator(mode="after")
    def _client_pair(self) -> ExtProcTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class EnvoySettings(_Strict):
    """What ``kvgate render-envoy`` puts into the Envoy bootstrap."""

    listen_host: str = Field("127.0.0.1", description="the address Envoy's listener binds: "
                             "an IP address (Envoy refuses a name there)")
    listen_port: int = Field(10000, ge=0, lt=65536)

    @field_validator("listen_host")
    @classmethod
    def _listen_ip(cls, value: str) -> str:
        """A name (``localhost``) passed `kvgate check` and rendered a bootstrap Envoy
        refused to start on: "malformed IP address"."""
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address: Envoy's listener binds an "
                             "address, not a name (127.0.0.1, 0.0.0.0, ::)") from None
        return value

    admin_port: int = Field(9901, ge=0, lt=65536)
    ext_proc_host: str = Field("127.0.0.1", description="where Envoy reaches kvgate: an IP "
                               "address or a DNS name, without the port (server.grpc_port)")

    @field_validator("ext_proc_host")
    @classmethod
    def _reachable_host(cls, value: str) -> str:
        return ip_or_dns_name(value, "server.grpc_port")
    ext_proc_tls: ExtProcTls | None = Field(
        None, description="TLS to kvgate (set when server.tls is); null = plaintext"
    )
    message_timeout_s: PositiveFloat = Field(
        1000, le=MAX_DURATION_S, description="per ext_proc message; must outlast the longest "
        "queueing"
    )
    route_timeout_s: float = Field(
        0, ge=0, le=MAX_DURATION_S, description="whole upstream request; 0 = none (long "
        "generations)"
    )
    connect_timeout_s: PositiveFloat = Field(2.0, le=MAX_DURATION_S)
    request_headers_timeout_s: PositiveFloat = Field(
        10, le=MAX_DURATION_S, description="a client must send its request headers within "
        "this, or Envoy answers 408 and closes: a client trickling headers cannot hold a "
        "connection open"
    )
    max_heap_mb: int = Field(
        1024, ge=32, description="Envoy's heap cap (MiB; set it to about 75% of the memory "
        "Envoy may use): past 95% of it Envoy refuses new requests (JSON 503, retry-after 1) "
        "and cuts off HTTP/1 connections still sending; from 90% it resets the HTTP/2 "
        "streams holding the most; so clients sending large bodies slowly cannot exhaust "
        "its memory"
    )
    request_attributes: bool = Field(
        True, description="inference POSTs with a body skip the ext_proc headers phase: the "
        "headers kvgate reads ride with the body as request_attributes, one gRPC message "
        "instead of two (Envoy holds the headers with its buffer filter and sets the upstream "
        "headers from kvgate's metadata); false: headers phase first, which refuses a "
        "request without a valid key or from an over-limit tenant before Envoy holds its "
        "body (where untrusted clients reach the gateway; bench/README.md)"
    )
    ratelimit_domain: str | None = Field(
        None, min_length=1, description="also render Envoy's ratelimit filter, asking "
        "kvgate's Rate Limit Service with this domain: per request (kind=requests, tenant) "
        "and a check of (kind=tokens, tenant), and after each response (kind=tokens, tenant) "
        "charged the response's real usage; null = no ratelimit filter"
    )

    @model_validator(mode="after")
    def _ports_apart(self) -> EnvoySettings:
        """The admin listens on 127.0.0.1 (``render-envoy``): a listener there or on
        0.0.0.0 at its port rendered a bootstrap `envoy --mode validate` accepts and Envoy
        then would not start on ("cannot bind … Address already in use")."""
        if (self.listen_port == self.admin_port != 0 and ipaddress.ip_address(self.listen_host)
                in (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv4Address("0.0.0.0"))):
            raise ValueError(f"listen_port {self.listen_port} is admin_port too (the admin "
                             "listens on 127.0.0.1), so Envoy could not bind its listener on "
                             f"{self.listen_host}")
        return self


class ScrapeSettings(_Strict):
    """How kvgate reads vLLM /metrics (and GPU readings) from every endpoint."""

    interval_s: PositiveFloat = Field(0.1, le=MAX_DURATION_S,
                                      description="one round of scrapes every this long")
    timeout_s: PositiveFloat = Field(0.5, le=MAX_DURATION_S, description="per scrape")
    max_concurrency: PositiveInt = Field(16, description="scrapes in flight at once")
    unhealthy_after: PositiveInt = Field(
        3, description="consecutive unreachable scrapes (refused, reset, DNS gone) → unhealthy; "
        "a slow scrape only ages the last reading")
    staleness_s: PositiveFloat = Field(2.0, le=MAX_DURATION_S,
                                       description="older metrics exclude the endpoint")
    metrics_path: str = "/metrics"


class AgentSettings(_Strict):
    """``kvgate agent``: serves this node's NVML readings for a gateway-mode kvgate."""

    host: str = "0.0.0.0"
    port: int = Field(9400, ge=0, lt=65536)
    interval_s: PositiveFloat = Field(1.0, le=MAX_DURATION_S)


class RedisSettings(_Strict):
    """Shared limits across replicas and worker processes; absent = in-memory (one process)."""

    url: str = Field(description="redis://host:port/db; with cluster, a name that reaches "
                     "any node (one node's address: a process that starts while it is down "
                     "cannot reach the cluster)")
    cluster: bool = Field(
        False, description="the url names a node of a Redis Cluster: every key of a tenant "
        "(and of a pool's fair queue) shares one hash tag, so each call runs on one shard"
    )
    prefix: str = Field("kvgate", min_length=1,
                        description="prefix of every key kvgate writes (no braces: it is "
                        "part of each tenant's Redis Cluster hash tag)")

    @field_validator("prefix")
    @classmethod
    def _no_braces(cls, value: str) -> str:
        if "{" in value or "}" in value:
            raise ValueError(f"{value!r} has a brace: the prefix is part of each tenant's "
                             "hash tag ({prefix:tenant}), and a brace in it would put every "
                             "tenant's keys on one Redis Cluster slot")
        return value
    timeout_ms: PositiveInt = Field(20, le=MAX_DURATION_MS,
                                    description="budget for one Redis call")
    failure_policy: Literal["fail_open", "fail_closed", "local"] = Field(
        "local", description="what admission does while Redis is unreachable"
    )
    replicas: PositiveInt = Field(
        1, description="kvgate processes sharing the limits (replicas × workers); 'local' "
        "gives each 1/replicas of every limit"
    )
    breaker_failures: PositiveInt = Field(3, description="consecutive failures that open it")
    breaker_open_ms: PositiveInt = Field(500, le=MAX_DURATION_MS,
                                         description="how long before one probe retries")
    lease_ttl_s: PositiveFloat = Field(
        60, le=MAX_DURATION_S,
        description="a concurrency slot's lease; renewed while the stream lives"
    )

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return url


class RlsReplace(_Strict):
    name: str = Field(min_length=1)


class RlsRateLimit(_Strict):
    """A descriptor's limit, as envoyproxy/ratelimit writes it, plus kvgate's algorithm."""

    unit: Literal["second", "minute", "hour", "day", "week", "month", "year"] | None = None
    requests_per_unit: int | None = Field(
        None, ge=0, le=2**32 - 1, description="0 refuses every hit (a uint32, as in Envoy's API)"
    )
    unlimited: bool = Field(False, description="matched, never limited (and never counted)")
    name: str = Field("", description="what other rules' replaces name")
    replaces: list[RlsReplace] = Field(
        default_factory=list, description="named limits this one switches off when both match"
    )
    algorithm: Literal["token_bucket", "sliding_window", "fixed_window"] = Field(
        "token_bucket", description="fixed_window is envoyproxy/ratelimit's only one"
    )
    burst: int | None = Field(
        None, gt=0, le=2**32 - 1, description="token bucket capacity; default requests_per_unit"
    )
    debt: bool = Field(
        False, description="always charge, into debt when over: for usage charged after the "
        "response (apply_on_stream_done); token_bucket and fixed_window only"
    )

    @model_validator(mode="after")
    def _complete(self) -> RlsRateLimit:
        if self.name and any(r.name == self.name for r in self.replaces):
            raise ValueError(f"replaces names this limit itself ({self.name!r})")
        if self.unlimited:
            if self.unit is not None:
                raise ValueError("unlimited: true takes no unit")
            return self
        if self.unit is None or self.requests_per_unit is None:
            raise ValueError("give unit and requests_per_unit (or unlimited: true)")
        if self.burst is not None and self.algorithm != "token_bucket":
            raise ValueError("burst is a token_bucket's capacity; windows have none")
        if self.debt and self.algorithm == "sliding_window":
            raise ValueError("debt needs token_bucket or fixed_window")
        if self.algorithm == "token_bucket" and self.requests_per_unit:
            from limiter.ratelimit import Limit

            Limit(self.requests_per_unit, self.unit, burst=self.burst).rate()  # or ValueError
        return self


class RlsDescriptor(_Strict):
    key: str = Field(min_length=1)
    value: str | None = Field(None, description="null = any value; '*' matches any run")
    rate_limit: RlsRateLimit | None = None
    shadow_mode: bool = Field(False, description="counted and reported, never refuses")
    descriptors: list[RlsDescriptor] = Field(default_factory=list)

    @field_validator("descriptors")
    @classmethod
    def _unique(cls, children: list[RlsDescriptor]) -> list[RlsDescriptor]:
        return _unique_descriptors(children)


def _unique_descriptors(children: list[RlsDescriptor]) -> list[RlsDescriptor]:
    seen = set()
    for child in children:
        if (child.key, child.value) in seen:
            value = "any value" if child.value is None else f"value {child.value!r}"
            raise ValueError(f"duplicate descriptor: key {child.key!r} with {value}")
        seen.add((child.key, child.value))
    return children


class RlsDomain(_Strict):
    domain: str = Field(min_length=1)
    descriptors: list[RlsDescriptor] = Field(default_factory=list)

    @field_validator("descriptors")
    @classmethod
    def _unique(cls, children: list[RlsDescriptor]) -> list[RlsDescriptor]:
        return _unique_descriptors(children)

    @model_validator(mode="after")
    def _replaces_named_limits(self) -> RlsDomain:
        """A ``replaces`` naming no limit of the domain would switch nothing off: a typo."""
        limits = [d.rate_limit for d in _walk(self.descriptors) if d.rate_limit]
        names = {limit.name for limit in limits if limit.name}
        for limit in limits:
            for replaced in limit.replaces:
                if replaced.name not in names:
                    raise ValueError(f"replaces names {replaced.name!r}, which no limit of "
                                     f"domain {self.domain!r} is called")
        return self


def _walk(descriptors: list[RlsDescriptor]) -> Iterator[RlsDescriptor]:
    for descriptor in descriptors:
        yield descriptor
        yield from _walk(descriptor.descriptors)


class RateLimitSettings(_Strict):
    """The Envoy Rate Limit Service on the gRPC port: descriptor rules per domain. A domain
    not listed answers OK (as envoyproxy/ratelimit does)."""

    domains: list[RlsDomain] = Field(default_factory=list)

    @field_validator("domains")
    @classmethod
    def _unique_domains(cls, domains: list[RlsDomain]) -> list[RlsDomain]:
        names = [d.domain for d in domains]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"duplicate domain {name!r}")
        return domains


class Config(_Strict):
    server: Server = Server()
    envoy: EnvoySettings = EnvoySettings()
    redis: RedisSettings | None = None
    scrape: ScrapeSettings = ScrapeSettings()
    queue: QueueSettings = QueueSettings()
    classification: Classification = Classification()
    agent: AgentSettings = AgentSettings()
    ratelimit: RateLimitSettings = RateLimitSettings()
    tiers: dict[str, Tier] = Field(min_length=1)
    classes: dict[str, RequestClass] = Field(
        default_factory=lambda: {name: RequestClass(**spec)
                                 for name, spec in BUILT_IN_CLASSES.items()}
    )
    tenants: list[Tenant] = Field(min_length=1)
    pools: list[Pool] = Field(min_length=1)

    @field_validator("classes", mode="before")
    @classmethod
    def _built_in_class_defaults(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {name: {**BUILT_IN_CLASSES[name], **(spec or {})}
                if name in BUILT_IN_CLASSES and isinstance(spec, dict | None) else spec
                for name, spec in value.items()}

    @model_validator(mode="after")
    def _references(self) -> Config:
        errors = list(self._reference_errors())
        if errors:
            raise ValueError("; ".join(errors))
        return self

    def _reference_errors(self) -> Iterable[str]:
        seen_keys: dict[str, str] = {}
        for i, tenant in enumerate(self.tenants):
            if tenant.tier not in self.tiers:
                yield (
                    f"tenants[{i}].tier: unknown tier {tenant.tier!r} "
                    f"(known: {_names(self.tiers)})"
                )
            for field_name in ("default_class", "max_class"):
                value = getattr(tenant, field_name)
                if value is not None and value not in self.classes:
                    yield (
                        f"tenants[{i}].{field_name}: unknown class {value!r} "
                        f"(known: {_names(self.classes)})"
                    )
            for key in tenant.api_keys:
                if key in seen_keys:
                    yield f"tenants[{i}].api_keys: key already belongs to {seen_keys[key]!r}"
                seen_keys[key] = tenant.name
        if not any(pool.degradation for pool in self.pools):
            for name, tier in self.tiers.items():
                if tier.overflow == "degrade":
                    yield f"tiers.{name}.overflow: 'degrade' needs a pool with a degradation plan"
            for i, tenant in enumerate(self.tenants):
                if tenant.overflow == "degrade":
                    yield f"tenants[{i}].overflow: 'degrade' needs a pool with a degradation plan"
        yield from self._limits_errors()
        yield from self._ratelimit_domain_errors()
        for path, name in self.classification.path_classes.items():
            if name not in self.classes:
                yield f"classification.path_classes.{path}: unknown class {name!r}"
        for name, klass in self.classes.items():
            if klass.deadline_s + TIMEOUT_MARGIN_S > self.envoy.message_timeout_s:
                yield (
                    f"classes.{name}.deadline_s: {klass.deadline_s:g} must be at least "
                    f"{TIMEOUT_MARGIN_S:g} s below envoy.message_timeout_s "
                    f"({self.envoy.message_timeout_s:g}), or Envoy fails the request (504, "
                    "no Retry-After) while kvgate still holds it"
                )
        seen: set[str] = set()  # (a list's index() here was quadratic in the tenants)
        for i, tenant in enumerate(self.tenants):
            if tenant.name in seen:
                yield f"tenants[{i}].name: duplicate tenant {tenant.name!r}"
            seen.add(tenant.name)
            yield from self._class_range_errors(i, tenant)
        pools: set[str] = set()  # one scheduler and one Envoy cluster per name
        for p, pool in enumerate(self.pools):
            if pool.name in pools:
                yield f"pools[{p}].name: duplicate pool {pool.name!r}"
            pools.add(pool.name)
        owners: dict[str, str] = {}
        for p, pool in enumerate(self.pools):
            if pool.degradation:
                for c in pool.degradation.classes:
                    if c not in self.classes:
                        yield f"pools[{p}].degradation.classes: unknown class {c!r}"
            for m, model in enumerate(pool.models):
                if model.name in owners:
                    yield (
                        f"pools[{p}].models[{m}]: {model.name!r} "
                        f"already served by {owners[model.name]!r}"
                    )
                owners[model.name] = pool.name
        for p, pool in enumerate(self.pools):
            if pool.reserved_in_flight and (pool.max_in_flight is None
                                            or pool.reserved_in_flight >= pool.max_in_flight):
                yield (f"pools[{p}].reserved_in_flight: {pool.reserved_in_flight} must be below "
                       f"max_in_flight ({pool.max_in_flight})")
            fallback = pool.degradation and pool.degradation.fallback_model
            if fallback and fallback not in owners:
                yield f"pools[{p}].degradation.fallback_model: no pool serves {fallback!r}"

    def _limits_errors(self) -> Iterable[str]:
        """Every tier's and tenant's limits: a shaped request's hold and then its wait in
        the queue (its class's deadline counts from the hold's end) must end before Envoy
        gives up on the message; a burst needs the rate it is the bucket of."""
        longest_wait = max((k.deadline_s for k in self.classes.values()), default=0.0)
        overridden = {t.tier for t in self.tenants if t.limits is not None}
        for where, limits in self._all_limits():
            hold = limits.shaping.longest_hold_s if limits.shaping else 0.0
            if limits.shaping and (hold + longest_wait + TIMEOUT_MARGIN_S
                                   > self.envoy.message_timeout_s):
                yield (f"{where}.limits.shaping: a full backlog waits {hold:g} s and then up "
                       f"to {longest_wait:g} s in the queue (the longest class deadline_s), "
                       f"which must end at least {TIMEOUT_MARGIN_S:g} s before "
                       f"envoy.message_timeout_s ({self.envoy.message_timeout_s:g})")
            tier_of_overrides = where.removeprefix("tiers.") in overridden
            for burst, rate in (("request_burst", "requests_per_second"),
                                ("token_burst", "tokens_per_minute")):
                if (getattr(limits, burst) is not None and getattr(limits, rate) is None
                        and not tier_of_overrides):  # its tenants may set the rate
                    yield (f"{where}.limits.{burst}: needs {rate} (a burst of no rate "
                           "limits nothing)")

    def _ratelimit_domain_errors(self) -> Iterable[str]:
        """``envoy.ratelimit_domain`` must name a domain of ``ratelimit.domains``: the
        rendered filter asks kvgate's own RLS, which answers every call of a domain it has
        no rules for OK, so a typo there limited nothing (and cost two gRPC calls a request)
        while `kvgate check` said OK."""
        domain = self.envoy.ratelimit_domain
        known = [d.domain for d in self.ratelimit.domains]
        if domain is not None and domain not in known:
            yield (f"envoy.ratelimit_domain: {domain!r} is not a domain of ratelimit.domains "
                   f"(known: {', '.join(sorted(known)) or 'none'}): kvgate's Rate Limit "
                   "Service answers every call of a domain it has no rules for OK, so the "
                   "rendered filter would limit nothing")

    def _class_range_errors(self, i: int, tenant: Tenant) -> Iterable[str]:
        """A tenant's ``max_class`` may not be less important than its ``default_class``:
        every request would be lowered to it, the default never applying."""
        order = self.class_order
        low, top = tenant.default_class, tenant.max_class
        if top in order and low in order and order.index(top) > order.index(low):
            yield (f"tenants[{i}].max_class: {top!r} is less important than its "
                   f"default_class {low!r}: every request would be lowered to {top!r}")

    def aging_s(self, class_name: str) -> float | None:
        """How long a request of this class waits per promotion (None: never promoted): the
        class's own ``aging_s`` if set, else ``queue.aging_s``, where 'auto' means half the
        class's deadline — promoted work still has half its deadline left to run."""
        klass = self.classes[class_name]
        if "aging_s" in klass.model_fields_set:
            return klass.aging_s
        if self.queue.aging_s == "auto":
            return klass.deadline_s / 2
        return self.queue.aging_s

    def long_prompt_tokens(self, tier: str) -> int | None:
        """The tier's own long-prompt threshold if it sets one (null: never), else the
        global ``classification.long_prompt_tokens``."""
        own = self.tiers[tier]
        if "long_prompt_tokens" in own.model_fields_set:
            return own.long_prompt_tokens
        return self.classification.long_prompt_tokens

    def _all_limits(self) -> Iterable[tuple[str, Limits]]:
        """Every tier's limits and every tenant's merged ones, with their path."""
        for name, tier in self.tiers.items():
            yield f"tiers.{name}", tier.limits
        for i, tenant in enumerate(self.tenants):
            if tenant.limits is not None and tenant.tier in self.tiers:
                yield f"tenants[{i}]", self.limits_for(tenant)

    def overflow_for(self, tenant: Tenant) -> Overflow:
        """The tenant's own overflow mode if it sets one, else its tier's."""
        return tenant.overflow or self.tiers[tenant.tier].overflow

    def limits_for(self, tenant: Tenant) -> Limits:
        return self.tiers[tenant.tier].limits.merged(tenant.limits)

    @property
    def class_order(self) -> list[str]:
        """Classes most important first (by vLLM priority, then as written): band = index."""
        names = list(self.classes)
        return sorted(names, key=lambda n: (self.classes[n].priority, names.index(n)))


def upstream_authorizations(config: Config) -> dict[str, str]:
    """``Authorization`` values for the pools that name an upstream key (read now, so a
    missing secret stops kvgate at start-up rather than failing requests)."""
    values, problems = {}, []
    for i, pool in enumerate(config.pools):
        if pool.upstream_api_key is not None:
            try:
                values[pool.name] = "Bearer " + pool.upstream_api_key.read()
            except ValueError as exc:
                problems.append(f"pools[{i}].upstream_api_key: {exc}")
    if problems:
        raise ConfigError("<config>", problems)
    return values


def _names(mapping: dict[str, Any]) -> str:
    return ", ".join(sorted(mapping)) or "none"


class ConfigError(Exception):
    """All problems found in one config file, each prefixed with its path. The message
    shows the first few, each cut short: a rejected reload logs it as one line, which a
    file of many broken values (or a megabyte key) must not make megabytes long; ``kvgate
    check`` prints :attr:`problems` whole."""

    SHOWN = 10
    WIDTH = 300  # characters of each problem

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        shown = [p if len(p) <= self.WIDTH else p[:self.WIDTH] + "…"
                 for p in problems[:self.SHOWN]]
        more = len(problems) - len(shown)
        super().__init__(f"{source}: " + "; ".join(shown) + (
            f"; and {more} more (`kvgate check` lists them all)" if more else ""))


def parse_config(data: Any, source: str = "<config>", found: Sequence[str] = ()) -> Config:
    """The validated config, or a ConfigError with every problem (``config_check``): those
    ``found`` in reading the file (duplicate keys) first."""
    data = data if data is not None else {}
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [*found, *explain(data, exc, Config)]) from None
    if found:
        raise ConfigError(source, list(found))
    return config


def read_config_data(path: str | Path) -> tuple[Any, list[str]]:
    """The YAML of a config file, unvalidated, and the problems found in reading it
    (duplicate keys: YAML keeps the last silently); problems name the file and the line."""
    path = Path(path)
    try:
        return yaml_input.load(yaml_input.read_text(path))
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:  # was a traceback from check, serve, render-envoy
        raise ConfigError(str(path), [f"cannot read: not UTF-8 text (byte {exc.start})"]) \
            from None
    except yaml_input.YamlInputError as exc:  # too large, too deep, expands too far
        raise ConfigError(str(path), [str(exc)]) from None
    except yaml.reader.ReaderError as exc:  # a NUL or control character: no mark, 2 lines
        raise ConfigError(str(path), [f"character {exc.position + 1}: not valid YAML: "
                                      f"{exc.reason} #x{exc.character:04x}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "
        what = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(str(path), [f"{where}not valid YAML: {what}"]) from None


def load_config(path: str | Path) -> Config:
    data, found = read_config_data(path)
    return parse_config(data, str(path), found)


class AgentFile(BaseModel):
    """What ``kvgate agent -c FILE`` reads of a config file: its ``agent:`` section alone.

    A GPU node's agent needs no tiers, tenants or pools, and should not have to hold the
    tenants' key hashes to set its port: a file of the one section is whole, and the
    gateway's own file serves as well, its other sections left unread."""

    model_config = ConfigDict(extra="ignore")
    agent: AgentSettings = AgentSettings()


def load_agent_settings(path: str | Path) -> AgentSettings:
    """The ``agent:`` section of the config file at ``path`` (see ``AgentFile``)."""
    data, found = read_config_data(path)
    data = data if data is not None else {}
    try:
        settings = AgentFile.model_validate(data).agent
    except ValidationError as exc:
        raise ConfigError(str(path), [*found, *explain(data, exc, AgentFile)]) from None
    if found:
        raise ConfigError(str(path), list(found))
    return settings


EXAMPLE_CONFIG = Path(__file__).parent / "examples" / "kvgate.yaml"


def for_worker(config: Config, index: int) -> Config:
    """Worker ``index``'s config: the gRPC port is shared (SO_REUSEPORT), but each worker
    serves its own metrics (``admin_port`` + i) and takes its own meter reports
    (``report_port`` + i: Envoy reports each response to the worker that admitted it)."""
    server = config.server
    moved = {name: getattr(server, name) + index for name in ("admin_port", "report_port")
             if index and getattr(server, name)}
    return config.model_copy(update={"server": server.model_copy(update=moved)}) if moved \
        else config
