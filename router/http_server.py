"""The HTTP front end's own server in each router replica, bound to the address it is given.

Why not Serve's HTTP proxy or its direct ingress: the proxy is one more process and hop that every
token crosses (measured at 13.4k tokens/s against the engine's 18.9k), and direct ingress gives each
replica a port of its own, so one port is served by one router process, whose CPU then caps the
streamed tokens a second. Here every router replica of a node binds the same host:port with
SO_REUSEPORT and the kernel spreads new connections over them: one endpoint, as many router
processes as `num_router_replicas`. The app is the same FastAPI app Serve's proxy reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from router.core import ListenAddress

__all__ = ["HttpServer", "start_http_server"]

log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves the process's signals alone (they are Ray's and Serve's)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # NOTE: uvicorn >= 0.29's hook (pyproject.toml)
        yield


class HttpServer:
    def __init__(self, server: _Server, task: asyncio.Task[None]) -> None:
        self._server, self._task = server, task
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not self._server.should_exit and not task.cancelled():
            log.error("the router's HTTP server stopped on its own (%r): this replica no longer serves its port; "
                      "the node's other replicas still do", task.exception())

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, lets open responses end for up to timeout_s, then closes the rest."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 1.0)
        except Exception as err:  # noqa: BLE001 - it had failed already (logged then); stopping goes on
            log.warning("the router's HTTP server ended with %r", err)


def _socket(address: ListenAddress) -> socket.socket:
    family = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address.host, address.port))
    except OSError as err:
        sock.close()
        raise OSError(f"HTTP cannot bind {address.host}:{address.port}: {err.strerror}; choose another --port or "
                      "--host") from None
    return sock


async def start_http_server(app: Any, address: ListenAddress) -> HttpServer:
    """Serves the ASGI `app` on address.host:port from this event loop (shared with the replicas of this
    node); raises OSError naming the address when it cannot be bound. Returns once it accepts."""
    sock = _socket(address)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, timeout_keep_alive=30)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    task = loop.create_task(server.serve(sockets=[sock]), name="pdserve-http")
    deadline = loop.time() + START_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise OSError(f"HTTP server on {address.host}:{address.port} stopped before it started")
        if loop.time() > deadline:
            task.cancel()
            raise OSError(f"HTTP server on {address.host}:{address.port} did not start in {START_TIMEOUT_S:g} s")
        await asyncio.sleep(0.01)
    return HttpServer(server, task)
