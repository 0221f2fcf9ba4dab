"""The engine against Hugging Face transformers on small random checkpoints of every supported
architecture: greedy tokens equal for 64 new tokens, logprobs (raw logits) within tolerance,
and batched equal to one-at-a-time."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.builders import ARCHITECTURES, hf_greedy, load_hf_model

pytest.importorskip("transformers")

NUM_NEW = 64
PROMPTS = [
    [0, 17, 400, 33, 1021, 7, 99, 1500, 250],
    [0, 5, 6, 7],
    list(range(40, 110)),  # longer than the mistral window (24) and several 16-token blocks
]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_and_logprobs_equal_transformers(arch, hf_checkpoints, make_llm):
    path = hf_checkpoints(arch)
    hf = load_hf_model(path)
    llm = make_llm(str(path), block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        want, want_logprobs = hf_greedy(hf, prompt, NUM_NEW)
        assert out.outputs[0].token_ids == want, f"{arch}: tokens differ from transformers"
        for step, (top, ref) in enumerate(zip(out.outputs[0].top_logprobs, want_logprobs, strict=True)):
            assert len(top) == 5, f"{arch} step {step}: {len(top)} top logprobs"
            got_ids = torch.tensor([t for t, _ in top])
            got_vals = torch.tensor([v for _, v in top])
            torch.testing.assert_close(got_vals, ref[got_ids], atol=2e-4, rtol=0, msg=f"{arch} step {step}")
            assert int(got_ids[0]) == int(ref.argmax())


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_batched_equals_one_at_a_time(arch, hf_checkpoints, make_llm):
    path = hf_checkpoints(arch)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in make_llm(str(path), num_blocks=64).generate(PROMPTS, params)]
    alone_llm = make_llm(str(path), num_blocks=64, max_num_seqs=1)
    alone = [alone_llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_bfloat16_runs_and_mostly_agrees(hf_checkpoints, make_llm):
    """bf16 rounds differently from HF's float32: the first tokens agree, the dtype is honoured."""
    path = hf_checkpoints("qwen3")
    llm = make_llm(str(path), dtype="bfloat16", num_blocks=64)
    assert llm.engine.runner.kv_caches.dtype == torch.bfloat16
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    want, _ = hf_greedy(load_hf_model(path), PROMPTS[0], 4)
    assert out.outputs[0].token_ids[:2] == want[:2]
