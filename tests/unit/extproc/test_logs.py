"""Log lines: JSON or text, with the request's context, never a Bearer credential; a
client's unparsable request to one of kvgate's HTTP ports is no error line."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from extproc.datalayer.agent import start_agent
from extproc.logs import (
    JsonFormatter,
    PlainFormatter,
    new_request_id,
    quiet_grpc_write_failures,
    redact,
    usable_request_id,
)


def record(message: str, *args: object, **extra: str) -> logging.LogRecord:
    entry = logging.LogRecord("extproc.stream", logging.INFO, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(entry, key, value)
    return entry


def test_json_lines_carry_the_request_context() -> None:
    line = orjson.loads(JsonFormatter().format(
        record("request %s admitted", "/v1/chat/completions", request_id="r-1", tenant="acme")))
    assert line["msg"] == "request /v1/chat/completions admitted"
    assert (line["level"], line["logger"], line["request_id"], line["tenant"]) == (
        "info", "extproc.stream", "r-1", "acme")
    assert line["ts"].endswith("+00:00")


def test_plain_lines_append_the_context() -> None:
    text = PlainFormatter().format(record("hello", request_id="r-2"))
    assert text.endswith("hello [request_id=r-2]")


def test_bearer_credentials_are_blanked_whatever_logs_them() -> None:
    assert redact("got Authorization: Bearer sk-live-123, then") == (
        "got Authorization: Bearer [redacted], then")
    try:
        raise ValueError("header was 'bearer sk-live-456'")
    except ValueError:
        import sys

        entry = record("failed")
        entry.exc_info = sys.exc_info()
    line = orjson.loads(JsonFormatter().format(entry))
    assert "sk-live-456" not in line["exc"] and "[redacted]" in line["exc"]
    assert "sk-live-456" not in PlainFormatter().format(entry)


def test_request_ids_that_may_go_into_log_lines() -> None:
    assert usable_request_id("0d4f6a2e-7b1c-4c55-9c1e-1f2a3b4c5d6e")
    assert not usable_request_id("")
    assert not usable_request_id("two words")
    assert not usable_request_id("x" * 129)
    made = new_request_id()
    assert usable_request_id(made) and made != new_request_id()


# -- requests aiohttp cannot parse -----------------------------------------------------------

UNPARSABLE = [b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
              b"GET / HTTP/1.1\r\nHost: " + b"h" * 9000 + b"\r\n\r\n",
              b"GET / HTTP/1.1\r\nbad header\r\n\r\n"]


async def raw_reply(host: str, port: int, request: bytes) -> bytes:
    """What a server answers to raw bytes, up to its hang-up."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    return reply


async def test_an_unparsable_request_is_one_debug_line_without_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    agent = await start_agent()  # the NVML agent: listens on every address by default
    try:
        with caplog.at_level(logging.INFO):
            for request in UNPARSABLE:
                reply = await raw_reply("127.0.0.1", agent.port, request)
                assert reply.split(b" ", 2)[1] == b"400"
        assert not caplog.records
        with caplog.at_level(logging.DEBUG, logger="kvgate.agent"):
            await raw_reply("127.0.0.1", agent.port, UNPARSABLE[0])
        lines = [(r.levelno, r.exc_info, r.getMessage()) for r in caplog.records]
        assert lines == [(logging.DEBUG, None,
                          "Error handling request from 127.0.0.1: LineTooLong 400")]
    finally:
        await agent.stop()


def test_a_reply_grpc_could_not_write_to_a_cancelled_rpc_is_no_error_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """Envoy gave up on the stream (its message timeout) as kvgate answered: gRPC logs the
    failed write at ERROR with a traceback, once per request in a timeout storm."""
    from grpc._cython.cygrpc import ExecuteBatchError

    quiet_grpc_write_failures()
    quiet_grpc_write_failures()  # once is enough: a second call adds no second filter
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    assert len(grpc_log.filters) == 1

    def failed_write() -> None:
        try:
            raise ExecuteBatchError("Failed \"execute_batch\": (<grpc._cython.cygrpc...>,)")
        except ExecuteBatchError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]",
                               "Process")

    with caplog.at_level(logging.INFO):
        failed_write()
        grpc_log.error("something else")  # gRPC's other errors stay errors
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, "something else")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="grpc._cython.cygrpc"):
        failed_write()
    assert [(r.levelno, r.exc_info, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, None, "ExecuteBatchError raised in core by servicer method [Process]: "
                              "ExecuteBatchError")]
