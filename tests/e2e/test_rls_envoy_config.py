"""The committed Envoy example for kvgate's Rate Limit Service (``envoy/ratelimit-tokens.yaml``,
rendered from ``extproc/examples/ratelimit.yaml``): current, and accepted by the real
``envoy --mode validate``."""

from __future__ import annotations

import pytest

from extproc.config import load_config
from extproc.envoy_config import render_bootstrap, render_yaml
from extproc.envoy_proc import validate
from tests.paths import REPO

SOURCE = REPO / "extproc" / "examples" / "ratelimit.yaml"
COMMITTED = REPO / "envoy" / "ratelimit-tokens.yaml"


def test_committed_ratelimit_example_is_current() -> None:
    assert COMMITTED.read_text() == render_yaml(load_config(SOURCE)), (
        "envoy/ratelimit-tokens.yaml is stale: regenerate it with `kvgate render-envoy "
        "extproc/examples/ratelimit.yaml -o envoy/ratelimit-tokens.yaml`"
    )


def test_the_ratelimit_filter_asks_kvgate_and_charges_usage_when_done() -> None:
    bootstrap = render_bootstrap(load_config(SOURCE))
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    names = [f["name"] for f in filters]
    # after ext_proc (the tenant is known) and the meter (which sees its 429), before routing
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.buffer", "envoy.filters.http.lua",
                     "envoy.filters.http.ratelimit", "envoy.filters.http.router"]
    ratelimit = filters[4]["typed_config"]
    assert ratelimit["domain"] == "kvgate"
    service = ratelimit["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert service == "kvgate_ext_proc"
    done = [r for r in ratelimit["rate_limits"] if r.get("apply_on_stream_done")]
    assert [r["hits_addend"] for r in done] == [
        {"format": "%DYNAMIC_METADATA(kvgate.usage:total_tokens)%"}]


@pytest.mark.e2e
def test_ratelimit_example_passes_envoy_validate() -> None:
    validate(COMMITTED)
