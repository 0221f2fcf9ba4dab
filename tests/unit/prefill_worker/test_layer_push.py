"""LayerPush (prefill_worker/layer_push.py) over real transports (local, gloo; nccl on two GPUs): a
claimed request's layer groups are gathered and sent while the step's forward runs, each as soon as
its layers are computed; `close` stops the engine thread's sends; only offered requests whose prompt
the step completes are claimed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.scheduler import ScheduledRequest
from kvtransfer import KvLayout, gather_blocks
from kvtransfer.layout import layer_groups
from prefill_worker.layer_push import LayerPush
from tests.unit.kvtransfer.conftest import KINDS, Builder, pair_both

LAYOUT = KvLayout(num_layers=5, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
WAIT_S = 10.0


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest):
    builder = Builder(request.param)
    a, b = builder.make("prefill-0", LAYOUT, index=0), builder.make("decode-0", LAYOUT, index=1)
    assert pair_both(a, b) == [None, None]
    yield builder, a, b
    for transport in builder.built:
        transport.close()


def _scheduled(request_id: str, block_ids: list[int], will_sample: bool = True) -> ScheduledRequest:
    request = SimpleNamespace(request_id=request_id, block_ids=block_ids)
    return ScheduledRequest(request, 8, will_sample)  # type: ignore[arg-type]


def _wait(handles) -> None:
    for handle in handles:
        assert handle.wait(WAIT_S)


def test_each_group_goes_when_its_layers_are_computed(pair) -> None:
    builder, a, b = pair
    kv = builder.kv(0, LAYOUT)
    blocks = [7, 2, 11]
    groups = layer_groups(LAYOUT.num_layers, 3)  # [0, 1), [1, 3), [3, 5)
    landing = torch.zeros(LAYOUT.buffer_shape(len(blocks)), device=builder.device(1))
    recvs = [b.recv("prefill-0", landing[first:stop]) for first, stop in groups]
    push = LayerPush(a, kv)
    push.offer("r", "decode-0", len(blocks), 3)
    on_layers = push.hook([_scheduled("other", [1]), _scheduled("r", [*blocks, 30])])
    assert on_layers is not None and push.is_claimed("r")
    expected = gather_blocks(kv, blocks).cpu()
    sent_after: list[int] = []
    for layer in range(LAYOUT.num_layers):
        # The step "computes" layer `layer` (its KV is in place), then hears of it.
        on_layers(layer + 1)
        num_sent = len(push._streams["r"].handles)
        sent_after.append(num_sent)
        # Overwrite the layers already sent: what arrives must be what was there when their group
        # went (gathered then, not after the step).
        if num_sent:
            if kv.is_cuda:  # NOTE: the gathers run on a side stream; a real step never writes sent layers
                torch.cuda.synchronize(kv.device)
            kv[: groups[num_sent - 1][1], :, blocks] = -1.0
    assert sent_after == [1, 1, 2, 2, 3]
    streamed = push.close("r")
    assert streamed is not None and streamed.was_claimed and len(streamed.handles) == 3
    _wait(streamed.handles)
    _wait(recvs)
    assert torch.equal(landing.cpu(), expected)
    assert push.close("r") is None  # idempotent


def test_close_stops_the_engine_threads_sends(pair) -> None:
    builder, a, b = pair
    kv = builder.kv(0, LAYOUT)
    landing = torch.zeros(LAYOUT.buffer_shape(2), device=builder.device(1))
    groups = layer_groups(LAYOUT.num_layers, LAYOUT.num_layers)
    recvs = [b.recv("prefill-0", landing[first:stop]) for first, stop in groups]
    push = LayerPush(a, kv)
    push.offer("r", "decode-0", 2, LAYOUT.num_layers)
    on_layers = push.hook([_scheduled("r", [3, 4])])
    assert on_layers is not None
    on_layers(2)
    streamed = push.close("r")  # e.g. the step failed after two layers: the asyncio side takes over
    on_layers(LAYOUT.num_layers)
    assert streamed is not None and len(streamed.handles) == 2
    # The asyncio side sends the remaining groups (here from the same buffer) in order.
    assert streamed.buffer is not None
    rest = [a.send("decode-0", streamed.buffer[first:stop]) for first, stop in groups[2:]]
    _wait([*streamed.handles, *rest])
    _wait(recvs)
    assert torch.equal(landing[:2].cpu(), gather_blocks(kv, [3, 4])[:2].cpu())


def test_only_offered_requests_whose_prompt_completes_are_claimed(pair) -> None:
    builder, a, _ = pair
    push = LayerPush(a, builder.kv(0, LAYOUT))
    assert push.hook([_scheduled("r", [1])]) is None  # nothing offered
    push.offer("r", "decode-0", 1, 1)
    assert push.hook([_scheduled("r", [1], will_sample=False)]) is None  # a chunk short of the prompt's end
    assert push.hook([_scheduled("s", [1])]) is None  # another request
    assert not push.is_claimed("r")
    streamed = push.close("r")  # offered, never claimed: the asyncio side sends everything
    assert streamed is not None and not streamed.was_claimed and streamed.handles == []
    assert push.hook([_scheduled("r", [1])]) is None  # closed: a later step cannot claim it
