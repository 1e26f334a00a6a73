"""Clients that send most of a large body and stall: what Envoy holds, and what frees it.

    .venv/bin/python -m bench.slow_bodies http2 [--cap-mib 48] [--connections 10] [--streams 10]
    .venv/bin/python -m bench.slow_bodies keyless [--clients 100]

``http2``: renders the bundled config with ``envoy.max_heap_mb`` = ``--cap-mib`` (kvgate
itself is not started: these requests never reach it), opens ``--connections`` cleartext
HTTP/2 connections and on each ``--streams`` streams that declare a 1 MB body and send 0.9 MB
of it as flow control allows, then stall. Prints the streams Envoy reset, the memory it had
allocated 2 s after the last was sent (its admin ``/memory``) and its overload counters.

``keyless``: the bundled config with kvgate and simulated engines, the default heap cap;
``--clients`` HTTP/1.1 clients with no API key each send 0.9 MB of a 1 MB body (20 ms
apart) and stall, once with ``envoy.request_attributes`` true (the default: kvgate sees a
request when its body is whole) and once false (a headers phase first). Prints Envoy's
allocated memory 2 s later and how many clients got their 401.

Results: the failure-modes table in the README; `bench/results/slow-bodies.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import time
import urllib.request
from typing import Any

import h2.connection
import h2.events
import h2.exceptions

from extproc.config import EXAMPLE_CONFIG, Config, load_config
from extproc.demo import local_stack
from extproc.envoy_proc import EnvoyProcess
from extproc.ports import free_port

BODY, SENT = 1_000_000, 900_000


def envoy_get(envoy: EnvoyProcess, path: str) -> bytes:
    with urllib.request.urlopen(f"{envoy.admin_url}{path}", timeout=5) as response:
        return response.read()


def stalled_stream(client: socket.socket, connection: Any) -> int:
    """Open a stream, send SENT bytes of a BODY-byte body as windows allow; resets seen."""
    stream = connection.get_next_available_stream_id()
    connection.send_headers(stream, [(":method", "POST"), (":path", "/v1/chat/completions"),
                                     (":authority", "x"), (":scheme", "http"),
                                     ("content-length", str(BODY))])
    left, resets = SENT, 0
    while left:
        window = min(16_384, left, connection.local_flow_control_window(stream))
        if window > 0:
            connection.send_data(stream, b"x" * window)
            left -= window
        else:
            try:
                data = client.recv(1 << 20)
            except TimeoutError:
                break
            events = connection.receive_data(data) if data else []
            resets += sum(isinstance(e, h2.events.StreamReset) for e in events)
            if not data or any(isinstance(e, h2.events.StreamReset) and e.stream_id == stream
                               for e in events):
                break
        client.sendall(connection.data_to_send())
    return resets


def http2(cap_mib: int, connections: int, streams: int) -> dict[str, Any]:
    data = load_config(EXAMPLE_CONFIG).model_dump()
    data["server"].update(grpc_port=free_port(), max_body_bytes=2**20)
    data["envoy"].update(listen_port=free_port(), admin_port=free_port(), max_heap_mb=cap_mib)
    resets = 0
    with EnvoyProcess(Config.model_validate(data)) as envoy, contextlib.ExitStack() as stack:
        for _ in range(connections):
            client = stack.enter_context(socket.create_connection(
                ("127.0.0.1", envoy.listen_port), timeout=10))
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.settimeout(0.2)
            connection = h2.connection.H2Connection()
            connection.initiate_connection()
            client.sendall(connection.data_to_send())
            for _ in range(streams):
                with contextlib.suppress(OSError, h2.exceptions.ProtocolError):
                    resets += stalled_stream(client, connection)
        time.sleep(2)
        held = json.loads(envoy_get(envoy, "/memory"))["allocated"]
        stats = envoy_get(envoy, "/stats?filter=reset_high_memory_stream|shed_load_count"
                                 "|fixed_heap.pressure").decode()
    counters = dict(line.split(": ", 1) for line in stats.splitlines() if ": " in line)
    return {"cap_mib": cap_mib, "connections": connections, "streams_per_connection": streams,
            "resets_seen": resets, "allocated_mib_2s_after": round(int(held) / 2**20, 1),
            "envoy": counters}


def keyless(clients: int) -> list[dict[str, Any]]:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    rows = []
    for attributes in (True, False):
        data = load_config(EXAMPLE_CONFIG).model_dump()
        data["server"].update(grpc_port=free_port(), admin_port=free_port(),
                              max_body_bytes=2**20)
        data["envoy"].update(listen_port=free_port(), admin_port=free_port(),
                             request_attributes=attributes)
        with local_stack(Config.model_validate(data)) as stack, \
                contextlib.ExitStack() as opened:
            sockets = []
            for _ in range(clients):
                client = opened.enter_context(socket.create_connection(
                    ("127.0.0.1", stack.envoy.listen_port), timeout=10))
                with contextlib.suppress(OSError):  # refused mid-send
                    client.sendall(head + b"x" * SENT)
                sockets.append(client)
                time.sleep(0.02)
            time.sleep(2)
            held = json.loads(envoy_get(stack.envoy, "/memory"))["allocated"]
            refused = 0
            for client in sockets:
                client.settimeout(0.1)
                with contextlib.suppress(OSError):
                    refused += client.recv(64).startswith(b"HTTP/1.1 401")
        rows.append({"request_attributes": attributes, "clients": clients,
                     "allocated_mib_2s_after": round(int(held) / 2**20, 1),
                     "answered_401": refused})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    h2_args = commands.add_parser("http2")
    h2_args.add_argument("--cap-mib", type=int, default=48)
    h2_args.add_argument("--connections", type=int, default=10)
    h2_args.add_argument("--streams", type=int, default=10)
    keyless_args = commands.add_parser("keyless")
    keyless_args.add_argument("--clients", type=int, default=100)
    args = parser.parse_args(argv)
    if args.command == "http2":
        print(json.dumps(http2(args.cap_mib, args.connections, args.streams)))
    else:
        for row in keyless(args.clients):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
