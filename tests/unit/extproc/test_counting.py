"""Long prompts are counted on the counting thread, exactly, while the event loop goes on;
when that thread is far behind, by estimate."""

from __future__ import annotations

import asyncio
import threading

from extproc.config import hash_api_key, parse_config
from extproc.counting import LONG_PROMPT_CHARS, MAX_BACKLOG_CHARS, PromptCosts
from extproc.metrics import Metrics
from extproc.openai import COMPLETIONS
from extproc.pricing import Pricer
from extproc.tokens import CharEstimate
from tests.unit.extproc.test_tokens import chat, chat_model, pricer_config, request

LONG = " ".join(["hello world kv cache"] * (2 * LONG_PROMPT_CHARS // 20))  # 2× the bar


class SpyTokenizer:
    """The model's tokenizer, noting the thread each encoding ran on."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.threads: list[str] = []
        self.encoding = False

    def encode_batch(self, texts, **options):
        self.threads.append(threading.current_thread().name)
        self.encoding = True
        try:
            return self.tokenizer.encode_batch(texts, **options)
        finally:
            self.encoding = False


def costs_with_spy(tmp_path):
    metrics = Metrics()
    pricer = Pricer(pricer_config(chat_model(tmp_path)))
    counter = pricer._counters["m"]
    spy = counter.tokenizer = SpyTokenizer(counter.tokenizer)
    return PromptCosts(pricer, metrics.long_prompts), pricer, spy, metrics


def test_short_prompts_are_counted_in_place_and_long_ones_on_the_thread(tmp_path):
    costs, pricer, spy, metrics = costs_with_spy(tmp_path)
    _, model = pricer.resolve("m")
    long_chat = chat({"role": "user", "content": LONG}, max_tokens=3)
    long_prompt = request(COMPLETIONS, prompt=LONG, max_tokens=3)

    async def main():
        short = await costs.price(model, chat({"role": "user", "content": "hello"}))
        return short, await costs.price(model, long_chat), await costs.price(model, long_prompt)

    short, counted_chat, counted_prompt = asyncio.run(main())
    costs.close()
    assert spy.threads[0] == threading.current_thread().name  # in place
    assert [t.startswith("kvgate-counting") for t in spy.threads[1:]] == [True, True]
    # exactly what the pricer counts in place: the thread changes where, not what
    assert counted_chat == pricer.price(model, long_chat)
    assert counted_prompt == pricer.price(model, long_prompt)
    assert short.prompt_tokens < LONG_PROMPT_CHARS < counted_chat.prompt_tokens * 5
    assert metrics.long_prompts.values == {("tokenizer",): 2, ("estimate",): 0}
    assert costs.backlog_chars == 0


def test_the_loop_goes_on_while_a_long_prompt_is_counted(tmp_path):
    """The tokenizer lets go of the GIL while it encodes (encode_batch; encode does not)."""
    costs, pricer, spy, _ = costs_with_spy(tmp_path)
    _, model = pricer.resolve("m")
    huge = chat({"role": "user", "content": " ".join(["hello world kv cache"] * 50_000)})

    async def main():
        ticks = 0
        counting = asyncio.ensure_future(costs.price(model, huge))
        while not counting.done():
            ticks += spy.encoding  # the loop ran while the thread encoded
            await asyncio.sleep(0)
        return ticks, counting.result()

    ticks, cost = asyncio.run(main())
    costs.close()
    assert cost.prompt_tokens == 200_006  # 4 words × 50,000 and the template's 6
    assert ticks > 1_000  # `encode` holds the GIL: ~20 here


def test_a_long_prompt_is_estimated_when_the_thread_is_far_behind(tmp_path):
    costs, pricer, spy, metrics = costs_with_spy(tmp_path)
    _, model = pricer.resolve("m")
    costs.backlog_chars = MAX_BACKLOG_CHARS - len(LONG) // 2  # a burst of long prompts
    long_chat = chat({"role": "user", "content": LONG}, max_tokens=3)

    cost = asyncio.run(costs.price(model, long_chat))
    assert spy.threads == []
    assert cost.prompt_tokens == CharEstimate(4.0).prompt_tokens(long_chat)
    assert metrics.long_prompts.values[("estimate",)] == 1


def test_an_abandoned_count_still_leaves_the_backlog(tmp_path):
    """The client left (its admission cancelled) while its prompt was counted: the thread
    finishes it, and only then is it off the backlog."""
    costs, pricer, _spy, _ = costs_with_spy(tmp_path)
    _, model = pricer.resolve("m")
    long_prompt = request(COMPLETIONS, prompt=LONG)

    async def main():
        counting = asyncio.ensure_future(costs.price(model, long_prompt))
        await asyncio.sleep(0)
        assert costs.backlog_chars > 0
        counting.cancel()
        for _ in range(200):
            if costs.backlog_chars == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    costs.close()
    assert costs.backlog_chars == 0


def test_without_a_tokenizer_nothing_is_long():
    """The estimate costs microseconds whatever the length: always counted in place."""
    pricer = Pricer(parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "p", "models": [{"name": "m"}], "endpoints": ["127.0.0.1:8000"]}],
    }))
    _, model = pricer.resolve("m")
    assert pricer.long_prompt_chars(model, chat({"role": "user", "content": LONG}),
                                    LONG_PROMPT_CHARS) == 0
