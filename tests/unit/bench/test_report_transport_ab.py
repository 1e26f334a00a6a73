"""``bench.report_transport_ab``'s variants are edits of the rendered meter: each must still
find what it edits (the script stops on a meter that changed under it) and change only that."""

from __future__ import annotations

import pytest

from bench import overhead
from bench import report_transport_ab as ab
from extproc.config import parse_config
from extproc.envoy_config import render_bootstrap

DONE = 'report(handle, meta, "done"'


def _shipped():
    config = overhead.kvgate_config("127.0.0.1:8101", 9001, 9002)
    return render_bootstrap(parse_config(config))


def _source(bootstrap) -> str:
    return ab._lua(bootstrap)["inline_string"]


def _manager(bootstrap):
    listener = bootstrap["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("mode", ab.VARIANTS)
def test_each_variant_edits_a_copy_of_the_shipped_meter(mode):
    shipped = _shipped()
    before = _source(shipped)
    variant = ab.variant_bootstrap(mode, shipped, 18555)
    assert _source(shipped) == before  # the shipped bootstrap is left as it was
    assert _source(variant) != before


def test_the_report_goes_sync_or_away():
    shipped = _shipped()
    assert DONE in _source(shipped) and ab.ASYNC_CALL in _source(shipped)
    sync = _source(ab.variant_bootstrap("kvgate_sync", shipped, 1))
    assert ab.SYNC_DONE_CALL in sync and ab.ASYNC_CALL not in sync
    for mode in ("kvgate_als", "kvgate_nodone"):
        source = _source(ab.variant_bootstrap(mode, shipped, 1))
        assert DONE not in source and "publish(handle, state.usage)" in source
    assert "publish(handle, state.usage)" not in _source(
        ab.variant_bootstrap("kvgate_nopublish", shipped, 1))


def test_only_the_access_log_variant_logs_metered_requests_to_the_sink():
    shipped = _shipped()
    als = ab.variant_bootstrap("kvgate_als", shipped, 18555)
    (entry,) = _manager(als)["access_log"][len(_manager(shipped).get("access_log", [])):]
    assert entry["filter"]["metadata_filter"]["matcher"]["path"] == [{"key": "meter"}]
    assert entry["typed_config"]["common_config"]["grpc_service"] == {
        "envoy_grpc": {"cluster_name": ab.ALS_CLUSTER}}
    clusters = {c["name"]: c for c in als["static_resources"]["clusters"]}
    endpoint = clusters[ab.ALS_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert endpoint["endpoint"]["address"]["socket_address"]["port_value"] == 18555
    nodone = ab.variant_bootstrap("kvgate_nodone", shipped, 18555)
    assert ab.ALS_CLUSTER not in {c["name"] for c in nodone["static_resources"]["clusters"]}


def test_a_meter_that_changed_stops_the_script():
    with pytest.raises(RuntimeError, match=r"meter\.lua changed"):
        ab._edit({"inline_string": "function envoy_on_response(h) end"}, ab.DONE_CALL, "")
