"""The serving modes bench.goodput compares: what `pdserve serve` flags make each (disaggregated PpDd,
colocated replicas, the adaptive mode that steers to the SLOs), by name, and the adaptive mode started
in the layout the planner picks from a step profile."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from loadgen.config import parse_range


@dataclass(frozen=True)
class ModeSpec:
    name: str
    serve_flags: tuple[str, ...]  # `pdserve serve` flags that make the mode
    description: str
    is_kv_transferred: bool  # prefill and decode on different workers: --transport applies
    num_workers: int  # one GPU each on a GPU machine
    steers_to_slos: bool = False  # the server gets the SLOs the sweep scores against


def disagg_mode(name: str, num_prefill: int, num_decode: int) -> ModeSpec:
    return ModeSpec(name, ("--prefill", str(num_prefill), "--decode", str(num_decode)),
                    f"disagg {num_prefill} prefill + {num_decode} decode", True, num_prefill + num_decode)


def colocated_mode(name: str, num_replicas: int) -> ModeSpec:
    return ModeSpec(name, ("--colocated", "--decode", str(num_replicas)), f"colocated {num_replicas} replicas",
                    False, num_replicas)


def adaptive_mode(name: str, num_prefill: int, num_decode: int) -> ModeSpec:
    """Starts as PpDd and steers to the SLOs: the 'slo' prefill rule (each prompt prefilled where its first
    token comes sooner, on a decode worker within the step budget or through the prefill workers), the
    engines' ITL budget, and the autoscaler moving workers between the pools within the same GPUs, down
    to no prefill worker (the decode workers then serve as colocated ones)."""
    num = num_prefill + num_decode
    return ModeSpec(name, ("--prefill", str(num_prefill), "--decode", str(num_decode), "--local-prefill-rule", "slo",
                           "--autoscale-max-gpus", str(num), "--autoscale-min-prefill", "0"),
                    f"adaptive from {num_prefill}P{num_decode}D", True, num, steers_to_slos=True)


def planned_adaptive_mode(name: str, layout: Any) -> ModeSpec:
    """The adaptive mode started in the layout the planner picked (cluster.planner.Layout): xPyD steering
    as adaptive_mode does, or colocated replicas (the router gets the SLOs; colocated engines keep no step
    budget, deploy.cli says why; no pools to move)."""
    spec = (colocated_mode(name, layout.num_decode) if layout.num_prefill == 0
            else adaptive_mode(name, layout.num_prefill, layout.num_decode))
    return dataclasses.replace(spec, description=f"adaptive: planned {layout.name}", steers_to_slos=True)


MODES = {m.name: m for m in (disagg_mode("disagg", 1, 1), colocated_mode("colocated", 2), adaptive_mode("adaptive", 1, 1))}
MODE_NAMES = ("disagg (1P1D), colocated (2 replicas), adaptive (from 1P1D, steering to the SLOs), <P>p<D>d "
              "(e.g. 1p3d, 2p6d), colocated<N> (e.g. colocated4), adaptive<P>p<D>d")


def mode_spec(name: str) -> ModeSpec:
    """A mode by name: the two of MODES, '<P>p<D>d' (P prefill + D decode workers) or 'colocated<N>'."""
    if name in MODES:
        return MODES[name]
    if m := re.fullmatch(r"(adaptive)?(\d+)p(\d+)d", name):
        num_prefill, num_decode = int(m[2]), int(m[3])
        if num_prefill >= 1 and num_decode >= 1:
            return (adaptive_mode if m[1] else disagg_mode)(name, num_prefill, num_decode)
    if (m := re.fullmatch(r"colocated(\d+)", name)) and int(m[1]) >= 1:
        return colocated_mode(name, int(m[1]))
    raise ValueError(f"--modes: unknown mode {name!r}; choose from {MODE_NAMES}")


def layout_of(spec: ModeSpec) -> tuple[int, int]:
    """(prefill workers, decode workers); prefill 0 for a colocated mode."""
    flags = spec.serve_flags
    decode = int(flags[flags.index("--decode") + 1])
    return (int(flags[flags.index("--prefill") + 1]), decode) if spec.is_kv_transferred else (0, decode)


def plan_adaptive_modes(args: argparse.Namespace, specs: dict[str, ModeSpec]) -> dict[str, Any]:
    """Each adaptive mode's layout, picked by the planner from --plan-profile for this run's workload and
    SLOs on the mode's GPUs (specs updated in place); per mode the pick and every layout's prediction."""
    from cluster.planner import SLO, StepProfile, Workload
    from cluster.planner import plan as plan_layouts

    profile = StepProfile.model_validate_json(args.plan_profile.read_text())
    workload = Workload(prompt_tokens=parse_range(args.input_len), output_tokens=parse_range(args.output_len))
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    out: dict[str, Any] = {}
    for name, spec in list(specs.items()):
        if not spec.steers_to_slos:
            continue
        plans = plan_layouts(spec.num_workers, {1: profile}, workload, slo)
        specs[name] = planned_adaptive_mode(name, plans[0].layout)
        out[name] = {"pick": plans[0].layout.name, "profile": str(args.plan_profile),
                     "predicted": {"goodput": plans[0].goodput, "why": plans[0].why},
                     "layouts": {p.layout.name: {"goodput": p.goodput, "why": p.why} for p in plans}}
    return out
