"""LayerPush (prefill_worker/layer_push.py) over real transports (local, gloo; nccl on two GPUs): a
claimed request's layer groups are gathered and sent while the step's forward runs, each once its
layers are written and the decode side has posted its receives (whichever comes second); `close`
stops the sends; only expected requests whose prompt the step completes are claimed."""

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


def _post_recvs(builder: Builder, b, num_blocks: int, num_messages: int):
    landing = torch.zeros(LAYOUT.buffer_shape(num_blocks), device=builder.device(1))
    groups = layer_groups(LAYOUT.num_layers, num_messages)
    return landing, [b.recv("prefill-0", landing[first:stop]) for first, stop in groups]


@pytest.mark.parametrize("offered_after_layers", [0, 3], ids=["offered-first", "offered-mid-forward"])
def test_each_group_goes_once_written_and_offered(pair, offered_after_layers: int) -> None:
    builder, a, b = pair
    kv = builder.kv(0, LAYOUT)
    blocks = [7, 2, 11]
    groups = layer_groups(LAYOUT.num_layers, 3)  # [0, 1), [1, 3), [3, 5)
    landing, recvs = _post_recvs(builder, b, len(blocks), 3)
    push = LayerPush(a, kv)
    push.expect("r", len(blocks), 3)
    on_layers = push.hook([_scheduled("other", [1]), _scheduled("r", [*blocks, 30])])
    assert on_layers is not None and push.is_claimed("r")
    expected = gather_blocks(kv, blocks).cpu()
    sent_after: list[int] = []
    for layer in range(LAYOUT.num_layers):
        if layer == offered_after_layers:
            push.offer("r", "decode-0")  # the handshake completes (on the asyncio thread)
        on_layers(layer + 1)  # the step has written layer `layer`
        num_sent = len(push._streams["r"].handles)
        sent_after.append(num_sent)
        # Overwrite the layers already sent: what arrives must be what was there when their group
        # went (gathered then, not after the step).
        if num_sent:
            if kv.is_cuda:  # NOTE: the gathers run on a side stream; a real step never writes sent layers
                torch.cuda.synchronize(kv.device)
            kv[: groups[num_sent - 1][1], :, blocks] = -1.0
    # Offered first: each group as its last layer is written. Offered after 3 layers: the two
    # groups written by then go at the offer, the last when written.
    assert sent_after == ([1, 1, 2, 2, 3] if offered_after_layers == 0 else [0, 0, 0, 2, 3])
    streamed = push.close("r")
    assert streamed is not None and streamed.was_claimed and len(streamed.handles) == 3
    _wait(streamed.handles)
    _wait(recvs)
    assert torch.equal(landing.cpu(), expected)
    assert push.close("r") is None  # idempotent


def test_an_offer_after_the_forward_sends_every_group_at_once(pair) -> None:
    builder, a, b = pair
    kv = builder.kv(0, LAYOUT)
    landing, recvs = _post_recvs(builder, b, 2, 2)
    push = LayerPush(a, kv)
    push.expect("r", 2, 2)
    on_layers = push.hook([_scheduled("r", [3, 4])])
    assert on_layers is not None
    for n in range(1, LAYOUT.num_layers + 1):
        on_layers(n)
    push.offer("r", "decode-0")
    streamed = push.close("r")
    assert streamed is not None and len(streamed.handles) == 2
    _wait(streamed.handles)
    _wait(recvs)
    assert torch.equal(landing.cpu(), gather_blocks(kv, [3, 4]).cpu())


def test_close_stops_the_sends_and_the_caller_sends_the_rest(pair) -> None:
    builder, a, b = pair
    kv = builder.kv(0, LAYOUT)
    groups = layer_groups(LAYOUT.num_layers, LAYOUT.num_layers)
    landing, recvs = _post_recvs(builder, b, 2, LAYOUT.num_layers)
    push = LayerPush(a, kv)
    push.expect("r", 2, LAYOUT.num_layers)
    push.offer("r", "decode-0")
    on_layers = push.hook([_scheduled("r", [3, 4])])
    assert on_layers is not None
    on_layers(2)
    streamed = push.close("r")  # e.g. the step failed after two layers: the asyncio side takes over
    on_layers(LAYOUT.num_layers)
    assert streamed is not None and len(streamed.handles) == 2
    assert streamed.buffer is not None
    rest = [a.send("decode-0", streamed.buffer[first:stop]) for first, stop in groups[2:]]
    _wait([*streamed.handles, *rest])
    _wait(recvs)
    assert torch.equal(landing[:2].cpu(), gather_blocks(kv, [3, 4])[:2].cpu())


def test_only_expected_requests_whose_prompt_completes_are_claimed(pair) -> None:
    builder, a, _ = pair
    push = LayerPush(a, builder.kv(0, LAYOUT))
    assert push.hook([_scheduled("r", [1])]) is None  # nothing expected
    push.expect("r", 1, 1)
    assert push.hook([_scheduled("r", [1], will_sample=False)]) is None  # a chunk short of the prompt's end
    assert push.hook([_scheduled("s", [1])]) is None  # another request
    assert not push.is_claimed("r")
    push.offer("r", "decode-0")
    streamed = push.close("r")  # offered, never claimed: the caller sends everything
    assert streamed is not None and not streamed.was_claimed and streamed.handles == []
    assert push.hook([_scheduled("r", [1])]) is None  # closed: a later step cannot claim it
    push.expect("t", 1, 1)
    assert push.close("t") is None  # never offered (the handshake failed): nothing was sent


def _deferred_push(pair, num_messages: int):
    """The worker's configuration: request "r" (blocks 6 and 8) expected, offered and claimed by a
    step, its sends deferred to a list (the event loop's queue). Returns the push, the step's
    on_layers, the deferred runs, and a check that closes the push and finds every group sent
    (`num_sent` of them) and landed intact."""
    builder, a, b = pair
    kv = builder.kv(0, LAYOUT)
    landing, recvs = _post_recvs(builder, b, 2, num_messages)
    deferred: list = []
    push = LayerPush(a, kv, deferred.append)
    push.expect("r", 2, num_messages)
    push.offer("r", "decode-0")
    on_layers = push.hook([_scheduled("r", [6, 8])])
    assert on_layers is not None

    def check_arrived(num_sent: int) -> None:
        streamed = push.close("r")
        assert streamed is not None and len(streamed.handles) == num_sent
        _wait(streamed.handles)
        _wait(recvs)
        assert torch.equal(landing.cpu(), gather_blocks(kv, [6, 8]).cpu())

    return push, on_layers, deferred, check_arrived


def test_with_defer_the_engine_thread_only_marks_layers_and_the_loop_sends(pair) -> None:
    """The worker's configuration: on_layers (the engine thread) marks layers written and hands the
    sends to another thread (`defer`); they go when that runs, each group once written."""
    push, on_layers, deferred, check_arrived = _deferred_push(pair, num_messages=5)
    on_layers(1)
    on_layers(2)
    assert push._streams["r"].handles == [] and len(deferred) == 2  # nothing sent on the engine thread
    deferred.pop(0)()
    assert len(push._streams["r"].handles) == 2  # both groups written by then
    for n in range(3, LAYOUT.num_layers + 1):
        on_layers(n)
    for run in deferred:
        run()
    check_arrived(5)


def test_the_event_loop_is_woken_once_a_group_not_once_a_layer(pair) -> None:
    """With fewer groups than layers (5 layers in 2 groups: [0, 3) and [3, 5)), only a group's last
    layer marks and defers a pump: 2 wake-ups of the event loop a forward, not 5; every group still
    goes once written."""
    push, on_layers, deferred, check_arrived = _deferred_push(pair, num_messages=2)
    for n in range(1, LAYOUT.num_layers + 1):
        on_layers(n)
        if n == 3:
            assert len(deferred) == 1  # the first group's last layer
    assert len(deferred) == 2
    for run in deferred:
        run()
    check_arrived(2)
