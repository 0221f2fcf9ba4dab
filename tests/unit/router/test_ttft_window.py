"""The router's first tokens against the TTFT SLO over its last window (router/ttft_window.py), which the
controller's autoscaler reads: late ones counted, old ones forgotten, and a request still waiting past the
SLO counted late before its first token comes; and RouterCore feeds it from its token streams."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from router.core import RouterConfig, RouterCore
from router.ttft_window import TtftWindow
from tests.unit.router.scripted import ScriptedDispatcher, tools_tokenizer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_first_tokens_later_than_the_slo_are_counted_over_the_window():
    clock = Clock()
    window = TtftWindow("router-a", ttft_s=0.3, clock=clock, window_s=10.0)
    for i, wait_s in enumerate([0.1, 0.5, 0.2, 0.9]):  # two of four late
        window.begin(i)
        clock.now += wait_s
        window.first_token(i)
        window.end(i)
    counts = window.counts()
    assert (counts.router_id, counts.num_first_tokens, counts.num_over_slo) == ("router-a", 4, 2)
    clock.now += 9.0  # the first two (at 100.1 and 100.6) leave the 10 s window
    assert (window.counts().num_first_tokens, window.counts().num_over_slo) == (2, 1)
    clock.now += 5.0
    assert (window.counts().num_first_tokens, window.counts().num_over_slo) == (0, 0)


def test_a_request_waiting_past_the_slo_counts_late_before_its_first_token_and_once():
    clock = Clock()
    window = TtftWindow("router-a", ttft_s=0.3, clock=clock)
    window.begin("slow")
    clock.now += 0.2
    assert window.counts().num_over_slo == 0  # within the SLO so far
    clock.now += 0.5
    assert (window.counts().num_first_tokens, window.counts().num_over_slo) == (1, 1)
    window.first_token("slow")
    window.end("slow")
    assert (window.counts().num_first_tokens, window.counts().num_over_slo) == (1, 1)  # not twice
    window.begin("aborted")
    clock.now += 1.0
    window.end("aborted")  # ended without a first token: it waits no more
    assert window.counts().num_first_tokens == 1


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        TtftWindow("r", ttft_s=0.0, clock=Clock())


class SlowFirstToken(ScriptedDispatcher):
    """Its first token comes `wait_s` (on the test's clock) after the request; the rest at once."""

    def __init__(self, tokenizer, clock: Clock, wait_s: float) -> None:
        super().__init__(tokenizer)
        self.clock, self.wait_s = clock, wait_s

    async def generate(self, request_id, prompt_token_ids, params):
        self.clock.now += self.wait_s
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out


@pytest.mark.parametrize("wait_s, late", [(0.1, 0), (0.5, 2)])
def test_router_core_counts_each_choices_first_token(wait_s, late):
    clock = Clock()
    tokenizer = tools_tokenizer()
    window = TtftWindow("router-a", ttft_s=0.3, clock=clock)
    dispatcher = SlowFirstToken(tokenizer, clock, wait_s)
    core = RouterCore(dispatcher, tokenizer, RouterConfig(), 2048, clock=clock,  # type: ignore[arg-type]
                      ttft_window=window)
    prompt = tokenizer.encode("hi", add_special_tokens=False)

    async def run() -> int:
        return len([d async for d in core.generate("r1", prompt, SamplingParams(max_tokens=8), n=2)])

    assert asyncio.run(run()) > 2
    counts = window.counts()
    assert (counts.num_first_tokens, counts.num_over_slo) == (2, late) and not window._waiting
