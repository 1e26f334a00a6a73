"""A vLLM-compatible simulated engine: the upstream for the demo and the end-to-end tests.

It speaks enough of vLLM's OpenAI server for kvgate to treat it as a real pod (chat and text
completions, streaming with ``stream_options.include_usage`` and ``continuous_usage_stats``,
embeddings, ``/v1/models``, ``/health``, ``/metrics`` with vLLM's metric names (a
``?name[]=`` query keeps only those series, as Prometheus's client library does), ``priority``
with vLLM's semantics, see ``--fcfs-priority``) while staying cheap, deterministic and
inspectable. The scheduling and KV model lives in ``extproc.engine.model``; this module is
only the HTTP layer and its lifecycle.

Run it::

    python -m extproc.engine --port 8101 [--host 127.0.0.1] [--model tiny-llama]
        [--scheduling-policy fcfs|priority] [--fcfs-priority ignore|reject]
        [--base-ms 7] [--decode-us-per-seq 60] [--prefill-us-per-token 90] [--time-scale 1]
        [--ms-per-token N] [--max-num-batched-tokens 2048]
        [--kv-blocks 2048 --block-size 16] [--max-num-seqs 64] [--max-model-len N]
        [--metrics-flavour vllm|sglang|tgi|trtllm]

The engine runs vLLM V1's step loop (continuous batching, chunked prefill, a step time that
grows with the batch; see ``extproc.engine.model``). ``--time-scale 10`` runs every step 10×
slower in real time. ``--fcfs-priority``: a non-zero ``priority`` on an ``fcfs`` engine is
ignored (``ignore``, the default, as vLLM 0.32 does; see ``bench/vllm_cpu/README.md``) or
answered 400 (``reject``, as older vLLM releases did).

``--metrics-flavour`` makes ``/metrics`` speak another engine's names (SGLang, TGI, or
TensorRT-LLM under Triton; see ``extproc.datalayer.metrics.ENGINES``) for the same modelled
state, so a pool of any engine can be tested end to end; ``sglang`` also reads ``priority``
the way SGLang does by default (higher first).

or from Python: ``handle = await start_engine(port, **opts)`` inside a running event loop
(``await handle.stop()``), or ``with EngineProcess(**opts) as engine:`` for a subprocess.

Prompt tokens are the whitespace-separated words of the prompt (``str.split()``): of every
message's content for chat (text parts only), of ``prompt`` for completions (a list of strings
counts all of them; a list of token ids counts the ids). No tokenizer, no chat template: the
same body always costs the same tokens, so tests can predict ``usage`` exactly. Generated
text is one vocabulary word plus a space per token, so its word count is the token count.
The output length is ``max_completion_tokens`` or ``max_tokens`` (default 16), always run to
the end, as with ``ignore_eos: true`` (which is accepted and changes nothing).

``n`` answers that many choices, as vLLM does: each choice is its own sequence in the
scheduler (vLLM V1 runs a child request per choice, ``<choice>_<id>`` in ``/debug/state``),
each with the prompt and run to the cap; the answer's ``choices`` have ``index`` 0..n-1, a
stream opens with a role chunk per choice (chat) and its chunks name their choice's
``index``; ``usage`` counts the prompt once and every choice's tokens (``completion_tokens``
= n × the cap), and a ``continuous_usage_stats`` chunk carries its own choice's count, as
vLLM's do. Simplification: with no prefix caching, each choice holds its own copy of the
prompt's KV blocks (vLLM with prefix caching shares them), so n > 1 costs the simulated
cache (n - 1) prompts more than a real one. ``best_of`` is ignored, as before; a batch of
prompts is still answered as one prompt (one set of choices).

Test hooks, under ``/debug/`` only (a real vLLM has none of them):

- ``GET /debug/requests``: every ``/v1/*`` request received, most recent last: method, path,
  query, headers (lowercase names), parsed JSON body (null if not JSON), raw body length and
  the ``content-length`` header as received (null if absent); ``DELETE`` clears it.
- ``POST /debug/metrics``: a JSON object of values that ``/metrics`` reports instead of the
  modelled ones, e.g. ``{"kv_cache_usage_perc": 0.97, "num_requests_waiting": 12}``; it
  replaces the previous overrides, ``{}`` clears them. ``GET`` shows the current ones.
- ``GET /debug/state``: running/waiting counts, KV blocks, finished and aborted (client
  disconnected) counts, and the requests in each queue.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as render_prometheus
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from extproc.engine.model import EngineConfig, EngineModel, SimRequest
from extproc.ports import PortInUse, free_port
from extproc.processes import stop_process

Kind = Literal["chat", "completion"]

DEFAULT_MAX_TOKENS = 16
EMBEDDING_DIM = 8
REQUEST_LOG_LIMIT = 10_000  # the demo runs for hours; tests never come close
VOCAB = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "again")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards look the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


# -- request parsing and vLLM-shaped errors ------------------------------------------------


class ApiError(Exception):
    """An error answered the way vLLM's OpenAI server answers it."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}
        return json_response(body, status=self.status)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, headers=headers,
                        content_type="application/json")


def count_words(text: str) -> int:
    return len(text.split())


def message_text(content: Any) -> str:
    """The text of a chat message's ``content``: a string, or the text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, "each content part must be an object", param="messages")
            if part.get("type") == "text":
                if not isinstance(part.get("text"), str):  # vLLM's validation: a 400
                    raise ApiError(400, "a text content part needs a string 'text'",
                                   param="messages")
                texts.append(part["text"])
        return " ".join(texts)
    if content is not None:
        raise ApiError(400, "content must be a string or a list of content parts",
                       param="messages")
    return ""


def prompt_token_count(prompt: Any) -> int:
    """Tokens of a completions ``prompt``: words of the string(s), or the number of ids (a
    batch's answered as one prompt here)."""
    if isinstance(prompt, str):
        return count_words(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return sum(count_words(p) for p in prompt)
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                        for p in prompt):
        return sum(map(len, prompt))
    raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids",
                   param="prompt")


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    return value


@dataclass
class Generation:
    """What a chat/completions body asks of the engine, validated."""

    kind: Kind
    prompt_tokens: int
    max_tokens: int
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    n: int = 1  # choices: each its own sequence, run to max_tokens


def parse_generation(body: dict[str, Any], kind: Kind, config: EngineConfig) -> Generation:
    """Validate a generation body in vLLM's order: shape (400), model (404), limits (400)."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "each message must be an object", param="messages")
        prompt_tokens = sum(count_words(message_text(m.get("content"))) for m in messages)
        max_tokens = int_field(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = int_field(body, "max_tokens")
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", param="prompt")
        prompt_tokens = prompt_token_count(body["prompt"])
        max_tokens = int_field(body, "max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.",
                       param="max_tokens")
    priority = int_field(body, "priority") or 0
    if config.metrics_flavour == "sglang":
        priority = -priority  # SGLang runs higher values first; the model, lower first
    n = int_field(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.", param="n")
    stream = body.get("stream")
    stream = False if stream is None else stream  # vLLM takes null as the default
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                       param="stream_options")
    options = stream_options if isinstance(stream_options, dict) else {}
    include_usage = options.get("include_usage") is True
    continuous = include_usage and options.get("continuous_usage_stats") is True

    check_model(body, config)
    total = prompt_tokens + max_tokens
    if total > config.context_limit:
        raise ApiError(400, f"This model's maximum context length is {config.context_limit} "
                       f"tokens. However, you requested {total} tokens ({prompt_tokens} in the "
                       f"messages, {max_tokens} in the completion). Please reduce the length "
                       "of the messages or completion.")
    check_priority(priority, config)
    check_cache_salt(body)
    return Generation(kind, prompt_tokens, max_tokens, priority, stream, include_usage,
                      continuous, n)


def check_model(body: dict[str, Any], config: EngineConfig) -> None:
    """vLLM serves a missing ``model`` with its default and answers 404 for any other name."""
    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


CACHE_SALT_MAX, CACHE_SALT_FORBIDDEN = 128, frozenset("@/\\\x00")


def check_cache_salt(body: dict[str, Any]) -> None:
    """vLLM 0.32's rules for the prefix cache's salt (entrypoints/generate/base/protocol.py):
    a gateway that salts requests must send what the engine accepts."""
    salt = body.get("cache_salt")
    if salt is None:
        return
    if (not isinstance(salt, str) or not salt or len(salt) > CACHE_SALT_MAX
            or not CACHE_SALT_FORBIDDEN.isdisjoint(salt)):
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string of at most 128 "
                       "characters and must not contain '@', '/', '\\', or NUL.",
                       param="cache_salt")


def check_priority(priority: int, config: EngineConfig) -> None:
    # vLLM 0.32 ignores a non-zero priority on an fcfs engine (``fcfs_priority="ignore"``);
    # older releases rejected it, with this wording from the engine's add_request
    # (vllm/engine/llm_engine.py, vllm/engine/async_llm_engine.py).
    if (priority != 0 and config.scheduling_policy != "priority"
            and config.fcfs_priority == "reject"):
        raise ApiError(400, f"Got priority {priority} but Priority scheduling is not enabled.")


# -- metrics -------------------------------------------------------------------------------

OVERRIDABLE = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
               "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total")


class EngineMetrics:
    """``/metrics`` in vLLM's names (or another engine's, ``metrics_flavour``); scalar values
    come from the model unless overridden (the overrides use vLLM's names whatever the
    flavour: ``kv_cache_usage_perc`` sets SGLang's ``token_usage`` too)."""

    def __init__(self, model: EngineModel, engine_index: str = "0"):
        self.model = model
        self.engine_index = engine_index
        self.overrides: dict[str, float] = {}
        self.labels = {"model_name": model.config.model, "engine": engine_index}
        self.registry = CollectorRegistry()
        self.registry.register(self)  # collect() below: the scalar families
        names = list(self.labels)
        # vLLM's histograms and counter; another flavour's body carries its own names only
        own = self.registry if model.config.metrics_flavour == "vllm" else CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=own)

        ttft = histogram("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        e2e = histogram("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        queue = histogram("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=own)
        self.ttft, self.e2e, self.queue = (h.labels(**self.labels) for h in (ttft, e2e, queue))
        self.success = success
        model.on_admitted = lambda req, seconds: self.queue.observe(seconds)
        model.on_first_token = lambda req, seconds: self.ttft.observe(seconds)
        model.on_finished = self._finished

    def _finished(self, req: SimRequest, seconds: float, reason: str) -> None:
        self.success.labels(**self.labels, finished_reason=reason).inc()
        if reason != "abort":
            self.e2e.observe(seconds)

    def set_overrides(self, overrides: dict[str, Any]) -> None:
        cleaned: dict[str, float] = {}
        for key, value in overrides.items():
            name = key.removeprefix("vllm:")
            if name not in OVERRIDABLE:
                raise ApiError(400, f"unknown metric {key!r}; overridable: {list(OVERRIDABLE)}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ApiError(400, f"override for {key!r} must be a number")
            cleaned[name] = float(value)
        self.overrides = cleaned

    def render(self, names: list[str] | None = None) -> bytes:
        """The page; ``names``: those series alone (a ``?name[]=`` query, as Prometheus's
        client library behind vLLM's ``/metrics`` answers it)."""
        return render_prometheus(self.registry.restricted_registry(names) if names
                                 else self.registry)

    def describe(self) -> list[Metric]:
        """The families' names, so that a filtered page finds them."""
        return self.collect()

    def collect(self) -> list[Metric]:
        model = self.model
        modelled = {
            "kv_cache_usage_perc": model.kv_cache_usage,
            "num_requests_running": len(model.running),
            "num_requests_waiting": len(model.waiting),
            "num_preemptions_total": model.num_preemptions,
            "prompt_tokens_total": model.prompt_tokens_total,
            "generation_tokens_total": model.generation_tokens_total,
        }
        values = {name: self.overrides.get(name, value) for name, value in modelled.items()}
        flavour = model.config.metrics_flavour
        if flavour == "vllm":
            return self._vllm(values)
        return FLAVOURS[flavour](values, model.config)

    def _vllm(self, values: dict[str, float]) -> list[Metric]:
        label_names, label_values = list(self.labels), list(self.labels.values())
        docs = {
            "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
            "num_requests_running": "Number of requests in model execution batches.",
            "num_requests_waiting": "Number of requests waiting to be processed.",
            "num_preemptions_total": "Cumulative number of preemption from the engine.",
            "prompt_tokens_total": "Number of prefill tokens processed.",
            "generation_tokens_total": "Number of generation tokens processed.",
        }
        families: list[Metric] = []
        for name, value in values.items():
            if name.endswith("_total"):
                family: Metric = CounterMetricFamily(f"vllm:{name.removesuffix('_total')}",
                                                     docs[name], labels=label_names)
            else:
                family = GaugeMetricFamily(f"vllm:{name}", docs[name], labels=label_names)
            family.add_metric(label_values, value)
            families.append(family)
        config = self.model.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "engine",
                    "num_gpu_blocks"])
        # like vLLM, it counts one block more than requests can use (vLLM's null block)
        info.add_metric([str(config.block_size), "auto", "False", self.engine_index,
                         str(config.kv_blocks + 1)], 1.0)
        families.append(info)
        return families


# The other engines' names for the same figures, as extproc.datalayer.metrics reads them
# (that module names each engine's source). Only what kvgate reads, plus the families
# around it that share a label scheme.


def _sglang(values: dict[str, float], config: EngineConfig) -> list[Metric]:
    labels = {"engine_type": "unified", "model_name": config.model, "moe_ep_rank": "0",
              "pp_rank": "0", "tp_rank": "0"}
    capacity = config.kv_blocks * config.block_size
    gauges = {"num_running_reqs": values["num_requests_running"],
              "num_used_tokens": round(values["kv_cache_usage_perc"] * capacity),
              "token_usage": values["kv_cache_usage_perc"],
              "num_queue_reqs": values["num_requests_waiting"],
              "max_total_num_tokens": capacity}
    counters = {"num_retracted_requests": values["num_preemptions_total"],
                "prompt_tokens": values["prompt_tokens_total"],
                "generation_tokens": values["generation_tokens_total"]}
    families: list[Metric] = []
    for name, value in gauges.items():
        family = GaugeMetricFamily(f"sglang:{name}", name, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        families.append(family)
    for name, value in counters.items():
        counter = CounterMetricFamily(f"sglang:{name}", name, labels=list(labels))
        counter.add_metric(list(labels.values()), value)
        families.append(counter)
    return families


def _tgi(values: dict[str, float], config: EngineConfig) -> list[Metric]:
    capacity = config.kv_blocks * config.block_size
    gauges = {"tgi_queue_size": values["num_requests_waiting"],
              "tgi_batch_current_size": values["num_requests_running"],
              "tgi_batch_current_max_tokens": round(values["kv_cache_usage_perc"] * capacity),
              "tgi_batch_max_total_tokens": capacity,
              # TGI's per-request token histograms, reduced to the _sum kvgate reads
              "tgi_request_input_length_sum": values["prompt_tokens_total"],
              "tgi_request_generated_tokens_sum": values["generation_tokens_total"]}
    return [GaugeMetricFamily(name, name, value=value) for name, value in gauges.items()]


def _trtllm(values: dict[str, float], config: EngineConfig) -> list[Metric]:
    labels = ["model", "version"]
    requests = GaugeMetricFamily("nv_trt_llm_request_metrics", "TRT LLM request metrics",
                                 labels=[*labels, "request_type"])
    for kind, value in (("waiting", values["num_requests_waiting"]),
                        ("scheduled", values["num_requests_running"]),
                        ("active", values["num_requests_running"]
                         + values["num_requests_waiting"]),
                        ("max", config.max_num_seqs)):
        requests.add_metric(["tensorrt_llm", "1", kind], value)
    kv = GaugeMetricFamily("nv_trt_llm_kv_cache_block_metrics",
                           "TRT LLM KV cache block metrics",
                           labels=[*labels, "kv_cache_block_type"])
    used = round(values["kv_cache_usage_perc"] * config.kv_blocks)
    for kind, value in (("fraction", values["kv_cache_usage_perc"]), ("max", config.kv_blocks),
                        ("used", used), ("free", config.kv_blocks - used),
                        ("tokens_per", config.block_size)):
        kv.add_metric(["tensorrt_llm", "1", kind], value)
    return [requests, kv]


FLAVOURS: dict[str, Callable[[dict[str, float], EngineConfig], list[Metric]]] = {
    "sglang": _sglang, "tgi": _tgi, "trtllm": _trtllm}


# -- the HTTP server -----------------------------------------------------------------------


class EngineServer:
    """The aiohttp application around one ``EngineModel``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = EngineModel(config)
        self.metrics = EngineMetrics(self.model)
        self.request_log: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_LIMIT)
        self.engine_id = ""  # host:port once listening; sent as x-bench-engine
        self.app = web.Application(middlewares=[self._record_and_map_errors])
        self.app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.post("/v1/embeddings", self.embeddings),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            # Test hooks: not part of vLLM's API.
            web.get("/debug/requests", self.debug_requests),
            web.delete("/debug/requests", self.debug_clear_requests),
            web.get("/debug/metrics", self.debug_get_metrics),
            web.post("/debug/metrics", self.debug_set_metrics),
            web.get("/debug/state", self.debug_state),
        ])

    @web.middleware
    async def _record_and_map_errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            await self._record(request)
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()

    async def _record(self, request: web.Request) -> None:
        raw = await request.read()  # aiohttp caches it: the handler reads it again for free
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            name = name.lower()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        self.request_log.append({
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "headers": headers,
            "body": body,
            "body_bytes": len(raw),
            "content_length": request.headers.get("content-length"),
            "received_at": time.time(),
        })

    def _headers(self) -> dict[str, str]:
        return {"x-bench-engine": self.engine_id}

    # -- generation ------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        body = parse_json(await request.read())
        gen = parse_generation(body, kind, self.config)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        # n > 1: a sequence per choice, each with the prompt (vLLM V1's child requests,
        # named "<choice>_<id>" as vLLM names them)
        reqs = [self.model.new_request(gen.prompt_tokens, gen.max_tokens, gen.priority,
                                       request_id if gen.n == 1 else f"{choice}_{request_id}")
                for choice in range(gen.n)]
        chunks = ChunkMaker(kind, request_id, self.config.model, gen)
        if gen.stream:
            return await self._stream(request, reqs, chunks)
        words: list[list[str]] = [[] for _ in reqs]
        async with contextlib.aclosing(self.model.generate_many(reqs)) as tokens:
            async for choice, index in tokens:
                words[choice].append(token_text(index))
        return json_response(chunks.full_response(["".join(w) for w in words]),
                             headers=self._headers())

    async def _stream(self, request: web.Request, reqs: list[SimRequest], chunks: ChunkMaker
                      ) -> web.StreamResponse:
        """SSE, one token of one choice per chunk. Headers go out at once, as vLLM's do,
        even if queued."""
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8",
                                           "cache-control": "no-cache", **self._headers()})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(self.model.generate_many(reqs)) as tokens:
                async for choice, index in tokens:
                    for chunk in chunks.token_chunks(choice, index):
                        await resp.write(sse(chunk))
            if chunks.gen.include_usage:
                await resp.write(sse(chunks.usage_chunk()))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; generate()'s cleanup freed the slot and counted an abort
        return resp

    # -- the rest of the API ---------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs
                                       and all(isinstance(i, int) for i in inputs)):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise ApiError(400, "input must be a string or a non-empty list", param="input")
        check_model(body, self.config)
        check_priority(int_field(body, "priority") or 0, self.config)
        check_cache_salt(body)
        data, tokens = [], 0
        for index, item in enumerate(inputs):
            tokens += prompt_token_count(item)
            data.append({"object": "embedding", "index": index, "embedding": embed(item)})
        self.model.record_pooling(tokens)
        return json_response({
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.config.model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }, headers=self._headers())

    async def models(self, request: web.Request) -> web.Response:
        model = self.config.model
        return json_response({"object": "list", "data": [{
            "id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": self.config.context_limit,
            "permission": [],
        }]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(request.query.getall("name[]", [])),
                            headers={"content-type": CONTENT_TYPE_LATEST})

    # -- test hooks ------------------------------------------------------------------------

    async def debug_requests(self, request: web.Request) -> web.Response:
        return json_response(list(self.request_log))

    async def debug_clear_requests(self, request: web.Request) -> web.Response:
        cleared = len(self.request_log)
        self.request_log.clear()
        return json_response({"cleared": cleared})

    async def debug_get_metrics(self, request: web.Request) -> web.Response:
        return json_response({"overrides": self.metrics.overrides})

    async def debug_set_metrics(self, request: web.Request) -> web.Response:
        self.metrics.set_overrides(parse_json(await request.read()))
        return json_response({"overrides": self.metrics.overrides})

    async def debug_state(self, request: web.Request) -> web.Response:
        return json_response({**self.model.snapshot(), "overrides": self.metrics.overrides,
                              "pid": os.getpid()})  # which process answers this port


def token_text(index: int) -> str:
    return VOCAB[index % len(VOCAB)] + " "


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def embed(item: str | list[int]) -> list[float]:
    """A small unit vector that depends only on the input."""
    digest = hashlib.blake2b(orjson.dumps(item), digest_size=EMBEDDING_DIM).digest()
    raw = [byte / 127.5 - 1.0 for byte in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


class ChunkMaker:
    """OpenAI response and chunk shapes for one request (chat or text completion)."""

    def __init__(self, kind: Kind, request_id: str, model: str, gen: Generation):
        self.kind, self.model, self.gen = kind, model, gen
        self.id = f"chatcmpl-{request_id}" if kind == "chat" else f"cmpl-{request_id}"
        self.created = int(time.time())
        self._opening = True  # the stream's first token is still to come

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _usage(self, completion: int | None = None) -> dict[str, int]:
        """The prompt once, however many choices (vLLM's count); ``completion`` defaults to
        every choice's tokens: all run to ``max_tokens``."""
        prompt = self.gen.prompt_tokens
        completion = self.gen.max_tokens * self.gen.n if completion is None else completion
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def token_chunks(self, choice: int, index: int) -> list[dict[str, Any]]:
        """The chunk(s) for token ``index`` of ``choice``; a chat stream opens with a role
        chunk per choice, all before the first token, like vLLM. With
        ``continuous_usage_stats`` each carries the usage so far — of its own choice, as
        vLLM's do: only the final usage chunk sums the choices."""
        chunks = self._role_chunks() if self._opening else []
        self._opening = False
        chunks.append(self._token_chunk(choice, index))
        if self.gen.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self._usage(index + 1 if chunk is chunks[-1] else 0)
        return chunks

    def _role_chunks(self) -> list[dict[str, Any]]:
        if self.kind == "completion":
            return []
        return [self._envelope("chat.completion.chunk", [{
            "index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]) for choice in range(self.gen.n)]

    def _token_chunk(self, choice: int, index: int) -> dict[str, Any]:
        finish = "length" if index == self.gen.max_tokens - 1 else None
        text = token_text(index)
        if self.kind == "completion":
            return self._envelope("text_completion", [{
                "index": choice, "text": text, "logprobs": None, "finish_reason": finish,
                "stop_reason": None}])
        return self._envelope("chat.completion.chunk", [{
            "index": choice, "delta": {"content": text}, "logprobs": None,
            "finish_reason": finish}])

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": self._usage()}

    def full_response(self, texts: list[str]) -> dict[str, Any]:
        """The whole answer: one choice per text, ``index`` 0..n-1."""
        if self.kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": None, "finish_reason": "length", "stop_reason": None}
                       for i, text in enumerate(texts)]
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": "length",
                        "stop_reason": None} for i, text in enumerate(texts)]
            obj = "text_completion"
        return {**self._envelope(obj, choices), "usage": self._usage()}


# -- lifecycle: in-process, subprocess, CLI ------------------------------------------------


@dataclass
class EngineHandle:
    """A running in-process engine; ``model`` gives tests direct access to its state."""

    server: EngineServer
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model(self) -> EngineModel:
        return self.server.model

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_engine(port: int = 0, host: str = "127.0.0.1", **opts: Any) -> EngineHandle:
    """Serve an engine from the caller's event loop; ``port=0`` picks a free port.

    ``opts`` are ``EngineConfig`` fields (model, scheduling_policy, ms_per_token, ...).
    Handlers are cancelled when their client disconnects, so a non-streaming request that
    is abandoned frees its slot too (aiohttp's default is to let it run to the end).
    """
    server = EngineServer(EngineConfig(**opts))
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=0.25)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    port = runner.addresses[0][1]
    server.engine_id = f"{host}:{port}"
    return EngineHandle(server, runner, host, port)




class EngineProcess:
    """The engine as a subprocess (``python -m extproc.engine``), for tests and the demo.

    ``with EngineProcess(ms_per_token=5) as engine: ... engine.url ...`` starts it, waits
    until ``/health`` answers and terminates it on exit. The helpers wrap the test hooks.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 startup_timeout: float = 15.0, **opts: Any):
        known = {f.name for f in fields(EngineConfig)}
        if unknown := set(opts) - known:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        self.host, self.port = host, port or free_port(host)
        self.opts, self.startup_timeout = opts, startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "extproc.engine", "--host", self.host,
               "--port", str(self.port)]
        for name, value in self.opts.items():
            if value is not None:
                cmd += [f"--{name.replace('_', '-')}", str(value)]
        return cmd

    def start(self) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process)
        self.proc = subprocess.Popen(self.command(), env=env, stdout=subprocess.DEVNULL,
                                     stderr=self._stderr)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._stderr.seek(0)
                err = self._stderr.read().decode(errors="replace")
                raise RuntimeError(f"engine exited with {self.proc.returncode}: {err}")
            with (contextlib.suppress(OSError),
                  urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp):
                if resp.status == 200:
                    self._check_ours()
                    return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"engine on {self.url} not healthy after {self.startup_timeout}s")

    def _check_ours(self) -> None:
        """The engine answering is the one started here, not another on the same port (a
        second demo would otherwise take the first one's engines for its own)."""
        assert self.proc is not None
        answering = self.state().get("pid")
        if answering != self.proc.pid:
            self.stop()
            raise PortInUse(f"{self.host}:{self.port} is already in use (by process "
                            f"{answering}): the engine started for it could not listen")

    def stop(self) -> None:
        stop_process(self.proc, timeout=5)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> EngineProcess:
        try:
            self.start()
        except BaseException:  # Ctrl-C or the demo's SIGTERM mid-start: no orphan engine
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test hooks, synchronously ---------------------------------------------------------

    def call(self, method: str, path: str, payload: Any = None) -> Any:
        data = None if payload is None else orjson.dumps(payload)
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return orjson.loads(resp.read())

    def requests(self) -> list[dict[str, Any]]:
        return self.call("GET", "/debug/requests")

    def clear_requests(self) -> None:
        self.call("DELETE", "/debug/requests")

    def set_metrics(self, **overrides: float) -> None:
        self.call("POST", "/debug/metrics", overrides)

    def state(self) -> dict[str, Any]:
        return self.call("GET", "/debug/state")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m extproc.engine", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   default=defaults.scheduling_policy)
    p.add_argument("--fcfs-priority", choices=["ignore", "reject"],
                   default=defaults.fcfs_priority,
                   help="non-zero priority on an fcfs engine: ignore (vLLM 0.32) or 400")
    p.add_argument("--base-ms", type=float, default=defaults.base_ms)
    p.add_argument("--decode-us-per-seq", type=float, default=defaults.decode_us_per_seq)
    p.add_argument("--prefill-us-per-token", type=float, default=defaults.prefill_us_per_token)
    p.add_argument("--time-scale", type=float, default=defaults.time_scale,
                   help="real seconds per model second (2 = twice as slow)")
    p.add_argument("--ms-per-token", type=float, default=defaults.ms_per_token,
                   help="older knob: overrides --base-ms")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=defaults.max_num_batched_tokens)
    p.add_argument("--kv-blocks", type=int, default=defaults.kv_blocks)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    p.add_argument("--metrics-flavour", choices=["vllm", "sglang", "tgi", "trtllm"],
                   default=defaults.metrics_flavour, help="whose /metrics names to export")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM or SIGINT, then stop cleanly."""
    opts = {k: v for k, v in vars(args).items() if k not in ("host", "port")}
    handle = await start_engine(args.port, args.host, **opts)
    print(f"extproc.engine {args.model} ({args.scheduling_policy}) listening on {handle.url}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await handle.stop()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
