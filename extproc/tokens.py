"""Prompt token counts before the engine sees the request.

The estimate decides admission, so it must be cheap (microseconds) and never fail: chars
per token by default, exact with a local HF ``tokenizer.json`` when a model names one (chat
prompts rendered with the model's chat template first, see ``extproc.chat_template``).
Reservations are reconciled with the engine's real ``usage`` afterwards, so an estimate
that is a little off only shifts tokens between this request and the next.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Protocol

from extproc.chat_template import ChatTemplate
from extproc.chat_template import load as load_chat_template
from extproc.openai import CHAT, COMPLETIONS, PER_MESSAGE_OVERHEAD_TOKENS, InferenceRequest

log = logging.getLogger(__name__)


class TokenCounter(Protocol):
    def count(self, texts: list[str]) -> int: ...

    def prompt_tokens(self, request: InferenceRequest) -> int: ...

    def work_chars(self, request: InferenceRequest) -> int:
        """About how many characters counting ``request`` renders and encodes (0: counting
        it is cheap whatever its size)."""
        ...


def _estimated_chat_overhead(request: InferenceRequest) -> int:
    """Without a chat template: the template's tokens around each message, guessed."""
    return PER_MESSAGE_OVERHEAD_TOKENS * request.message_count


class CharEstimate:
    def __init__(self, chars_per_token: float):
        self.chars_per_token = chars_per_token

    def count(self, texts: list[str]) -> int:
        return math.ceil(sum(map(len, texts)) / self.chars_per_token)

    def prompt_tokens(self, request: InferenceRequest) -> int:
        ids = _given_token_ids(request)
        if ids is not None:
            return ids
        return self.count(request.prompt_texts) + _estimated_chat_overhead(request)

    def work_chars(self, request: InferenceRequest) -> int:
        return 0


class HFTokenizer:
    """Exact counts from a local ``tokenizer.json`` (no hub download, ever).

    Chat prompts are counted as vLLM builds them when the model has a chat template (its
    own ``chat_template`` file, or the one beside the tokenizer): rendered, then encoded
    without special tokens; plain prompts (completions, embeddings) are encoded with them
    (the BOS a Llama-style post-processor adds), as vLLM does by default.
    """

    def __init__(self, path: Path, chat_template: Path | None = None):
        from tokenizers import Tokenizer  # imported only when a model names a tokenizer

        # read here, not by from_file: its read, in Rust, holds the GIL, and a Python signal
        # handler (all a container's PID 1 has for SIGTERM) then waits for a slow or hung
        # file system to answer
        self.tokenizer = Tokenizer.from_str(Path(path).read_text(encoding="utf-8"))
        self.template: ChatTemplate | None = None
        self._render_failure_logged = False
        try:
            self.template = load_chat_template(path, chat_template)
        except Exception as exc:  # a broken template costs exactness, never the gateway
            log.error("chat template for %s unusable (%s); chat prompts are counted by "
                      "their contents plus %d tokens a message", chat_template or path, exc,
                      PER_MESSAGE_OVERHEAD_TOKENS)

    def count(self, texts: list[str], *, special: bool = False) -> int:
        """Tokens in ``texts``, encoded with ``encode_batch``: unlike ``encode``, it lets go
        of the GIL while it works (``extproc.counting`` runs long prompts on a thread)."""
        if not texts:
            return 0
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=special)
        return sum(len(e.ids) for e in encodings)

    def work_chars(self, request: InferenceRequest) -> int:
        return (sum(map(len, request.prompt_texts))
                + RENDER_MESSAGE_CHARS * request.message_count)

    def prompt_tokens(self, request: InferenceRequest) -> int:
        body = request.body
        if request.path == CHAT:
            if self.template is not None:
                try:
                    text = self.template.render(body)
                    _check_rendered(text, request)
                except Exception as exc:  # the template's raise_exception, odd messages
                    self._log_render_failure(exc)
                else:
                    special = body.get("add_special_tokens") is True  # vLLM's default: no
                    return self.count([text], special=special)
            return self.count(request.prompt_texts) + _estimated_chat_overhead(request)
        ids = _given_token_ids(request)
        if ids is not None:
            return ids
        special = body.get("add_special_tokens") is not False  # vLLM's default: yes
        return self.count(request.prompt_texts, special=special)

    def _log_render_failure(self, exc: Exception) -> None:
        if self._render_failure_logged:
            return
        self._render_failure_logged = True
        origin = self.template.origin if self.template is not None else "?"
        log.warning("chat template %s failed to render a request (%s: %s); such requests "
                    "are counted by their contents plus %d tokens a message (logged once)",
                    origin, type(exc).__name__, exc, PER_MESSAGE_OVERHEAD_TOKENS)


def _given_token_ids(request: InferenceRequest) -> int | None:
    """How many tokens a completions or embeddings prompt given as token ids (or lists of
    them) holds, counted as given (no BOS added); None for text and for chat."""
    if request.path == CHAT:
        return None
    value = request.body.get("prompt" if request.path == COMPLETIONS else "input")
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, int) for v in value):
        return len(value)
    if all(isinstance(v, list) for v in value):
        return sum(len(v) for v in value)
    return None


def make_counter(tokenizer: Path | None, chars_per_token: float,
                 chat_template: Path | None = None) -> TokenCounter:
    if tokenizer is None:
        return CharEstimate(chars_per_token)
    try:
        return HFTokenizer(tokenizer, chat_template)
    except Exception as exc:  # a broken tokenizer file must not take the gateway down
        log.error("tokenizer %s unusable (%s); estimating %.1f chars/token", tokenizer, exc,
                  chars_per_token)
        return CharEstimate(chars_per_token)


# A rendered chat prompt is its texts plus the template's markup around each message; far
# more means the template multiplies something (a value printed per message), and
# tokenizing it would hold the event loop (or exhaust memory): it is counted by estimate.
RENDER_MARKUP_CHARS = 512  # per message, at most, in any template measured
RENDER_MESSAGE_CHARS = 32  # per message, about, in the templates measured
RENDER_SLACK_CHARS = 65_536  # a system prompt and tool schemas the template adds


def _check_rendered(text: str, request: InferenceRequest) -> None:
    limit = (2 * sum(len(t) for t in request.prompt_texts)
             + RENDER_MARKUP_CHARS * request.message_count + RENDER_SLACK_CHARS)
    if len(text) > limit:
        raise ValueError(f"the rendered prompt ({len(text)} characters) is far longer than "
                         f"the request's texts allow ({limit})")
