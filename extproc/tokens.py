"""Prompt token counts before the engine sees the request.

The estimate decides admission, so it must be cheap (microseconds) and never fail: chars
per token by default, exact with a local HF ``tokenizer.json`` when a model names one.
Reservations are reconciled with the engine's real ``usage`` afterwards, so an estimate
that is a little off only shifts tokens between this request and the next.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class TokenCounter(Protocol):
    def count(self, texts: list[str]) -> int: ...


class CharEstimate:
    def __init__(self, chars_per_token: float):
        self.chars_per_token = chars_per_token

    def count(self, texts: list[str]) -> int:
        return math.ceil(sum(map(len, texts)) / self.chars_per_token)


class HFTokenizer:
    """Exact counts from a local ``tokenizer.json`` (no hub download, ever)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # imported only when a model names a tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def count(self, texts: list[str]) -> int:
        if not texts:
            return 0
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return sum(len(e.ids) for e in encodings)


def make_counter(tokenizer: Path | None, chars_per_token: float) -> TokenCounter:
    if tokenizer is None:
        return CharEstimate(chars_per_token)
    try:
        return HFTokenizer(tokenizer)
    except Exception as exc:  # a broken tokenizer file must not take the gateway down
        log.error("tokenizer %s unusable (%s); estimating %.1f chars/token", tokenizer, exc,
                  chars_per_token)
        return CharEstimate(chars_per_token)
