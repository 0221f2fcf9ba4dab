"""The planner's simulation against served runs, request by request: each static layout's recorded
requests of a `bench.goodput` run (their arrival times, prompt and output lengths) replayed through
`cluster.planner.simulate` with step profiles (one per worker size), and per rate the measured and
predicted TTFT p50/p90, TPOT p90 and attainment of one SLO pair side by side. Nothing is re-measured.
The same arrivals on both sides, so what differs is the model: where prediction and measurement part,
the simulation misses a cost the served system pays.

    python -m bench.planner_replay --runs adaptive_2xh200_static_run1.json \\
        adaptive_2xh200_1p1d_1000_40_and_colocated_run2.json adaptive_2xh200_r5_colocated_and_1p1d.json \\
        adaptive_2xh200_r5b_adaptive_and_colocated.json adaptive_2xh200_r9_queue_model_colocated.json \\
        --profile planner_profile_llama-3.1-8b_nvidia-h200.json --out bench/results --tag 2xh200_8b
    python -m bench.planner_replay --runs goodput_70b_fp8_4xh200_plan_r1_2p2d_and_colocated.json \\
        goodput_70b_fp8_4xh200_plan_r2_3p1d.json goodput_70b_fp8_4xh200_plan_r3_3p1d_and_colocated_5_6.json \\
        goodput_70b_fp8_4xh200_split_k.json --profile planner_profile_llama-3.1-70b_fp8_tp1_nvidia-h200.json \\
        planner_profile_llama-3.1-70b_fp8_tp2_nvidia-h200.json --out bench/results --tag 4xh200_70b_fp8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.adaptive_report import RESULTS, goodput
from bench.common import save_plot
from bench.goodput_modes import layout_of, mode_spec
from cluster.planner import StepProfile
from cluster.planner.simulate import Layout, Profiles, simulate
from cluster.planner.workload import Request
from loadgen.metrics import percentile


def static_layout(mode: str, tp: int) -> Layout | None:
    """A bench.goodput mode's layout, its workers of the run's --tp GPUs unless the mode says; None for an
    adaptive mode (its layout moves while it runs)."""
    spec = mode_spec(mode, tp)
    if spec.steers_to_slos:
        return None
    flags = spec.serve_flags

    def size(flag: str) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else tp

    num_prefill, num_decode = layout_of(spec)
    return Layout(num_prefill, num_decode, size("--prefill-tp"), size("--decode-tp"))


def run_tp(run: dict[str, Any]) -> int:
    flags = run.get("config", {}).get("engine_flags", [])
    return int(flags[flags.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in flags else 1


def summary(ttft_ms: list[float], tpot_ms: list[float], slo: tuple[float, float],
            planned: int | None = None) -> dict[str, float]:
    """planned: the requests sent, a failed one a miss (default: those timed)."""
    good = sum(1 for a, b in zip(ttft_ms, tpot_ms) if a <= slo[0] and b <= slo[1])
    return {"ttft_p50_ms": percentile(ttft_ms, 50), "ttft_p90_ms": percentile(ttft_ms, 90),
            "tpot_p90_ms": percentile(tpot_ms, 90), "attainment": good / (planned or len(ttft_ms))}


def replay(run: dict[str, Any], profiles: Profiles, slo: tuple[float, float]) -> list[dict[str, Any]]:
    rows = []
    for mode, blocks in run.get("requests", {}).items():
        layout = static_layout(mode, run_tp(run))
        if layout is None:
            continue
        for block in blocks:
            records = [r for r in block["records"] if r.get("ok")]
            if not records:
                continue
            reqs = [Request(r["send_s"], r["in"], r["out"]) for r in records]
            timings = simulate(layout, profiles, reqs)
            rows.append({
                "mode": mode, "layout": layout.name, "rate": block["rate"], "requests": len(records),
                "failed": len(block["records"]) - len(records),
                # NOTE: a failed request counts as a miss, as bench.adaptive_report scores the run
                "measured": summary([r["ttft_ms"] for r in records], [r["tpot_ms"] for r in records], slo,
                                    planned=len(block["records"])),
                "predicted": summary([t.ttft_s * 1e3 for t in timings], [t.tpot_s * 1e3 for t in timings], slo),
            })
    return rows


def goodputs(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per layout of a run, the goodput by one rule (bench.adaptive_report.goodput: the highest rate of an
    unbroken run at >= 90%) from the measured and from the replayed attainments at the same arrivals: the
    planner's error with the sampling of the run's windows taken out."""
    out = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["rate"])
        out[layout] = {side: goodput([{"rate": r["rate"], "attainment": r[side]["attainment"]} for r in mine])[0]
                       for side in ("measured", "predicted")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="bench.goodput JSON files (in --results)")
    parser.add_argument("--profile", nargs="+", required=True,
                        help="the planner's step profile JSON (in --results), one per worker size")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for planner_replay_<tag>.json and .png")
    parser.add_argument("--tag", default="2xh200")
    args = parser.parse_args()
    profiles = {p.tensor_parallel_size: p for p in (StepProfile.model_validate_json((args.results / name).read_text())
                                                    for name in args.profile)}
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    doc: dict[str, Any] = {"benchmark": "planner_replay", "profiles": args.profile, "slo_ttft_ms": slo[0],
                           "slo_tpot_ms": slo[1],
                           "context_ms_per_pair": {size: p.context_ms_per_pair for size, p in profiles.items()},
                           "runs": {}}
    for name in args.runs:
        run = json.loads((args.results / name).read_text())
        rows = replay(run, profiles, slo)
        doc["runs"][name] = {"device_name": run.get("environment", {}).get("device_name"), "rows": rows,
                             "goodput": goodputs(rows)}
        for row in rows:
            m, p = row["measured"], row["predicted"]
            print(f"{name[:44]:44s} {row['layout']:15s} {row['rate']:5.1f} req/s: TTFT p50/p90 {m['ttft_p50_ms']:6.0f}/"
                  f"{m['ttft_p90_ms']:6.0f} ms measured, {p['ttft_p50_ms']:6.0f}/{p['ttft_p90_ms']:6.0f} predicted; "
                  f"TPOT p90 {m['tpot_p90_ms']:5.1f} / {p['tpot_p90_ms']:5.1f}; attainment {m['attainment']:.2f} / "
                  f"{p['attainment']:.2f}", flush=True)
    for name, run in doc["runs"].items():
        for layout, g in run["goodput"].items():
            print(f"{name[:44]:44s} {layout:15s} goodput at these arrivals: {g['measured']} req/s measured, "
                  f"{g['predicted']} replayed")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"planner_replay_{args.tag}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")

        def plot(fig: Any) -> None:
            axes = fig.subplots(1, 2)
            layouts = sorted({r["layout"] for run in doc["runs"].values() for r in run["rows"]})
            colours = dict(zip(layouts, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")))
            for (name, run), marker in zip(doc["runs"].items(), "os^v"):
                for layout in layouts:
                    rows = [r for r in run["rows"] if r["layout"] == layout]
                    if not rows:
                        continue
                    rates, colour = [r["rate"] for r in rows], colours.get(layout, "grey")
                    for ax, key in zip(axes, ("ttft_p90_ms", "attainment")):
                        ax.plot(rates, [r["measured"][key] for r in rows], marker=marker, color=colour,
                                label=f"{layout} measured ({name[:24]})")
                        ax.plot(rates, [r["predicted"][key] for r in rows], marker=marker, color=colour,
                                linestyle="--", label=f"{layout} predicted")
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
