"""kvgate's Envoy-facing side: the ext_proc server, director, scheduler and data layer."""

import kvgate_native

kvgate_native.activate(__name__, __path__)  # compiled modules, when built (make native)
