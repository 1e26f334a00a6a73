"""The output kvgate reserves covers what the engine then runs: for any combination of the
cap fields (absent, null, a number) on chat and completions, the body kvgate sends makes
the simulated engine (which reads them as vLLM does) run at most the reserved output."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import hash_api_key, parse_config
from extproc.engine.model import EngineConfig
from extproc.engine.server import ApiError, parse_generation
from extproc.openai import CHAT, COMPLETIONS, BadRequest, mutate_body, parse_body
from extproc.pricing import output_cap

MODEL = parse_config({
    "tiers": {"t": {}},
    "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")]}],
    "pools": [{"name": "p", "endpoints": ["127.0.0.1:1"],
               "models": [{"name": "tiny-llama", "default_max_tokens": 40}]}],
}).pools[0].models[0]
ENGINE = EngineConfig(kv_blocks=1_000_000)
CAP = st.none() | st.integers(min_value=1, max_value=5000)
FIELD = st.sampled_from(["absent", "null", "set"])


def with_field(body: dict, name: str, how: str, value: int | None) -> None:
    if how == "null":
        body[name] = None
    elif how == "set" and value is not None:
        body[name] = value


@settings(max_examples=300, deadline=None)
@given(path=st.sampled_from([CHAT, COMPLETIONS]), tokens=FIELD, completion=FIELD,
       tokens_value=CAP, completion_value=CAP,
       min_tokens=st.none() | st.integers(min_value=0, max_value=100),
       degraded=st.none() | st.integers(min_value=1, max_value=64))
def test_the_engine_runs_at_most_the_output_kvgate_reserved(
        path, tokens, completion, tokens_value, completion_value, min_tokens, degraded):
    body: dict = {"model": "tiny-llama"}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with_field(body, "max_tokens", tokens, tokens_value)
    with_field(body, "max_completion_tokens", completion, completion_value)
    if min_tokens is not None:
        body["min_tokens"] = min_tokens
    request = parse_body(path, orjson.dumps(body))
    reserved = output_cap(MODEL, request)
    overrides = {} if request.max_output_tokens is not None else {"max_tokens": reserved}
    if degraded is not None and reserved > degraded:  # a degradation's smaller cap
        reserved, overrides = degraded, {"max_tokens": degraded}
    sent = orjson.loads(mutate_body(request, priority=None, inject_usage=False,
                                    overrides=overrides))
    try:
        generation = parse_generation(sent, "chat" if path == CHAT else "completion", ENGINE)
    except ApiError:
        return  # the engine refuses it (min_tokens above the cap): nothing runs
    assert generation.max_tokens <= reserved, (body, sent, reserved)


def test_a_cap_kvgate_refuses_is_never_sent():
    for bad in (0, -1, True, 2.5, "9"):
        try:
            parse_body(COMPLETIONS, orjson.dumps({"model": "m", "prompt": "x",
                                                   "max_tokens": bad}))
        except BadRequest:
            continue
        raise AssertionError(bad)
