"""deploy/grafana/pdserve.json against the metrics the router exports (router/metrics.py): every
metric has a panel, and every series a panel or a variable queries is one /metrics serves (a
renamed or removed metric fails here, not as an empty panel). Importable: a ${DS_PROMETHEUS}
input that every query uses, unique panel ids."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from protocol.api import WorkerStatsMsg
from protocol.messages import PrefillResultMsg, PushTotalsMsg
from router.metrics import PrometheusMetrics

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "pdserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SERIES = re.compile(r"pdserve:[A-Za-z0-9_:]+")
# The series of a metric family in the text format, by type (`_created`: creation times, for no panel).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def _exported() -> dict[str, set[str]]:
    """Metric family -> the series names it serves, from the registry itself."""
    metrics = PrometheusMetrics("m")
    families = [*metrics.registry.collect(), *metrics.worker_registry.collect()]
    return {f.name: {f.name + s for s in SUFFIXES[f.type]} for f in families}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panel_queries() -> list[str]:
    return [t["expr"] for p in _panels(_dashboard()["panels"]) for t in p.get("targets", [])]


def test_every_exported_metric_has_a_panel():
    used = {name for expr in _panel_queries() for name in SERIES.findall(expr)}
    missing = {family for family, series in _exported().items() if not series & used}
    assert not missing, f"metrics without a panel in {DASHBOARD.name}: {sorted(missing)}"


def test_every_series_the_dashboard_queries_is_exported():
    exported = set().union(*_exported().values())
    variables = [v["definition"] for v in _dashboard()["templating"]["list"]]
    unknown = {name for expr in [*_panel_queries(), *variables] for name in SERIES.findall(expr)} - exported
    assert not unknown, f"{DASHBOARD.name} queries series that /metrics does not serve: {sorted(unknown)}"


def test_the_series_names_are_those_a_scrape_shows():
    """The suffixes above are prometheus_client's: checked on a scrape with every metric set."""

    async def worker_stats() -> list[WorkerStatsMsg]:
        load = dict(pid=1, is_healthy=True, num_running=1, num_waiting=0, num_blocks=10, num_free_blocks=4)
        totals = PushTotalsMsg(num_pushed=1, num_failed=0, num_cancelled=0, push_bytes=10, push_seconds=0.01)
        return [WorkerStatsMsg(worker_id="p0", role="prefill", push_totals=totals, **load),
                WorkerStatsMsg(worker_id="d0", role="decode", num_leases=1, **load)]

    metrics = PrometheusMetrics("m", worker_stats=worker_stats)
    metrics.on_choice_finished(finish_reason="stop", num_prompt_tokens=5, num_completion_tokens=3,
                               num_cached_tokens=2, time_to_first_token_s=0.1, elapsed_s=0.3)
    metrics.on_inter_token(gap_s=0.1, num_tokens=1)
    metrics.on_rejected(status_code=429)
    metrics.on_response(route="/v1/completions", status_code=200, elapsed_s=0.3)
    metrics.on_prefill_result(PrefillResultMsg(request_id="a", push_bytes=10))
    text = asyncio.run(metrics.render()).decode()
    scraped = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    exported = _exported()
    assert {n for n in scraped if not n.endswith("_created")} == set().union(*exported.values())


def test_importable_with_a_prometheus_input():
    dashboard = _dashboard()
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus" and dashboard["schemaVersion"] >= 39
    panels = list(_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE and panel["targets"], panel["title"]
        assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    assert all(v["datasource"] == DATASOURCE for v in dashboard["templating"]["list"])
