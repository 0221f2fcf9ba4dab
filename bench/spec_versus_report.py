"""Two drafters side by side, from bench.spec_decode results: each run's paired speedup over plain
decoding (the median over repeats of plain's time over the drafter's, runs alternated in one
process) per drafter, batch size and temperature, in one JSON and one bar plot.

    python -m bench.spec_versus_report NAME RESULT.json [RESULT.json ...] [--out bench/results]

Each RESULT is one bench.spec_decode run (with --versus, both drafters measured in its runs; without,
one). NAME tags the output files: spec_versus_NAME_<device>.json/.png.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import label_bars, save_plot


def rows_of(result: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The speculative rows of one run: drafter, batch, temperature, paired speedup, acceptance."""
    workload = result["workload"]
    return [
        {
            "source": source,
            "method": r.get("method") or workload["method"],
            "batch_size": r["batch_size"],
            "temperature": workload["temperature"],
            "disable_above_batch_size": workload["disable_above_batch_size"],
            "paired_speedup": r["paired_speedup"],
            "paired_speedup_all": r["paired_speedup_all"],
            "accepted_per_drafted": r["spec_acceptance_rate"],
            "num_decode_steps": r["num_decode_steps"],
        }
        for r in result["speed"]
        if r["mode"] == "speculative"
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--labels", nargs="+", default=None,
                        help="One label a RESULT (an A/B of one drafter: old, new), shown before each bar's method.")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.results):
        parser.error(f"--labels has {len(args.labels)} labels for {len(args.results)} results: give one a result")
    runs = [json.loads(p.read_text()) for p in args.results]
    devices = {r["environment"]["device_name"] for r in runs}
    if len(devices) != 1:
        parser.error(f"the results come from different devices {sorted(devices)}: compare within one call")
    device = devices.pop()
    labels = args.labels or [""] * len(runs)
    rows = [row | {"label": label} for p, r, label in zip(args.results, runs, labels) for row in rows_of(r, p.name)]
    record = {"benchmark": "spec_versus", "device_name": device, "sources": [p.name for p in args.results],
              "rows": rows}
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")  # NOTE: as bench.common.device_slug names it
    stem = args.out / f"spec_versus_{args.name}_{slug}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")

    def plot(fig: Any) -> None:
        ax = fig.subplots(1, 1)
        names = [f"{r['label']} {r['method']}".strip() + f"\nT={r['temperature']:g} b{r['batch_size']}"
                  + (f"\ncap {r['disable_above_batch_size']}" if r["disable_above_batch_size"] < r["batch_size"]
                     else "") for r in rows]
        values = [r["paired_speedup"] for r in rows]
        first = (rows[0]["label"], rows[0]["method"])
        bars = ax.bar(range(len(rows)), values,
                      color=["tab:blue" if (r["label"], r["method"]) == first else "tab:orange" for r in rows])
        ax.set_xticks(range(len(rows)), names, fontsize=7)
        label_bars(ax, bars, values, "{:.2f}x")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(ylabel="decode speed over plain (paired median)")

    save_plot(stem.with_suffix(".png"), plot, f"Speculative decoding, drafters side by side ({args.name})\n{device}")
    print(f"wrote {stem}.json and .png")
    return record


if __name__ == "__main__":
    main()
