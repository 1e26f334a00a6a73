"""The pipelined Redis connection against a server that takes commands and never answers
(a paused Redis, a blackholed network): what it keeps stays bounded."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from limiter.stores import redis_pipe
from limiter.stores.redis_codec import pack
from limiter.stores.redis_pipe import RedisPipe

pytest.importorskip("hiredis")


async def test_a_connection_redis_answers_nothing_on_is_dropped(monkeypatch) -> None:
    """Every call on a connection Redis never answers stayed in its ``waiting`` (with its
    exception and traceback) while the connection stayed open: a paused Redis and the
    failover store's repair loop grew an idle kvgate by ~25 MB a minute. Past
    ``SILENT_DROP_S`` of silence the connection goes, and what it held with it."""
    monkeypatch.setattr(redis_pipe, "SILENT_DROP_S", 0.2, raising=False)
    connections: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while await reader.read(65536):  # takes every command, answers none
            pass

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = RedisPipe("127.0.0.1", port, timeout_s=0.02, connect_timeout_s=1)
    try:
        for _ in range(60):
            results = await asyncio.gather(*(pipe.call(pack(b"PING")) for _ in range(5)),
                                           return_exceptions=True)
            assert all(isinstance(r, RedisTimeoutError) for r in results)
            await asyncio.sleep(0.01)
        protocol = pipe._protocol
        assert protocol is not None
        assert len(connections) >= 2  # dropped, and a new one opened by the next call
        assert len(protocol.waiting) < 300 // 2
    finally:
        await pipe.close()
        for writer in connections:
            writer.close()
        server.close()
