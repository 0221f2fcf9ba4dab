"""The router replica's own HTTP server (router/http_server.py): two servers, as two router replicas
would run, share one port and both take connections; a port held by a socket that did not ask to
share it is refused with the address named; stop() ends the server and frees the port."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from kvtransfer.netaddr import free_port
from router.core import ListenAddress
from router.http_server import start_http_server


def _app(name: str):  # type: ignore[no-untyped-def]
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        assert scope["type"] == "http"
        body = json.dumps({"router": name}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


async def _get(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a new connection each time
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])["router"]


def test_two_servers_share_one_port_and_both_answer() -> None:
    async def main() -> set[str]:
        address = ListenAddress(port=free_port())
        servers = [await start_http_server(_app(name), address) for name in ("a", "b")]
        try:
            return {await _get(address.port) for _ in range(24)}  # all on one of two: odds 2 in 2^24
        finally:
            for server in servers:
                await server.stop(2.0)

    assert asyncio.run(main()) == {"a", "b"}


def test_a_port_held_without_sharing_is_refused_by_name() -> None:
    async def main() -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            with pytest.raises(OSError, match=f"HTTP cannot bind 127.0.0.1:{port}.*--port"):
                await start_http_server(_app("a"), ListenAddress(port=port))

    asyncio.run(main())


def test_stop_frees_the_port() -> None:
    async def main() -> None:
        address = ListenAddress(port=free_port())
        server = await start_http_server(_app("a"), address)
        assert await _get(address.port) == "a"
        await server.stop(2.0)
        with pytest.raises(OSError):
            await _get(address.port)
        again = await start_http_server(_app("b"), address)  # the port binds again at once
        assert await _get(address.port) == "b"
        await again.stop(2.0)

    asyncio.run(main())
