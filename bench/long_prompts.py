"""Long prompts and the event loop: short requests' counting latency while long ones are counted.

kvgate counts a prompt before admitting it; with a model's tokenizer that costs about a
microsecond a character. This benchmark prices a stream of short chat requests (one every
millisecond, as the event loop admits them) while a few 1 MiB chat prompts arrive, and
reports how long each short request waited to be counted (its pricing latency, loop stall
included) and how long the long ones took, for:

- ``in place``: every prompt counted on the event loop (kvgate before the counting thread;
  this run sets the long-prompt bar past any prompt to get it);
- ``shipped``: kvgate as shipped (prompts over 8,192 characters counted on the thread).

The tokenizer is a byte-level BPE (32k vocabulary, the kind Llama 3 and Qwen ship) trained
here on generated text with a fixed seed, with a ChatML template.

    .venv/bin/python -m bench.long_prompts [--long 4] [--out bench/results/long-prompts.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `kvgate serve` runs

from extproc import counting
from extproc.config import hash_api_key, parse_config
from extproc.counting import PromptCosts
from extproc.openai import CHAT, parse_body
from extproc.pricing import Pricer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def words_text(rng: random.Random, words: list[str], chars: int) -> str:
    out, total = [], 0
    while total < chars:
        word = rng.choice(words)
        out.append(word)
        total += len(word) + 1
    return " ".join(out)


def train_tokenizer(folder: Path, rng: random.Random, words: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [words_text(rng, words, 2_000) for _ in range(1_000)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=32_000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"]))
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return path


def chat_request(text: str) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return parse_body(CHAT, orjson.dumps(body))


async def measure(costs: PromptCosts, model: Any, shorts: list[Any], longs: list[Any],
                  ) -> dict[str, Any]:
    """Short requests every ms for as long as the long ones take; long ones at the start."""
    waits: list[float] = []
    long_times: list[float] = []

    async def one_long(request: Any) -> None:
        started = time.perf_counter()
        await costs.price(model, request)
        long_times.append(time.perf_counter() - started)

    async def one_short(request: Any, due: float) -> None:
        await costs.price(model, request)
        waits.append(time.perf_counter() - due)

    started = time.perf_counter()
    tasks = [asyncio.ensure_future(one_long(r)) for r in longs]
    shorts_sent = []
    index = 0
    while not all(t.done() for t in tasks) or index < 200:
        due = started + index / 1000
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        shorts_sent.append(asyncio.ensure_future(one_short(shorts[index % len(shorts)], due)))
        index += 1
    await asyncio.gather(*tasks, *shorts_sent)
    ordered = sorted(waits)
    return {
        "short_requests": len(waits),
        "short_wait_p50_ms": 1000 * statistics.median(ordered),
        "short_wait_p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "short_wait_max_ms": 1000 * ordered[-1],
        "long_count_s": [round(t, 3) for t in sorted(long_times)],
        "wall_s": round(time.perf_counter() - started, 3),
    }


def run(longs_n: int, repeats: int) -> list[dict[str, Any]]:
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
             for _ in range(20_000)]
    folder = Path(tempfile.mkdtemp(prefix="kvgate-long-prompts-"))
    tokenizer = train_tokenizer(folder, rng, words)
    config = parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": [{"name": "m", "tokenizer": str(tokenizer)}],
                   "endpoints": ["127.0.0.1:8000"]}],
    })
    pricer = Pricer(config)
    _, model = pricer.resolve("m")
    shorts = [chat_request(words_text(rng, words, 400)) for _ in range(50)]
    longs = [chat_request(words_text(rng, words, 1_000_000)) for _ in range(longs_n)]
    rows = []
    shipped_bar = counting.LONG_PROMPT_CHARS
    for repeat in range(repeats):
        for mode, bar in (("in place", 10**12), ("shipped", shipped_bar)):
            counting.LONG_PROMPT_CHARS = bar
            costs = PromptCosts(pricer)
            row = {"mode": mode, "repeat": repeat + 1, "long_prompts": longs_n,
                   **asyncio.run(measure(costs, model, shorts, longs))}
            costs.close()
            rows.append(row)
            print(_line(row), flush=True)
    counting.LONG_PROMPT_CHARS = shipped_bar
    return rows


HEADER = ("| mode | run | long 1 MiB prompts | short requests | short wait p50 ms | p99 ms | "
          "max ms | long prompts counted in (s) | wall s |\n|---|---|---|---|---|---|---|---|---|")


def _line(row: dict[str, Any]) -> str:
    return (f"| {row['mode']} | {row['repeat']} | {row['long_prompts']} | "
            f"{row['short_requests']} | {row['short_wait_p50_ms']:.2f} | "
            f"{row['short_wait_p99_ms']:.1f} | {row['short_wait_max_ms']:.1f} | "
            f"{', '.join(map(str, row['long_count_s']))} | {row['wall_s']} |")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=4, help="1 MiB prompts per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/long-prompts.md"))
    args = parser.parse_args(argv)
    print(HEADER)
    rows = run(args.long, args.repeats)
    command = "python -m bench.long_prompts " + " ".join(argv)
    args.out.write_text(f"# Long prompts and the event loop\n\n`{command.strip()}`\n\n"
                        + HEADER + "\n" + "\n".join(map(_line, rows)) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows},
                                                        indent=1))
    print(f"wrote {args.out} and its .json")


if __name__ == "__main__":
    main(sys.argv[1:])
