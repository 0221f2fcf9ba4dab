"""Instructions a weight in a Triton kernel's main loop, counted without a GPU: the kernel is compiled
for Hopper (sm_90) on the CPU, its cubin disassembled by the cuobjdump Triton ships, and the
instructions between the widest backward branch and its target counted, by opcode. Divided by the
weights a thread takes a loop trip, that is the issue cost of a weight (of every lane's share).
Pointers, strides, N and K are compiled as multiples of 16, as Triton's launcher specializes them.

Kernels: `int4_small` (int4_kernels._small_matmul_kernel: BLOCK_N x BLOCK_K weights a trip).
What it counted (2026-11-28): the words kernel 4.33 a weight at one row (16 x 1,024, 4 warps), 3.95 at
32 x 1,024; the float-bits kernel before it 6.39 at 16 x 1,024.

    python -m bench.diag.sass_loop [--rows 1] [--tile 16 1024] [--warps 4]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,5})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int):
    names = list(signature)
    aligned = [a for a in names if signature[a].startswith("*") or a.startswith("stride") or a in ("N", "K")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}},
                       constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sass(kernel) -> str:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_opcodes(text: str) -> collections.Counter:
    """Opcodes between the widest backward branch and its target."""
    rows = [(int(m.group(1), 16), m.group(3), line) for line in text.splitlines() if (m := INSTRUCTION.match(line))]
    spans = [(int(b.group(1), 16), at) for at, _, line in rows if (b := re.search(r"BRA (0x[0-9a-f]+)", line))
             and int(b.group(1), 16) < at]
    if not spans:
        raise ValueError("no backward branch: the kernel has no loop")
    start, end = max(spans, key=lambda s: s[1] - s[0])
    return collections.Counter(op for at, op, _ in rows if start <= at <= end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tile", type=int, nargs=2, default=[16, 1024], metavar=("BLOCK_N", "BLOCK_K"))
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    from engine.quant.int4_kernels import _small_matmul_kernel

    bf16 = "*bf16"
    signature = dict(x_ptr=bf16, w_ptr="*i32", s_ptr="*fp16", bias_ptr=bf16, out_ptr=bf16, M="i32", N="i32", K="i32",
                     stride_x="i32", stride_w="i32", stride_sn="i32", stride_o="i32")
    block_n, block_k = args.tile
    kernel = compile_sm90(_small_matmul_kernel, signature,
                          dict(GROUP=args.group, HAS_BIAS=False, BLOCK_M=triton.next_power_of_2(args.rows),
                               BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=3), args.warps)
    ops = loop_opcodes(sass(kernel))
    weights = block_n * block_k / (32 * args.warps)
    total = sum(ops.values())
    print(f"int4_small rows {args.rows} tile {block_n} x {block_k} warps {args.warps}: {total} instructions a trip, "
          f"{total / weights:.2f} a weight")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))


if __name__ == "__main__":
    main()
