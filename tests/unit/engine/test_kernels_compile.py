"""The engine's Triton kernels that quantize or fuse (engine/models/fused_kernels.py, engine/quant/), and the
decode step's attention kernels, compile for Hopper (sm_90) on the CPU as their launches specialize them, each
with programmatic dependent launch (engine/pdl.py): its PTX waits for the kernel before it, then lets the next
one in; and none keeps more than a register pair in local memory (spills). Triton's compiler
runs its whole pipeline to a cubin without a GPU. The interpreter, which every other kernel test runs on,
does not hold a kernel to the compiler's rules (a kernel that read a plain float global passed every
interpreted test and failed to compile), nor runs the PDL instructions, so this runs the compiler, in a
process of its own (the kernels the other tests import are interpreted ones, which cannot be compiled)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# NOTE: not importorskip: importing Triton here, uninterpreted, would break the interpreted kernel tests
# collected after this module (tests/interpreted.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

ROOT = Path(__file__).resolve().parents[3]

# (module, kernel, signature, constexprs): the bf16 model's arguments; "constexpr" entries set below
CASES = """
from engine.attention.triton_backend import TritonAttentionConfig
from engine.quant.int4_kernels import word_asm, words_num_warps
P = "*bf16"
WORD_ASM = word_asm(0x4300)
CASES = [
    ("engine.models.fused_kernels", "_add_rms_norm_kernel",
     dict(x_ptr=P, res_ptr=P, w_ptr=P, out_ptr="*fp8e4nv", res_out_ptr=P, scale_ptr="*fp32", stride_x="i32",
          stride_r="i32", stride_o="i32", stride_ro="i32", n="i32", eps="fp32"),
     dict(HAS_RESIDUAL=True, QUANTIZE=True, BLOCK=4096, PDL=True)),
    ("engine.models.fused_kernels", "_add_rms_norm_kernel",
     dict(x_ptr=P, res_ptr=P, w_ptr=P, out_ptr=P, res_out_ptr=P, scale_ptr=P, stride_x="i32", stride_r="i32",
          stride_o="i32", stride_ro="i32", n="i32", eps="fp32"),
     dict(HAS_RESIDUAL=False, QUANTIZE=False, BLOCK=4096, PDL=True)),
    *(("engine.models.fused_kernels", "_norm_rope_kernel",
       dict(x_ptr=P, cos_ptr=P, sin_ptr=P, wq_ptr=P, wk_ptr=P, q_out_ptr=P, k_out_ptr=P, stride_xt="i32",
            stride_xh="i32", stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32", stride_c="i32",
            eps="fp32", num_q_heads="i32", num_heads="i32", v_ptr=P, kc_ptr=cache, vc_ptr=cache, slot_ptr="*i64",
            stride_vt="i32", stride_vh="i32", stride_kcb="i64", stride_kco="i32", stride_kch="i32",
            stride_vcb="i64", stride_vco="i32", stride_vch="i32", num_kv_heads="i32", k_inverse="fp32",
            v_inverse="fp32"),
       dict(HEAD_DIM=128, HALF=64, BLOCK_H=8, HAS_NORM=True, STORE=store, BLOCK_SIZE=16, PDL=True))
      for cache, store in ((P, False), (P, True), ("*fp8e4nv", True))),
    ("engine.models.fused_kernels", "_silu_and_mul_kernel",
     dict(x_ptr=P, out_ptr=P, stride_x="i32", stride_o="i32", n="i32"), dict(BLOCK=1024, PDL=True)),
    ("engine.models.fused_kernels", "_silu_and_mul_quantized_kernel",
     dict(x_ptr=P, q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_x="i32", stride_q="i32", n="i32"),
     dict(BLOCK=16384, ONE_BLOCK=True, PDL=True)),
    ("engine.models.fused_kernels", "_silu_and_mul_quantized_kernel",
     dict(x_ptr=P, q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_x="i32", stride_q="i32", n="i32"),
     dict(BLOCK=16384, ONE_BLOCK=False, PDL=True)),
    ("engine.quant.fp8_kernels", "_quantize_rows_kernel",
     dict(x_ptr=P, q_ptr="*fp8e4nv", scale_ptr="*fp32", stride_x="i32", stride_q="i32", n="i32", chunk="i32"),
     dict(ROW_BLOCK=4096, BLOCK=1024, PDL=True)),
    ("engine.quant.fp8_kernels", "_split_k_matmul_kernel",
     dict(xq_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*fp32",
          out_ptr=P, part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32",
          stride_x="i32", stride_w="i32", stride_o="i32"),
     dict(HAS_BIAS=False, SPLIT_K=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, PDL=True)),
    ("engine.models.row_kernels", "_row_product_kernel",
     dict(x_ptr=P, w_ptr=P, bias_ptr=P, out_ptr=P, N="i32", K="i32", stride_w="i32", buffer_ptrs="i32",
          calls_ptr=P, region="i32"),
     dict(HAS_BIAS=False, BLOCK_N=8, BLOCK_K=512, NUM_STAGES=3, PUSH=False, RANK=0, WORLD=1, PDL=True)),
    ("engine.models.row_kernels", "_row_product_kernel",  # pushing its row into a peer's buffer (its PTX store)
     dict(x_ptr=P, w_ptr=P, bias_ptr=P, out_ptr=P, N="i32", K="i32", stride_w="i32", buffer_ptrs="i64",
          calls_ptr="*i32", region="i32"),
     dict(HAS_BIAS=False, BLOCK_N=8, BLOCK_K=1024, NUM_STAGES=3, PUSH=True, RANK=1, WORLD=2, PDL=True)),
    ("engine.parallel.symm_kernels", "_pushed_add_rms_norm_kernel",
     dict(buffer_ptrs="i64", calls_ptr="*i32", x_ptr=P, res_ptr=P, w_ptr=P, out_ptr="*fp8e4nv", res_out_ptr=P,
          scale_ptr="*fp32", n="i32", region="i32", eps="fp32"),
     dict(RANK=0, WORLD=2, HAS_RESIDUAL=True, QUANTIZE=True, BLOCK=4096, PDL=True)),
    ("engine.quant.fp8_kernels", "_gemv_kernel",
     dict(xq_ptr="*fp8e4nv", x_scale_ptr="*fp32", w_ptr="*fp8e4nv", w_scale_ptr="*fp32", bias_ptr="*fp32",
          out_ptr=P, N="i32", K="i32", stride_w="i32"),
     dict(HAS_BIAS=True, BLOCK_N=8, BLOCK_K=1024, NUM_STAGES=3, PDL=True)),
    ("engine.quant.int4_kernels", "_words_kernel",  # its PTX conversion assembled too
     dict(x_ptr=P, w_ptr="*i32", s_ptr="*fp16", bias_ptr=P, out_ptr=P, part_ptr="*fp32", count_ptr="*i32", M="i32",
          N="i32", K="i32", k_per_split="i32", stride_x="i32", stride_o="i32"),
     dict(GROUP=128, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=128, SPLIT_K=8, ASM=True, WORD_ASM=WORD_ASM, MAGIC=0x4300,
          OFFSET=128.0, NUM_STAGES=3, PDL=True)),
    ("engine.quant.int4_kernels", "_words_kernel",
     dict(x_ptr=P, w_ptr="*i32", s_ptr="*fp16", bias_ptr=P, out_ptr=P, part_ptr="*fp32", count_ptr="*i32", M="i32",
          N="i32", K="i32", k_per_split="i32", stride_x="i32", stride_o="i32"),
     dict(GROUP=32, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=32, SPLIT_K=1, ASM=True, WORD_ASM=WORD_ASM, MAGIC=0x4300,
          OFFSET=128.0, NUM_STAGES=3, PDL=True)),
    *(("engine.quant.int4_kernels", "_words_kernel",  # the 8B shape's 128-row tiles at 17-32 and 33-64 rows
       dict(x_ptr=P, w_ptr="*i32", s_ptr="*fp16", bias_ptr=P, out_ptr=P, part_ptr="*fp32", count_ptr="*i32", M="i32",
            N="i32", K="i32", k_per_split="i32", stride_x="i32", stride_o="i32"),
       dict(GROUP=128, HAS_BIAS=False, BLOCK_M=block_m, BLOCK_N=128, SPLIT_K=4, ASM=True, WORD_ASM=WORD_ASM,
            MAGIC=0x4300, OFFSET=128.0, NUM_STAGES=3, PDL=True)) for block_m in (32, 64)),
    ("engine.quant.int4_kernels", "_dequantize_words_kernel",
     dict(w_ptr="*i32", s_ptr="*fp16", out_ptr=P, K="i32", stride_o="i32"), dict(GROUP=32, BLOCK_N=128, PDL=True)),
    ("engine.parallel.symm_kernels", "_allreduce_add_rms_norm_kernel",
     dict(buffer_ptrs="i64", signal_pads="i64", calls_ptr="*i32", x_ptr=P, res_ptr=P, w_ptr=P, out_ptr="*fp8e4nv",
          res_out_ptr=P, scale_ptr="*fp32", stride_x="i32", stride_r="i32", stride_o="i32", stride_ro="i32", n="i32",
          half="i32", eps="fp32"),
     dict(RANK=1, WORLD=2, HAS_RESIDUAL=True, QUANTIZE=True, BLOCK=4096, PDL=True)),
    ("engine.parallel.symm_kernels", "_allreduce_add_rms_norm_kernel",
     dict(buffer_ptrs="i64", signal_pads="i64", calls_ptr="*i32", x_ptr=P, res_ptr=P, w_ptr=P, out_ptr=P,
          res_out_ptr=P, scale_ptr=P, stride_x="i32", stride_r="i32", stride_o="i32", stride_ro="i32", n="i32",
          half="i32", eps="fp32"),
     dict(RANK=0, WORLD=4, HAS_RESIDUAL=False, QUANTIZE=False, BLOCK=8192, PDL=True)),
    ("engine.attention.triton_kernels", "_store_kv_kernel",
     dict(k_ptr=P, v_ptr=P, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", slot_ptr="*i64", stride_kt="i32",
          stride_kh="i32", stride_vt="i32", stride_vh="i32", stride_kcb="i32", stride_kco="i32", stride_kch="i32",
          stride_vcb="i32", stride_vco="i32", stride_vch="i32"),
     dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, BLOCK_SIZE=16, PDL=True)),
    *(("engine.attention.triton_kernels", "_decode_kernel",  # bfloat16 (the early launch) and FP8 caches
       dict(q_ptr=P, k_cache_ptr=cache, v_cache_ptr=cache, out_ptr=P, part_acc_ptr="*fp32", part_m_ptr="*fp32",
            part_l_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
            scale_log2="fp32", window="i32", num_splits="i32", num_heads="i32", stride_qt="i32", stride_qh="i32",
            stride_ot="i32", stride_oh="i32", stride_kb="i32", stride_ko="i32", stride_kh="i32", stride_vb="i32",
            stride_vo="i32", stride_vh="i32", stride_bt="i32", cos_ptr=P, sin_ptr=P, k_new_ptr=P, v_new_ptr=P,
            slot_ptr="*i64" if rotate else "*i32", stride_c="i32", stride_knt="i32", stride_knh="i32",
            stride_vnt="i32", stride_vnh="i32", q_scale="fp32", k_inverse="fp32", v_inverse="fp32"),
       dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_SIZE=16, HAS_WINDOW=False,
            BLOCK_N=TritonAttentionConfig().decode_tiles(fp8).block_n, IS_SPLIT=not fp8, PRECISION="tf32",
            F16_DOTS=fp8, VALUES_ASM=fp8, ROTATE=rotate, PDL=True, EARLY=not fp8))
      for cache, fp8, rotate in ((P, False, True), ("*fp8e4nv", True, False), ("*fp8e4nv", True, True))),
    ("engine.attention.triton_kernels", "_decode_reduce_kernel",
     dict(out_ptr=P, part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32", seq_lens_ptr="*i32",
          query_start_loc_ptr="*i32", window="i32", num_splits="i32", num_heads="i32", stride_ot="i32",
          stride_oh="i32"),
     dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32, BLOCK_N=64, HAS_WINDOW=False, PDL=True)),
]
"""

# CASES compiled as their launches specialize them (compile_case)
COMPILER = CASES + """
import importlib
import os
import re
import subprocess
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bench.diag.sass_loop import loop_lines, sass

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def launch_options(name, constexprs, signature):
    # num_warps / num_stages as the product's launchers take them for the case's shape
    if name in ("_add_rms_norm_kernel", "_pushed_add_rms_norm_kernel", "_allreduce_add_rms_norm_kernel"):
        return dict(num_warps=4 if constexprs["BLOCK"] <= 2048 else 8)
    if name == "_silu_and_mul_quantized_kernel":
        return dict(num_warps=16 if constexprs["BLOCK"] >= 8192 else 8)
    if name == "_decode_kernel":
        tiles = TritonAttentionConfig().decode_tiles(fp8_cache=constexprs["F16_DOTS"])
        return dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if name == "_prefill_kernel":  # its cache's tiles, whatever its dots
        tiles = TritonAttentionConfig().prefill_tiles(fp8_cache=signature["k_cache_ptr"] == "*fp8e4nv")
        return dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if name == "_words_kernel":
        return dict(num_warps=words_num_warps(constexprs["BLOCK_M"], constexprs["BLOCK_N"]))
    return dict(num_warps={"_norm_rope_kernel": 2, "_quantize_rows_kernel": 8}.get(name, 4))


def compile_case(module, name, signature, constexprs):
    fn = getattr(importlib.import_module(module), name)
    # NOTE: as a launch at the 8B shape specializes it: pointers, sizes and strides divisible by 16
    attrs = {(list(fn.arg_names).index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t != "fp32" and n not in fn.do_not_specialize}
    options = launch_options(name, constexprs, signature)
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)
"""

PROGRAM = COMPILER + """
for module, name, signature, constexprs in CASES:
    kernel = compile_case(module, name, signature, constexprs)
    assert "cubin" in kernel.asm, name
    # NOTE: no thread keeps more than a register pair in local memory: the FP8 decode attention took 471 us a
    # layer, spilling 336 bytes a thread and reading its values a byte at a time, where it takes 271 without
    # either (README: values converted before their dot). Triton 3.9 compiles the early bfloat16 decode kernel
    # with an 8-byte stack; 3.6, on the GPU machines, with none.
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    assert int(re.search(r"STACK:(\\d+)", usage).group(1)) <= 8, (name, constexprs, usage)
    # NOTE: with PDL (engine/pdl.py) a kernel waits for the one before it, then lets the next one in
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, name
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents"), name
    print("compiled", name, flush=True)
print("cases", len(CASES))
"""


def _compiled(program: str) -> str:
    """`program`'s output, run in a process of its own with Triton compiling (not interpreting)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_fused_and_quantizing_kernels_compile_for_hopper_on_the_cpu_without_spilling():
    out = _compiled(PROGRAM)
    cases = int(out.rsplit("cases ", 1)[1])
    assert cases >= PROGRAM.count('("engine.') and out.count("compiled ") == cases, out


# CASES' FP8 decode kernel, its values converted by PTX (VALUES_ASM) or by Triton
VALUES_PROGRAM = COMPILER + """
module, name, signature, constexprs = next(c for c in CASES if c[1] == "_decode_kernel" and c[3]["F16_DOTS"])
ptx = compile_case(module, name, signature, dict(constexprs, VALUES_ASM=VALUES_ASM)).asm["ptx"]
print("byte loads", ptx.count("ld.shared.b8") + ptx.count("ld.shared.u8"))
print("transposed", ptx.count(".trans.shared.b16"))
"""


@pytest.mark.parametrize("values_asm", [True, False])
def test_fp8_decode_reads_its_value_tiles_as_float16_through_transposing_ldmatrix(values_asm: bool):
    """With VALUES_ASM, the FP8 decode kernel (specialized as at the 8B shape) converts its value tiles before
    their trip through shared memory into the dot's layout, so it reads them back by transposing ldmatrix,
    with no byte loads; without it (the case that shows the test can fail), Triton moves the conversion after
    the trip and reads each value's byte alone."""
    out = _compiled(f"VALUES_ASM = {values_asm}\n" + VALUES_PROGRAM)
    byte_loads = int(out.split("byte loads ")[1].split()[0])
    transposed = int(out.split("transposed ")[1].split()[0])
    if values_asm:
        assert byte_loads == 0 and transposed > 0, out
    else:
        assert byte_loads >= 64 and transposed == 0, out


# CASES' 4-bit words kernel at a group size: its K loop's warpgroup MMAs and waits, in its SASS
WORDS_PROGRAM = COMPILER + """
module, name, signature, constexprs = next(c for c in CASES if c[1] == "_words_kernel" and c[3]["GROUP"] == 128)
body = loop_lines(sass(compile_case(module, name, signature, dict(constexprs, GROUP=GROUP))))
print("mmas", sum("HGMMA" in line for line in body))
print("waits", sum("WARPGROUP.DEPBAR" in line for line in body))
print("global", sum(" LDG." in line for line in body))
"""


@pytest.mark.parametrize("group", [128, 16])
def test_int4_words_kernel_issues_a_groups_warpgroup_mmas_back_to_back(group: int):
    """The words kernel (128-row tiles, one row tile of 16, as at the 8B shape) multiplies a group's nibbles as one
    dot, so at groups of 128 its loop issues a trip's sixteen warpgroup MMAs (two a 16-column nibble, 64 rows each)
    with one wait (a dot a 16-column nibble waited for each: 1.27x slower at one row on an H200, README); at groups
    of 16 (the case that shows the test can fail) each nibble is a group of its own, a dot and a wait each."""
    out = _compiled(f"GROUP = {group}\n" + WORDS_PROGRAM)
    mmas = int(out.split("mmas ")[1].split()[0])
    waits = int(out.split("waits ")[1].split()[0])
    assert mmas == 16, out
    assert waits == (1 if group == 128 else 8), out


@pytest.mark.parametrize("group", [128, 16])
def test_int4_words_kernel_loop_waits_on_no_global_load(group: int):
    """Every load of the words kernel's K loop goes through the pipeline's asynchronous copies (a trip ahead into
    shared memory), the group scales included: read as one 32-bit word a row (scale and zero point), not two 16-bit
    halves, which an asynchronous copy cannot take (it moves 4, 8 or 16 bytes), so that each trip waited on a global
    load of its scales (4 a thread a trip at groups of 128, 32 at 16; Triton 3.6 and 3.9)."""
    out = _compiled(f"GROUP = {group}\n" + WORDS_PROGRAM)
    assert int(out.split("global ")[1].split()[0]) == 0, out


# CASES' decode attention kernels: signed-arithmetic fix-ups in their K loop's SASS
INDEX_PROGRAM = COMPILER + """
for module, name, signature, constexprs in CASES:
    if name == "_decode_kernel":
        body = loop_lines(sass(compile_case(module, name, signature, constexprs)))
        print("signed", sum("SHF.R.S32.HI" in line or "LEA.HI " in line for line in body), "of", len(body))
"""


def test_decode_attention_loops_index_the_paged_cache_unsigned():
    """The decode kernels' loops (bfloat16 and FP8 caches, as at the 8B shape) find each key's block and offset
    unsigned (triton_kernels.cache_blocks): no sign extension or round-toward-zero fix-up of a signed division
    (`SHF.R.S32.HI`, `LEA.HI`): with them the FP8 loop took 837 instructions a 128-key trip, without 653 (Triton
    3.6, as on the GPU machines; the figures: README)."""
    out = _compiled(INDEX_PROGRAM)
    counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("signed ")]
    assert len(counts) == 3 and counts == [0, 0, 0], out


# The prefill kernel over an FP8 cache with bfloat16 queries, its dots in float16 (F16_DOTS) or not: its widest
# loop's (the masked keys') scalar float conversions, in its SASS
PREFILL_PROGRAM = COMPILER + """
tiles = TritonAttentionConfig().prefill_tiles(fp8_cache=True)
signature = dict(q_ptr=P, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", out_ptr=P, block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", query_start_loc_ptr="*i32", num_seqs="i32", scale_log2="fp32", window="i32",
                 stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_kb="i32",
                 stride_ko="i32", stride_kh="i32", stride_vb="i32", stride_vo="i32", stride_vh="i32", stride_bt="i32")
constexprs = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=tiles.block_m,
                  BLOCK_Q=tiles.block_m // 4, BLOCK_N=tiles.block_n, BLOCK_SIZE=16,
                  HAS_WINDOW=False, PRECISION="tf32", F16_DOTS=F16_DOTS)
body = loop_lines(sass(compile_case("engine.attention.triton_prefill", "_prefill_kernel", signature, constexprs)))
print("f2f", sum(" F2F." in line for line in body), "of", len(body))
"""


@pytest.mark.parametrize("f16_dots", [True, False])
def test_fp8_prefill_takes_its_dots_in_float16(f16_dots: bool):
    """With F16_DOTS, the prefill kernel (as at the 8B shape, an FP8 cache, bfloat16 queries) turns its E4M3 key
    and value tiles into float16 operands in one conversion a pair, so its loop holds no scalar `F2F` (on sm_90,
    Triton 3.6: 401 instructions a 64-key trip against 506, README); without it (the case that shows the test
    can fail), each element reaches bfloat16 through a conversion of its own."""
    out = _compiled(f"F16_DOTS = {f16_dots}\n" + PREFILL_PROGRAM)
    f2f = int(out.split("f2f ")[1].split()[0])
    assert f2f == 0 if f16_dots else f2f >= 64, out
