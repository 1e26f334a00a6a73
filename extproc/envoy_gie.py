"""An Envoy bootstrap that calls kvgate the way a Gateway API Inference Extension gateway
calls its endpoint picker (``kvgate render-envoy --gie``).

Not kvgate's recommended deployment (``envoy_config.py`` renders that): a reference for
what an Inference Extension gateway (Envoy Gateway, kgateway, Istio, GKE) configures on its
own, so that kvgate's full-duplex mode (``duplex.py``) is tested against the real Envoy, and
so that deploy/gateway-api can show what a gateway must send. Its ext_proc filter:

* request headers, body and trailers, response headers, body and trailers all sent, both
  bodies ``FULL_DUPLEX_STREAMED`` (kvgate answers every chunk);
* no mode overrides, no header forwarding rules, no graceful-close runtime flag, no Lua
  meter and no local-reply mapper: none of kvgate's own refinements;
* ``envoy.lb`` the only metadata namespace received;
* the upstream: an ORIGINAL_DST cluster on the ``x-gateway-destination-endpoint`` header
  kvgate sets (it always overwrites a client's), as Inference Extension gateways route.

In this mode Envoy does not time the processor's replies (``message_timeout`` is rendered,
1000 s as in the Inference Extension's own examples, but a request kvgate holds past it
gets kvgate's 503 at its class deadline, never Envoy's 504; measured on Envoy 1.40): the
HCM's stream idle timeout bounds a stalled body or a hung kvgate. ``failure_mode_allow``
stays false: with it a dead picker would let requests through unadmitted, and the routing
header would be the client's. The route removes no headers, as a gateway's route to an
InferencePool does not: kvgate removes the engine-control headers itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from extproc.envoy_config import (
    EXT_PROC_CLUSTER,
    GATEWAY_LISTENER,
    _circuit_breakers,
    _ext_proc_cluster,
    _router_filter,
    _seconds,
    _socket_address,
    client_options,
    idle_timeout_s,
)
from extproc.headers import DESTINATION_HEADER, LB_NAMESPACE

if TYPE_CHECKING:
    from extproc.config import Config

GIE_UPSTREAM_CLUSTER = "original_destination_cluster"
# Envoy's HTTP/2 flood guard: at most this many frames queued to write on one connection
# (Envoy's default is 10,000). See :func:`_unlimit_outbound_frames`.
EXT_PROC_OUTBOUND_FRAMES = 2**31 - 1


def _ext_proc_filter(config: Config) -> Any:
    from envoy_data_plane.envoy.config.core.v3 import GrpcService, GrpcServiceEnvoyGrpc
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
        MetadataOptions,
        MetadataOptionsMetadataNamespaces,
        ProcessingMode,
        ProcessingModeBodySendMode,
        ProcessingModeHeaderSendMode,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpFilter,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    send = ProcessingModeHeaderSendMode.SEND
    duplex = ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED
    ext_proc = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXT_PROC_CLUSTER)),
        failure_mode_allow=False,
        message_timeout=_seconds(config.envoy.message_timeout_s),
        processing_mode=ProcessingMode(
            request_header_mode=send, response_header_mode=send,
            request_body_mode=duplex, response_body_mode=duplex,
            request_trailer_mode=send, response_trailer_mode=send,
        ),
        metadata_options=MetadataOptions(receiving_namespaces=MetadataOptionsMetadataNamespaces(
            untyped=[LB_NAMESPACE])),
    )
    return HttpFilter(name="envoy.filters.http.ext_proc", typed_config=AnyMsg.pack(ext_proc))


def _http_connection_manager(config: Config) -> Any:
    from envoy_data_plane.envoy.config.route.v3 import (
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
    )

    idle = _seconds(idle_timeout_s(config))
    route = Route(name="inference-pool", match=RouteMatch(prefix="/"), route=RouteAction(
        cluster=GIE_UPSTREAM_CLUSTER, timeout=_seconds(config.envoy.route_timeout_s),
        idle_timeout=idle))
    return HttpConnectionManager(
        stat_prefix=GATEWAY_LISTENER,
        **client_options(config),
        route_config=RouteConfiguration(name="gie_routes", virtual_hosts=[
            # no request_headers_to_remove: a gateway's route to an InferencePool has none,
            # so kvgate removes the engine-control headers itself (DuplexStream)
            VirtualHost(name="gie", domains=["*"], routes=[route])]),
        http_filters=[_ext_proc_filter(config), _router_filter()],
    )


def _upstream_cluster(config: Config) -> Any:
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterLbPolicy,
        ClusterOriginalDstLbConfig,
    )

    return Cluster(
        name=GIE_UPSTREAM_CLUSTER,
        type=ClusterDiscoveryType.ORIGINAL_DST,
        lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
        original_dst_lb_config=ClusterOriginalDstLbConfig(
            use_http_header=True, http_header_name=DESTINATION_HEADER),
        connect_timeout=_seconds(config.envoy.connect_timeout_s),
        circuit_breakers=_circuit_breakers(),
    )


def build_gie_bootstrap(config: Config) -> Any:
    from envoy_data_plane.envoy.config.bootstrap.v3 import (
        Admin,
        Bootstrap,
        BootstrapStaticResources,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.google.protobuf import Any as AnyMsg

    env = config.envoy
    listener = Listener(
        name=GATEWAY_LISTENER,
        address=_socket_address(env.listen_host, env.listen_port),
        filter_chains=[FilterChain(filters=[Filter(
            name="envoy.filters.network.http_connection_manager",
            typed_config=AnyMsg.pack(_http_connection_manager(config)))])],
    )
    return Bootstrap(
        admin=Admin(address=_socket_address("127.0.0.1", env.admin_port)),
        static_resources=BootstrapStaticResources(
            listeners=[listener],
            clusters=[_upstream_cluster(config), _ext_proc_cluster(config)]),
    )


def render_gie_bootstrap(config: Config) -> dict[str, Any]:
    """The bootstrap as proto3 JSON (snake_case keys), ``failure_mode_allow`` spelt out."""
    from betterproto2 import Casing

    from extproc.envoy_config import ext_proc_filter_config

    rendered = build_gie_bootstrap(config).to_dict(casing=Casing.SNAKE)
    ext_proc_filter_config(rendered).setdefault("failure_mode_allow", False)
    _unlimit_outbound_frames(rendered)
    order = ["admin", "static_resources"]
    return {key: rendered[key] for key in order if key in rendered} | {
        key: value for key, value in rendered.items() if key not in order}


def _unlimit_outbound_frames(rendered: dict[str, Any]) -> None:
    """Lift Envoy's outbound-frame flood guard on the connection to kvgate. In full duplex
    Envoy writes kvgate one gRPC message per request body chunk as the client sends it, and
    a client picks its chunks: an HTTP/2 body in 1-byte DATA frames (150 KB of them,
    measured on Envoy 1.40) queued past the default 10,000 frames, and Envoy closed the whole
    connection as a flood: every other request on it was cut. kvgate reads all it is sent;
    a client's frames stay bounded by its flow-control window (one largest body)."""
    for cluster in rendered["static_resources"]["clusters"]:
        if cluster["name"] == EXT_PROC_CLUSTER:
            options = cluster["typed_extension_protocol_options"]
            http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            http2 = http["explicit_http_config"]["http2_protocol_options"]
            http2["max_outbound_frames"] = EXT_PROC_OUTBOUND_FRAMES


HEADER = """\
# Envoy bootstrap calling kvgate as a Gateway API Inference Extension gateway calls its
# endpoint picker (FULL_DUPLEX_STREAMED bodies, every phase sent; extproc/envoy_gie.py).
# GENERATED by `kvgate render-envoy --gie`; do not edit by hand. Regenerate with
#   kvgate render-envoy --gie KVGATE_CONFIG -o THIS_FILE
"""


def render_gie_yaml(config: Config) -> str:
    return HEADER + yaml.safe_dump(render_gie_bootstrap(config), sort_keys=False,
                                   default_flow_style=False, width=1000)
