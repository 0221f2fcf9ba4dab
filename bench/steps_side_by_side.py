"""Decode steps of several trees measured in one device call (bench.tensor_parallel or bench.quantized JSONs,
one per tree and repeat), gathered into one result: each label's ms per step by batch (every repeat, and their
mean), and each label's mean over the first label's of the same model, TP size and weights (its baseline);
with bench.quantized's offline run, its output tokens per second too.
Measures nothing itself: the JSONs come from the GPU.

    python -m bench.steps_side_by_side --out bench/results --name NAME \\
        --run main=a.json --run main=b.json --run fused=c.json ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean
from typing import Any

from bench.common import save_plot


def gather(runs: list[tuple[str, Path]]) -> dict[str, Any]:
    """{label: {"tp": .., "device_name": .., "step_ms": {batch: [ms per repeat]}}}, labels in first-seen order."""
    labels: dict[str, Any] = {}
    for label, path in runs:
        record = json.loads(path.read_text())
        for run in record["runs"]:
            model = Path(record["environment"]["model"]["name"]).name
            tp, variant = run.get("tp", 1), run.get("variant")  # bench.quantized's runs: one GPU, a variant each
            key = f"{label} {model} " + (variant or f"TP={tp}")
            entry = labels.setdefault(key, {"tp": tp, "variant": variant, "device_name": run["device_name"],
                                            "step_ms": {}, "model": model})
            for row in run["decode"]:
                entry["step_ms"].setdefault(str(row["batch"]), []).append(row["step_s"] * 1e3)
            if run.get("offline"):
                entry.setdefault("offline_tok_per_s", []).append(run["offline"]["output_tok_per_s"])
    return labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True,
                        help="LABEL=bench.tensor_parallel or bench.quantized JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True, help="the result's file stem (device name included)")
    parser.add_argument("--note", default="", help="what was compared and how, kept in the JSON")
    args = parser.parse_args()
    runs = [(r.split("=", 1)[0], Path(r.split("=", 1)[1])) for r in args.run]
    labels = gather(runs)
    devices = {e["device_name"] for e in labels.values()}
    if len(devices) != 1:
        raise SystemExit(f"--run: the JSONs come from {sorted(devices)}: compare only within one device call")
    for entry in labels.values():
        entry["mean_ms"] = {b: mean(v) for b, v in entry["step_ms"].items()}
    for key, entry in labels.items():
        same = (entry["tp"], entry["model"], entry["variant"])
        entry["baseline"] = next(k for k, e in labels.items() if (e["tp"], e["model"], e["variant"]) == same)
        base = labels[entry["baseline"]]["mean_ms"]
        entry["over_baseline"] = {b: m / base[b] for b, m in entry["mean_ms"].items() if b in base}
    record = {"benchmark": args.name, "device_name": devices.pop(), "note": args.note, "labels": labels}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")

    def plot(fig: Any) -> None:
        steps, ratio = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for key, entry in labels.items():
            batches = sorted(entry["mean_ms"], key=int)
            steps.plot([int(b) for b in batches], [entry["mean_ms"][b] for b in batches], marker="o", label=key)
            ratio.plot([int(b) for b in batches], [entry["over_baseline"][b] for b in batches], marker="o", label=key)
        for ax in (steps, ratio):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (decoding sequences)")
        steps.set_yscale("log")
        steps.set_ylabel("ms per decode step (mean of repeats)")
        ratio.set_ylabel("step time over its baseline (first label of its model, TP and weights)")
        ratio.legend(fontsize=8)

    save_plot(args.out / f"{args.name}.png", plot, f"{args.name}: {record['device_name']}")
    for key, entry in labels.items():
        print(key, " ".join(f"b{b} {m:.2f} ms ({entry['over_baseline'].get(b, float('nan')):.3f}x)"
                            for b, m in entry["mean_ms"].items()),
              " ".join(f"offline {t:,.0f} tok/s" for t in entry.get("offline_tok_per_s", [])))


if __name__ == "__main__":
    main()
