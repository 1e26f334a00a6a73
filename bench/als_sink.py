"""A stand-in receiver for Envoy's gRPC access log (``bench.report_transport_ab``).

Reads each batch Envoy sends and, from every entry, what kvgate would need to settle a
request: the lease (``kvgate`` metadata) and the usage the Lua meter published
(``kvgate.usage``). Counts them; ``--stats-port`` answers ``messages entries with_usage
seconds`` as one line of text (seconds: the Python time spent reading the entries).
Not part of kvgate: it prices the transport, not a design.

    python -m bench.als_sink --port P --stats-port S
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc


class Sink(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self) -> None:
        self.messages = self.entries = self.with_usage = 0
        self.busy = 0.0

    async def StreamAccessLogs(self, request_iterator, context):  # the gRPC method name
        async for message in request_iterator:
            t0 = time.perf_counter()
            self.messages += 1
            for entry in message.http_logs.log_entry:
                metadata = entry.common_properties.metadata.filter_metadata
                lease = metadata["kvgate"].fields["lease"].string_value
                usage = metadata["kvgate.usage"].fields if "kvgate.usage" in metadata else None
                self.entries += 1
                if lease and usage is not None and "total_tokens" in usage:
                    self.with_usage += 1
            self.busy += time.perf_counter() - t0
        return als_pb2.StreamAccessLogsResponse()


async def serve(port: int, stats_port: int) -> None:
    sink = Sink()
    server = grpc.aio.server()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()

    async def stats(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"{sink.messages} {sink.entries} {sink.with_usage} {sink.busy:.6f}\n".encode())
        await writer.drain()
        writer.close()

    stats_server = await asyncio.start_server(stats, "127.0.0.1", stats_port)
    async with stats_server:
        await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats-port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.stats_port))


if __name__ == "__main__":
    main()
