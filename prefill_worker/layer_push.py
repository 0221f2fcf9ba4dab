"""LayerPush: sends a prompt's KV layer group by layer group while the step that computes the prompt
is still running, so on a GPU the transfer overlaps the rest of the prefill instead of following it.

The prefill worker offers a request once its early handshake was accepted (the decode worker has
posted one receive per layer group, then one for the first token). The engine thread, about to run
the step that completes that prompt, claims the offer (`hooks`) and, each time the forward has
queued the layers of a group, gathers them into the group's slice of one buffer (on a side stream,
after an event on the compute stream) and sends that slice. The worker's asyncio side then `close`s
the request: from then on the engine thread sends nothing more for it, and what it sent (and how
many groups) is returned, so the asyncio side sends whatever groups are missing (a stand-in after a
failed step) and then the first token, in the order the decode worker receives them.

Threads: `offer` and `close` run on the asyncio thread, the hook on the engine thread; one lock
guards every stream's state and is held across each send (sends never block), so a close never
interleaves its sends with the engine thread's on a pair.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.pinned import upload
from engine.runner import OnLayers
from engine.scheduler import ScheduledRequest
from kvtransfer import TransferHandle, Transport
from kvtransfer.layout import gather_layers, layer_groups

__all__ = ["LayerPush", "Streamed"]


class _State(enum.Enum):
    OFFERED = "offered"  # the decode side waits for the groups; no step has claimed the request yet
    CLAIMED = "claimed"  # the engine thread sends groups as its step computes them
    CLOSED = "closed"  # the asyncio side owns whatever is left to send


@dataclass
class Streamed:
    """What the engine thread did for one request: the buffer its groups were gathered into (None if
    never claimed) and the handles of the groups it sent, in order."""

    decode_id: str
    num_blocks: int
    groups: list[tuple[int, int]]
    state: _State = _State.OFFERED
    buffer: torch.Tensor | None = None
    index: torch.Tensor | None = None  # the prompt's block ids on the device
    handles: list[TransferHandle] = field(default_factory=list)
    gather_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    @property
    def was_claimed(self) -> bool:
        return self.buffer is not None

    def gather_device_seconds(self) -> float:
        """The gathers' time on the device (0.0 on the CPU); once the sends that read them are done."""
        return sum(a.elapsed_time(b) for a, b in self.gather_events) / 1e3

    def send_device_seconds(self) -> float:
        """The sends' time on the device, summed over the groups (each from when its stream reached it)."""
        return sum(h.device_seconds() or 0.0 for h in self.handles)


class LayerPush:
    def __init__(self, transport: Transport, kv: torch.Tensor) -> None:
        self.transport = transport
        self.kv = kv  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.num_layers = kv.shape[0]
        self._lock = threading.Lock()
        self._streams: dict[str, Streamed] = {}
        self._side = torch.cuda.Stream(kv.device) if kv.is_cuda else None

    # ---- the asyncio side
    def offer(self, request_id: str, decode_id: str, num_blocks: int, num_messages: int) -> None:
        """The decode worker has posted receives for `num_messages` layer groups of `num_blocks`
        blocks; the step that completes the prompt may send them."""
        with self._lock:
            self._streams[request_id] = Streamed(decode_id, num_blocks, layer_groups(self.num_layers, num_messages))

    def is_claimed(self, request_id: str) -> bool:
        with self._lock:
            stream = self._streams.get(request_id)
            return stream is not None and stream.was_claimed

    def close(self, request_id: str) -> Streamed | None:
        """Ends the engine thread's part for the request (idempotent): its stream, or None if it was
        never offered. Call it before sending anything else on the pair for this request."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.state = _State.CLOSED
            return stream

    # ---- the engine thread
    def hook(self, scheduled: Sequence[ScheduledRequest]) -> OnLayers | None:
        """EngineCore.layer_hook: claims the offered requests whose prompt this step completes."""
        if not self._streams:  # NOTE: a racy read, only to skip the lock on most steps
            return None
        claimed: list[tuple[Streamed, list[int]]] = []
        with self._lock:
            for s in scheduled:
                stream = self._streams.get(s.request.request_id)
                if stream is None or stream.state is not _State.OFFERED or not s.will_sample:
                    continue
                stream.state = _State.CLAIMED
                claimed.append((stream, list(s.request.block_ids[: stream.num_blocks])))
        if not claimed:
            return None
        for stream, block_ids in claimed:
            with self._on_side():  # NOTE: the buffer's first use is on the side stream (the allocator's rule)
                shape = (*self.kv.shape[:2], len(block_ids), *self.kv.shape[3:])
                stream.buffer = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
                stream.index = upload(block_ids, torch.long, self.kv.device)
        streams = [stream for stream, _ in claimed]

        def on_layers(num_done: int) -> None:
            with self._lock:
                for stream in streams:
                    while (stream.state is _State.CLAIMED and len(stream.handles) < len(stream.groups)
                           and stream.groups[len(stream.handles)][1] <= num_done):
                        self._send_group(stream, *stream.groups[len(stream.handles)])

        return on_layers

    def _send_group(self, stream: Streamed, first: int, stop: int) -> None:  # engine thread, lock held
        assert stream.buffer is not None and stream.index is not None
        if self._side is None:
            gather_layers(self.kv, stream.index, stream.buffer, first, stop)
            stream.handles.append(self.transport.send(stream.decode_id, stream.buffer[first:stop]))
            return
        computed = torch.cuda.Event()
        computed.record()  # the compute stream, past layers [0, stop)
        self._side.wait_event(computed)
        with torch.cuda.stream(self._side):
            started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
            gather_layers(self.kv, stream.index, stream.buffer, first, stop)
            ended.record()
            stream.gather_events.append((started, ended))
            # NOTE: the send's stream waits for this (the current) stream: the gather above
            stream.handles.append(self.transport.send(stream.decode_id, stream.buffer[first:stop]))

    def _on_side(self) -> torch.cuda.StreamContext | _NoStream:
        return torch.cuda.stream(self._side) if self._side is not None else _NoStream()


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
