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
