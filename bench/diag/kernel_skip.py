"""What fusing a kernel away could save at most (LAB ONLY): decode steps of `bench.quantized`'s FP8 variant with
chosen kernels not launched (their outputs left unwritten: the tokens are garbage, the times are what a step
without that launch takes), each setting in a process of its own, in turns, in one run.

- `rope`: the rotary kernel (`fused_kernels.norm_rope_qk`): the queries read unrotated, no K/V stored; what
  a decode attention launch that rotated its queries and stored the new K/V itself could save, at most;
- `quantize`: the activation quantization before the o projection (`fp8_kernels.quantize_rows`);
- `swiglu`: the quantizing SwiGLU between gate/up and down (`fused_kernels.silu_and_mul`).

    python -m bench.diag.kernel_skip --model bench/shapes/llama-3.1-8b --load-format dummy \\
        --skips none rope quantize rope,quantize --batches 1 8 --out DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.common import add_child_arguments, base_parser, finish_child, run_in_processes, write_results


def skip(names: set[str]) -> None:
    """Replace the named launchers by ones that launch nothing (before the model is built: Fp8Matmul keeps
    its quantizer)."""
    from engine.models import fused_kernels
    from engine.quant import fp8_kernels
    from engine.quant.fp8 import FP8, QuantizedRows

    if "rope" in names:
        def norm_rope_qk(qk, num_q_heads, cos, sin, q_w, k_w, eps, store=None):  # type: ignore[no-untyped-def]
            return qk[:, :num_q_heads], (None if store is not None else qk[:, num_q_heads:])
        fused_kernels.norm_rope_qk = norm_rope_qk  # type: ignore[assignment]
    if "quantize" in names:
        def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows, n = x.shape
            return (torch.empty(rows, n, dtype=FP8, device=x.device),
                    torch.empty(rows, 1, dtype=torch.float32, device=x.device))
        fp8_kernels.quantize_rows = quantize_rows  # type: ignore[assignment]
    if "swiglu" in names:
        def silu_and_mul(gate_up: torch.Tensor, quantize: bool = False) -> Any:
            rows, n = gate_up.shape[0], gate_up.shape[1] // 2
            if quantize:
                return QuantizedRows(torch.empty(rows, n, dtype=FP8, device=gate_up.device),
                                     torch.empty(rows, 1, dtype=torch.float32, device=gate_up.device), gate_up.dtype)
            return torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
        fused_kernels.silu_and_mul = silu_and_mul  # type: ignore[assignment]


def one(args: Any, setting: str) -> dict[str, Any]:
    from bench.quantized import one_variant

    skip(set(setting.split(",")) - {"none"})
    result = one_variant(args, "fp8")
    return {"skip": setting, "decode": result["decode"], "device_name": result["device_name"], "env": result["env"]}


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--skips", nargs="+", default=["none", "rope", "quantize", "rope,quantize"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.set_defaults(requests=0)  # bench.quantized's offline run: not run here
    parser.add_argument("--tag", default="")
    add_child_arguments(parser)  # one setting, in a child process
    args = parser.parse_args()
    if args.one is not None:
        finish_child(args.one_out, one(args, args.one))
    runs = run_in_processes("bench.diag.kernel_skip", args.skips, 400.0)
    for run in runs:
        print(run["skip"], [(r["batch"], round(r["step_s"] * 1e3, 3)) for r in run["decode"]], flush=True)
    env = {**runs[0]["env"], "device_name": runs[0]["device_name"], "torch_version": torch.__version__}
    for r in runs:
        r.pop("env")

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 1, 1)
        for r in runs:
            ax.plot([row["batch"] for row in r["decode"]], [row["step_s"] * 1e3 for row in r["decode"]], marker="o",
                    label=f"skipped: {r['skip']}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel(f"ms per decode step (context {args.context})")
        ax.legend()

    write_results(Path(args.out), f"kernel_skip{args.tag}", env, {"context": args.context, "runs": runs}, plot,
                  f"FP8 decode steps with kernels not launched (lab), {env['device_name']}")


if __name__ == "__main__":
    main()
