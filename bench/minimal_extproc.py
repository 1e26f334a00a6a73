"""The Python floor: an ext_proc server that does nothing but answer CONTINUE.

    python -m bench.minimal_extproc --port 9001 [--host 127.0.0.1] [--stats-port 9003]
        [--cpu-policy batch|normal]

grpc.aio on uvloop, the same server style as kvgate (an async generator per stream, one
reply per message, in order). Every reply is a prebuilt ``ProcessingResponse`` of the
message's kind with an empty ``CommonResponse`` (status CONTINUE). The RPC ends after the
reply to the last message Envoy will send: the response body chunk with ``end_of_stream``
(or, for a request that never reaches the response path, when Envoy half-closes), so that
Envoy can close the stream gracefully as it does with kvgate.

It counts the messages it receives by kind; ``--stats-port`` serves those counts as one
JSON object to whoever connects (no HTTP: read until EOF), for ``bench.overhead``.
``--cpu-policy`` is kvgate's ``server.cpu_policy`` (``extproc.processes.set_cpu_policy``), so
that the floor can be scheduled like kvgate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections import Counter
from collections.abc import AsyncIterator

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.processes import set_cpu_policy

MAX_MESSAGE_BYTES = 2 * 1024 * 1024  # as kvgate: its default body limit + 1 MiB

# What an ext_proc that meters responses itself asks for: the request body whole, then the
# response body chunk by chunk (kvgate's bootstrap sends neither by default; kvgate reads
# its responses through Envoy's Lua meter instead).
METERING = ProcessingMode(
    request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SKIP,
    request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.STREAMED,
    request_trailer_mode=ProcessingMode.SKIP, response_trailer_mode=ProcessingMode.SKIP,
)

REPLIES: dict[str, pb.ProcessingResponse] = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse(),
                                             mode_override=METERING),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


class ContinueProcessor(pb_grpc.ExternalProcessorServicer):
    """CONTINUE to everything; counts messages by kind."""

    def __init__(self) -> None:
        self.messages: Counter[str] = Counter()
        self.streams = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        self.streams += 1
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            self.messages[kind] += 1
            yield REPLIES[kind]
            if kind == "response_body" and message.response_body.end_of_stream:
                return  # the last reply Envoy waits for: end the RPC

    def stats(self) -> dict[str, object]:
        return {"streams": self.streams, "messages": dict(self.messages)}


async def _serve_stats(processor: ContinueProcessor, host: str, port: int) -> asyncio.Server:
    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json.dumps(processor.stats()).encode())
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, host, port)


async def serve(host: str, port: int, stats_port: int | None) -> None:
    """Serve until SIGTERM or SIGINT."""
    processor = ContinueProcessor()
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stats = await _serve_stats(processor, host, stats_port) if stats_port is not None else None
    print(f"minimal ext_proc on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if stats is not None:
        stats.close()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.minimal_extproc",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stats-port", type=int, help="serve message counts (JSON) here")
    parser.add_argument("--cpu-policy", choices=("batch", "normal"), default="normal")
    args = parser.parse_args(argv)
    set_cpu_policy(args.cpu_policy)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args.host, args.port, args.stats_port))


if __name__ == "__main__":
    main()
