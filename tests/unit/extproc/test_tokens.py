"""Prompt token counting: the chars/token estimate, exact counts from a local tokenizer.json,
and chat prompts rendered with the model's chat template as vLLM renders them."""

from __future__ import annotations

import json
import logging

import orjson
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

from extproc.chat_template import conversation
from extproc.config import ConfigError, hash_api_key, parse_config
from extproc.openai import CHAT, COMPLETIONS, EMBEDDINGS, BadRequest, parse_body
from extproc.pricing import Pricer
from extproc.tokens import CharEstimate, HFTokenizer, make_counter

WORDS = ["hello", "world", "kv", "cache", "be", "brief", "system", "user", "assistant", "tool",
         "sunny", "weather", "city", "paris", "name", "arguments", "call"]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen-style models ship it, with a BOS in front (so the BOS is counted once,
# from the template, not from the tokenizer's post-processor)
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a template that iterates over content parts (vLLM's "openai" content format)
PARTS = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% for part in message['content'] %}{% if part.type == 'text' %}{{ part.text }} "
    "{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer(path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "kv": 3, "cache": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def chat_model(folder, template=CHATML, *, config_extra=None):
    """A model folder: tokenizer.json (WordLevel, BOS post-processor, ChatML special tokens)
    and tokenizer_config.json carrying ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(SPECIALS + WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
              "unk_token": "[UNK]", **(config_extra or {})}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def request(path, **body):
    return parse_body(path, orjson.dumps({"model": "m", **body}))


def chat(*messages, **body):
    return request(CHAT, messages=list(messages), **body)


SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hello world"}
ASSISTANT = {"role": "assistant", "content": "kv cache"}


# --- the estimate and plain counts ----------------------------------------------------------

def test_char_estimate_rounds_up():
    assert CharEstimate(4).count(["abcd", "e"]) == 2
    assert CharEstimate(4).count([]) == 0


def test_char_estimate_counts_token_ids_as_given():
    """Whatever chars_per_token is: ids are tokens, not text."""
    assert CharEstimate(7.5).prompt_tokens(request(COMPLETIONS, prompt=[5, 6, 7])) == 3
    assert CharEstimate(2).prompt_tokens(request(EMBEDDINGS, input=[[5], [6, 7]])) == 3


def test_char_estimate_adds_a_per_message_allowance():
    assert CharEstimate(4).prompt_tokens(chat(USER)) == 3 + 3  # ceil(11/4) + 3


def test_local_tokenizer_counts_exactly(tmp_path):
    counter = make_counter(word_tokenizer(tmp_path / "tokenizer.json"), 4.0)
    assert isinstance(counter, HFTokenizer)
    assert counter.count(["hello world", "kv cache unknownword"]) == 5


def test_broken_tokenizer_falls_back_to_the_estimate(tmp_path, caplog):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    with caplog.at_level(logging.ERROR):
        counter = make_counter(bad, 4.0)
    assert isinstance(counter, CharEstimate)
    assert "unusable" in caplog.text


# --- chat prompts through the template --------------------------------------------------------

def test_chat_is_rendered_with_the_template_then_counted(tmp_path):
    counter = make_counter(chat_model(tmp_path), 4.0)
    # <s> <|im_start|> user hello world <|im_end|> <|im_start|> assistant
    assert counter.prompt_tokens(chat(USER)) == 8
    # the body sent upstream is untouched
    assert chat(USER).body["messages"] == [USER]


def test_system_user_assistant(tmp_path):
    counter = make_counter(chat_model(tmp_path), 4.0)
    # <s>, then per message <|im_start|> role (2 words) <|im_end|>, then the generation prompt
    assert counter.prompt_tokens(chat(SYSTEM, USER, ASSISTANT)) == 1 + 3 * 5 + 2
    # without it, and with add_special_tokens (vLLM adds the post-processor's BOS then)
    assert counter.prompt_tokens(chat(SYSTEM, USER, add_generation_prompt=False)) == 11
    assert counter.prompt_tokens(chat(SYSTEM, USER, add_special_tokens=True)) == 14


def test_content_parts_are_joined_with_newlines(tmp_path):
    counter = make_counter(chat_model(tmp_path), 4.0)
    parts = {"role": "user", "content": [
        {"type": "text", "text": "hello"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},  # no text: dropped
        {"type": "text", "text": "kv cache"},
    ]}
    assert conversation([parts], openai_content=False) == [
        {"role": "user", "content": "hello\nkv cache"}]
    # <s> <|im_start|> user hello kv cache <|im_end|> <|im_start|> assistant
    assert counter.prompt_tokens(chat(parts)) == 9


def test_templates_that_loop_over_content_get_the_parts(tmp_path):
    counter = make_counter(chat_model(tmp_path, PARTS), 4.0)
    assert counter.template is not None and counter.template.openai_content
    assert not make_counter(chat_model(tmp_path / "chatml"), 4.0).template.openai_content
    parts = {"role": "user", "content": [{"type": "text", "text": "hello"},
                                         {"type": "text", "text": "world"}]}
    # <|im_start|> user hello world <|im_end|> <|im_start|> assistant; a string content is
    # one text part
    assert counter.prompt_tokens(chat(parts)) == 7
    assert counter.prompt_tokens(chat(USER)) == 7


def test_tool_calls_reach_the_template_with_parsed_arguments(tmp_path):
    template = (
        "{% for m in messages %}{{ m.role }} {{ m.content }}"
        "{% for c in m.tool_calls or [] %} call {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}\n{{ ' ' }}{% endfor %}"  # trim_blocks: no \n
    )
    counter = make_counter(chat_model(tmp_path, template), 4.0)
    call = {"id": "1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "paris"}'}}
    tool = {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "sunny"}]}
    body = chat(USER, {"role": "assistant", "content": None, "tool_calls": [call]}, tool)
    # user hello world / assistant call weather paris / tool sunny
    assert counter.prompt_tokens(body) == 3 + 4 + 2
    assert call["function"]["arguments"] == '{"city": "paris"}'  # the request is not changed


def test_tools_special_tokens_and_tojson(tmp_path):
    template = ("{{ bos_token }}{{ eos_token }}{% if tools %}{{ tools | tojson }}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    counter = make_counter(chat_model(tmp_path, template), 4.0)
    tools = [{"type": "function", "function": {"name": "weather"}}]
    # the special tokens as variables; tojson as transformers': no HTML escaping, key order
    rendered = counter.template.render(chat(USER, tools=tools).body)
    assert rendered == '<s></s>[{"type": "function", "function": {"name": "weather"}}]hello world'


def test_continue_final_message_stops_after_its_text(tmp_path):
    counter = make_counter(chat_model(tmp_path), 4.0)
    body = chat(USER, ASSISTANT, add_generation_prompt=False, continue_final_message=True)
    # <s> <|im_start|> user hello world <|im_end|> <|im_start|> assistant kv cache
    assert counter.prompt_tokens(body) == 10


def test_named_templates_take_default(tmp_path):
    named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
             {"name": "default", "template": CHATML}]
    assert make_counter(chat_model(tmp_path, named), 4.0).prompt_tokens(chat(USER)) == 8


def test_no_template_counts_contents_plus_an_allowance(tmp_path):
    counter = make_counter(chat_model(tmp_path, None), 4.0)
    assert counter.template is None
    assert counter.prompt_tokens(chat(SYSTEM, USER)) == 4 + 2 * 3


def test_a_template_that_does_not_compile_falls_back(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        counter = make_counter(chat_model(tmp_path, "{% for m in messages %}{{ m"), 4.0)
    assert isinstance(counter, HFTokenizer) and counter.template is None
    assert "chat template" in caplog.text
    assert counter.prompt_tokens(chat(SYSTEM, USER)) == 4 + 2 * 3


def test_a_render_error_falls_back_and_is_logged_once(tmp_path, caplog):
    template = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}"
                "{% endif %}" + CHATML)
    counter = make_counter(chat_model(tmp_path, template), 4.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert counter.prompt_tokens(chat(SYSTEM, USER)) == 4 + 2 * 3
        weird = chat({"role": "user", "content": [{"type": "text", "text": "hello"}]},
                     {"role": "user"})  # no content at all: "" for the template
        assert counter.prompt_tokens(weird) == 1 + 4 + 3 + 2
    failures = [r for r in caplog.records if "failed to render" in r.message]
    assert len(failures) == 1 and "no system role" in failures[0].message


def test_model_chat_template_overrides_the_tokenizer_config(tmp_path):
    tokenizer = chat_model(tmp_path)
    override = tmp_path / "plain.jinja"
    override.write_text("{% for m in messages %}{{ m.role }} {{ m.content }}\n{% endfor %}")
    counter = make_counter(tokenizer, 4.0, override)
    assert counter.prompt_tokens(chat(SYSTEM, USER)) == 6  # system be brief user hello world
    # chat_template.jinja beside the tokenizer (newer transformers save it there) also wins
    # over tokenizer_config.json
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert make_counter(tokenizer, 4.0).prompt_tokens(chat(USER, ASSISTANT)) == 2


# --- completions and embeddings -------------------------------------------------------------

def test_completions_add_the_bos(tmp_path):
    counter = make_counter(chat_model(tmp_path), 4.0)
    assert counter.prompt_tokens(request(COMPLETIONS, prompt="hello world")) == 3
    assert counter.prompt_tokens(request(COMPLETIONS, prompt=["hello", "kv cache"])) == 5
    no_bos = request(COMPLETIONS, prompt="hello world", add_special_tokens=False)
    assert counter.prompt_tokens(no_bos) == 2
    assert counter.prompt_tokens(request(EMBEDDINGS, input="hello world")) == 3


def test_token_id_prompts_count_as_given(tmp_path):
    counter = make_counter(chat_model(tmp_path), 4.0)
    assert counter.prompt_tokens(request(COMPLETIONS, prompt=[5, 6, 7])) == 3
    assert counter.prompt_tokens(request(COMPLETIONS, prompt=[[5], [6, 7]])) == 3
    assert counter.prompt_tokens(request(EMBEDDINGS, input=[5, 6])) == 2


# --- configuration and the pricer -----------------------------------------------------------

def pricer_config(tokenizer, chat_template=None):
    model = {"name": "m", "tokenizer": str(tokenizer)}
    if chat_template is not None:
        model["chat_template"] = str(chat_template)
    return parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": [model], "endpoints": ["127.0.0.1:8000"]}],
    })


def test_pricer_reserves_the_rendered_prompt(tmp_path):
    pricer = Pricer(pricer_config(chat_model(tmp_path)))
    _, model = pricer.resolve("m")
    cost = pricer.price(model, chat(SYSTEM, USER, ASSISTANT, max_tokens=7))
    assert (cost.prompt_tokens, cost.max_output_tokens) == (18, 7)
    assert pricer.price(model, request(COMPLETIONS, prompt="hello", max_tokens=1)).prompt_tokens \
        == 2


def test_pricer_uses_the_configured_chat_template(tmp_path):
    override = tmp_path / "plain.jinja"
    override.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    pricer = Pricer(pricer_config(chat_model(tmp_path), override))
    _, model = pricer.resolve("m")
    assert model.chat_template == override
    assert pricer.price(model, chat(SYSTEM, USER, max_tokens=1)).prompt_tokens == 4


def media_pricer(**model):
    return Pricer(parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": [{"name": "m", **model}],
                   "endpoints": ["127.0.0.1:8000"]}],
    }))


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_media_parts_are_refused_unless_the_model_says_what_they_cost():
    """No text shows an image's tokens: default-deny, or the operator's figure per part."""
    looking = chat({"role": "user", "content": [{"type": "text", "text": "abcd"}, IMAGE,
                                                {"type": "input_audio"}]}, max_tokens=1)
    pricer = media_pricer()
    _, model = pricer.resolve("m")
    with pytest.raises(BadRequest) as info:
        pricer.price(model, looking)
    assert (info.value.status, info.value.code, info.value.param) == (
        400, "unsupported_content", "messages")
    assert pricer.price(model, chat(USER, max_tokens=1)).prompt_tokens == 3 + 3  # text only
    pricer = media_pricer(tokens_per_media_part=576)
    _, model = pricer.resolve("m")
    # "abcd" is one token, one message's template overhead 3, two parts 576 each
    assert pricer.price(model, looking).prompt_tokens == 1 + 3 + 2 * 576


def test_an_unknown_model_name_is_quoted_short():
    config = parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"]}],
    })
    with pytest.raises(BadRequest) as info:
        Pricer(config).resolve("x" * 100_000)  # was echoed whole in the 404's message
    assert info.value.message == (f"the model '{'x' * 200}… (100000 characters)' does not "
                                  "exist (served here: m)")
    with pytest.raises(BadRequest) as info:
        Pricer(config).resolve("gpt-9")
    assert info.value.message == "the model 'gpt-9' does not exist (served here: m)"
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_chat_template_needs_a_tokenizer():
    with pytest.raises(ConfigError) as info:
        parse_config({
            "tiers": {"t": {}},
            "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
            "pools": [{"name": "p", "models": [{"name": "m", "chat_template": "x.jinja"}],
                       "endpoints": ["127.0.0.1:8000"]}],
        })
    assert any("chat_template needs a tokenizer" in p for p in info.value.problems)


# --- hostile bodies: bounded work before admission --------------------------------------------

def test_chat_template_kwargs_cannot_replace_the_models_special_tokens(tmp_path):
    """A client's 100 KB eos_token, printed by the template after each of 1,000 messages,
    rendered 100 MB from a 129 KB body, and the tokenizer's allocation aborted kvgate. The
    request is refused (vLLM would render the prompt kvgate could not count), and the
    template never takes them from a body either."""
    for name in ("eos_token", "bos_token", "additional_special_tokens"):
        with pytest.raises(BadRequest) as error:
            chat(USER, chat_template_kwargs={name: "x" * 100_000})
        assert error.value.param == f"chat_template_kwargs.{name}"
    template = "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    counter = make_counter(chat_model(tmp_path, template), 4.0)
    body = {**chat(USER).body, "chat_template_kwargs": {"eos_token": "x" * 100_000}}
    assert counter.template.render(body) == "hello world</s>"
    assert chat(USER, chat_template_kwargs={"enable_thinking": False}).body  # others pass


def test_a_rendered_prompt_far_past_its_texts_is_counted_by_estimate(tmp_path, caplog):
    """A template that multiplies a value per message could make a small body a huge
    prompt: it is counted by estimate rather than tokenized on the event loop."""
    template = ("{% for m in messages %}{% for i in range(100000) %}{{ m.content }}"
                "{% endfor %}{% endfor %}")
    counter = make_counter(chat_model(tmp_path, template), 4.0)
    with caplog.at_level(logging.WARNING):
        assert counter.prompt_tokens(chat(USER)) == 2 + 3  # its texts, plus the allowance
    assert "far longer than the request's texts allow" in caplog.text


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": [{"role": "user", "content": ""}] * 10_001}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 20_001}]},
     "messages"),
    (COMPLETIONS, {"prompt": ["a"] * 2049}, "prompt"),
    (EMBEDDINGS, {"input": [[1, 2]] * 2049}, "input"),
    (COMPLETIONS, {"prompt": ["a"] * 9, "suffix": "s" * 500_000}, "suffix"),
])
def test_bodies_that_would_cost_seconds_to_count_are_refused(path, body, param):
    """Parsed, rendered and tokenized on the loop every tenant's admission shares: 349,000
    empty messages cost 2.6 s there, and a long suffix copied into each prompt of a batch
    asked for gigabytes."""
    with pytest.raises(BadRequest) as error:
        request(path, **body)
    assert error.value.param == param and error.value.status == 400
    if param != "messages" or len(body["messages"]) > 1:  # within the limits: accepted
        request(path, **{k: v[:2048] if isinstance(v, list) and k != "messages" else
                         (v[:10_000] if k == "messages" else v) for k, v in body.items()
                         if k != "suffix"})
