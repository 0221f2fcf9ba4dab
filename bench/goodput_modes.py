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
    num_workers: int
    num_gpus: int  # the workers' GPUs: each worker has its pool's tensor-parallel size of them
    steers_to_slos: bool = False  # the server gets the SLOs the sweep scores against


def _tp_flags(prefill_tp: int, decode_tp: int, tp: int) -> tuple[str, ...]:
    """--prefill-tp/--decode-tp where a pool's size differs from the engine's --tp (which both pools take)."""
    return (("--prefill-tp", str(prefill_tp)) if prefill_tp != tp else ()) + \
        (("--decode-tp", str(decode_tp)) if decode_tp != tp else ())


def _tp_note(prefill_tp: int, decode_tp: int) -> str:
    if prefill_tp == decode_tp:
        return f" (TP{prefill_tp} each)" if prefill_tp > 1 else ""
    return f" (P TP{prefill_tp}, D TP{decode_tp})"


def disagg_mode(name: str, num_prefill: int, num_decode: int, prefill_tp: int = 1, decode_tp: int = 1,
                tp: int = 1) -> ModeSpec:
    return ModeSpec(name, ("--prefill", str(num_prefill), "--decode", str(num_decode),
                           *_tp_flags(prefill_tp, decode_tp, tp)),
                    f"disagg {num_prefill} prefill + {num_decode} decode{_tp_note(prefill_tp, decode_tp)}", True,
                    num_prefill + num_decode, num_prefill * prefill_tp + num_decode * decode_tp)


def colocated_mode(name: str, num_replicas: int, worker_tp: int = 1, tp: int = 1) -> ModeSpec:
    """Replicas of WORKER_TP GPUs each (--decode-tp where it differs from the engine's --tp)."""
    return ModeSpec(name, ("--colocated", "--decode", str(num_replicas), *_tp_flags(tp, worker_tp, tp)),
                    f"colocated {num_replicas} replicas{f' (TP{worker_tp} each)' if worker_tp > 1 else ''}", False,
                    num_replicas, num_replicas * worker_tp)


def adaptive_mode(name: str, num_prefill: int, num_decode: int, prefill_tp: int = 1, decode_tp: int = 1,
                  tp: int = 1) -> ModeSpec:
    """Starts as PpDd and steers to the SLOs: the 'slo' prefill rule (each prompt prefilled where its first
    token comes sooner, on a decode worker within the step budget or through the prefill workers), the
    engines' ITL budget, and the autoscaler moving workers between the pools within the same GPUs, down
    to no prefill worker (the decode workers then serve as colocated ones; only between pools of one
    worker size)."""
    spec = disagg_mode(name, num_prefill, num_decode, prefill_tp, decode_tp, tp)
    return dataclasses.replace(
        spec, serve_flags=(*spec.serve_flags, "--local-prefill-rule", "slo", "--autoscale-max-gpus", str(spec.num_gpus),
                           "--autoscale-min-prefill", "0"),
        description=f"adaptive from {num_prefill}P{num_decode}D{_tp_note(prefill_tp, decode_tp)}", steers_to_slos=True)


def planned_adaptive_mode(name: str, layout: Any, tp: int = 1) -> ModeSpec:
    """The adaptive mode started in the layout the planner picked (cluster.planner.Layout): xPyD steering
    as adaptive_mode does, or colocated replicas (the router gets the SLOs; colocated engines keep no step
    budget, deploy.cli says why; no pools to move). TP: the engine's --tp, which the layout's sizes override."""
    spec = (colocated_mode(name, layout.num_decode, layout.decode_tp, tp) if layout.num_prefill == 0
            else adaptive_mode(name, layout.num_prefill, layout.num_decode, layout.prefill_tp, layout.decode_tp, tp))
    return dataclasses.replace(spec, description=f"adaptive: planned {layout.name}", steers_to_slos=True)


MODE_NAMES = ("disagg (1P1D), colocated (2 replicas), adaptive (from 1P1D, steering to the SLOs), <P>p<D>d "
              "(e.g. 1p3d, 2p6d), colocated<N> (e.g. colocated4), adaptive<P>p<D>d; every worker of --tp GPUs, "
              "or, for the split modes, a suffix -tp<A>x<B> for prefill workers of A GPUs and decode workers of B "
              "(e.g. 2p1d-tp1x2)")


def mode_spec(name: str, tp: int = 1) -> ModeSpec:
    """A mode by name: disagg, colocated, adaptive, '<P>p<D>d' (P prefill + D decode workers) or
    'colocated<N>', each worker of TP GPUs (the engine's --tp), or '<P>p<D>d-tp<A>x<B>' with A and B."""
    aliases = {"disagg": "1p1d", "colocated": "colocated2", "adaptive": "adaptive1p1d"}
    if m := re.fullmatch(r"(adaptive)?(\d+)p(\d+)d(?:-tp(\d+)x(\d+))?", aliases.get(name, name)):
        num_prefill, num_decode = int(m[2]), int(m[3])
        prefill_tp, decode_tp = (int(m[4]), int(m[5])) if m[4] else (tp, tp)
        if min(num_prefill, num_decode, prefill_tp, decode_tp) >= 1:
            return (adaptive_mode if m[1] else disagg_mode)(name, num_prefill, num_decode, prefill_tp, decode_tp, tp)
    if (m := re.fullmatch(r"colocated(\d+)", aliases.get(name, name))) and int(m[1]) >= 1:
        return colocated_mode(name, int(m[1]), tp, tp)
    raise ValueError(f"--modes: unknown mode {name!r}; choose from {MODE_NAMES}")


def layout_of(spec: ModeSpec) -> tuple[int, int]:
    """(prefill workers, decode workers); prefill 0 for a colocated mode."""
    flags = spec.serve_flags
    decode = int(flags[flags.index("--decode") + 1])
    return (int(flags[flags.index("--prefill") + 1]), decode) if spec.is_kv_transferred else (0, decode)


def plan_adaptive_modes(args: argparse.Namespace, specs: dict[str, ModeSpec], tp: int = 1) -> dict[str, Any]:
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
        plans = plan_layouts(spec.num_gpus, {profile.tensor_parallel_size: profile}, workload, slo)
        specs[name] = planned_adaptive_mode(name, plans[0].layout, tp)
        out[name] = {"pick": plans[0].layout.name, "profile": str(args.plan_profile),
                     "predicted": {"goodput": plans[0].goodput, "why": plans[0].why},
                     "layouts": {p.layout.name: {"goodput": p.goodput, "why": p.why} for p in plans}}
    return out
