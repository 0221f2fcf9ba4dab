"""Instructions a weight in a Triton kernel's main loop, counted without a GPU: the kernel is compiled
for Hopper (sm_90) on the CPU, its cubin disassembled by the cuobjdump Triton ships, and the
instructions between the widest backward branch and its target counted, by opcode. Divided by the
weights a thread takes a loop trip, that is the issue cost of a weight (of every lane's share).
Pointers, strides, N and K are compiled as multiples of 16, as Triton's launcher specializes them.

Kernel: int4_kernels._words_kernel (BLOCK_N x 128 weights a trip).
What it counted: the CUDA-core kernel before it (2026-11-28) 4.33 a weight at one row (16 x 1,024, 4
warps), 3.95 at 32 x 1,024, and the one before that 6.39; the tensor-core words kernel (2026-11-29,
Triton 3.9 here) 4.34 at 64 rows a tile, 3.17 at 128, of which 1.6 convert (PTX) and take the zero
point (packed adds).
A group's nibbles as one dot (2026-12-01, Triton 3.6 as on the GPU machines): 3.31 at 64 rows a tile
(212 instructions a trip against 277 before, with one warpgroup wait a trip where each of the eight
16-column products had one).

    python -m bench.diag.sass_loop [--block-n 64] [--group 128] [--warps 4]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,5})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int):
    names = list(signature)
    aligned = [a for a in names
               if signature[a].startswith("*") or a.startswith("stride") or a in ("N", "K", "k_per_split")]
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


def loop_lines(text: str) -> list[str]:
    """The SASS lines between the widest backward branch and its target (a kernel's main loop)."""
    rows = [(int(m.group(1), 16), line) for line in text.splitlines() if (m := INSTRUCTION.match(line))]
    spans = [(int(b.group(1), 16), at) for at, line in rows if (b := re.search(r"BRA (0x[0-9a-f]+)", line))
             and int(b.group(1), 16) < at]
    if not spans:
        raise ValueError("no backward branch: the kernel has no loop")
    start, end = max(spans, key=lambda s: s[1] - s[0])
    return [line for at, line in rows if start <= at <= end]


def loop_opcodes(text: str) -> collections.Counter:
    """Opcodes between the widest backward branch and its target."""
    return collections.Counter(INSTRUCTION.match(line).group(3) for line in loop_lines(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    from engine.quant.int4_kernels import MAGIC, _words_kernel, word_asm

    bf16 = "*bf16"
    signature = dict(x_ptr=bf16, w_ptr="*i32", s_ptr="*fp16", bias_ptr=bf16, out_ptr=bf16, part_ptr="*fp32",
                     count_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32", stride_x="i32", stride_o="i32")
    magic, offset = MAGIC[torch.bfloat16]
    kernel = compile_sm90(_words_kernel, signature,
                          dict(GROUP=args.group, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=args.block_n, SPLIT_K=4, ASM=True,
                               WORD_ASM=word_asm(magic), MAGIC=magic, OFFSET=offset, NUM_STAGES=3, PDL=True),
                          args.warps)
    ops = loop_opcodes(sass(kernel))
    weights = args.block_n * 128 / (32 * args.warps)
    total = sum(ops.values())
    print(f"int4 words block_n {args.block_n} group {args.group} warps {args.warps}: {total} instructions a trip, "
          f"{total / weights:.2f} a weight")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))


if __name__ == "__main__":
    main()
