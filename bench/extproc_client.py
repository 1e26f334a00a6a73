"""Speaks ext_proc to kvgate the way Envoy does, without Envoy.

For tests and benchmarks that need many kvgate processes or many decisions per second
(two replicas sharing one Redis, the store benchmark): one gRPC stream per request, the
same messages Envoy sends (request headers, request body), then what Envoy's Lua meter does
at the response's end (the ``done`` report with its usage, to the process the admission's
metadata names) and the end of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import httpx
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
        self.reports = httpx.AsyncClient(timeout=5)

    async def close(self) -> None:
        await self.channel.close()
        await self.reports.aclose()

    async def _end(self, call: grpc.aio.StreamStreamCall, admitted: pb.ProcessingResponse,
                   response: bytes) -> None:
        """The response has passed: report it as the Lua meter does, then end the stream
        as Envoy does (kvgate releases the request there)."""
        meta = admitted.dynamic_metadata.fields["kvgate"].struct_value.fields
        usage = orjson.loads(response).get("usage")
        await self.reports.post(
            f"http://{meta['report'].string_value}/done/{meta['lease'].string_value}",
            content=orjson.dumps({"usage": usage, "events": 0}),
            headers={"x-kvgate-report-key": meta["key"].string_value})
        await call.done_writing()
        await call.read()  # the end of the RPC: kvgate has released

    async def chat(
        self,
        key: str,
        body: dict,
        *,
        response: bytes | None = None,
        path: str = "/v1/chat/completions",
    ) -> Outcome:
        """One request's whole exchange. ``response`` (a JSON body with ``usage``) is what
        the engine answered: reported, then the stream ends, which releases the lease."""
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
                await self._end(call, reply, response)
            return outcome
        finally:
            await call.done_writing()
            call.cancel()

    async def finish(self, call: grpc.aio.StreamStreamCall, admitted: pb.ProcessingResponse,
                     response: bytes) -> None:
        """End a request opened with :meth:`open`: its response (a JSON body with ``usage``)
        reported, then its stream ended."""
        try:
            await self._end(call, admitted, response)
        finally:
            call.cancel()

    async def open(self, key: str, body: dict
                   ) -> tuple[Outcome, grpc.aio.StreamStreamCall, pb.ProcessingResponse]:
        """Admit a request and keep its stream open (a long generation); cancel to end it,
        or :meth:`finish` it with the admission reply."""
        call = self.stub.Process()
        await call.write(_headers_message("/v1/chat/completions", key, end_of_stream=False))
        first = await call.read()
        outcome = _immediate(first)
        if outcome:
            call.cancel()
            return outcome, call, first
        await call.write(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=orjson.dumps(body), end_of_stream=True)))
        reply = await call.read()
        return _immediate(reply) or Outcome(200, _set_headers(reply)), call, reply


def _set_headers(reply: pb.ProcessingResponse) -> dict[str, str]:
    mutation = reply.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
