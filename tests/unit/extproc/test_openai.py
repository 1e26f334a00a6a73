"""Parsing and editing OpenAI request bodies: what admission reads, and which 400 a bad one gets."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.openai import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MAX_NESTING,
    BadRequest,
    Usage,
    mutate_body,
    parse_body,
    route_path,
    usage_from,
)
from extproc.tokens import CharEstimate


def parse(body, path=CHAT):
    return parse_body(path, orjson.dumps(body))


def error(body, path=CHAT) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        parse(body, path) if not isinstance(body, bytes) else parse_body(path, body)
    return caught.value


def test_chat_fields():
    request = parse({"model": "m", "max_tokens": 7, "stream": True, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"},
                                     "bare", {"type": "input_audio"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]})
    assert (request.path, request.model, request.stream) == (CHAT, "m", True)
    assert request.prompt_texts == ["be brief", "hi", "bare"]
    assert (request.message_count, request.media_parts) == (3, 2)
    assert request.max_output_tokens == 7


def test_content_parts_count_as_vllm_reads_them():
    """vLLM renders thinking (and input_text, output_text) parts as text, and takes a part
    without a type by its media field, dropping any text beside it: counted the other way
    round, 40,000 characters of thinking were reserved as one media part, and an image
    passed a text-only model as the word beside it."""
    request = parse({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "step by step"},
        {"type": "input_text", "text": "in"}, {"type": "output_text", "text": "out"},
        {"text": "hi", "image_url": "http://example.com/a.png"},
        {"input_audio": {"data": "", "format": "wav"}},
        {"text": "plain"},
    ]}]})
    assert request.prompt_texts == ["step by step", "in", "out", "plain"]
    assert request.media_parts == 2


def test_what_chat_templates_render_besides_content_is_counted():
    """Tool schemas, tool calls and documents become prompt tokens too: an agent's tools
    are often thousands of them."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    request = parse({"model": "m", "tools": tools, "documents": [{"text": "doc"}],
                     "messages": [
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function",
             "function": {"name": "search", "arguments": '{"q": "kv"}'}}, "junk"]},
        {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "tool", "tool_call_id": "1", "content": "found"},
        {"role": "assistant", "content": "ok", "name": "bot", "reasoning": "think " * 3},
    ], "chat_template_kwargs": {"enable_thinking": True}})
    assert request.prompt_texts == [
        "find it", "search", '{"q": "kv"}', "", "f", "{}", "found", "1",
        "ok", "bot", "think think think ",
        orjson.dumps(tools).decode(), '[{"text":"doc"}]', '{"enable_thinking":true}']
    assert request.media_parts == 0


def test_a_message_field_that_is_not_text_counts_as_its_json():
    """SGLang renders a system or developer message's own ``tools`` (vLLM a developer's):
    a list, which the count of a message's text fields skipped, so 100 KB of tool schemas
    on one message were reserved as nothing."""
    tools = [{"type": "function", "function": {"name": "f" * 50, "parameters": {}}}]
    request = parse({"model": "m", "messages": [
        {"role": "system", "content": "be brief", "tools": tools, "cache": None},
        {"role": "user", "content": "hi"}]})
    assert request.prompt_texts == ["be brief", orjson.dumps(tools).decode(), "hi"]


def test_completions_and_embeddings_prompts():
    assert parse({"model": "m", "prompt": "abc"}, COMPLETIONS).prompt_texts == ["abc"]
    assert parse({"model": "m", "prompt": ["a", "b"]}, COMPLETIONS).prompt_texts == ["a", "b"]
    assert parse({"model": "m", "prompt": [1, 2]}, COMPLETIONS).prompt_texts == [" " * 8]
    assert parse({"model": "m", "prompt": [[1], [2, 3]]}, COMPLETIONS).prompt_texts == [
        " " * 4, " " * 8]
    embedding = parse({"model": "m", "input": "x", "max_tokens": -1}, EMBEDDINGS)
    assert (embedding.prompt_texts, embedding.max_output_tokens, embedding.message_count) == (
        ["x"], 0, 0)


def test_output_cap_prefers_max_completion_tokens():
    assert parse({"model": "m", "messages": [{"content": "x"}]}).max_output_tokens is None
    assert parse({"model": "m", "messages": [{"content": "x"}], "max_tokens": None,
                  "max_completion_tokens": 3}).max_output_tokens == 3
    assert parse({"model": "m", "messages": [{"content": "x"}], "max_tokens": 9,
                  "max_completion_tokens": None}).max_output_tokens == 9


def test_completions_are_capped_by_max_tokens_alone():
    """The completions API has no max_completion_tokens: an engine ignores it there, so a
    request must not be reserved by it while the engine runs to max_tokens."""
    body = {"model": "m", "prompt": "x", "max_completion_tokens": 1}
    assert parse({**body, "max_tokens": 500}, COMPLETIONS).max_output_tokens == 500
    assert parse(body, COMPLETIONS).max_output_tokens is None
    capped = parse({**body, "max_tokens": 500}, COMPLETIONS)
    sent = orjson.loads(mutate_body(capped, priority=None, inject_usage=False,
                                    overrides={"max_tokens": 20}))
    assert (sent["max_tokens"], sent["max_completion_tokens"]) == (20, 1)
    chat = parse({"model": "m", "messages": [{"content": "x"}], "max_tokens": 500,
                  "max_completion_tokens": None})
    sent = orjson.loads(mutate_body(chat, priority=None, inject_usage=False,
                                    overrides={"max_tokens": 20}))
    assert (sent["max_tokens"], sent["max_completion_tokens"]) == (20, None)


@pytest.mark.parametrize(("path", "field", "value", "code"), [
    (CHAT, "kv_transfer_params", {"prompt_token_ids": [1] * 500}, "unsupported_parameter"),
    (COMPLETIONS, "kv_transfer_params", {"do_remote_prefill": True}, "unsupported_parameter"),
    (CHAT, "ec_transfer_params", {}, "unsupported_parameter"),
    (CHAT, "session_params", {"id": "s", "offset": 0}, "unsupported_parameter"),
    (COMPLETIONS, "bootstrap_host", "10.0.0.9", "unsupported_parameter"),
    (CHAT, "disaggregated_params", {"request_type": "generation_only"}, "unsupported_parameter"),
    # vLLM (--trust-request-chat-template) and trtllm-serve render with a request's template
    (CHAT, "chat_template", "{% for i in range(99999) %}{{ messages[0].content }}{% endfor %}",
     "unsupported_parameter"),
    # SGLang: prompt token ids that bypass the chat template
    (CHAT, "input_ids", [1] * 500, "unsupported_parameter"),
    # how many tokens a media part becomes: vLLM's HF processor and media loader options,
    # SGLang's patch counts and a video's audio track
    (CHAT, "mm_processor_kwargs", {"max_pixels": 12845056}, "unsupported_parameter"),
    (COMPLETIONS, "mm_processor_kwargs", {"num_crops": 16}, "unsupported_parameter"),
    (EMBEDDINGS, "mm_processor_kwargs", {}, "unsupported_parameter"),
    (CHAT, "media_io_kwargs", {"video": {"num_frames": 1000}}, "unsupported_parameter"),
    (CHAT, "images_config", {"max_pixels": 12845056}, "unsupported_parameter"),
    (CHAT, "max_dynamic_patch", 40, "unsupported_parameter"),
    (CHAT, "min_dynamic_patch", 40, "unsupported_parameter"),
    (CHAT, "use_audio_in_video", True, "unsupported_parameter"),
    # the engine's request id: another tenant's would name its request
    (CHAT, "request_id", "chatcmpl-someone-elses", "unsupported_parameter"),
    (COMPLETIONS, "request_id", "x", "unsupported_parameter"),
    (EMBEDDINGS, "request_id", "x", "unsupported_parameter"),
    (CHAT, "rid", "someone-elses", "unsupported_parameter"),
    (COMPLETIONS, "rid", ["a", "b"], "unsupported_parameter"),
    # work kvgate's one-request reservation does not describe
    (CHAT, "use_beam_search", True, "unsupported_parameter"),
    (COMPLETIONS, "use_beam_search", True, "unsupported_parameter"),
    (CHAT, "vllm_xargs", {"my_processor_arg": 1}, "unsupported_parameter"),
    (CHAT, "custom_logit_processor", "{}", "unsupported_parameter"),
    (COMPLETIONS, "return_hidden_states", True, "unsupported_parameter"),
    (CHAT, "return_hidden_states", "last", "unsupported_parameter"),
    # SGLang's adapter by path, whatever `model` names
    (CHAT, "lora_path", "/adapters/other-tenants", "unsupported_parameter"),
    (COMPLETIONS, "lora_path", ["sql"], "unsupported_parameter"),
    # SGLang's data-parallel placement: kvgate places requests
    (CHAT, "routed_dp_rank", 0, "unsupported_parameter"),
    (CHAT, "data_parallel_rank", 1, "unsupported_parameter"),
    (COMPLETIONS, "disagg_prefill_dp_rank", 1, "unsupported_parameter"),
    (COMPLETIONS, "prompt_embeds", "AAAA", "unsupported_content"),
    (COMPLETIONS, "prompt_embeds", ["AAAA"], "unsupported_content"),
    (EMBEDDINGS, "messages", [{"role": "user", "content": "x" * 9999}], "unsupported_content"),
])
def test_what_an_engine_would_run_instead_of_the_counted_prompt_is_refused(
        path, field, value, code):
    """vLLM prefills kv_transfer_params.prompt_token_ids in place of the messages, and
    prompt_embeds beside the prompt: neither shows in the text kvgate counts."""
    body = {"model": "m", "messages": [{"content": "hi"}], "prompt": "hi", "input": "hi",
            "max_tokens": 1}
    if path == EMBEDDINGS:
        del body["messages"]
    refused = error({**body, field: value}, path)
    assert (refused.status, refused.code, refused.param) == (400, code, field)
    assert parse({**body, field: None}, path).prompt_texts == ["hi"]


@pytest.mark.parametrize("field", ["use_beam_search", "return_hidden_states",
                                   "use_audio_in_video"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_refused_switch_left_off_passes(path, field):
    """``false`` is the engine's default: a client that spells it out asks for nothing."""
    body = {"model": "m", "messages": [{"content": "hi"}], "prompt": "hi", "max_tokens": 1}
    assert parse({**body, field: False}, path).prompt_texts == ["hi"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                        "max_dynamic_patch": 40}},
    {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4",
                                        "min_dynamic_patch": 12}},
    {"image_url": {"url": "data:image/png;base64,AAAA", "max_dynamic_patch": 40}},
])
def test_a_media_part_setting_its_own_token_count_is_refused(part):
    """SGLang reads patch counts from a media part as from the body: they decide how many
    tokens the image or video becomes, past the model's ``tokens_per_media_part``."""
    body = {"model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}]}
    refused = error(body)
    assert (refused.status, refused.code, refused.param) == (
        400, "unsupported_parameter", "messages[0].content")
    media = next(key for key in part if key != "type")
    plain = {**part, media: {"url": part[media]["url"]}}
    assert parse({**body, "messages": [{"role": "user", "content": [plain]}]}).media_parts == 1


def test_a_template_in_chat_template_kwargs_is_refused():
    """The engine renders with ``chat_template_kwargs.chat_template`` as with the body's own:
    a template of the client's makes a prompt kvgate never counted."""
    body = {"model": "m", "messages": [{"content": "hi"}], "max_tokens": 1}
    loop = "{% for i in range(99999) %}{{ messages[0].content }}{% endfor %}"
    refused = error({**body, "chat_template_kwargs": {"chat_template": loop}})
    assert (refused.status, refused.code, refused.param) == (
        400, "unsupported_parameter", "chat_template_kwargs.chat_template")
    assert parse({**body, "chat_template_kwargs": {"chat_template": None}}).prompt_texts


def test_a_completion_suffix_counts_in_every_prompt():
    """A fill-in-the-middle model renders the suffix into each prompt of the batch."""
    body = {"model": "m", "prompt": ["ab", "c"], "suffix": "xyz", "max_tokens": 1}
    assert parse(body, COMPLETIONS).prompt_texts == ["abxyz", "cxyz"]
    assert parse({**body, "suffix": None}, COMPLETIONS).prompt_texts == ["ab", "c"]
    assert body["prompt"] == ["ab", "c"]


def test_completions_prompt_scoring_runs_one_step():
    """echo with max_tokens 0 scores the prompt: the engine runs one step for it."""
    body = {"model": "m", "prompt": "x", "max_tokens": 0}
    assert parse({**body, "echo": True}, COMPLETIONS).max_output_tokens == 1
    for refused in (body, {**body, "messages": [{"content": "x"}], "echo": True}):
        with pytest.raises(BadRequest):
            parse(refused, CHAT if "messages" in refused else COMPLETIONS)
    with pytest.raises(BadRequest):
        parse({**body, "echo": True, "max_tokens": False}, COMPLETIONS)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"{nope", "invalid_json", None),
        (b"[1]", "invalid_json", None),
        ({"messages": []}, "invalid_request_error", "model"),
        ({"model": "", "messages": []}, "invalid_request_error", "model"),
        ({"model": "m", "messages": []}, "invalid_request_error", "messages"),
        ({"model": "m", "messages": "hi"}, "invalid_request_error", "messages"),
        ({"model": "m", "messages": [{"content": "a"}, 3]}, "invalid_request_error",
         "messages[1]"),
        ({"model": "m", "messages": [{"content": "a"}, {"content": 5}]},
         "invalid_request_error", "messages[1].content"),
        ({"model": "m", "messages": [{"content": [{"type": "text", "text": None}]}]},
         "invalid_request_error", "messages[0].content"),
        ({"model": "m", "messages": [{"content": [{"text": 5}]}]},
         "invalid_request_error", "messages[0].content"),
        ({"model": "m", "messages": [{"content": [7]}]},
         "invalid_request_error", "messages[0].content"),
        ({"model": "m", "messages": [{"content": [{"type": []}]}]},  # found by hypothesis
         "invalid_request_error", "messages[0].content"),
        ({"model": "m", "messages": [{"content": "a"}], "max_tokens": 0},
         "invalid_request_error", "max_tokens"),
        ({"model": "m", "messages": [{"content": "a"}], "max_tokens": True},
         "invalid_request_error", "max_tokens"),
        ({"model": "m", "messages": [{"content": "a"}], "max_tokens": 2.0},
         "invalid_request_error", "max_tokens"),
        ({"model": "m", "messages": [{"content": "a"}], "max_completion_tokens": "2"},
         "invalid_request_error", "max_completion_tokens"),
        ({"model": "m", "messages": [{"content": "a"}], "stream": 1},
         "invalid_request_error", "stream"),
        ({"model": "m", "messages": [{"content": "a"}], "stream": True, "stream_options": "x"},
         "invalid_request_error", "stream_options"),
        ({"model": "m", "messages": [{"content": "a"}], "stream": True,
          "stream_options": {"include_usage": "yes"}},  # vLLM would read it as true
         "invalid_request_error", "stream_options.include_usage"),
        ({"model": "m", "messages": [{"content": "a"}], "n": 0}, "invalid_request_error", "n"),
        ({"model": "m", "messages": [{"content": "a"}], "n": -3}, "invalid_request_error", "n"),
        ({"model": "m", "messages": [{"content": "a"}], "n": 1.5},
         "invalid_request_error", "n"),
        ({"model": "m", "messages": [{"content": "a"}], "n": True},
         "invalid_request_error", "n"),
        ({"model": "m", "messages": [{"content": "a"}], "best_of": "2"},
         "invalid_request_error", "best_of"),
        ({"model": "m", "messages": [{"content": "a"}], "max_tokens": 2**31},
         "invalid_request_error", "max_tokens"),
        ({"model": "m", "messages": [{"content": "a"}], "cache_salt": ""},
         "invalid_request_error", "cache_salt"),
        ({"model": "m", "messages": [{"content": "a"}], "cache_salt": ["x"]},
         "invalid_request_error", "cache_salt"),
        # several problems: the prompt is checked before the cap, the cap before stream
        ({"model": "m", "messages": [3], "max_tokens": 0, "stream": 1},
         "invalid_request_error", "messages[0]"),
        ({"model": "m", "messages": [{"content": "a"}], "max_tokens": 0, "stream": 1},
         "invalid_request_error", "max_tokens"),
    ],
)
def test_bad_bodies(body, code, param):
    caught = error(body)
    assert (caught.code, caught.param, caught.status) == (code, param, 400)


def test_mutate_body_sets_priority_usage_and_overrides():
    request = parse({"model": "m", "messages": [{"content": "x"}], "priority": -5,
                     "max_completion_tokens": 50, "stream": True,
                     "stream_options": {"other": 1}})
    assert not request.wants_usage_chunk
    sent = orjson.loads(mutate_body(request, priority=2, inject_usage=True,
                                    overrides={"max_tokens": 10, "model": "small"}))
    assert sent["priority"] == 2 and sent["model"] == "small"
    assert sent["max_completion_tokens"] == 10 and "max_tokens" not in sent
    assert sent["stream_options"] == {"other": 1, "include_usage": True}
    again = orjson.loads(mutate_body(request, priority=None, inject_usage=False))
    assert "priority" not in again and "cache_salt" not in again


def test_the_usage_kvgate_asks_for_turns_no_per_chunk_usage_on():
    """vLLM sends usage in every chunk only with include_usage: asking for the final usage
    chunk on the client's behalf must not start it for a client that set
    continuous_usage_stats alone."""
    request = parse({"model": "m", "messages": [{"content": "x"}], "stream": True,
                     "stream_options": {"continuous_usage_stats": True}})
    assert not request.wants_usage_chunk
    sent = orjson.loads(mutate_body(request, priority=None, inject_usage=True))
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_mutate_body_sets_the_tenants_cache_salt_over_the_clients():
    request = parse({"model": "m", "messages": [{"content": "x"}], "cache_salt": "mine"})
    sent = orjson.loads(mutate_body(request, priority=None, inject_usage=False,
                                    cache_salt="kvgate-abc"))
    assert sent["cache_salt"] == "kvgate-abc"
    request = parse({"model": "m", "messages": [{"content": "x"}], "cache_salt": "mine"})
    unsalted = orjson.loads(mutate_body(request, priority=None, inject_usage=False))
    assert unsalted["cache_salt"] == "mine"  # a pool that shares its cache: as sent


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="/.%2fFv1chat?a", max_size=30) | st.text(max_size=30))
def test_a_routed_path_is_always_in_normal_form(raw):
    path = route_path(raw)
    segments = path.split("/")
    assert segments[0] == "" and path.startswith("/")
    assert all(s not in ("", ".", "..") for s in segments[1:]) or path == "/"
    assert route_path(raw + "?q=1") == path


def test_null_is_the_default_where_the_spec_allows_it():
    request = parse({"model": "m", "messages": [{"content": "a"}], "stream": None, "n": None,
                     "best_of": None, "max_tokens": None, "stream_options": None})
    assert (request.stream, request.choices, request.max_output_tokens) == (False, 1, None)
    streamed = parse({"model": "m", "messages": [{"content": "a"}], "stream": True,
                      "stream_options": {"include_usage": None}})
    assert streamed.stream and not streamed.wants_usage_chunk


def test_a_batch_of_completion_prompts_gets_answers_for_each():
    """``prompt`` as a list is a batch: the engine answers every prompt ``n`` times."""
    body = {"model": "m", "max_tokens": 10, "n": 2}
    assert parse({**body, "prompt": ["a", "b", "c"]}, COMPLETIONS).choices == 6
    assert parse({**body, "prompt": [[1, 2], [3]]}, COMPLETIONS).choices == 4
    assert parse({**body, "prompt": [1, 2, 3]}, COMPLETIONS).choices == 2  # one prompt's ids
    assert parse({**body, "prompt": "abc"}, COMPLETIONS).choices == 2
    assert parse({**body, "input": ["a", "b"]}, EMBEDDINGS).choices == 1


def test_n_and_best_of_multiply_the_output_reservation():
    body = {"model": "m", "messages": [{"content": "a"}], "max_tokens": 10}
    assert parse({**body, "n": 3}).choices == 3
    assert parse({**body, "n": 2, "best_of": 4}).choices == 4
    assert parse({"model": "m", "prompt": "a", "best_of": 5}, COMPLETIONS).choices == 5
    assert parse({"model": "m", "input": "a", "n": 7}, EMBEDDINGS).choices == 1


def test_route_path():
    assert route_path("/v1/chat/completions") == CHAT
    assert route_path("/v1/chat/completions/?x=1") == CHAT
    assert route_path("") == "/" and route_path("/?a") == "/"


@pytest.mark.parametrize("raw", [
    "/v1/chat%2Fcompletions", "/v1/chat%2fcompletions", "/v1//chat/completions",
    "//v1/chat/completions/", "/v1/./chat/completions", "/v1/x/../chat/completions",
    "/%76%31/chat/completions?stream=1", "/v1/chat/completions%3Fx",
])
def test_route_path_decodes_and_normalises_as_the_engine_would(raw):
    """vLLM's server percent-decodes the path once before routing: kvgate matches the same
    path (slashes merged and dot segments resolved too), whatever Envoy did or did not do."""
    expected = CHAT if "%3F" not in raw else CHAT + "?x"
    assert route_path(raw) == expected


def test_usage_from():
    assert usage_from({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == Usage(3, 4)
    assert usage_from({"usage": {"prompt_tokens": 3, "completion_tokens": None}}) == Usage(3, 0)
    assert usage_from({"usage": {"prompt_tokens": "3"}}) is None
    assert usage_from({"usage": []}) is None
    assert usage_from([]) is None


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": -5, "completion_tokens": 4}, {"prompt_tokens": 3, "completion_tokens": -1},
    {"prompt_tokens": True, "completion_tokens": 4}, {"prompt_tokens": 3.0},
    {"prompt_tokens": 3, "completion_tokens": 2**31}, {"prompt_tokens": 10**30},
])
def test_usage_an_engine_could_not_have_produced_is_no_usage(usage):
    """Charged its reservation instead: a negative count would refund the tenant more than
    it was charged, a huge one lock it out."""
    assert usage_from({"usage": usage}) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "name", "arguments", "function",
                         "tool_calls", "include_usage", "image_url", "prompt_token_ids"]),
        inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "messages", "prompt", "input", "suffix", "tools", "functions", "documents",
          "chat_template_kwargs", "n", "best_of", "max_tokens", "max_completion_tokens",
          "min_tokens", "echo", "stream", "stream_options", "priority", "prompt_embeds",
          "kv_transfer_params", "session_params", "cache_salt"]


BASES = {CHAT: {"messages": [{"role": "user", "content": "hi"}]}, COMPLETIONS: {"prompt": "hi"},
         EMBEDDINGS: {"input": "hi"}}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"])},
                                optional={"content": JSON, "name": JSON, "tool_calls": JSON,
                                          "reasoning": JSON})


@settings(max_examples=500, deadline=None)
@given(path=st.sampled_from([CHAT, COMPLETIONS, EMBEDDINGS]),
       extra=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3),
       messages=st.none() | st.lists(MESSAGE, min_size=1, max_size=3))
def test_any_json_body_parses_or_is_a_clear_400(path, extra, messages):
    """A valid body with any fields set to any JSON: a request kvgate can price and rewrite,
    or a BadRequest (never another exception)."""
    body = {"model": "m", **BASES[path], **extra}
    if messages is not None and path == CHAT:
        body["messages"] = messages
    try:
        request = parse(body, path)
    except BadRequest as refused:
        assert refused.status == 400 and refused.message
        return
    assert request.choices >= 1 and all(isinstance(t, str) for t in request.prompt_texts)
    assert request.max_output_tokens is None or request.max_output_tokens >= 0
    assert CharEstimate(4).prompt_tokens(request) >= 0
    orjson.loads(mutate_body(request, priority=3, inject_usage=request.stream,
                             overrides={"max_tokens": 5}))


def _nested(levels: int) -> bytes:
    """``levels`` of arrays (JSON text: orjson cannot write what kvgate must refuse)."""
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize(("path", "template", "depth"), [
    (CHAT, b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":%s}', 1),
    (CHAT, b'{"model":"m","messages":[{"role":"user","content":"x","meta":%s}]}', 3),
    (CHAT, b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":%s}', 1),
    (COMPLETIONS, b'{"model":"m","prompt":"x","x":%s}', 1),
    (EMBEDDINGS, b'{"model":"m","input":"x","x":%s}', 1),
])
def test_a_body_nested_deeper_than_kvgate_can_write_back_is_a_clear_400(path, template, depth):
    """orjson reads 1024 levels but writes 254: a body between the two was admitted and then
    failed as kvgate wrote it back (a 503 after the tenant's limits were charged).
    ``depth``: the levels around the insertion point."""
    deepest_ok = MAX_NESTING - depth
    request = parse_body(path, template % _nested(deepest_ok))
    orjson.loads(mutate_body(request, priority=3, inject_usage=True, cache_salt="s"))
    for levels in (deepest_ok + 1, 600, 1024 - depth):
        with pytest.raises(BadRequest) as refused:
            parse_body(path, template % _nested(levels))
        assert refused.value.status == 400 and refused.value.code == "invalid_json"
        assert str(MAX_NESTING) in refused.value.message


def test_many_brackets_that_do_not_nest_deep_are_not_refused():
    """Only the depth is refused: a long conversation has hundreds of brackets."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * 200
    request = parse({"model": "m", "messages": messages})
    assert len(request.body["messages"]) == 200


def test_long_paths_are_never_cached():
    """The cache is filled before the API key is checked: ~60 KB paths from unauthenticated
    clients held ~470 MB."""
    from extproc import openai

    openai._route_paths.clear()
    for i in range(50):
        assert route_path(f"/x{i}" + "a" * 60_000).startswith(f"/x{i}")
    assert route_path("/v1/chat/completions") == "/v1/chat/completions"
    assert list(openai._route_paths) == ["/v1/chat/completions"]
