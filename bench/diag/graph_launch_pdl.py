"""Why does launching some CUDA graphs on an idle device hold the host 70-170 us, and others 8-18?
bench.diag.spec_graph_launch saw the 1-row target decode graph launch in 8-18 us and the 8-row one in
69-100, with the same 141 kernels; the draft loop graph in 113-170. One difference: at one row every
Triton kernel launches with programmatic dependent launch (engine/pdl.py), at more rows only the weight
products do, and the draft loop's first pass has two rows: those graphs mix PDL and plain edges.

Synthetic graphs of --nodes tiny kernels, captured and replayed on an idle device (synchronised before
each replay) and behind a busy one (a spin kernel first), host time of replay() alone, median:
  pdl: every kernel a Triton one with PDL;  plain: the same without PDL;
  alternate: PDL and plain in turns;  torch_mix: PDL Triton kernels with a torch add between every two.

    python -m bench.diag.graph_launch_pdl [--nodes 150]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench.graph_launch import replay_times
from engine.cuda_graphs import capture_graphs
from engine.pdl import after_previous, pdl


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def bodies(x: torch.Tensor, nodes: int, on: bool) -> dict[str, Callable[[], None]]:
    """Each variant's captured work: `nodes` launches."""

    def bump(with_pdl: bool) -> None:
        _bump[(1,)](x, x.numel(), BLOCK=256, PDL=on, launch_pdl=on and with_pdl)

    def run(pattern: Callable[[int], str]) -> Callable[[], None]:
        def body() -> None:
            for i in range(nodes):
                kind = pattern(i)
                if kind == "torch":
                    x.add_(1)
                else:
                    bump(kind == "pdl")

        return body

    return {
        "pdl": run(lambda i: "pdl"),
        "plain": run(lambda i: "plain"),
        "alternate": run(lambda i: "pdl" if i % 2 == 0 else "plain"),
        "torch_mix": run(lambda i: "torch" if i % 3 == 0 else "pdl"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=150)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.zeros(256, device=device)
    rows = {}
    for name, body in bodies(x, args.nodes, pdl(device)).items():
        graph = capture_graphs([1], lambda _, body=body: body(), device)[1]
        idle_s, idle_sync_s = replay_times(graph, args.iters)
        busy_s, _ = replay_times(graph, args.iters, busy_cycles=2_000_000)
        rows[name] = {"idle_host_us": idle_s * 1e6, "idle_replay_sync_us": idle_sync_s * 1e6,
                      "busy_host_us": busy_s * 1e6}
        print(name, {k: round(v, 1) for k, v in rows[name].items()}, flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "nodes": args.nodes, "pdl": pdl(device), "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
