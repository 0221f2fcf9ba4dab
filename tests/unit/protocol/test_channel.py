"""The request channel's protocol with plain handlers (no engine): calls and their answers, the
errors a caller gets (bad input as InvalidRequestError, other failures named), the secret, the
frame size limit, pushed batches with their heartbeat, and a lost connection failing what waits;
a worker that streams no tokens refusing a subscription; worker references (Refs) in a call."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator

import pytest

from engine.validation import InvalidRequestError
from protocol.clients import DecodeClient
from protocol.channel import (
    MAX_FRAME_BYTES,
    Call,
    ChannelClient,
    ChannelError,
    ChannelServer,
    Refs,
    RemoteCallError,
)
from protocol.messages import TokenBatchMsg, TokenOutputMsg


class _Worker:
    """Handlers like a decode worker's, and an outbox `poll` can wait on."""

    def __init__(self) -> None:
        self.rows: list[TokenOutputMsg] = []
        self.ready = asyncio.Event()
        self.calls: list[tuple[Call, tuple]] = []
        self.release = asyncio.Event()  # abort waits for it: a call still running when the connection goes

    async def submit(self, request: bytes) -> float:
        self.calls.append((Call.SUBMIT, (request,)))
        if request == b"bad":
            raise InvalidRequestError("prompt", "is empty; at least 1 token is required")
        if request == b"boom":
            raise KeyError("lost")
        return 1.5

    async def reserve(self, request: bytes) -> bytes | None:
        return None if request == b"full" else b"lease:" + request

    async def abort(self, request_id: str) -> bool:
        await self.release.wait()
        return True

    async def poll(self, router_id: str, timeout_s: float) -> bytes:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        rows, self.rows = self.rows, []
        self.ready.clear()
        return TokenBatchMsg(worker_id=router_id, outputs=rows).encode()

    def server(self) -> ChannelServer:
        return ChannelServer({Call.SUBMIT: self.submit, Call.RESERVE: self.reserve, Call.ABORT: self.abort},
                             self.poll, "127.0.0.1")


async def _client(server: ChannelServer, secret: str | None = None) -> ChannelClient:
    host, port, real = await server.address()

    async def address():
        return host, port, real if secret is None else secret

    return ChannelClient("w0", address, connect_timeout_s=5.0)


@contextlib.asynccontextmanager
async def _connected() -> AsyncIterator[tuple[_Worker, ChannelServer, ChannelClient]]:
    """A worker serving on the channel, its server and a client of it; both closed after."""
    worker = _Worker()
    server = worker.server()
    client = await _client(server)
    try:
        yield worker, server, client
    finally:
        client.close()
        await server.close()


async def _pushed_rows(worker: _Worker, client: ChannelClient, row: TokenOutputMsg) -> list[TokenOutputMsg]:
    """ROW appears at the worker: the rows of the first non-empty batch its stream then carries."""
    worker.rows.append(row)
    worker.ready.set()
    for _ in range(100):  # bounded: heartbeats may come first
        batch = TokenBatchMsg.decode(await asyncio.wait_for(client.next_batch("r0", 0.05), 10))
        if batch.outputs:
            break
    return batch.outputs


def test_calls_answer_and_errors_keep_their_kind():
    async def main():
        async with _connected() as (worker, server, client):
            results = await asyncio.wait_for(asyncio.gather(
                client.call(Call.SUBMIT, b"ok"), client.call(Call.RESERVE, b"r1"), client.call(Call.RESERVE, b"full"),
            ), 10)
            assert results == [1.5, b"lease:r1", None]
            with pytest.raises(InvalidRequestError) as invalid:
                await asyncio.wait_for(client.call(Call.SUBMIT, b"bad"), 10)
            assert (invalid.value.field == "prompt"
                    and str(invalid.value) == "prompt: is empty; at least 1 token is required")
            with pytest.raises(RemoteCallError, match="KeyError: 'lost'"):
                await asyncio.wait_for(client.call(Call.SUBMIT, b"boom"), 10)
            with pytest.raises(RemoteCallError, match=r"does not serve PREFILL_LOCALLY \(it serves \['ABORT', "):
                await asyncio.wait_for(client.call(Call.PREFILL_LOCALLY, b"x"), 10)
            # the connection outlives failed calls: one connection, every call on it
            assert await asyncio.wait_for(client.call(Call.SUBMIT, b"again"), 10) == 1.5
            assert len(server._connections) == 1

    asyncio.run(main())


def test_a_client_without_the_secret_is_refused():
    async def main():
        worker = _Worker()
        server = worker.server()
        client = await _client(server, secret="0" * 32)
        try:
            with pytest.raises(ChannelError, match="lost"):
                await asyncio.wait_for(client.call(Call.SUBMIT, b"ok"), 10)
            assert worker.calls == []  # nothing ran
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_an_oversized_frame_ends_the_connection_and_nothing_runs():
    async def main():
        worker = _Worker()
        server = worker.server()
        host, port, secret = await server.address()
        reader, writer = await asyncio.open_connection(host, port)
        try:
            import msgpack

            hello = msgpack.packb([1, secret])
            writer.write(struct.pack(">I", len(hello)) + hello + struct.pack(">I", MAX_FRAME_BYTES + 1))
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the worker, no answer
            assert worker.calls == []
        finally:
            writer.close()
            await server.close()

    asyncio.run(main())


def test_batches_are_pushed_as_rows_appear_and_an_idle_worker_sends_heartbeats():
    async def main():
        async with _connected() as (worker, _, client):
            loop = asyncio.get_running_loop()
            start = loop.time()
            idle = TokenBatchMsg.decode(await asyncio.wait_for(client.next_batch("r0", 0.05), 10))
            assert idle.outputs == [] and loop.time() - start < 5  # the heartbeat: an empty batch
            # rows appear: the next batch carries them without another request from the router
            row = TokenOutputMsg(request_id="a", new_token_ids=[7])
            assert await _pushed_rows(worker, client, row) == [row]

    asyncio.run(main())


def test_a_lost_connection_fails_waiting_calls_and_the_stream_then_the_next_call_reconnects():
    async def main():
        async with _connected() as (worker, server, client):
            pending = asyncio.ensure_future(client.call(Call.ABORT, "a"))  # waits on the worker
            stream = asyncio.ensure_future(client.next_batch("r0", 30.0))  # no rows, no heartbeat for 30 s
            await asyncio.sleep(0.1)
            for task in list(server._connections):  # the worker's side of the connection goes
                task.cancel()
            with pytest.raises(ChannelError):
                await asyncio.wait_for(pending, 10)
            with pytest.raises(ChannelError):
                await asyncio.wait_for(stream, 10)
            worker.release.set()
            assert await asyncio.wait_for(client.call(Call.ABORT, "a"), 10) is True  # a new connection

    asyncio.run(main())


def test_a_worker_that_is_not_listening_is_a_channel_error():
    async def main():
        async def address():
            return "127.0.0.1", 1, "x"  # nothing listens on port 1

        client = ChannelClient("w9", address, connect_timeout_s=5.0)
        with pytest.raises(ChannelError, match="cannot open the channel to w9"):
            await asyncio.wait_for(client.call(Call.SUBMIT, b"ok"), 10)

    asyncio.run(main())


def test_a_poll_whose_caller_stops_waiting_drops_the_connection():
    """A router that gives up on a quiet worker must not leave its pusher taking rows nobody reads."""

    async def main():
        async with _connected() as (worker, server, client):
            handle = DecodeClient("w0", worker, client)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(handle.next_batch("r0", 30.0), 0.2)
            for _ in range(100):  # bounded: the worker sees the close
                if not server._connections:
                    break
                await asyncio.sleep(0.02)
            assert not server._connections

    asyncio.run(main())


class _Picklable:
    """Stands in for a Ray actor handle: pickles, and counts how often."""

    dumps = 0

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        _Picklable.dumps += 1
        return _Picklable, (self.name,)


def test_refs_pickle_each_handle_once_and_load_it_once():
    refs, other_side = Refs(), Refs()
    d0 = _Picklable("d0")
    _Picklable.dumps = 0
    first = refs.encode(d0)
    assert refs.encode(d0) == refs.encode(d0) == first
    assert _Picklable.dumps == 1  # once per handle object, not once per call
    loaded = other_side.decode(first)
    assert isinstance(loaded, _Picklable) and loaded.name == "d0"
    assert other_side.decode(first) is loaded  # loaded once
    assert refs.encode(None) is None and other_side.decode(None) is None


def test_refs_keep_a_bounded_number_of_handles(monkeypatch):
    monkeypatch.setattr("protocol.channel._NUM_REFS_KEPT", 3)
    refs = Refs()
    handles = [_Picklable(f"d{i}") for i in range(5)]
    encoded = [refs.encode(h) for h in handles]
    assert len(refs._encoded) == 3 and len({e for e in encoded}) == 5
    for e in encoded:
        refs.decode(e)
    assert len(refs._decoded) == 3


def test_a_worker_without_a_token_stream_refuses_a_subscription_and_names_what_it_serves():
    async def main():
        async def prefill(task: bytes, ref: bytes | None) -> bytes:
            return task + (ref or b"")

        server = ChannelServer({Call.PREFILL: prefill}, None, "127.0.0.1")
        client = await _client(server)
        try:
            assert await asyncio.wait_for(client.call(Call.PREFILL, b"t", b"+r"), 10) == b"t+r"
            with pytest.raises(RemoteCallError, match=r"does not serve SUBMIT \(it serves \['PREFILL'\]\)"):
                await asyncio.wait_for(client.call(Call.SUBMIT, b"x"), 10)
            with pytest.raises(ChannelError, match="lost"):  # the worker closes a connection that subscribes
                await asyncio.wait_for(client.next_batch("r0", 1.0), 10)
            assert await asyncio.wait_for(client.call(Call.PREFILL, b"u", None), 10) == b"u"  # a new connection
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_a_channel_closed_when_idle_answers_the_calls_under_way_then_closes():
    """A worker that left the routers' set (a draining prefill worker): its prompts under way, and
    one sent meanwhile by a request that chose the worker before, are answered over the channel; then
    that connection closes."""
    async def main():
        release = asyncio.Event()

        async def prefill(task: bytes, ref: bytes | None) -> bytes:
            await release.wait()
            return task

        server = ChannelServer({Call.PREFILL: prefill}, None, "127.0.0.1")
        client = await _client(server)
        try:
            under_way = [asyncio.ensure_future(client.call(Call.PREFILL, t, None)) for t in (b"a", b"b")]
            for _ in range(200):  # bounded: both calls reach the worker
                await asyncio.sleep(0.01)
                if client._conn is not None and len(client._conn.pending) == 2:
                    break
            client.close_when_idle()
            late = asyncio.ensure_future(client.call(Call.PREFILL, b"late", None))  # chose the worker before
            await asyncio.sleep(0.05)
            assert server.num_connections == 1 and not any(f.done() for f in [*under_way, late])
            release.set()
            assert await asyncio.wait_for(asyncio.gather(*under_way, late), 10) == [b"a", b"b", b"late"]
            for _ in range(200):
                if server.num_connections == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.num_connections == 0  # closed after the last answer
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_a_channel_closed_when_idle_with_nothing_under_way_closes_at_once():
    async def main():
        async def prefill(task: bytes, ref: bytes | None) -> bytes:
            return task

        server = ChannelServer({Call.PREFILL: prefill}, None, "127.0.0.1")
        client = await _client(server)
        try:
            assert await asyncio.wait_for(client.call(Call.PREFILL, b"a", None), 10) == b"a"
            client.close_when_idle()
            assert client._conn is None
            assert await asyncio.wait_for(client.call(Call.PREFILL, b"b", None), 10) == b"b"  # reopened, answered
            assert client._conn is not None  # a later use keeps its new connection (a stream may ride it)
            client.close()
            for _ in range(200):
                if server.num_connections == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.num_connections == 0
        finally:
            await server.close()

    asyncio.run(main())


def test_a_stream_on_a_connection_opened_after_close_when_idle_outlives_the_calls_beside_it():
    """A channel closed when idle and used again (bench.disagg hands one WorkerChannels the sets of
    modes run one after another): its new connection stays open after a call on it ends, so the token
    stream riding it goes on (closing it there failed the stream: 'no colocated worker is serving')."""
    async def main():
        async with _connected() as (worker, _, client):
            assert await asyncio.wait_for(client.call(Call.SUBMIT, b"r"), 10) == 1.5
            client.close_when_idle()  # nothing under way: closed at once
            idle = TokenBatchMsg.decode(await asyncio.wait_for(client.next_batch("r0", 0.05), 10))  # reopens
            assert idle.outputs == []
            assert await asyncio.wait_for(client.call(Call.RESERVE, b"x"), 10) == b"lease:x"
            row = TokenOutputMsg(request_id="a", new_token_ids=[7])
            assert await _pushed_rows(worker, client, row) == [row]

    asyncio.run(main())
