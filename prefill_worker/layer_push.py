"""LayerPush: sends a prompt's KV layer group by layer group while the step that computes the prompt
is still running, so on a GPU the transfer overlaps the rest of the prefill instead of following it.

A request's life here, for a prompt whose handshake starts early (before its computation):
  expect   (asyncio thread, before the prompt is queued) the prompt's KV will go in these groups;
  claim    (engine thread, `hook`, as the step that completes the prompt starts) a buffer for it;
           then, as the forward queues each layer, an event (CUDA) marks layers [0, n) as written;
  offer    (asyncio thread, once the decode worker has posted one receive per group) where to;
  close    (asyncio thread, before anything else goes on the pair for it) the engine thread's part
           ends; what was sent is returned, so the caller sends the rest and then the first token.
Each group is gathered (on a side stream, after the event of its last layer) and sent as soon as it
is both written and offered, by whichever thread learns of the second: the engine thread in the
forward, or the asyncio thread when the handshake completes after the forward has queued layers.
The handshake usually completes a few milliseconds into the step, so the groups of the layers
queued by then go at once and the rest as they are queued.

Threads: one lock guards every request's state and is held across each send (sends never block),
so a close never interleaves its own sends with another thread's on a pair. In the worker the
engine thread only marks layers written; the sends are issued on the event loop (`defer`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from engine.pinned import upload
from engine.runner import OnLayers
from engine.scheduler import ScheduledRequest
from kvtransfer import TransferHandle, Transport
from kvtransfer.layout import gather_layers, layer_groups

__all__ = ["LayerPush", "Streamed"]


@dataclass
class Streamed:
    """One request's layer push."""

    num_blocks: int
    groups: list[tuple[int, int]]  # layer ranges, in the order they are sent
    decode_id: str | None = None  # set by offer: the decode worker has posted its receives
    buffer: torch.Tensor | None = None  # set by the claim (the step completing the prompt)
    index: torch.Tensor | None = None  # the prompt's block ids on the device
    # (n, event): layers [0, n) written once the event has completed (None on the CPU: written)
    written: list[tuple[int, torch.cuda.Event | None]] = field(default_factory=list)
    handles: list[TransferHandle] = field(default_factory=list)  # the groups sent, in order
    gather_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    is_closed: bool = False
    # How far the step had got when the offer came, in whole layer groups' layers (-1: before the claim).
    layers_written_at_offer: int = -1

    @property
    def was_claimed(self) -> bool:
        return self.buffer is not None

    def gather_device_seconds(self) -> float:
        """The gathers' time on the device (0.0 on the CPU); once the sends that read them are done."""
        return sum(a.elapsed_time(b) for a, b in self.gather_events) / 1e3

    def tail_device_seconds(self) -> float:
        """Device seconds from the step's last layer written to the last group sent: what the push
        adds after the forward (0.0 where not timed). Once the sends are done."""
        last = next((event for n, event in self.written if n >= self.groups[-1][1]), None)
        if last is None or len(self.handles) < len(self.groups):
            return 0.0
        return self.handles[-1].seconds_since(last) or 0.0


class LayerPush:
    def __init__(
        self, transport: Transport, kv: torch.Tensor, defer: Callable[[Callable[[], None]], None] | None = None
    ) -> None:
        """defer: runs a callable on another thread soon (the worker's event loop); the engine thread
        then only marks layers written and the sends are issued there (an NCCL send costs the host
        ~0.4 ms to issue, which a host-bound forward would wait for). None: sends are issued by
        whichever thread learns a group is ready (tests)."""
        self.transport = transport
        self._defer = defer
        self.kv = kv  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.num_layers = kv.shape[0]
        self._lock = threading.Lock()
        self._streams: dict[str, Streamed] = {}
        # The gathers' stream; high priority, as the pairs' NCCL streams: a group's gather and send run
        # beside the step's next layers, not after them.
        self._side = torch.cuda.Stream(kv.device, priority=-1) if kv.is_cuda else None

    # ---- the asyncio side
    def expect(self, request_id: str, num_blocks: int, num_messages: int) -> None:
        """The prompt's KV will go in `num_messages` layer groups of `num_blocks` blocks: the step that
        completes it keeps track of its layers. Before the prompt is queued."""
        with self._lock:
            self._streams[request_id] = Streamed(num_blocks, layer_groups(self.num_layers, num_messages))

    def offer(self, request_id: str, decode_id: str) -> None:
        """The decode worker `decode_id` has posted the receives: the groups written go now, the rest
        as they are written."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and not stream.is_closed:
                stream.decode_id = decode_id
                if stream.was_claimed:
                    stream.layers_written_at_offer = stream.written[-1][0] if stream.written else 0
                self._pump(stream)

    def is_claimed(self, request_id: str) -> bool:
        with self._lock:
            stream = self._streams.get(request_id)
            return stream is not None and stream.was_claimed

    def close(self, request_id: str) -> Streamed | None:
        """Ends the engine thread's part for the request (idempotent). Returns its push if it was
        offered (its `handles` are the groups sent so far), else None (nothing was sent)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return None
            stream.is_closed = True
            return stream if stream.decode_id is not None else None

    # ---- the engine thread
    def hook(self, scheduled: Sequence[ScheduledRequest]) -> OnLayers | None:
        """EngineCore.layer_hook: claims the expected requests whose prompt this step completes."""
        if not self._streams:  # NOTE: a racy read, only to skip the lock on most steps
            return None
        claimed: list[tuple[Streamed, list[int]]] = []
        with self._lock:
            for s in scheduled:
                stream = self._streams.get(s.request.request_id)
                if stream is None or stream.was_claimed or not s.will_sample:
                    continue
                claimed.append((stream, list(s.request.block_ids[: stream.num_blocks])))
        if not claimed:
            return None
        for stream, block_ids in claimed:
            with self._on_side():  # NOTE: the buffer's first use is on the side stream (the allocator's rule)
                shape = (*self.kv.shape[:2], len(block_ids), *self.kv.shape[3:])
                index = upload(block_ids, torch.long, self.kv.device)
                buffer = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
            with self._lock:
                stream.index, stream.buffer = index, buffer
        streams = [stream for stream, _ in claimed]
        # NOTE: only a group's last layer can make a group sendable: after any other layer there is
        # nothing to mark and no pump to wake the event loop for (one wake-up a group, not a layer).
        stops = {stop for stream in streams for _, stop in stream.groups}

        def on_layers(num_written: int) -> None:
            if num_written not in stops:
                return
            written = None
            if self._side is not None:
                written = torch.cuda.Event(enable_timing=True)  # NOTE: timed: tail_device_seconds
                written.record()  # the compute stream, past layers [0, num_written)
            with self._lock:
                for stream in streams:
                    stream.written.append((num_written, written))
            if self._defer is not None:
                self._defer(pump)
            else:
                pump()

        def pump() -> None:
            with self._lock:
                for stream in streams:
                    self._pump(stream)

        return on_layers

    # ---- either thread, the lock held
    def _pump(self, stream: Streamed) -> None:
        """Sends the groups that are written, in order, once offered and claimed."""
        while (stream.decode_id is not None and stream.buffer is not None and not stream.is_closed
               and len(stream.handles) < len(stream.groups)):
            first, stop = stream.groups[len(stream.handles)]
            written = next((w for w in stream.written if w[0] >= stop), None)
            if written is None:
                return
            self._send_group(stream, first, stop, written[1])

    def _send_group(self, stream: Streamed, first: int, stop: int, written: torch.cuda.Event | None) -> None:
        assert stream.buffer is not None and stream.index is not None and stream.decode_id is not None
        if self._side is None:
            gather_layers(self.kv, stream.index, stream.buffer, first, stop)
            stream.handles.append(self.transport.send(stream.decode_id, stream.buffer[first:stop]))
            return
        assert written is not None
        self._side.wait_event(written)
        with torch.cuda.stream(self._side):
            started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
            gather_layers(self.kv, stream.index, stream.buffer, first, stop)
            ended.record()
            stream.gather_events.append((started, ended))
            # NOTE: the send's stream waits for this (the current) stream: the gather above
            stream.handles.append(self.transport.send(stream.decode_id, stream.buffer[first:stop]))

    def _on_side(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self._side) if self._side is not None else nullcontext()

