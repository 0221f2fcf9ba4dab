"""On a CUDA GPU (marked `gpu`, skipped elsewhere): the engine with each attention backend equals
Hugging Face transformers token for token on the small random checkpoints, in float32."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.builders import ARCHITECTURES, hf_greedy, load_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[0, 17, 400, 33, 1021, 7, 99, 1500, 250], list(range(40, 110)), [0, 5, 6, 7]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gpu_greedy_equals_transformers(arch, backend, hf_checkpoints, make_llm):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = hf_checkpoints(arch)
    hf = load_hf_model(path)
    llm = make_llm(str(path), device="cuda", dtype="float32", attention_backend=backend, num_blocks=64)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 64)[0], f"{arch}/{backend}"
