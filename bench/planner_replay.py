"""The planner's simulation against served runs, request by request: each static layout's recorded
requests of a `bench.goodput` run (their arrival times, prompt and output lengths) replayed through
`cluster.planner.simulate` with a step profile, and per rate the measured and predicted TTFT p50/p90,
TPOT p90 and attainment of one SLO pair side by side. Nothing is re-measured. The same arrivals on
both sides, so what differs is the model: where prediction and measurement part, the simulation
misses a cost the served system pays.

    python -m bench.planner_replay --runs adaptive_2xh200_static_run1.json adaptive_2xh200_r5_colocated_and_1p1d.json \\
        --profile planner_profile_llama-3.1-8b_nvidia-h200.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.adaptive_report import RESULTS
from bench.common import save_plot
from cluster.planner import StepProfile
from cluster.planner.simulate import Layout, simulate
from cluster.planner.workload import Request
from loadgen.metrics import percentile

LAYOUTS = {"colocated": Layout(0, 2), "disagg": Layout(1, 1)}  # the 2-GPU runs' static layouts


def summary(ttft_ms: list[float], tpot_ms: list[float], slo: tuple[float, float]) -> dict[str, float]:
    good = sum(1 for a, b in zip(ttft_ms, tpot_ms) if a <= slo[0] and b <= slo[1])
    return {"ttft_p50_ms": percentile(ttft_ms, 50), "ttft_p90_ms": percentile(ttft_ms, 90),
            "tpot_p90_ms": percentile(tpot_ms, 90), "attainment": good / len(ttft_ms)}


def replay(run: dict[str, Any], profile: StepProfile, slo: tuple[float, float]) -> list[dict[str, Any]]:
    rows = []
    for mode, layout in LAYOUTS.items():
        for block in run.get("requests", {}).get(mode, []):
            records = [r for r in block["records"] if r.get("ok")]
            if not records:
                continue
            reqs = [Request(r["send_s"], r["in"], r["out"]) for r in records]
            timings = simulate(layout, profile, reqs)
            rows.append({
                "mode": mode, "rate": block["rate"], "requests": len(records),
                "measured": summary([r["ttft_ms"] for r in records], [r["tpot_ms"] for r in records], slo),
                "predicted": summary([t.ttft_s * 1e3 for t in timings], [t.tpot_s * 1e3 for t in timings], slo),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="bench.goodput JSON files (in --results)")
    parser.add_argument("--profile", required=True, help="the planner's step profile JSON (in --results)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for planner_replay_<tag>.json and .png")
    parser.add_argument("--tag", default="2xh200")
    args = parser.parse_args()
    profile = StepProfile.model_validate_json((args.results / args.profile).read_text())
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    doc: dict[str, Any] = {"benchmark": "planner_replay", "profile": args.profile, "slo_ttft_ms": slo[0],
                           "slo_tpot_ms": slo[1], "context_ms_per_pair": profile.context_ms_per_pair, "runs": {}}
    for name in args.runs:
        run = json.loads((args.results / name).read_text())
        rows = replay(run, profile, slo)
        doc["runs"][name] = {"device_name": run.get("environment", {}).get("device_name"), "rows": rows}
        for row in rows:
            m, p = row["measured"], row["predicted"]
            print(f"{name[:44]:44s} {row['mode']:9s} {row['rate']:5.1f} req/s: TTFT p50/p90 {m['ttft_p50_ms']:6.0f}/"
                  f"{m['ttft_p90_ms']:6.0f} ms measured, {p['ttft_p50_ms']:6.0f}/{p['ttft_p90_ms']:6.0f} predicted; "
                  f"TPOT p90 {m['tpot_p90_ms']:5.1f} / {p['tpot_p90_ms']:5.1f}; attainment {m['attainment']:.2f} / "
                  f"{p['attainment']:.2f}", flush=True)
    if args.out is not None:
        path = args.out / f"planner_replay_{args.tag}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")

        def plot(fig: Any) -> None:
            axes = fig.subplots(1, 2)
            for (name, run), marker in zip(doc["runs"].items(), "os^v"):
                for mode, colour in (("colocated", "tab:blue"), ("disagg", "tab:orange")):
                    rows = [r for r in run["rows"] if r["mode"] == mode]
                    if not rows:
                        continue
                    rates = [r["rate"] for r in rows]
                    for ax, key in zip(axes, ("ttft_p90_ms", "attainment")):
                        ax.plot(rates, [r["measured"][key] for r in rows], marker=marker, color=colour,
                                label=f"{mode} measured ({name[:24]})")
                        ax.plot(rates, [r["predicted"][key] for r in rows], marker=marker, color=colour,
                                linestyle="--", label=f"{mode} predicted")
            axes[0].set_ylabel("TTFT p90 (ms)")
            axes[1].set_ylabel(f"attainment (TTFT <= {slo[0]:g} ms, TPOT <= {slo[1]:g} ms)")
            for ax in axes:
                ax.set_xlabel("request rate (req/s)")
            axes[1].legend(fontsize=6)

        save_plot(args.out / f"planner_replay_{args.tag}.png", plot,
                  f"planner's simulation vs served runs ({doc['runs'][args.runs[0]]['device_name']})")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
