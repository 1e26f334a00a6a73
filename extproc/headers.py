"""The names kvgate and Envoy agree on: headers kvgate reads or sets, metadata namespaces.

The request path and the bootstrap renderer (``envoy_config.py``) both import them from here,
so the rendered filter forwards exactly the headers the stream reads.
"""

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# The request headers kvgate reads (plus the class header and any x-kvgate-* a client sent,
# which kvgate strips): Envoy forwards only these to it.
# content-encoding: kvgate meters the body it reads, so an encoded one (which the engine would
# decode, or fail on) is refused rather than passed through unmetered.
EXT_PROC_HEADERS = (":method", ":path", "authorization", "content-length", "content-encoding",
                    "x-request-id")
REQUEST_ID_HEADER = "x-request-id"  # Envoy's request id: in kvgate's log lines, and upstream
KVGATE_HEADER_PREFIX = "x-kvgate-"
# Request headers an engine obeys that a client must not send it: vLLM takes a request's
# scheduling priority from x-vllm-priority before the body's and its data-parallel rank from
# x-data-parallel-rank (a client's would undo kvgate's order), and endpoint-load-metrics-
# format makes it answer with its load (KV usage, queue: every tenant's traffic), and
# accept-encoding would let an engine (or a proxy before it) compress the answer, which
# kvgate's meter must read: the engine's usage, the usage event it strips. The rendered
# routes drop them.
ENGINE_CONTROL_HEADERS = ("x-vllm-priority", "x-data-parallel-rank",
                          "endpoint-load-metrics-format", "accept-encoding")
# Dynamic metadata namespaces kvgate may return; Envoy drops any other namespace.
LB_NAMESPACE = "envoy.lb"
# An admitted request's x-ratelimit-* values (header name → value), which the rendered route
# adds to its response (response_headers_to_add with %DYNAMIC_METADATA%): no extra message.
RATELIMIT_NAMESPACE = "kvgate.ratelimit"
# each dimension's (limit, remaining, reset) headers; quota only on refusals
RATELIMIT_FAMILIES = {kind: tuple(f"x-ratelimit-{what}-{kind}"
                                  for what in ("limit", "remaining", "reset"))
                      for kind in ("requests", "tokens", "quota")}
RATELIMIT_HEADERS = (*RATELIMIT_FAMILIES["requests"], *RATELIMIT_FAMILIES["tokens"])
# With envoy.request_attributes (no headers phase), Envoy applies no header mutation of
# kvgate's body-phase reply: the headers kvgate sets upstream go here instead (header name →
# value), and the pool's attributes route sets them (and drops the client's key).
UPSTREAM_HEADERS_NAMESPACE = "kvgate.headers"
UPSTREAM_HEADERS = ("x-kvgate-tenant", "x-kvgate-class", "x-kvgate-priority", "authorization")
# where the Lua meter finds the most a request can have used ("prompt:output" tokens), to
# hold the usage it publishes for Envoy's rate limit filter to that (a namespace of its own:
# a concatenated message's "kvgate" entry would replace the routing reply's whole one)
BOUND_NAMESPACE = "kvgate.bound"
# every namespace kvgate's replies set: Envoy drops the others (ext_proc's
# receiving_namespaces), and the meter never saw kvgate.bound
RECEIVING_NAMESPACES = (LB_NAMESPACE, "kvgate", RATELIMIT_NAMESPACE, BOUND_NAMESPACE)
