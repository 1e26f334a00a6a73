"""Request classification: header where allowed, path rules, long-prompt demotion, ceiling."""

from __future__ import annotations

import pytest

from extproc.classify import Classifier
from extproc.config import hash_api_key, parse_config
from extproc.openai import BadRequest


def classifier(**tenant):
    config = parse_config({
        "tiers": {"t": {}},
        "classification": {"long_prompt_tokens": 1000},
        "tenants": [{"name": "a", "tier": "t", "api_keys": [hash_api_key("k")], **tenant}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:1"]}],
    })
    return Classifier(config), config.tenants[0]


def classify(requested=None, path="/v1/chat/completions", prompt=10, **tenant):
    c, t = classifier(**tenant)
    return c.classify(t, requested=requested, path=path, prompt_tokens=prompt)


def test_default_class_and_its_band_and_priority():
    assert classify().name == "interactive"
    assert (classify().band, classify().priority) == (0, 0)
    assert classify(default_class="batch").name == "batch"


def test_client_can_lower_its_priority():
    assert classify("offline").name == "offline"
    assert classify("offline").priority == 2


def test_client_cannot_rise_above_its_tenants_ceiling():
    assert classify("interactive", default_class="batch").name == "batch"
    assert classify("interactive", default_class="offline", max_class="batch").name == "batch"


def test_header_ignored_when_the_tenant_may_not_choose():
    assert classify("offline", class_header=False).name == "interactive"


def test_paths_have_default_classes():
    assert classify(path="/v1/embeddings").name == "batch"


def test_long_prompts_drop_one_class_but_never_below_the_last():
    assert classify(prompt=1001).name == "batch"
    assert classify("offline", prompt=5000).name == "offline"


def test_unknown_class_is_a_clear_400():
    with pytest.raises(BadRequest) as info:
        classify("urgent")
    assert info.value.status == 400 and "interactive" in info.value.message


def test_long_prompt_rule_per_tier_the_free_tenants_pdf():
    """A 10-page PDF (~6,500 tokens) from a free tenant drops to batch under its tier's
    2,048-token rule, while a paying tenant's prompt of the same length keeps the global
    8,192 rule and stays interactive; a tier may turn the rule off (null)."""
    keys = iter(range(10))
    config = parse_config({
        "tiers": {"free": {"weight": 1, "long_prompt_tokens": 2048},
                  "gold": {"weight": 3},
                  "platinum": {"weight": 5, "long_prompt_tokens": None}},
        "tenants": [{"name": name, "tier": name, "api_keys": [hash_api_key(str(next(keys)))]}
                    for name in ("free", "gold", "platinum")],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:1"]}],
    })
    c = Classifier(config)
    free, gold, platinum = config.tenants

    def name(tenant, prompt):
        return c.classify(tenant, requested=None, path="/v1/chat/completions",
                          prompt_tokens=prompt).name

    assert name(free, 6500) == "batch"
    assert name(free, 300) == "interactive"  # its chat is still chat
    assert name(gold, 6500) == "interactive"
    assert name(gold, 9000) == "batch"  # the global rule
    assert name(platinum, 100_000) == "interactive"
    assert config.long_prompt_tokens("gold") == 8192


def test_an_unknown_class_is_quoted_short():
    """The 400 quoted the header whole: a 50 KB value came back in a 50 KB body."""
    with pytest.raises(BadRequest) as error:
        classify("x" * 50_000)
    assert len(str(error.value)) < 400 and "(50000 characters)" in str(error.value)
