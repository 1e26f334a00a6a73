"""The HTTP ports kvgate serves to scrapers, probes and people (the admin port, ``kvgate
agent``'s page): aiohttp, bounded against clients that hold connections open (slowloris).

A request whose headers are not whole within :data:`REQUEST_TIMEOUT_S` of its connection
opening (or of the answer before it) is dropped — aiohttp 3.14.4+ counts its keep-alive
timeout from a connection's start too — as is an unread body still coming that long after
its answer; and at most :data:`MAX_CONNECTIONS` are open at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from extproc.logs import http_server_log

REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 256


async def serve_http(app: web.Application, host: str, port: int, log_name: str,
                     **options: Any) -> web.AppRunner:
    """``app`` served on ``host:port`` (0: a free port, see ``runner.addresses``)."""
    runner = web.AppRunner(app, access_log=None, logger=http_server_log(log_name),
                           keepalive_timeout=REQUEST_TIMEOUT_S, lingering_time=REQUEST_TIMEOUT_S,
                           **options)
    await runner.setup()
    assert runner.server is not None
    _ConnectionCap(runner.server, MAX_CONNECTIONS)
    await web.TCPSite(runner, host, port).start()
    return runner


class _ConnectionCap:
    """At most ``most`` open connections to an aiohttp server: each one past it closes the
    oldest of the peer address holding the most. Refusing the new one instead would let a
    client holding ``most`` slow connections lock Prometheus and the kubelet's probes out;
    closing the oldest of all, a client reconnecting as fast as it is closed would close
    theirs. The cost per connection is a dict entry, and past the cap a look at each peer."""

    def __init__(self, server: web.Server, most: int) -> None:
        self.most = most
        self.peer_of: dict[Any, Any] = {}  # handler -> its peer's address
        self.by_peer: dict[Any, dict[Any, None]] = {}  # peer -> its handlers, oldest first
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            self.add(handler, peer[0] if isinstance(peer, tuple) else None)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            lost(handler, exc)
            self.drop(handler)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def add(self, handler: Any, peer: Any) -> None:
        self.peer_of[handler] = peer
        self.by_peer.setdefault(peer, {})[handler] = None
        if len(self.peer_of) > self.most:
            oldest = next(iter(max(self.by_peer.values(), key=len)))
            self.drop(oldest)
            oldest.force_close()

    def drop(self, handler: Any) -> None:
        if handler not in self.peer_of:
            return  # closed here already, now lost
        peer = self.peer_of.pop(handler)
        held = self.by_peer[peer]
        del held[handler]
        if not held:
            del self.by_peer[peer]
