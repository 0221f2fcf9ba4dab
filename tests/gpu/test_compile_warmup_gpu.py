"""On a CUDA GPU: once an engine has started, no step compiles a Triton kernel. A kernel compiled at
run time stalls its step (and every request in it) by the seconds the compiler takes, which a serving
worker shows as a clump of late first tokens; Triton compiles a new variant whenever an integer argument
changes between 1, a multiple of 16 and anything else, so the varied batches below would find one."""

from __future__ import annotations

from pathlib import Path

import sys

import pytest
import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LLAMA_8B_SHAPE = Path(__file__).resolve().parents[2] / "bench" / "shapes" / "llama-3.1-8b"

# Batches of prompt lengths, each added at once: one prompt and several, lengths of every class
# (multiples of 16 and not, one token past a block, a prompt chunked over steps), batches of 1-17;
# greedy, then sampled, then sampled with seeds.
BATCHES = [[1500], [16], [700, 1904], [1024, 333, 2047], [17] * 17, [5000], [48, 49, 50, 51, 52, 53, 54]]
SAMPLED = [[900, 33, 64], [1200, 5]]


def forget_compiled_kernels() -> None:
    """Empties every engine kernel's in-process cache, so that an engine built next compiles (or
    loads from Triton's disk cache) what it needs as if it were the process's first."""
    for name, module in list(sys.modules.items()):
        if name.startswith("engine."):
            for value in vars(module).values():
                if isinstance(value, JITFunction):
                    value.device_caches.clear()


@pytest.mark.parametrize("quantization", ["auto", "fp8"])
def test_no_step_compiles_a_kernel_after_start(make_llm, quantization):
    forget_compiled_kernels()
    llm = make_llm(str(LLAMA_8B_SHAPE), device="cuda", dtype="bfloat16", load_format="dummy", quantization=quantization,
                   num_blocks=4096, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=2048)
    engine = llm.engine
    compiled: list[str] = []

    def record(*, repr: str, compile: dict, **_: object) -> None:
        compiled.append(f"{repr.split('[')[0]} specialized {compile['configs'][0]}")

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        batches = [(lengths, {}) for lengths in BATCHES] + [(lengths, {"temperature": 0.8}) for lengths in SAMPLED]
        batches += [(lengths, {"temperature": 0.7, "top_p": 0.9, "seed": 7}) for lengths in SAMPLED]
        for b, (lengths, sampling) in enumerate(batches):
            params = SamplingParams(**{"max_tokens": 1 + 3 * b, "temperature": 0.0, "ignore_eos": True, **sampling})
            for i, n in enumerate(lengths):
                engine.add_request(f"b{b}r{i}", [(b * 7919 + i * 31 + j) % 128_000 for j in range(n)], params)
            for _ in range(200):
                if not engine.has_unfinished():
                    break
                engine.step()
            assert not engine.has_unfinished()
    finally:
        knobs.runtime.jit_cache_hook = previous
    for name in compiled:
        print("compiled after start:", name[:600])
    assert compiled == []
