"""Comparisons of measured `bench.goodput` runs under three TTFT/TPOT SLO pairs, by named set: issue 24's
on two GPUs (2 colocated replicas, 1P1D and the adaptive modes, the planner's predictions beside them)
and issue 28's 4-GPU layouts at the Llama-3.1-70B shape (bfloat16 and FP8).

Nothing is re-measured. A static layout (colocated, disagg) serves the same way whatever the SLOs, so its
per-request records are scored against each pair. An adaptive run steered to one pair (the server had
those SLOs) counts under that pair only. Per configuration and pair: SLO attainment per rate (requests
that met both SLOs / requests planned), goodput = the highest rate of the sweep at which attainment
was >= 90% and at every lower rate, where attainment crosses 90% between two rates of the sweep
(linear in between: the grid is 4 req/s apart), and how many requests were decoding at once (between
their first token and their end, as the client saw them; every engine runs at most max_num_seqs, 64 in
these runs). The planner's goodput per layout is computed here from
the step profiles (one per worker size) measured on the same machine kind (pdserve plan's simulation; deterministic).

    python -m bench.adaptive_report --set adaptive_2xh200  # reads and writes bench/results/adaptive_2xh200*
    python -m bench.adaptive_report --set tp70b_4xh200    # bfloat16
    python -m bench.adaptive_report --set fp8_70b_4xh200  # FP8 projections, the planner's layouts of TP=1 and TP=2
    python -m bench.adaptive_report --set fp8_70b_2xh200
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import save_plot

RESULTS = Path(__file__).resolve().parent / "results"
PAIRS = ((1000.0, 40.0), (1000.0, 20.0), (300.0, 40.0))  # (TTFT ms, TPOT ms)
ATTAINMENT = 0.9


class Source(NamedTuple):
    label: str
    file: str
    mode: str
    steered: tuple[float, float] | None  # the SLO pair the server steered to; None: a static layout


class ReportSet(NamedTuple):
    sources: tuple[Source, ...]
    profiles: tuple[str, ...]  # the planner's step profiles, one per worker size (GPUs); none: no prediction
    profile_note: str
    num_gpus: int
    title: str
    styles: dict[str, tuple[str, str]]  # label prefix -> (colour, line style)


SOURCES_24 = (
    Source("2 colocated (run 1)", "adaptive_2xh200_static_run1.json", "colocated", None),
    Source("2 colocated (run 2)", "adaptive_2xh200_1p1d_1000_40_and_colocated_run2.json", "colocated", None),
    Source("1P1D", "adaptive_2xh200_static_run1.json", "disagg", None),
    Source("adaptive from 1P1D", "adaptive_2xh200_1p1d_1000_40_and_colocated_run2.json", "adaptive", (1000.0, 40.0)),
    Source("adaptive from 1P1D", "adaptive_2xh200_1p1d_1000_20.json", "adaptive", (1000.0, 20.0)),
    Source("adaptive from 1P1D", "adaptive_2xh200_1p1d_300_40.json", "adaptive", (300.0, 40.0)),
    Source("planned colocated + step budget", "adaptive_2xh200_planned_colocated_budget_1000_40.json", "adaptive",
           (1000.0, 40.0)),
    Source("planned colocated + step budget", "adaptive_2xh200_planned_colocated_budget_1000_20.json", "adaptive",
           (1000.0, 20.0)),
    Source("planned colocated + step budget", "adaptive_2xh200_planned_colocated_budget_300_40.json", "adaptive",
           (300.0, 40.0)),
    # after the step rates' fix (02a5211) and roles that reach colocation (75b9bab): the autoscaler may give the
    # prefill worker to decoding (0P2D); run 3 is one call, its colocated sweep cut short by the call's budget
    Source("2 colocated (run 3)", "adaptive_2xh200_r3_1000_40_and_colocated_run3.json", "colocated", None),
    Source("adaptive, roles to 0P2D", "adaptive_2xh200_r3_1000_40_and_colocated_run3.json", "adaptive", (1000.0, 40.0)),
    Source("adaptive, roles to 0P2D", "adaptive_2xh200_r3_1000_20.json", "adaptive", (1000.0, 20.0)),
    Source("adaptive, roles to 0P2D", "adaptive_2xh200_r3_300_40.json", "adaptive", (300.0, 40.0)),
    Source("adaptive, roles to 0P2D (run b)", "adaptive_2xh200_r3b_1000_40_timeline.json", "adaptive",
           (1000.0, 40.0)),
    # the decode workers drop the step budget when the last prefill worker's drain begins (e3af98c)
    Source("adaptive, roles to 0P2D (run c)", "adaptive_2xh200_r4_1000_40_flip.json", "adaptive", (1000.0, 40.0)),
    # run 5, on GPU pairs of a 4x H200 host: after the decode batch cap (86e26e9), step rates from the device's time
    # (7fc1deb) and the autoscaler's prediction for the last prefill worker (014c268); 5b is the next call
    Source("2 colocated (run 5)", "adaptive_2xh200_r5_colocated_and_1p1d.json", "colocated", None),
    Source("1P1D (run 5, decode batch capped)", "adaptive_2xh200_r5_colocated_and_1p1d.json", "disagg", None),
    Source("2 colocated (run 5b)", "adaptive_2xh200_r5b_adaptive_and_colocated.json", "colocated", None),
    Source("adaptive from 1P1D (run 5b)", "adaptive_2xh200_r5b_adaptive_and_colocated.json", "adaptive",
           (1000.0, 40.0)),
    # runs 6-7 (GPU pairs of 4x and 2x H200), before and after the channels' close_when_idle (26b112e); run 8
    # after the arrivals-past-rate term (02a5be5); run 9 after the arrivals' queue model (61079b2), its adaptive
    # and colocated sweeps in one lease, its TTFT<=300 ms adaptive sweep in another
    Source("2 colocated (run 6)", "adaptive_2xh200_r6_before_channel_fix_adaptive_and_colocated.json", "colocated",
           None),
    Source("adaptive from 1P1D (run 6)", "adaptive_2xh200_r6_before_channel_fix_adaptive_and_colocated.json",
           "adaptive", (1000.0, 40.0)),
    Source("2 colocated (run 7)", "adaptive_2xh200_r7_after_channel_fix_adaptive_and_colocated.json", "colocated",
           None),
    Source("adaptive from 1P1D (run 7)", "adaptive_2xh200_r7_after_channel_fix_adaptive_and_colocated.json",
           "adaptive", (1000.0, 40.0)),
    Source("2 colocated (run 8)", "adaptive_2xh200_r8_arrivals_past_rate.json", "colocated", None),
    Source("adaptive from 1P1D (run 8)", "adaptive_2xh200_r8_arrivals_past_rate.json", "adaptive", (1000.0, 40.0)),
    Source("2 colocated (run 9)", "adaptive_2xh200_r9_queue_model_colocated.json", "colocated", None),
    Source("adaptive, queue model (run 9)", "adaptive_2xh200_r9_queue_model_adaptive.json", "adaptive",
           (1000.0, 40.0)),
    Source("adaptive, queue model (run 9)", "adaptive_2xh200_r9_queue_model_adaptive_300_40.json", "adaptive",
           (300.0, 40.0)),
    # run 10 after no step compiles a kernel (7ebdc48), with the late-first-token term (its first GPU runs): each
    # SLO pair's adaptive and colocated sweeps in one lease, the two pairs in two calls on one machine
    Source("2 colocated (run 10)", "adaptive_2xh200_r10_compile_warmup_300_40.json", "colocated", None),
    Source("adaptive, kernels compiled at start (run 10)", "adaptive_2xh200_r10_compile_warmup_300_40.json",
           "adaptive", (300.0, 40.0)),
    Source("2 colocated (run 10b)", "adaptive_2xh200_r10_compile_warmup_1000_20.json", "colocated", None),
    Source("adaptive, kernels compiled at start (run 10b)", "adaptive_2xh200_r10_compile_warmup_1000_20.json",
           "adaptive", (1000.0, 20.0)),
)
SOURCES_28 = (
    Source("2 colocated TP2 (run a)", "goodput_70b_4xh200_bf16_a.json", "colocated2", None),
    Source("2 colocated TP2 (run b)", "goodput_70b_4xh200_bf16_b.json", "colocated2", None),
    Source("1P(TP2)1D(TP2) (run a)", "goodput_70b_4xh200_bf16_a.json", "1p1d", None),
    Source("1P(TP2)1D(TP2) (run b)", "goodput_70b_4xh200_bf16_b.json", "1p1d", None),
    Source("adaptive from 1P(TP2)1D(TP2)", "goodput_70b_4xh200_bf16_b.json", "adaptive1p1d", (1000.0, 40.0)),
)
# issue 28 in FP8 projections on 4x H200, 15 s a rate; labels begin with the planner's layout names. The first two
# ran before the split-K FP8 decode product (issue 25); plan_r1-r3 after it, in one lease of one machine: the
# TP=1 profile's pick (2P2D, then 3P1D) beside 2 colocated TP2 (r3: rates 5 and 6 alone)
SOURCES_28_FP8 = (
    Source("2 colocated TP2, before split-K", "goodput_70b_4xh200_fp8.json", "colocated2", None),
    Source("2P1D(TP2), before split-K", "goodput_70b_4xh200_fp8.json", "2p1d-tp1x2", None),
    Source("2 colocated TP2 (split-K run)", "goodput_70b_fp8_4xh200_split_k.json", "colocated2", None),
    Source("1P(TP2)1D(TP2) (split-K run)", "goodput_70b_fp8_4xh200_split_k.json", "1p1d", None),
    Source("adaptive from 1P(TP2)1D(TP2) (split-K run)", "goodput_70b_fp8_4xh200_split_k.json", "adaptive1p1d",
           (1000.0, 40.0)),
    Source("2 colocated TP2 (plan r1)", "goodput_70b_fp8_4xh200_plan_r1_2p2d_and_colocated.json", "colocated2", None),
    Source("2P2D (plan r1)", "goodput_70b_fp8_4xh200_plan_r1_2p2d_and_colocated.json", "2p2d-tp1x1", None),
    Source("3P1D (plan r2)", "goodput_70b_fp8_4xh200_plan_r2_3p1d.json", "3p1d", None),
    Source("3P1D (plan r3, rates 5-6)", "goodput_70b_fp8_4xh200_plan_r3_3p1d_and_colocated_5_6.json", "3p1d-tp1x1",
           None),
    Source("2 colocated TP2 (plan r3, rates 5-6)", "goodput_70b_fp8_4xh200_plan_r3_3p1d_and_colocated_5_6.json",
           "colocated2", None),
)
# issue 24's decode-heavy workload, 20 s of arrivals a rate. Until the scheduler's ready queue, a decode worker ran
# every pushed request at once, past max_num_seqs, where a colocated one held its batch to it: the 64-sequence 1P1D
# rows ran up to 256 at once (the router's max_in_flight)
SOURCES_24_DECODE_HEAVY = (
    Source("2 colocated, 64 seqs", "decode_heavy_2xh200_seqs64_run1.json", "colocated", None),
    Source("1P1D, 64 seqs, decode batch uncapped (run 1)", "decode_heavy_2xh200_seqs64_run1.json", "disagg", None),
    Source("1P1D, 64 seqs, decode batch uncapped (run 2)", "decode_heavy_2xh200_seqs64_run2.json", "disagg", None),
    Source("adaptive from 1P1D, 64 seqs", "decode_heavy_2xh200_seqs64_run2.json", "adaptive", (1000.0, 40.0)),
    Source("2 colocated, 256 seqs", "decode_heavy_2xh200_seqs256.json", "colocated", None),
    Source("1P1D, 256 seqs", "decode_heavy_2xh200_seqs256.json", "disagg", None),
    # on GPUs 0,1 of a 4x H200 host, after 86e26e9, 7fc1deb and 014c268 (see SOURCES_24's run 5)
    Source("2 colocated, 256 seqs (run 2)", "decode_heavy_2xh200_seqs256_adaptive_and_colocated.json", "colocated",
           None),
    Source("adaptive from 1P1D, 256 seqs", "decode_heavy_2xh200_seqs256_adaptive_and_colocated.json", "adaptive",
           (1000.0, 40.0)),
)
# issue 24's 70B point: Llama-3.1-70B shape in FP8 on two H200s, a whole replica (TP=1) a GPU, ISL 3000 / OSL 150
# (NVIDIA Dynamo's single-node point), on GPU pairs of 4x H200 hosts. r1's colocated run printed its table only
# (goodput_70b_fp8_2xh200_r1_colocated_and_1p1d_table.txt); r1's adaptive mode ran before 7fc1deb and 014c268
SOURCES_24_70B_FP8 = (
    Source("2 colocated (r2)", "goodput_70b_fp8_2xh200_r2_adaptive_and_colocated.json", "colocated2", None),
    Source("1P1D (r1)", "goodput_70b_fp8_2xh200_r1_adaptive_before_fixes_and_1p1d.json", "1p1d", None),
    Source("1P1D (r3, 40 s a rate)", "goodput_70b_fp8_2xh200_r3_1p1d.json", "1p1d", None),
    Source("adaptive before the fixes (r1)", "goodput_70b_fp8_2xh200_r1_adaptive_before_fixes_and_1p1d.json",
           "adaptive", (1000.0, 40.0)),
    Source("adaptive (r2)", "goodput_70b_fp8_2xh200_r2_adaptive_and_colocated.json", "adaptive", (1000.0, 40.0)),
    Source("adaptive (r3, 40 s a rate)", "goodput_70b_fp8_2xh200_r3_adaptive.json", "adaptive", (1000.0, 40.0)),
)
SETS = {
    "adaptive_2xh200": ReportSet(
        SOURCES_24, ("planner_profile_llama-3.1-8b_nvidia-h200.json",),
        "measured before measure.decode_tokens: its decode figures where the batch's chunked prefill took more steps "
        "than a request's 11 tokens (8 x 4,096, 32 x 1,024 and 32 x 4,096) timed fewer sequences than asked, so its "
        "decode steps are too fast there", 2, "issue 24 on {gpus}: Llama-3.1-8B shape (dummy bf16)",
        {"2 colocated": ("tab:blue", "-"), "1P1D": ("tab:orange", "-"), "adaptive from 1P1D": ("tab:green", "-"),
         "planned colocated + step budget": ("tab:red", "--"), "adaptive, roles to 0P2D": ("tab:purple", "-"),
         "adaptive, queue model": ("tab:brown", "-"), "adaptive, kernels compiled at start": ("black", "-")}),
    "decode_heavy_2xh200": ReportSet(
        SOURCES_24_DECODE_HEAVY, ("planner_profile_llama-3.1-8b_nvidia-h200.json",),
        "measured with max_num_seqs 64 (the 64-sequence runs' engines) before measure.decode_tokens (see "
        "adaptive_2xh200); the 256-sequence runs have no profile of their own", 2,
        "issue 24, decode-heavy, on {gpus}: Llama-3.1-8B shape (dummy bf16)",
        {"2 colocated, 256": ("tab:blue", "--"), "1P1D, 256": ("tab:orange", "--"), "2 colocated": ("tab:blue", "-"),
         "1P1D": ("tab:orange", "-"), "adaptive": ("tab:green", "-")}),
    "fp8_70b_2xh200": ReportSet(
        SOURCES_24_70B_FP8, ("planner_profile_llama-3.1-70b_fp8_tp1_before_split_k_nvidia-h200.json",),
        "FP8 TP=1 on one H200 of a 4x H200 host, measured before the split-K FP8 decode product as these runs were "
        "(70B shape, max_num_seqs 64)", 2,
        "issue 24's 70B point on {gpus} (GPU pairs of 4x H200 hosts): Llama-3.1-70B shape, FP8, TP=1",
        {"2 colocated": ("tab:blue", "-"), "1P1D": ("tab:orange", "-"), "adaptive before": ("tab:grey", "--"),
         "adaptive": ("tab:green", "-")}),
    "tp70b_4xh200": ReportSet(
        SOURCES_28, ("planner_profile_llama-3.1-70b_bf16_tp2_transcribed_nvidia-h200.json",),
        "bfloat16 TP=2 on GPUs 2,3 of a 4x H200 host (pdserve plan; its JSON did not come back from the machine: "
        "the figures are transcribed from its printed lines, to 0.1 ms)", 4,
        "issue 28 on {gpus}: Llama-3.1-70B shape (dummy bfloat16)",
        {"2 colocated TP2": ("tab:blue", "-"), "1P(TP2)1D(TP2)": ("tab:orange", "-"),
         "adaptive from 1P(TP2)1D(TP2)": ("tab:green", "-")}),
    "fp8_70b_4xh200": ReportSet(
        SOURCES_28_FP8, ("planner_profile_llama-3.1-70b_fp8_tp1_nvidia-h200.json",
                         "planner_profile_llama-3.1-70b_fp8_tp2_nvidia-h200.json"),
        "FP8 TP=1 (GPU 2) and TP=2 (GPUs 0,1) measured at once on a 4x H200 host in the lease of the plan runs, after "
        "the split-K FP8 decode product", 4, "issue 28 on {gpus}: Llama-3.1-70B shape (dummy), FP8 projections",
        {"2 colocated TP2, before": ("tab:blue", ":"), "2P1D(TP2)": ("tab:purple", ":"),
         "2 colocated TP2": ("tab:blue", "-"), "1P(TP2)1D(TP2)": ("tab:orange", "-"),
         "adaptive from": ("tab:green", "-"), "2P2D": ("tab:red", "-"), "3P1D": ("tab:brown", "-")}),
}


def wilson_interval(good: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a share good/n: what a window of n requests says of the share a
    longer run at that rate would meet (45 requests at 89% give 0.77-0.95)."""
    if n == 0:
        return 0.0, 1.0
    p = good / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)


def attainment_rows(run: dict[str, Any], mode: str, ttft_ms: float, tpot_ms: float) -> list[dict[str, Any]]:
    """Per rate of the run: requests that completed and met both SLOs over all planned, with its 95%
    interval (wilson_interval)."""
    rows = []
    for at_rate in run["requests"][mode]:
        records = at_rate["records"]
        good = sum(1 for r in records if r["ok"] and r["ttft_ms"] <= ttft_ms
                   and (r["tpot_ms"] is None or r["tpot_ms"] <= tpot_ms))
        rows.append({"rate": at_rate["rate"], "attainment": good / len(records) if records else 0.0,
                     "num_requests": len(records), "ci95": list(wilson_interval(good, len(records)))})
    return sorted(rows, key=lambda r: r["rate"])


def decoding(run: dict[str, Any], mode: str, step_s: float = 0.5) -> list[dict[str, Any]]:
    """Per rate: how many requests were between their first token and their end (as the client saw
    them) every `step_s` over the arrivals' window, mean and most: a worker runs at most max_num_seqs."""
    window_s = run["config"]["seconds_per_rate"]
    out = []
    for at_rate in run["requests"][mode]:
        spans = [(r["send_s"] + r["ttft_ms"] / 1e3, r["send_s"] + r["e2e_ms"] / 1e3)
                 for r in at_rate["records"] if r["ok"]]
        counts = [sum(1 for a, b in spans if a <= k * step_s < b) for k in range(int(window_s / step_s))]
        out.append({"rate": at_rate["rate"], "mean": round(sum(counts) / len(counts), 1), "most": max(counts)})
    return sorted(out, key=lambda r: r["rate"])


def ttft_fit(run: dict[str, Any], mode: str) -> dict[str, float] | None:
    """At the sweep's lowest rate (the least queueing): TTFT = a + b x prompt tokens by least squares over
    the requests that completed; 1/b is the prompt tokens a second the prefill reached, a what a request
    waited apart from its prompt (dispatch, a step in progress, the first token's way back). It reads
    the prefill's speed only where that rate leaves the prefill mostly idle (queueing bends it: the 8B
    runs' lowest rate, 8 req/s, gives intercepts below zero)."""
    at_rate = min(run["requests"][mode], key=lambda r: r["rate"])
    points = [(r["in"], r["ttft_ms"]) for r in at_rate["records"] if r["ok"]]
    if len(points) < 3:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return {"rate": at_rate["rate"], "intercept_ms": round(my - b * mx, 1),
            "prompt_tokens_per_s": round(1e3 / b) if b > 0 else None}


def goodput(rows: Sequence[dict[str, Any]]) -> tuple[float | None, float | None, bool]:
    """(the highest rate at >= 90% with every lower rate too, where attainment crosses 90% after it
    (interpolated; None if the sweep never fell under), whether the sweep fell under 90% at all)."""
    best = None
    for i, row in enumerate(rows):
        if row["attainment"] < ATTAINMENT:
            if best is None:
                return None, None, True
            prev = rows[i - 1]
            frac = (prev["attainment"] - ATTAINMENT) / (prev["attainment"] - row["attainment"])
            return best, prev["rate"] + frac * (row["rate"] - prev["rate"]), True
        best = row["rate"]
    return best, None, False


def planner_goodput(profile_paths: Sequence[Path], num_gpus: int, workload: dict[str, Any], ttft_ms: float,
                    tpot_ms: float) -> dict[str, Any]:
    """pdserve plan's prediction from step profiles of one worker size each: every layout of those sizes."""
    from cluster.planner import SLO, StepProfile, Workload, plan

    if not profile_paths:
        return {"pick": None, "layouts": {}}
    profiles = [StepProfile.model_validate_json(path.read_text()) for path in profile_paths]
    load = Workload(prompt_tokens=tuple(workload["input_len"]), output_tokens=tuple(workload["output_len"]))
    plans = plan(num_gpus, {p.tensor_parallel_size: p for p in profiles}, load, SLO(ttft_ms=ttft_ms, tpot_ms=tpot_ms))
    return {"pick": plans[0].layout.name, "layouts": {p.layout.name: {"goodput": p.goodput, "why": p.why}
                                                      for p in plans}}


def report(results: Path, name: str = "adaptive_2xh200") -> dict[str, Any]:
    the_set = SETS[name]
    runs: dict[str, dict[str, Any]] = {}
    for s in the_set.sources:
        runs.setdefault(s.file, json.loads((results / s.file).read_text()))
    first = runs[the_set.sources[0].file]
    workload = first["config"]
    pairs = []
    for ttft, tpot in PAIRS:
        configs = []
        for s in the_set.sources:
            if s.steered is not None and s.steered != (ttft, tpot):
                continue
            rows = attainment_rows(runs[s.file], s.mode, ttft, tpot)
            best, crossing, fell = goodput(rows)
            configs.append({"label": s.label, "file": s.file, "mode": s.mode, "steered": s.steered is not None,
                            "rows": rows, "goodput": best, "crossing_90": crossing, "sweep_fell_under_90": fell,
                            "decoding": decoding(runs[s.file], s.mode), "ttft_fit": ttft_fit(runs[s.file], s.mode)})
        pairs.append({"slo_ttft_ms": ttft, "slo_tpot_ms": tpot, "configs": configs,
                      "planner": planner_goodput([results / p for p in the_set.profiles], the_set.num_gpus, workload,
                                                 ttft, tpot)})
    return {"benchmark": "adaptive_report", "environment": first["environment"],
            "workload": {k: workload[k] for k in ("input_len", "output_len", "seconds_per_rate", "arrivals", "prompts",
                                                  "engine_flags")},
            "sources": [s._asdict() for s in the_set.sources], "profiles": list(the_set.profiles),
            "profile_note": the_set.profile_note,
            "dates": sorted({run["environment"]["date"][:10] for run in runs.values()}),
            "pairs": pairs}


def plot(fig: Any, doc: dict[str, Any], styles: dict[str, tuple[str, str]]) -> None:
    axes = fig.subplots(1, len(doc["pairs"]), sharey=True)
    for ax, pair in zip(axes, doc["pairs"]):
        for c in pair["configs"]:
            colour, line = next(v for k, v in styles.items() if c["label"].startswith(k))
            marker = "s" if "run 2" in c["label"] or "run b" in c["label"] else "o"
            rates, shares = [r["rate"] for r in c["rows"]], [100 * r["attainment"] for r in c["rows"]]
            ax.plot(rates, shares, line, color=colour, marker=marker,
                    label=f"{c['label']}: {c['goodput'] or 0:g}{'' if c['sweep_fell_under_90'] else '+'} req/s")
            ax.fill_between(rates, [100 * r["ci95"][0] for r in c["rows"]], [100 * r["ci95"][1] for r in c["rows"]],
                            color=colour, alpha=0.06, linewidth=0)  # NOTE: each window's 95% interval
        for name, p in pair["planner"]["layouts"].items():  # NOTE: a measured layout's label begins with its name
            colour = next((v[0] for k, v in styles.items() if k.startswith(name) or name.startswith(k)), "grey")
            ax.axvline(p["goodput"], color=colour, linestyle=":", alpha=0.7)
            ax.text(p["goodput"], 101, name, rotation=90, fontsize=6, va="bottom", ha="center", color=colour)
        ax.axhline(100 * ATTAINMENT, color="grey", linewidth=0.8)
        planner = f"dotted: planner per layout (pick: {pair['planner']['pick']})" if pair["planner"]["pick"] else \
            "no planner prediction"
        ax.set_title(f"TTFT <= {pair['slo_ttft_ms']:g} ms, TPOT <= {pair['slo_tpot_ms']:g} ms\n{planner}", fontsize=9)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("requests meeting both SLOs (%)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--set", choices=sorted(SETS), default="adaptive_2xh200")
    args = parser.parse_args(argv)
    doc = report(args.results, args.set)
    out = args.results / f"{args.set}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    env = doc["environment"]
    gpus = f"{len(env['gpus'])}x {env['gpus'][0] if env['gpus'] else env['device_name']}"
    title = (f"{SETS[args.set].title.format(gpus=gpus)}, prompts {doc['workload']['input_len']}, outputs "
             f"{doc['workload']['output_len']}, {' to '.join(dict.fromkeys((doc['dates'][0], doc['dates'][-1])))}")
    save_plot(out.with_suffix(".png"), lambda fig: plot(fig, doc, SETS[args.set].styles), title)
    for pair in doc["pairs"]:
        predicted = ", ".join(f"{k} {v['goodput']:.2f}" for k, v in pair["planner"]["layouts"].items())
        print(f"TTFT <= {pair['slo_ttft_ms']:g} ms, TPOT <= {pair['slo_tpot_ms']:g} ms (planner: {predicted})")
        for c in pair["configs"]:
            rows = ", ".join(f"{r['rate']:g}: {100 * r['attainment']:.0f}% ({100 * r['ci95'][0]:.0f}-"
                             f"{100 * r['ci95'][1]:.0f}, n={r['num_requests']})" for r in c["rows"])
            cross = f", crosses 90% near {c['crossing_90']:.1f}" if c["crossing_90"] is not None else ""
            more = "" if c["sweep_fell_under_90"] else " (the sweep ended above 90%)"
            print(f"  {c['label']:<34} goodput {c['goodput'] or 0:>4g}{cross}{more}  [{rows}]")
            print(f"  {'':<34} decoding at once (mean/most): "
                  + ", ".join(f"{d['rate']:g}: {d['mean']:g}/{d['most']}" for d in c["decoding"]))
            if (fit := c["ttft_fit"]) is not None:
                print(f"  {'':<34} TTFT at {fit['rate']:g} req/s: {fit['intercept_ms']:g} ms + prompt tokens at "
                      f"{fit['prompt_tokens_per_s']} a second")
    print(f"wrote {out} and its PNG")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
