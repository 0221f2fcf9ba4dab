"""bench.diag.ring_latency on the CPU: every message's write-to-read delay is measured, and summed up."""

from __future__ import annotations

from bench.diag import ring_latency
from engine.parallel import ring


def test_each_message_gets_its_delay_and_the_summary_orders_them() -> None:
    delays = ring_latency.latencies_us(ring.SPIN_S, period_s=0.002, messages=20)
    assert len(delays) == 20 and all(d > 0 for d in delays)
    stats = ring_latency.summary(delays)
    assert stats["median_us"] <= stats["p90_us"] <= stats["p99_us"] <= stats["max_us"] == max(delays)
