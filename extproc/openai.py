"""OpenAI-compatible request bodies: what kvgate must know to admit them, and how it edits them.

Parsing is strict where a mistake would let a request dodge its limits (the model, the
output cap) and lenient elsewhere: vLLM validates the rest and answers in its own words.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
INFERENCE_PATHS = (CHAT, COMPLETIONS, EMBEDDINGS)  # metered by their body
MODELS_PATH = "/v1/models"  # answered by kvgate itself: every pool's models (model_list)
HARMLESS_PATHS = (MODELS_PATH, "/health")  # one request's worth, decided on headers
# Default-deny: the only paths that pass, and the methods each allows. Everything else an
# engine serves (responses, scoring, pooling, audio, tokenize, debug hooks…) kvgate cannot
# meter, so it answers 404 itself.
ROUTES: dict[str, frozenset[str]] = {
    **{path: frozenset({"POST"}) for path in INFERENCE_PATHS},
    **{path: frozenset({"GET", "HEAD"}) for path in HARMLESS_PATHS},
}
PER_MESSAGE_OVERHEAD_TOKENS = 3  # chat-template tokens around each message
# levels of arrays and objects a body may nest: orjson reads 1024 but writes 254, and kvgate
# writes every admitted body back (its priority, the tenant's cache salt)
MAX_NESTING = 254
MAX_COUNT = 2**31 - 1  # no sane max_tokens, n or best_of is larger (vLLM's are int32-bound)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the completions API's cap when max_tokens is absent or null
# The fields that cap one answer, the first set wins: chat takes max_completion_tokens over
# max_tokens; the completions API has only max_tokens (an engine ignores the other there).
OUTPUT_CAP_FIELDS = {CHAT: ("max_completion_tokens", "max_tokens"), COMPLETIONS: ("max_tokens",)}
_SERVING = ("is set by the serving system, not by clients: from a client it could replace or "
            "extend the prompt this gateway counted, or place the request where it did not")
_PROMPT_IDS = ("would replace the prompt this gateway counts (the engine skips the chat "
               "template): send the messages alone")
_MEDIA = "changes how many tokens a media part becomes, which this gateway cannot count"
_REQUEST_ID = ("names the request inside the engine: ids are this gateway's (x-request-id), "
               "and a client's could name another tenant's request")
_UNMETERED_WORK = "asks the engine for work this gateway does not meter"
_ADAPTER = ("picks a LoRA adapter other than the model the request names: this gateway "
            "authorizes and routes by `model` (name the adapter there)")
REFUSED_FIELDS: dict[str, str] = {
    # the serving system's own: disaggregated prefill and decode, engine sessions, placement
    **dict.fromkeys(("kv_transfer_params", "ec_transfer_params",  # vLLM
                     "bootstrap_host", "bootstrap_port", "bootstrap_room", "session_params",
                     "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",  # SGLang
                     "disaggregated_params"), _SERVING),  # TensorRT-LLM
    "input_ids": _PROMPT_IDS,  # SGLang chat
    **dict.fromkeys(("mm_processor_kwargs", "media_io_kwargs",  # vLLM
                     "images_config", "max_dynamic_patch", "min_dynamic_patch",  # SGLang
                     "use_audio_in_video"), _MEDIA),
    "request_id": _REQUEST_ID, "rid": _REQUEST_ID,  # vLLM, SGLang
    "lora_path": _ADAPTER,  # SGLang
    **dict.fromkeys(("use_beam_search", "vllm_xargs",  # vLLM
                     "custom_logit_processor", "return_hidden_states"), _UNMETERED_WORK),
}
"""Request fields refused with 400 ``unsupported_parameter`` (any value but null or false),
and why: what an engine would do with them kvgate cannot meter.

- The serving system's own fields: vLLM prefills ``kv_transfer_params.prompt_token_ids``
  instead of the messages, an SGLang session prepends its earlier context, the bootstrap
  fields point an engine at another host for its KV, and SGLang's data-parallel ranks undo
  the placement kvgate chose by each endpoint's KV. SGLang's ``input_ids`` is a prompt of
  token ids the engine runs in place of the rendered messages.
- Media options: the engine's HF processor (``mm_processor_kwargs``: ``max_pixels``,
  ``num_crops``), its media loaders (``media_io_kwargs``: a video's ``num_frames``) and
  SGLang's patch counts decide how many tokens an image or video becomes, and
  ``use_audio_in_video`` adds the audio track's: ``tokens_per_media_part`` is set for the
  model's defaults, so a client's options would run more than was reserved.
- Request ids: vLLM takes the engine's request id from the body's ``request_id``, SGLang
  from ``rid``; engines keep a request's state (and abort it) by that id, so a client's own
  could name another tenant's request in flight, and would part the engine's logs from
  kvgate's.
- SGLang's ``lora_path`` runs the request on an adapter of its choosing whatever
  ``model`` says, past the tenant's model allow-list and the pool routed to.
- Work the one-request reservation does not describe: beam search (vLLM runs one engine
  request per beam and step, the prompt resubmitted each time), ``vllm_xargs`` (arguments
  for the operator's custom extensions, and the engine's ``extra_args`` where its KV
  connector reads transfer parameters), SGLang's custom logit processor (code sent with the
  request) and hidden states (every token's whole hidden vector in the answer)."""
TEMPLATE_FIELD = "chat_template"
"""A chat template of the request's own (the body's, or one in ``chat_template_kwargs``),
which vLLM (with ``--trust-request-chat-template``) and trtllm-serve render the prompt with:
a loop in it makes a prompt of any length from a short body, while kvgate counts with the
model's template. Refused, as the model's special tokens are."""
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
"""Content part types that are text, and the field holding it; any other type is media. The
types vLLM renders as text (``thinking`` too: counted as media, a 40,000-character one was
reserved as ``tokens_per_media_part`` tokens while the engine ran 10,000)."""
MEDIA_FIELDS = frozenset(("image_url", "image_pil", "image_embeds", "audio_embeds",
                          "prompt_embeds", "audio_url", "input_audio", "video_url"))
"""Fields that make a content part without a ``type`` media to vLLM: its request model keeps
only the media field of such a part (``{"text": "hi", "image_url": "…"}`` is an image there),
so kvgate counts it as media, never as the text beside it."""
PART_TOKEN_FIELDS = ("max_dynamic_patch", "min_dynamic_patch")
"""Fields of a media part's object (``image_url``, ``video_url``) from which SGLang takes how
many patches, so tokens, the image or video becomes: refused as the body's own are."""
RENDERED_FIELDS = ("tools", "functions", "documents", "chat_template_kwargs")
"""Chat request fields besides ``messages`` that chat templates render into the prompt."""


def shown(value: str, limit: int = 200) -> str:
    """A client's value as an error quotes it: a 1 MB model name (or a 50 KB header) is not
    echoed back whole."""
    return value if len(value) <= limit else f"{value[:limit]}… ({len(value)} characters)"


class BadRequest(Exception):
    """A client error that becomes a 4xx with an OpenAI-style JSON body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str | None = "invalid_request_error",
        param: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.error_type = error_type
        self.headers = headers  # extra response headers (405's allow)


@dataclass(slots=True)
class InferenceRequest:
    """A parsed body: the JSON document plus the fields admission needs."""

    path: str
    body: dict[str, Any]
    model: str
    prompt_texts: list[str]
    message_count: int
    max_output_tokens: int | None  # None: the request set no cap
    stream: bool
    choices: int  # max(n, best_of), × the prompts of a batch: the answers the engine makes
    media_parts: int = 0  # chat content parts that are not text (images, audio, …)
    request_class: str | None = None  # set once classified (the metrics' class label)

    @property
    def wants_usage_chunk(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True


# What one request may hold, refused with a 400 before any of it is counted: parsing,
# rendering and tokenizing run on the event loop every tenant's admission shares, and a 1 MiB
# body of 349,000 empty messages cost 2.6 s there; a long suffix copied into each prompt
# of a batch asked for gigabytes
MAX_MESSAGES = 10_000  # a chat's messages (a conversation that long fits no context)
MAX_PROMPTS = 2048  # a batch's prompts (completions, embeddings), as OpenAI's embeddings
MAX_SUFFIX_CHARS = 4 * 1024 * 1024  # a completion's suffix, times the prompts it joins
MAX_CHAT_TEXTS = 2 * MAX_MESSAGES  # a chat's texts: contents, content parts, tool calls
# a chat template's special-token variables: the model's own (tokenizer_config.json)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
TEMPLATE_SPECIAL_TOKENS = frozenset((*SPECIAL_TOKENS, "additional_special_tokens"))

_MAX_CACHED_PATHS = 4096
# paths longer than this are worked out each time, never kept: the cache is filled before
# the API key is checked, and Envoy lets ~60 KB paths through (4,096 of them held ~470 MB)
_MAX_CACHED_PATH_CHARS = 256
_route_paths: dict[str, str] = {}


def route_path(path: str) -> str:
    """The path as the engine routes it, to match against ROUTES: without the query string,
    percent-decoded once (vLLM's server decodes ``%2F`` before routing), slashes merged, dot
    segments resolved, no trailing slash. Cached per short path: clients send the same few."""
    raw = path.partition("?")[0]
    found = _route_paths.get(raw)
    if found is None:
        found = _normalise(raw)
        if len(raw) <= _MAX_CACHED_PATH_CHARS:
            if len(_route_paths) >= _MAX_CACHED_PATHS:
                _route_paths.clear()
            _route_paths[raw] = found
    return found


_METERED = frozenset(INFERENCE_PATHS)


def check_route(method: str, path: str) -> bool:
    """Whether ``path`` (from :func:`route_path`) is metered by its body; 404 for a path
    kvgate does not let through, 405 for a method the path does not take."""
    allowed = ROUTES.get(path)
    if allowed is None:
        raise BadRequest(f"Invalid URL ({method[:16]} {path[:200]})", status=404,
                         code="unknown_url")
    if method not in allowed:
        raise BadRequest(f"{method[:16]} is not allowed on {path}", status=405,
                         code="method_not_allowed", headers={"allow": ", ".join(sorted(allowed))})
    return path in _METERED


def _check_stream_options(options: object) -> None:
    """kvgate adds ``include_usage`` when the client did not ask for it, and strips the usage
    chunk it asked for itself: whether the client asked must not be open to reading."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    include = options.get("include_usage")
    if include is not None and include is not True and include is not False:
        raise BadRequest("'stream_options.include_usage' must be a boolean",
                         param="stream_options.include_usage")


def check_encoding(encoding: str | None) -> None:
    """A metered body must be what kvgate reads: 415 for any ``content-encoding`` but
    identity (vLLM's server does not decode request bodies, other engines might: either way
    kvgate would meter bytes other than the request the engine runs)."""
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise BadRequest(f"request bodies must not be encoded (content-encoding: "
                         f"{encoding[:40]}); send plain JSON", status=415,
                         code="unsupported_content_encoding")


def _normalise(raw: str) -> str:
    segments: list[str] = []
    for segment in unquote(raw).split("/"):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment and segment != ".":
            segments.append(segment)
    return "/" + "/".join(segments)


def prompt_field(path: str) -> str:
    """The body field that carries ``path``'s prompt (an error about its length names it)."""
    return "messages" if path == CHAT else "prompt" if path == COMPLETIONS else "input"


def parse_body(path: str, raw: bytes) -> InferenceRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    _check_nesting(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")
    _refuse_unmetered_prompts(path, body)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    field = prompt_field(path)
    media = 0
    if path == CHAT:
        texts, messages, media = _chat_texts(body.get(field))
        _check_template_kwargs(body.get("chat_template_kwargs"))
        texts.extend(_rendered_fields(body))
        if len(texts) > MAX_CHAT_TEXTS:  # parts, tool calls: one message may hold thousands
            raise BadRequest(f"'messages' holds {len(texts)} texts (contents, content parts, "
                             f"tool calls); at most {MAX_CHAT_TEXTS} are accepted",
                             param="messages")
    else:
        texts, messages = _plain_texts(body.get(field), field), 0
        suffix = body.get("suffix") if path == COMPLETIONS else None
        if isinstance(suffix, str) and suffix:  # a fill-in-the-middle model renders it
            if len(suffix) * len(texts) > MAX_SUFFIX_CHARS:  # into every prompt
                raise BadRequest(f"'suffix' ({len(suffix)} characters) is rendered into each "
                                 f"of the {len(texts)} prompts: more than {MAX_SUFFIX_CHARS} "
                                 "characters in all", param="suffix")
            texts = [text + suffix for text in texts]
    output = _max_output_tokens(path, body)
    stream = body.get("stream")
    if stream is None:  # absent, or null as the spec allows: not streamed
        stream = False
    elif stream is not True and stream is not False:
        raise BadRequest("'stream' must be a boolean", param="stream")
    elif stream:
        _check_stream_options(body.get("stream_options"))
    choices = 1 if path == EMBEDDINGS else max(_count(body, "n"), _count(body, "best_of"))
    if path == COMPLETIONS:  # a list of prompts is a batch: each gets its own answers
        choices *= len(texts)
    # positional: matching eight keyword arguments costs as much as the rest of the call
    return InferenceRequest(path, body, model, texts, messages, output, stream, choices,
                            media)


def _refuse_unmetered_prompts(path: str, body: dict[str, Any]) -> None:
    """Default-deny for what an engine would run in place of, or beside, the prompt kvgate
    counts: prompt embeddings (their length shows in no text), ``REFUSED_FIELDS`` and a
    chat template of the request's own."""
    for name, value in body.items():  # in the body's order: the same field named each time
        why = REFUSED_FIELDS.get(name)
        if why is not None and value is not None and value is not False:  # null, false: unset
            raise BadRequest(f"'{name}' {why}", code="unsupported_parameter", param=name)
    if body.get(TEMPLATE_FIELD) is not None:
        raise _own_template(TEMPLATE_FIELD)
    if path == COMPLETIONS and body.get("prompt_embeds") not in (None, []):
        raise BadRequest("this gateway cannot meter 'prompt_embeds': send the prompt as text "
                         "or token ids", code="unsupported_content", param="prompt_embeds")
    if path == EMBEDDINGS and body.get("messages") is not None:
        raise BadRequest("this gateway meters embeddings of 'input' text or token ids, not of "
                         "chat 'messages'", code="unsupported_content", param="messages")


def _own_template(param: str) -> BadRequest:
    return BadRequest("this gateway counts prompts with the model's own chat template: a "
                      "request may not bring its own", code="unsupported_parameter", param=param)


def _check_template_kwargs(kwargs: Any) -> None:
    """The model's special tokens are the model's: a client's ``eos_token`` would change the
    prompt vLLM renders (a 100 KB one, printed after each message, made a 129 KB body a
    100 MB prompt) into one kvgate cannot count, and what it cannot meter does not pass."""
    if isinstance(kwargs, dict):
        if kwargs.get(TEMPLATE_FIELD) is not None:  # the engine renders with it as well
            raise _own_template(f"chat_template_kwargs.{TEMPLATE_FIELD}")
        for key in kwargs:
            if key in TEMPLATE_SPECIAL_TOKENS:
                raise BadRequest(f"'chat_template_kwargs.{shown(str(key))}' may not be set: the "
                                 "model's special tokens are its own",
                                 param=f"chat_template_kwargs.{shown(str(key))}")


def _chat_texts(messages: Any) -> tuple[list[str], int, int]:
    """The texts of ``messages`` the engine's chat template renders, how many messages, and
    how many content parts are media (images, audio, video, files: tokens no text shows)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"'messages' holds {len(messages)} messages; at most {MAX_MESSAGES} "
                         "are accepted", param="messages")
    texts: list[str] = []
    media = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, str):  # the usual message
            texts.append(content)
        elif content is not None:  # null: tool calls
            media += _content_parts(content, f"messages[{i}].content", texts)
        texts.extend(_calls(message))
        texts.extend(_other_fields(message))
    return texts, len(messages), media


def _content_parts(content: Any, param: str, texts: list[str]) -> int:
    """Message content other than a string or null, a list of parts: their texts go to
    ``texts``; returns how many are media."""
    if not isinstance(content, list):
        raise BadRequest(f"'{param}' must be a string or an array of content parts",
                         param=param)
    media = 0
    for part in content:
        if isinstance(part, str):  # a bare string part: text, as engines take it
            texts.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type", "text"), str):
            raise BadRequest(f"'{param}' parts must be objects with a string 'type'",
                             param=param)
        if "type" not in part and not MEDIA_FIELDS.isdisjoint(part):
            media += _media_part(part, param)  # an engine reads an untyped part by its
            continue  # media field
        key = TEXT_PARTS.get(part.get("type", "text"))
        if key is None:
            media += _media_part(part, param)
        elif isinstance(text := part.get(key), str):
            texts.append(text)
        else:
            raise BadRequest(f"a '{part.get('type', 'text')}' part of '{param}' needs a string "
                             f"'{key}'", param=param)
    return media


def _media_part(part: dict[str, Any], param: str) -> int:
    """One media part, counted as the model's ``tokens_per_media_part``: refused where it
    sets how many tokens it becomes (``PART_TOKEN_FIELDS``)."""
    for value in part.values():
        if isinstance(value, dict) and any(value.get(f) is not None for f in PART_TOKEN_FIELDS):
            raise BadRequest(f"a media part of '{param}' may not set "
                             f"{' or '.join(PART_TOKEN_FIELDS)}: {_MEDIA}",
                             code="unsupported_parameter", param=param)
    return 1


_COUNTED_APART = frozenset(("role", "content", "tool_calls", "function_call"))


def _other_fields(message: dict[str, Any]) -> list[str]:
    """A message's other fields (name, reasoning, tool_call_id, a system message's own
    tools…): templates render them, and a field kvgate did not count must not carry a
    prompt. Text as it is, anything else but null as its JSON."""
    return [value if isinstance(value, str) else orjson.dumps(value).decode()
            for key, value in message.items()
            if key not in _COUNTED_APART and value is not None]


def _calls(message: dict[str, Any]) -> list[str]:
    """An assistant message's tool calls (and legacy function call): names and arguments,
    which the chat template renders into the prompt."""
    calls = message.get("tool_calls")
    functions = [c.get("function") for c in calls if isinstance(c, dict)] \
        if isinstance(calls, list) else []
    functions.append(message.get("function_call"))
    return [value for f in functions if isinstance(f, dict)
            for value in (f.get("name"), f.get("arguments")) if isinstance(value, str)]


def _check_nesting(body: dict[str, Any]) -> None:
    """Refused before admission rather than found when the body is written back. The trial
    write is orjson's own check, and cheap: 0.1 µs for a 0.6 KB chat body, 9 µs for 98 KB
    (counting the raw body's brackets first took 0.4 and 51)."""
    try:
        orjson.dumps(body)
    except TypeError:
        raise BadRequest(f"request body nests arrays and objects more than {MAX_NESTING} "
                         "levels deep", code="invalid_json") from None


def _rendered_fields(body: dict[str, Any]) -> list[str]:
    """``tools``, ``functions`` and ``documents`` as the JSON text they are (an agent's tool
    schemas are often thousands of tokens): counted like message text."""
    return [orjson.dumps(body[name]).decode() for name in RENDERED_FIELDS
            if body.get(name) is not None]


def _plain_texts(value: Any, field: str) -> list[str]:
    """``prompt`` / ``input``: a string, a list of strings, or token ids (counted as given)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if len(value) > MAX_PROMPTS and not isinstance(value[0], int):
            raise BadRequest(f"'{field}' holds {len(value)} prompts; at most {MAX_PROMPTS} are "
                             "accepted in one request", param=field)
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, int) for v in value):
            return [" " * 4 * len(value)]  # token ids: one token each at 4 chars/token
        if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
            return [" " * 4 * len(v) for v in value]
    raise BadRequest(f"'{field}' must be a string, an array of strings, or token ids", param=field)


def _max_output_tokens(path: str, body: dict[str, Any]) -> int | None:
    if path == EMBEDDINGS:
        return 0
    for name in OUTPUT_CAP_FIELDS[path]:
        value = body.get(name)
        if value is None:
            continue
        if path == COMPLETIONS and type(value) is int and value == 0 and body.get("echo") is True:
            return 1  # prompt scoring: the engine echoes the prompt and runs one step
        return _positive(value, name)
    return None


def _count(body: dict[str, Any], name: str) -> int:
    """``n`` / ``best_of``: absent or null is 1."""
    value = body.get(name)
    return 1 if value is None else _positive(value, name)


def _positive(value: Any, name: str) -> int:
    # JSON integers parse to exact ints: this is "an int, and not a bool"
    if type(value) is not int or not 1 <= value <= MAX_COUNT:
        raise BadRequest(f"'{name}' must be a positive integer (at most {MAX_COUNT})",
                         param=name)
    return value


def mutate_body(
    request: InferenceRequest,
    *,
    priority: int | None,
    inject_usage: bool,
    overrides: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> bytes:
    """The body sent upstream: kvgate's priority (never the client's); for streams whose
    client did not ask for it, the usage chunk kvgate needs to reconcile tokens (and no
    per-chunk usage, which the engine would then add for a client that asked for it without
    ``include_usage``, where it sends none); any
    degradation rewrites (``model``, ``max_tokens``); the tenant's ``cache_salt`` (None:
    the client's, if any, as sent)."""
    body = request.body
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if overrides:
        for name, value in overrides.items():
            if name == "max_tokens":
                name = next((field for field in OUTPUT_CAP_FIELDS.get(request.path, ())
                             if body.get(field) is not None), "max_tokens")
            body[name] = value
    if priority is None:
        body.pop("priority", None)
    else:
        body["priority"] = priority
    if inject_usage:
        options = body.get("stream_options")
        options = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        if options.get("continuous_usage_stats"):  # vLLM's usage in every chunk, which it
            options["continuous_usage_stats"] = False  # sends only with include_usage
        body["stream_options"] = options
    return orjson.dumps(body)


def model_list(models: Iterable[tuple[str, str]], created: int) -> bytes:
    """``GET /v1/models`` in OpenAI's list format, from ``(model, pool)`` pairs: what a
    client may ask kvgate for, whichever pool serves it (``owned_by`` names the pool)."""
    return orjson.dumps({"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": pool}
        for model, pool in models
    ]})


def error_body(error: BadRequest) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": error.message,
                "type": error.error_type,
                "param": error.param,
                "code": error.code,
            }
        }
    )


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_from(document: Any) -> Usage | None:
    """``usage`` of a response or of the final stream chunk, if it has a valid one."""
    if not isinstance(document, dict):
        return None
    return usage_of(document.get("usage"))


def usage_of(usage: Any) -> Usage | None:
    """A parsed ``usage`` object, if it is a valid one: counts that are whole numbers from
    0 to ``MAX_COUNT`` (a negative one would refund a tenant more than it was charged, a huge
    one lock it out; the request is then charged its reservation, as with no usage)."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", 0) or 0
    # JSON integers parse to exact ints: this is "an int, and not a bool"
    if type(prompt) is not int or type(completion) is not int:
        return None
    if not (0 <= prompt <= MAX_COUNT and 0 <= completion <= MAX_COUNT):
        return None
    return Usage(prompt, completion)
