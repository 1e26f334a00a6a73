"""A model's chat template, rendered as vLLM renders it, so chat prompts count exactly.

vLLM (``safe_apply_chat_template`` → transformers' ``apply_chat_template``) turns the
request's messages into one prompt string with the model's Jinja chat template and
tokenizes that string without adding special tokens. To reserve what vLLM will report as
``usage.prompt_tokens`` kvgate does the same here: the messages are normalised the way
vLLM's ``parse_chat_messages`` does (text parts joined with newlines unless the template
loops over ``message['content']``, tool-call arguments parsed from JSON, …), then rendered
in a sandboxed Jinja environment configured like transformers' (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a non-escaping ``tojson``, ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag) with the special tokens as variables.

The template is read and compiled once, at start-up. Rendering may raise (a template's
own ``raise_exception``, messages a template does not expect): the caller falls back to
an estimate; it never fails a request.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from extproc.openai import SPECIAL_TOKENS, TEMPLATE_SPECIAL_TOKENS

log = logging.getLogger(__name__)

_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
# set by the request itself or the model, never through chat_template_kwargs: a client's
# 100 KB eos_token, printed after each of 1,000 messages, rendered 100 MB from a 129 KB body
# and the tokenizer's allocation aborted the process
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                       "continue_final_message", "chat_template", "tokenize",
                       *TEMPLATE_SPECIAL_TOKENS})


class ChatTemplate:
    """A compiled chat template plus the special-token variables it renders with."""

    def __init__(self, source: str, special_tokens: dict[str, Any], origin: str = "<string>"):
        self.source = source
        self.origin = origin
        self.special_tokens = special_tokens
        self._template = _environment().from_string(source)  # raises on a syntax error
        self.openai_content = _loops_over_content(self._template.environment, source)

    def render(self, body: dict[str, Any]) -> str:
        """The prompt vLLM builds for this chat-completions body."""
        messages = conversation(body["messages"], openai_content=self.openai_content)
        extra = body.get("chat_template_kwargs")
        variables: dict[str, Any] = dict(self.special_tokens)
        if isinstance(extra, dict):
            variables.update((k, v) for k, v in extra.items() if k not in _RESERVED)
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False) is True
        rendered = self._template.render(
            messages=messages,
            # vLLM passes them even with tool_choice "none" (unless started with
            # --exclude-tools-when-tool-choice-none)
            tools=body.get("tools"),
            documents=body.get("documents"),
            add_generation_prompt=add_generation_prompt is not False,
            **variables,
        )
        if continue_final and messages:
            rendered = _cut_after_final_message(rendered, messages[-1].get("content"))
        return rendered


def load(tokenizer: Path, override: Path | None = None) -> ChatTemplate | None:
    """The chat template for the model whose ``tokenizer.json`` is ``tokenizer``: the
    ``override`` file when given, else (as transformers loads it) ``chat_template.jinja``
    or ``tokenizer_config.json``'s ``chat_template`` beside it; None when there is none.
    Raises when a file named or found is unreadable or the template does not compile."""
    folder = tokenizer.parent
    config = _read_json(folder / "tokenizer_config.json")
    specials = _special_tokens(config, _read_json(folder / "special_tokens_map.json"))
    if override is not None:
        return ChatTemplate(override.read_text(), specials, str(override))
    beside = folder / "chat_template.jinja"
    if beside.is_file():
        return ChatTemplate(beside.read_text(), specials, str(beside))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, specials, str(folder / "tokenizer_config.json"))


def conversation(messages: list[Any], *, openai_content: bool) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template (the request body is not changed)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        texts = _texts(message.get("content"))
        content: Any = ([{"type": "text", "text": t} for t in texts] if openai_content
                        else "\n".join(texts))
        if role == "tool" and openai_content:
            content = "\n".join(texts)  # vLLM flattens tool results whatever the format
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                item["tool_calls"] = [_tool_call(c) for c in calls]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                item["reasoning"] = item["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                item[key] = message[key]
        if role == "developer":
            item["tools"] = message.get("tools")
        out.append(item)
    return out


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            kind = part.get("type")
            key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
            if key is not None and isinstance(part.get(key), str):
                texts.append(part[key])
    return texts


def _tool_call(call: Any) -> Any:
    """A copy with ``function.arguments`` parsed from its JSON string, as vLLM does."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            function["arguments"] = {}
    elif not isinstance(arguments, dict | list):
        function["arguments"] = {}
    return {**call, "function": function}


def _cut_after_final_message(rendered: str, content: Any) -> str:
    """``continue_final_message``: the prompt ends where the last message's text ends."""
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, dict) and "text" in p]
        content = texts[-1] if texts else None
    if not isinstance(content, str):
        raise ValueError("continue_final_message needs a final message with text")
    final = content.strip()
    if final not in rendered:
        raise ValueError("the final message is not in the rendered prompt")
    return rendered[: rendered.rindex(final) + len(final)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _special_tokens(config: dict[str, Any], special_map: dict[str, Any]) -> dict[str, Any]:
    """bos_token, eos_token, …: strings, or AddedToken dicts ({"content": ...})."""
    out: dict[str, Any] = {}
    for source in (config, special_map):  # special_tokens_map.json wins, as in transformers
        for name in SPECIAL_TOKENS:
            value = source.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[name] = value
        extra = source.get("additional_special_tokens")
        if isinstance(extra, list):
            out["additional_special_tokens"] = [
                t.get("content") if isinstance(t, dict) else t for t in extra
            ]
    return out


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}`` (assistant masks): renders its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # transformers' tojson: no HTML escaping, keys in order, unlike jinja's own
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _loops_over_content(env: Any, source: str) -> bool:
    """Whether the template iterates over a message's ``content`` (vLLM's "openai" content
    format: parts stay a list of ``{"type": "text", ...}``) rather than printing it as a
    string. Like vLLM: a ``for`` over ``<m>['content']`` / ``<m>.content`` where ``<m>`` is
    the target of a ``for`` over ``messages`` (or a variable assigned from it)."""
    from jinja2 import nodes

    def name_of(node: Any) -> str | None:
        while isinstance(node, nodes.Filter | nodes.Test) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            node = node.node
        return node.name if isinstance(node, nodes.Name) else None

    def content_of(node: Any) -> str | None:
        while isinstance(node, nodes.Filter | nodes.Test):
            node = node.node
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) \
                and node.arg.value == "content":
            return name_of(node.node)
        if isinstance(node, nodes.Getattr) and node.attr == "content":
            return name_of(node.node)
        return None

    try:
        tree = env.parse(source)
        lists = {"messages"}
        changed = True
        while changed:  # variables assigned from messages (or from those)
            changed = False
            for assign in tree.find_all(nodes.Assign):
                if isinstance(assign.target, nodes.Name) and name_of(assign.node) in lists \
                        and assign.target.name not in lists:
                    lists.add(assign.target.name)
                    changed = True
        loops = list(tree.find_all(nodes.For))
        items = {loop.target.name for loop in loops
                 if isinstance(loop.target, nodes.Name) and name_of(loop.iter) in lists}
        return any(content_of(loop.iter) in items for loop in loops)
    except Exception:  # vLLM's default when the template cannot be analysed
        return False
