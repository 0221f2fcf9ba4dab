"""Goodput of a measured `bench.goodput` run again under other SLOs: where the time goes.

The per-request records of a run (TTFT, TPOT, worst inter-token gap) are scored against each TPOT
SLO of --tpot-slos (TTFT SLO fixed at the run's) and, separately, against worst-gap SLOs; a
request is good when it completed and met both. Goodput at a rate = good requests / the run's
duration at that rate (the same duration the run itself divided by). Nothing is re-measured.

    python -m bench.goodput_slo bench/results/goodput_nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import save_plot


def best_goodput(run: dict[str, Any], mode: str, ttft_ms: float, tpot_ms: float,
                 gap_ms: float | None) -> dict[str, Any]:
    durations = {row["rate"]: row["duration_s"] for row in run["modes"][mode]["rows"]}
    best = {"goodput": 0.0, "rate": None}
    for at_rate in run["requests"][mode]:
        rate = at_rate["rate"]
        if rate not in durations:
            continue
        good = sum(
            1
            for r in at_rate["records"]
            if r["ok"] and r["ttft_ms"] <= ttft_ms and (r["tpot_ms"] or 0.0) <= tpot_ms
            and (gap_ms is None or (r["max_itl_ms"] or 0.0) <= gap_ms)
        )
        goodput = good / durations[rate]
        if goodput > best["goodput"]:
            best = {"goodput": goodput, "rate": rate}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a goodput_<device>.json written by bench.goodput")
    parser.add_argument("--tpot-slos", default="40,30,25,20,15,12")
    parser.add_argument("--gap-slos", default="200,100,75,50,30", help="worst inter-token gap SLOs, ms")
    args = parser.parse_args()
    run = json.loads(args.run.read_text())
    ttft = run["config"]["slo_ttft_ms"]
    tpot_default = run["config"]["slo_tpot_ms"]
    modes = list(run["modes"])
    rows: list[dict[str, Any]] = []
    for kind, values in (("tpot", args.tpot_slos), ("max_gap", args.gap_slos)):
        for value in (float(v) for v in values.split(",")):
            tpot, gap = (value, None) if kind == "tpot" else (tpot_default, value)
            best = {m: best_goodput(run, m, ttft, tpot, gap) for m in modes}
            a, b = best.get("disagg", {}).get("goodput", 0.0), best.get("colocated", {}).get("goodput", 0.0)
            rows.append({"slo": kind, "ttft_ms": ttft, "tpot_ms": tpot, "max_gap_ms": gap, "best": best,
                         "disagg_over_colocated": a / b if b else None})
            ratio = f"{a / b:.2f}" if b else "inf" if a else "-"
            print(f"TTFT<={ttft:g} ms TPOT<={tpot:g} ms" + (f" gap<={gap:g} ms" if gap else "") +
                  "".join(f"  {m} {best[m]['goodput']:.2f} req/s (at {best[m]['rate']})" for m in modes) +
                  f"  ratio {ratio}")
    out = args.run.with_name(args.run.name.replace("goodput_", "goodput_slo_"))
    record = {"source": args.run.name, "device": run["environment"].get("device_name"), "rows": rows,
              "what": "best goodput over the measured sweep, per mode, re-scored under other SLOs (no new run)"}
    out.write_text(json.dumps(record, indent=1) + "\n")

    def plot(fig: Any) -> None:
        axes = fig.subplots(1, 2)
        for ax, kind, key, label in ((axes[0], "tpot", "tpot_ms", f"TPOT SLO, ms (TTFT <= {ttft:g} ms)"),
                                     (axes[1], "max_gap", "max_gap_ms", "worst inter-token gap SLO, ms")):
            sel = [r for r in rows if r["slo"] == kind]
            for m in modes:
                ax.plot([r[key] for r in sel], [r["best"][m]["goodput"] for r in sel], "o-", label=m)
            ax.set_xlabel(label)
            ax.set_ylabel("best goodput, req/s")
            ax.invert_xaxis()
            ax.legend()

    save_plot(out.with_suffix(".png"), plot, f"Goodput re-scored under other SLOs — {record['device']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
