"""The request channel: a direct socket between a router and a worker for the calls every request
makes (a decode or colocated worker's submit, prefill_locally, reserve, abort; a prefill worker's
prefill, abort) and for a decode worker's token batches, which it pushes as each engine step ends
instead of answering polls.

Why: a Ray actor call costs the hot path far more than a frame over a socket, and a poll makes each
token batch wait for the next poll (the README has the figures). Everything else (pairing, stats,
health, drain, the KV hand-off between workers) stays a Ray call: it is rare, or not on the
request's path.

What it does not know: which worker it serves (the worker hands it its handlers, one per `Call`)
or how the router finds the worker (the client is given a coroutine that returns the address).
A prefill call names the decode worker to push to: its handle goes as a reference (`Refs`: by
default the pickled Ray actor handle, which the prefill worker loads back into one).

Frames: a 4-byte big-endian length, then a msgpack list.

| frame     | from -> to       | body                                                        |
|-----------|------------------|-------------------------------------------------------------|
| HELLO     | router -> worker | [HELLO, secret]  (first frame; a wrong secret closes it)    |
| CALL      | router -> worker | [CALL, call id, Call, [args]]                               |
| REPLY     | worker -> router | [REPLY, call id, OK, value] / [REPLY, call id, ERROR, [kind, field, message]] |
| SUBSCRIBE | router -> worker | [SUBSCRIBE, router id, heartbeat_s]  (decode workers only)   |
| BATCH     | worker -> router | [BATCH, TokenBatchMsg bytes]  (an empty one every heartbeat_s when idle) |

A worker that dies closes the socket (the router sees it at once); a worker that hangs sends no
heartbeat (the router's poll deadline sees it). Either way the router moves the worker's requests,
as when a Ray poll fails. The socket binds the worker's transport host (127.0.0.1 unless the
cluster is told otherwise) and takes only clients that know the secret the worker hands out
through Ray (`channel_address` of either worker). The secret is what makes loading a pickled
reference safe: whoever has it can already call the cluster's actors, and so run any code there.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import itertools
import logging
import pickle
import secrets
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgpack

from engine.validation import InvalidRequestError

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 64 << 20  # a frame carries at most one request (the router caps a body at 1 MiB by default)
HELLO_TIMEOUT_S = 10.0
_LENGTH = struct.Struct(">I")


class Call(enum.IntEnum):
    """The worker calls a channel carries; each worker maps them to its methods."""

    SUBMIT = 1  # (GenerateRequestMsg bytes) -> arrival time (float)
    PREFILL_LOCALLY = 2  # (LocalPrefillMsg bytes) -> LocalPrefillReplyMsg bytes
    RESERVE = 3  # (ReserveMsg bytes) -> LeaseMsg bytes | None
    ABORT = 4  # (request id) -> bool (either kind of worker)
    PREFILL = 5  # (PrefillTaskMsg bytes, decode worker ref) -> PrefillResultMsg bytes (a prefill worker)


class _Frame(enum.IntEnum):
    HELLO = 1
    CALL = 2
    REPLY = 3
    SUBSCRIBE = 4
    BATCH = 5


_OK, _ERROR = 0, 1
_INVALID, _FAILED = "invalid", "failed"  # an InvalidRequestError (the client's input), anything else

Handler = Callable[..., Awaitable[Any]]
Poll = Callable[[str, float], Awaitable[bytes]]  # (router id, wait up to s) -> TokenBatchMsg bytes
ChannelAddress = tuple[str, int, str]  # host, port, secret
_NUM_REFS_KEPT = 256  # handles a Refs remembers each way (a cluster's decode workers, with room to spare)


class ChannelError(ConnectionError):
    """The channel to a worker is lost, or could not be opened: treat the worker as failed."""


class RemoteCallError(RuntimeError):
    """The worker's method raised; the message names the exception and what it said."""


class Refs:
    """Worker handles as bytes and back, for calls that name another worker (a prefill names the
    decode worker it pushes to). Pickled: a Ray actor handle pickles as a reference to its actor,
    and a ChannelHandle as the handle it wraps. Each side remembers the latest _NUM_REFS_KEPT, so a
    handle is pickled once per router and loaded once per prefill worker, not once a request."""

    def __init__(self) -> None:
        # id(handle) -> (handle, its bytes): the handle is kept, so its id is not reused meanwhile
        self._encoded: OrderedDict[int, tuple[Any, bytes]] = OrderedDict()
        self._decoded: OrderedDict[bytes, Any] = OrderedDict()

    def encode(self, handle: Any) -> bytes | None:
        if handle is None:
            return None
        kept = self._encoded.get(id(handle))
        if kept is None:
            kept = self._encoded[id(handle)] = (handle, pickle.dumps(handle))
            _trim(self._encoded)
        else:
            self._encoded.move_to_end(id(handle))
        return kept[1]

    def decode(self, ref: bytes | None) -> Any:
        if ref is None:
            return None
        handle = self._decoded.get(ref)
        if handle is None:
            handle = self._decoded[ref] = pickle.loads(ref)  # NOTE: from a client that knew the secret
            _trim(self._decoded)
        else:
            self._decoded.move_to_end(ref)
        return handle


def _trim(kept: OrderedDict[Any, Any]) -> None:
    while len(kept) > _NUM_REFS_KEPT:
        kept.popitem(last=False)


def _pack(frame: list[Any]) -> bytes:
    body = msgpack.packb(frame, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


async def _read(reader: asyncio.StreamReader) -> list[Any]:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ChannelError(f"a frame of {size} bytes exceeds MAX_FRAME_BYTES ({MAX_FRAME_BYTES})")
    return msgpack.unpackb(await reader.readexactly(size), raw=False)


def _error_body(err: BaseException) -> list[Any]:
    if isinstance(err, InvalidRequestError):
        message = str(err).removeprefix(f"{err.field}: ")
        return [_INVALID, err.field, message]
    return [_FAILED, "", f"{type(err).__name__}: {err}"]


def _raise_error(body: list[Any]) -> None:
    kind, field, message = body
    if kind == _INVALID:
        raise InvalidRequestError(field, message)
    raise RemoteCallError(message)


# ---- the worker's side


class ChannelServer:
    """Serves one worker's channel on its event loop: every call runs as a task of its own (as
    concurrent Ray actor calls do), and each subscribed router gets a task that pushes its batches."""

    def __init__(self, handlers: Mapping[Call, Handler], poll: Poll | None, host: str) -> None:
        """poll: the worker's token batches for a router (None: a worker that streams none)."""
        self.handlers = dict(handlers)
        self.poll = poll
        self.host = host
        self.secret = secrets.token_hex(16)
        self._server: asyncio.base_events.Server | None = None
        self._lock = asyncio.Lock()
        self._connections: set[asyncio.Task[None]] = set()

    async def address(self) -> ChannelAddress:
        """Starts listening on first use (port 0: the system picks); (host, port, secret)."""
        async with self._lock:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return self.host, port, self.secret

    @property
    def num_connections(self) -> int:
        """Routers connected now."""
        return len(self._connections)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        tasks: set[asyncio.Task[None]] = set()  # this connection's calls and its pusher
        try:
            hello = await asyncio.wait_for(_read(reader), HELLO_TIMEOUT_S)
            if len(hello) != 2 or hello[0] != _Frame.HELLO or not hmac.compare_digest(str(hello[1]), self.secret):
                log.warning("request channel: a client without the secret was refused")
                return
            while True:
                frame = await _read(reader)
                kind = frame[0]
                if kind == _Frame.CALL:
                    _, call_id, call, args = frame
                    new = asyncio.create_task(self._answer(writer, call_id, Call(call), args))
                elif kind == _Frame.SUBSCRIBE:
                    _, router_id, heartbeat_s = frame
                    if self.poll is None:
                        raise ChannelError("a router subscribed to a worker that streams no tokens")
                    new = asyncio.create_task(self._push(writer, str(router_id), float(heartbeat_s)))
                else:
                    raise ChannelError(f"unexpected frame kind {kind!r} from a router")
                tasks.add(new)
                new.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the router left (or never said hello): its calls' answers have nowhere to go
        except Exception:  # noqa: BLE001 - a malformed frame ends this connection only
            log.exception("request channel: connection ended")
        finally:
            for t in tasks:
                t.cancel()
            writer.close()
            self._connections.discard(task)

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, call: Call, args: list[Any]) -> None:
        try:
            handler = self.handlers.get(call)
            if handler is None:
                served = sorted(c.name for c in self.handlers)
                raise ValueError(f"this worker does not serve {call.name} (it serves {served})")
            reply = [_Frame.REPLY, call_id, _OK, await handler(*args)]
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the caller gets it, as a Ray call's caller would
            reply = [_Frame.REPLY, call_id, _ERROR, _error_body(err)]
        if not writer.is_closing():
            writer.write(_pack(reply))

    async def _push(self, writer: asyncio.StreamWriter, router_id: str, heartbeat_s: float) -> None:
        """The router's batches, each as soon as a step has rows for it; an empty one after
        heartbeat_s without any (the router's sign that the worker is alive)."""
        assert self.poll is not None
        while not writer.is_closing():
            batch = await self.poll(router_id, heartbeat_s)
            writer.write(_pack([_Frame.BATCH, batch]))
            await writer.drain()  # NOTE: a router that reads slowly slows this pusher, not the engine


# ---- the router's side


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str) -> None:
        self.writer = writer
        self.name = name
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.batches: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self.is_subscribed = False
        self.lost: BaseException | None = None
        self.loop = asyncio.get_running_loop()
        self.reader_task = self.loop.create_task(self._read_all(reader))

    async def _read_all(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                frame = await _read(reader)
                if frame[0] == _Frame.BATCH:
                    self.batches.put_nowait(frame[1])
                    continue
                _, call_id, status, value = frame
                future = self.pending.pop(call_id, None)
                if future is None or future.done():
                    continue  # its caller stopped waiting
                if status == _OK:
                    future.set_result(value)
                else:
                    try:
                        _raise_error(value)
                    except Exception as err:  # noqa: BLE001 - handed to the caller
                        future.set_exception(err)
        except asyncio.CancelledError:
            self._fail(ChannelError(f"the channel to {self.name} was closed"))
            raise
        except Exception as err:  # noqa: BLE001 - EOF, reset, a malformed frame: the channel is lost
            self._fail(ChannelError(f"the channel to {self.name} was lost: {type(err).__name__}: {err}"))

    def _fail(self, err: ChannelError) -> None:
        self.lost = err
        for future in self.pending.values():
            if not future.done():
                future.set_exception(err)
        self.pending.clear()
        self.batches.put_nowait(err)
        self.writer.close()

    def close(self) -> None:
        self.reader_task.cancel()
        self.writer.close()


class ChannelClient:
    """A router's connection to one worker's channel: opened on first use, shared by every call and
    the token stream, opened again on the next call after it is lost. It lives on the event loop
    that opened it; a caller on another loop is refused (ChannelError), never mixed in."""

    def __init__(self, name: str, address: Callable[[], Awaitable[ChannelAddress]],
                 connect_timeout_s: float = 10.0) -> None:
        self.name = name  # the worker, for error messages
        self._address = address
        self.connect_timeout_s = connect_timeout_s
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._call_ids = itertools.count()
        self._leaving: _Connection | None = None  # close_when_idle's: closed when its last call under way ends

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.lost is None:
            if conn.loop is not asyncio.get_running_loop():
                raise ChannelError(f"the channel to {self.name} belongs to another event loop")
            return conn
        connecting = self._connecting
        if connecting is None:
            connecting = self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Connection:
        try:
            host, port, secret = await asyncio.wait_for(self._address(), self.connect_timeout_s)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout_s)
        except Exception as err:  # noqa: BLE001 - the worker is gone or unreachable
            raise ChannelError(f"cannot open the channel to {self.name}: {type(err).__name__}: {err}") from None
        writer.write(_pack([_Frame.HELLO, secret]))
        self._conn = _Connection(reader, writer, self.name)
        return self._conn

    async def call(self, call: Call, *args: Any) -> Any:
        conn = await self._connection()
        call_id = next(self._call_ids)
        future = conn.loop.create_future()
        conn.pending[call_id] = future
        conn.writer.write(_pack([_Frame.CALL, call_id, int(call), list(args)]))
        try:
            return await future
        finally:
            conn.pending.pop(call_id, None)
            if conn is self._leaving and not conn.pending:
                self._close_leaving()

    async def next_batch(self, router_id: str, heartbeat_s: float) -> bytes:
        """The next TokenBatchMsg the worker pushed for this router (subscribing on first use)."""
        conn = await self._connection()
        if not conn.is_subscribed:
            conn.is_subscribed = True
            conn.writer.write(_pack([_Frame.SUBSCRIBE, router_id, heartbeat_s]))
        item = await conn.batches.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def reset(self) -> None:
        """Drops the connection (its calls fail); the next call opens a new one."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self.reset()

    def close_when_idle(self) -> None:
        """For a worker that left the routers' set: the calls under way keep their connection and are
        answered (a draining prefill worker finishes its prompts: closing at once failed them all,
        and the router computed them again elsewhere), and so are calls sent on it meanwhile; it
        closes when its last call under way ends (at once with none). A later use opens a new one,
        as after `reset`."""
        self._leaving = self._conn
        if self._conn is None or not self._conn.pending:
            self._close_leaving()

    def _close_leaving(self) -> None:
        conn, self._leaving = self._leaving, None
        if conn is not None:
            conn.close()
            if self._conn is conn:
                self._conn = None


__all__ = [
    "Call",
    "ChannelAddress",
    "ChannelClient",
    "ChannelError",
    "ChannelServer",
    "Refs",
    "RemoteCallError",
]
