"""The counts of every router replica on a node, summed for one /metrics answer.

Router replicas share the HTTP port (SO_REUSEPORT): a scrape reaches any one of them, and each counts
only what it served. So each replica publishes its own counters and histograms (Prometheus text) to a
file of its own in a directory the node's replicas share, at every scrape it answers and every
`interval_s`, and a scrape sums the latest file of each replica. Each file only grows, so the sum never
goes down between scrapes whichever replica answers; a replica's part is at most `interval_s` old; a
replica that died keeps its last counts in the sum (its requests happened).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

SUFFIX = ".prom"


class SharedCounts:
    """Publishes REPLICA's exposition (from RENDER) under DIRECTORY and sums every replica's there."""

    def __init__(self, directory: Path, replica: str, render: Callable[[], bytes], interval_s: float = 1.0) -> None:
        self.directory = directory
        self.path = directory / f"{replica}{SUFFIX}"
        self.render = render
        self.interval_s = interval_s
        directory.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        """This replica's counts now, replacing its last file whole (a reader sees the old or the new)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(self.render())
        os.replace(tmp, self.path)

    async def publish_every_interval(self) -> None:
        while True:
            self.publish()
            await asyncio.sleep(self.interval_s)

    def summed(self) -> bytes:
        """Every replica's latest counts, summed per series (`_created` taken as the earliest)."""
        self.publish()
        texts = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                texts.append(path.read_text())
            except FileNotFoundError:  # NOTE: os.replace swaps names; a file gone between glob and read is rare
                continue
        return sum_expositions(texts)


def sum_expositions(texts: list[str]) -> bytes:
    """Prometheus text expositions of processes with the same metrics, as one: samples of equal name and
    labels added (counters and histogram buckets, sums and counts), creation times the earliest."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            merged = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in merged:
                    merged[key] = sample.value
                elif sample.name.endswith("_created"):
                    merged[key] = min(merged[key], sample.value)
                else:
                    merged[key] += sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector of given families (prometheus_client renders collectors only)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
