"""Speaks ext_proc to kvgate the way Envoy does, without Envoy.

For tests and benchmarks that need many kvgate processes or many decisions per second
(two replicas sharing one Redis, the store benchmark): one gRPC stream per request, the
same message order Envoy uses (request headers, request body, response body chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc


@dataclass
class Outcome:
    """200 when kvgate routed the request upstream, else its immediate response's status."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def admitted(self) -> bool:
        return self.status == 200


def _headers_message(path: str, key: str, end_of_stream: bool) -> pb.ProcessingRequest:
    values = {":method": "POST", ":path": path, "authorization": f"Bearer {key}",
              "content-type": "application/json"}
    headers = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                 for k, v in values.items()])
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=headers, end_of_stream=end_of_stream)
    )


def _immediate(reply: pb.ProcessingResponse) -> Outcome | None:
    if not reply.HasField("immediate_response"):
        return None
    immediate = reply.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return Outcome(immediate.status.code, headers, immediate.body)


class ExtProcClient:
    def __init__(self, target: str):
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def chat(
        self,
        key: str,
        body: dict,
        *,
        response: bytes | None = None,
        path: str = "/v1/chat/completions",
    ) -> Outcome:
        """One request's whole exchange. ``response`` (a JSON body with ``usage``) is sent
        back through the response phase, which releases the request's lease."""
        call = self.stub.Process()
        try:
            await call.write(_headers_message(path, key, end_of_stream=False))
            outcome = _immediate(await call.read())
            if outcome:
                return outcome
            await call.write(pb.ProcessingRequest(
                request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True)))
            reply = await call.read()
            outcome = _immediate(reply) or Outcome(200, _set_headers(reply))
            if outcome.admitted and response is not None:
                await call.write(pb.ProcessingRequest(
                    response_body=pb.HttpBody(body=response, end_of_stream=True)))
                await call.read()
            return outcome
        finally:
            await call.done_writing()
            call.cancel()

    @staticmethod
    async def finish(call: grpc.aio.StreamStreamCall, response: bytes) -> None:
        """End a request opened with :meth:`open`: its response body (with ``usage``)."""
        try:
            await call.write(pb.ProcessingRequest(
                response_body=pb.HttpBody(body=response, end_of_stream=True)))
            await call.read()
        finally:
            await call.done_writing()
            call.cancel()

    async def open(self, key: str, body: dict) -> tuple[Outcome, grpc.aio.StreamStreamCall]:
        """Admit a request and keep its stream open (a long generation); cancel to end it."""
        call = self.stub.Process()
        await call.write(_headers_message("/v1/chat/completions", key, end_of_stream=False))
        outcome = _immediate(await call.read())
        if outcome:
            call.cancel()
            return outcome, call
        await call.write(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True)))
        reply = await call.read()
        return _immediate(reply) or Outcome(200, _set_headers(reply)), call


def _set_headers(reply: pb.ProcessingResponse) -> dict[str, str]:
    mutation = reply.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
