"""Prompt token counting: the chars/token estimate and exact counts from a local tokenizer.json."""

from __future__ import annotations

import logging

from tokenizers import Tokenizer, models, pre_tokenizers

from extproc.tokens import CharEstimate, HFTokenizer, make_counter


def word_tokenizer(path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "kv": 3, "cache": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_char_estimate_rounds_up():
    assert CharEstimate(4).count(["abcd", "e"]) == 2
    assert CharEstimate(4).count([]) == 0


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
