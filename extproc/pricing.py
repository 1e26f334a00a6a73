"""What a request costs: the model (and so the pool) that serves it, and its tokens.

Prompt tokens come from the model's tokenizer when one is configured (chat prompts rendered
with its chat template, as vLLM does), else a chars-per-token estimate plus a guess at the
chat template's overhead per message; media content parts (images, audio, …) add the model's
``tokens_per_media_part``, or are refused where it is unset; output tokens are the request's
``max_tokens`` (or the model's default) times the answers it asks for (``n``, ``best_of``,
each prompt of a completions batch).
The reservation is reconciled with the engine's real usage when the request ends.
"""

from __future__ import annotations

from extproc.config import Config, Model, Pool
from extproc.openai import (
    COMPLETIONS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_COUNT,
    BadRequest,
    InferenceRequest,
    shown,
)
from extproc.tokens import CharEstimate, TokenCounter, make_counter
from limiter.outcome import Cost


class Pricer:
    def __init__(self, config: Config):
        self._models: dict[str, tuple[Pool, Model]] = {
            m.name: (p, m) for p in config.pools for m in p.models
        }
        self._counters: dict[str, TokenCounter] = {
            name: make_counter(model.tokenizer, config.server.chars_per_token,
                               model.chat_template)
            for name, (_, model) in self._models.items()
        }
        self._estimate = CharEstimate(config.server.chars_per_token)

    def resolve(self, model_name: str) -> tuple[Pool, Model]:
        """The pool serving ``model_name`` and its configuration; 404 for an unknown one."""
        found = self._models.get(model_name)
        if found is None:
            raise BadRequest(
                f"the model '{shown(model_name)}' does not exist "
                f"(served here: {', '.join(sorted(self._models))})",
                status=404, code="model_not_found", param="model",
            )
        return found

    def long_prompt_chars(self, model: Model, request: InferenceRequest, long: int) -> int:
        """The characters counting ``request`` for ``model`` works through when they are
        more than ``long``, else 0 (``extproc.counting``: where it is counted)."""
        chars = self._counters[model.name].work_chars(request)
        return chars if chars > long else 0

    def price(self, model: Model, request: InferenceRequest, *, estimate: bool = False) -> Cost:
        """``estimate``: count the prompt by the chars-per-token estimate, tokenizer or not."""
        counter = self._estimate if estimate else self._counters[model.name]
        prompt = counter.prompt_tokens(request)
        if request.media_parts:
            prompt += media_tokens(model, request.media_parts)
        # n / best_of: the engine generates (and holds KV for) that many answers
        return Cost(prompt, output_cap(model, request) * request.choices)


def output_cap(model: Model, request: InferenceRequest) -> int:
    """The most output tokens one answer may make: the request's ``max_tokens``, else the
    model's ``default_max_tokens`` (the completions API's own default of 16 when that is
    less; kvgate then sends it as the request's cap), but not below the request's
    ``min_tokens`` (vLLM refuses a cap under it)."""
    if request.max_output_tokens is not None:
        return request.max_output_tokens
    default = model.default_max_tokens
    if request.path == COMPLETIONS:
        default = min(default, COMPLETIONS_DEFAULT_MAX_TOKENS)
    floor = request.body.get("min_tokens")
    floor = floor if isinstance(floor, int) and not isinstance(floor, bool) else 0
    return max(default, min(floor, MAX_COUNT))


def media_tokens(model: Model, parts: int) -> int:
    """What ``parts`` media content parts count as; 400 where the model does not say."""
    if model.tokens_per_media_part is None:
        raise BadRequest(
            f"the model '{shown(model.name)}' takes text only here: this gateway cannot "
            "meter images, audio, video or file content parts for it (its operator can set "
            "tokens_per_media_part)", code="unsupported_content", param="messages")
    return parts * model.tokens_per_media_part
