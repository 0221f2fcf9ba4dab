"""On a CUDA GPU (marked `gpu`, skipped elsewhere): steps replaying CUDA graphs give the tokens of
eager steps, and a graph step synchronizes with the host only when the sampled tokens are read.

The workloads mix everything a run meets: prompts of different lengths in chunks that share steps
with decoding requests (short ones replay graphs, one row per position; long ones run eagerly),
more requests than max_num_seqs (later ones wait), and different max_tokens (requests finish at
different times), so batches of many sizes replay graphs of the next captured size up, with
padding rows.

float32 on the small random checkpoints: exactly the same tokens. bfloat16 at the Qwen3-0.6B
shape (dummy weights): a graph of the padded size multiplies matrices of another height than the
eager step, so the last bits of a logit may differ; tokens must be the same up to the first
position where the eager run's own top two logprobs are within TIE_NATS (a near-tie, which such
bits decide), and each request may part there.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from tests.builders import ARCHITECTURES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

QWEN3_SHAPE = Path(__file__).resolve().parents[2] / "bench" / "shapes" / "qwen3-0.6b"
TIE_NATS = 0.125  # bf16 logits of magnitude 2-4 are 1/64-1/32 apart; a few roundings of slack


def mixed_workload(num_requests: int, vocab_size: int, max_prompt: int, max_output: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab_size) for _ in range(rng.randint(1, max_prompt))] for _ in range(num_requests)]
    max_tokens = [rng.randint(1, max_output) for _ in range(num_requests)]
    return prompts, max_tokens


def generate(llm, prompts, max_tokens, logprobs=None):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=logprobs) for m in max_tokens]
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_float32_tokens_equal_with_and_without_graphs(arch, hf_checkpoints, make_llm):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(hf_checkpoints(arch))
    prompts, max_tokens = mixed_workload(11, 2048, 90, 40, seed=1)
    options = dict(device="cuda", dtype="float32", attention_backend="triton", num_blocks=128, max_num_seqs=6,
                   max_num_batched_tokens=64)
    eager = make_llm(path, enforce_eager=True, **options)
    graphed = make_llm(path, **options)
    assert eager.engine.runner.graphs is None
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 32, 64]  # the token budget
    want, got = generate(eager, prompts, max_tokens), generate(graphed, prompts, max_tokens)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.token_ids == w.token_ids, f"{arch}: request {i} parts at {first_difference(g.token_ids, w.token_ids)}"
    assert graphs.num_replays > 0 and graphs.num_padding_rows > 0, "the workload should replay padded graphs"


def test_bfloat16_qwen3_shape_tokens_equal_up_to_near_ties(make_llm):
    prompts, max_tokens = mixed_workload(14, 151936, 300, 48, seed=2)
    options = dict(device="cuda", dtype="bfloat16", load_format="dummy", attention_backend="triton", num_blocks=640,
                   max_model_len=4096, max_num_seqs=10, max_num_batched_tokens=512)
    eager = make_llm(str(QWEN3_SHAPE), enforce_eager=True, **options)
    graphed = make_llm(str(QWEN3_SHAPE), **options)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    want = generate(eager, prompts, max_tokens, logprobs=5)
    got = generate(graphed, prompts, max_tokens, logprobs=5)
    num_parted = 0
    for i, (w, g) in enumerate(zip(want, got)):
        assert len(g.token_ids) == len(w.token_ids) == max_tokens[i]
        at = first_difference(g.token_ids, w.token_ids)
        if at is None:
            continue
        num_parted += 1
        assert at > 0, f"request {i}: the first token comes from an eager prefill in both runs"
        top = dict(w.top_logprobs[at])  # the eager run's alternatives where the graphed run parted
        gap = top[w.token_ids[at]] - top.get(g.token_ids[at], float("-inf"))
        assert gap <= TIE_NATS, f"request {i} parts at token {at} without a near-tie (gap {gap:.3f} nats)"
    assert graphs.num_replays > 0 and graphs.num_padding_rows > 0, "the workload should replay padded graphs"
    print(f"{num_parted} of {len(prompts)} requests parted at a near-tie; {graphs.num_replays} graph steps")


def test_graph_decode_step_synchronizes_only_for_the_sampled_tokens(hf_checkpoints, make_llm):
    """Every decode-only step's runner part (staging, copies, replay, logits) runs under
    torch.cuda.set_sync_debug_mode('error'): any host synchronization in it raises. The sampler
    then reads the tokens (a synchronization, outside the guard)."""
    llm = make_llm(str(hf_checkpoints("qwen3")), device="cuda", dtype="float32", attention_backend="triton",
                   num_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None
    execute = runner.execute
    guarded: list[int] = []

    def execute_guarded(scheduled, patch=None):
        if not all(s.num_new_tokens == 1 and s.will_sample and not s.num_spec_tokens for s in scheduled):
            return execute(scheduled, patch)  # prefill or mixed: eager
        torch.cuda.synchronize()
        before = graphs.num_replays
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = execute(scheduled, patch)  # NOTE: asynchronous scheduling's device-side inputs included
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert graphs.num_replays == before + 1, "a decode-only step should replay a graph"
        guarded.append(len(scheduled))
        return logits

    runner.execute = execute_guarded  # type: ignore[method-assign]
    # Asynchronous scheduling (on by default on CUDA): queuing the draw waits for nothing either.
    assert llm.engine.async_scheduling
    sampler = llm.engine.sampler
    launch = sampler.launch
    num_launches: list[int] = []

    def launch_guarded(logits, rows, generator=None, mask=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(logits, rows, generator, mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            num_launches.append(len(rows))

    sampler.launch = launch_guarded  # type: ignore[method-assign]
    prompts = [[0, 17, 400, 33, 1021], list(range(40, 75)), [0, 5, 6]]
    generate(llm, prompts, [12, 7, 3])
    assert sorted(set(guarded)) == [1, 2, 3], f"decode batch sizes seen: {guarded}"
    assert num_launches, "every step's draw should be queued through Sampler.launch"


def test_long_context_graph_step_reads_every_key(make_llm):
    """128 sequences of 1,500-2,600 tokens at the Qwen3-0.6B shape (bf16): one decode step's logits
    through the graph equal the eager Triton step's and the torch reference backend's, to bf16
    rounding. A decode launch that skipped keys would part from both by the attention's whole share."""
    from engine.runner import _forward_seqs

    rng = random.Random(5)
    # NOTE: synchronous steps: the test runs one step's parts by hand, so every input token is on the host
    llm = make_llm(str(QWEN3_SHAPE), device="cuda", dtype="bfloat16", load_format="dummy", attention_backend="triton",
                   num_blocks=128 * 170, max_model_len=4096, max_num_seqs=128, max_num_batched_tokens=16384,
                   async_scheduling=False)
    engine = llm.engine
    for i in range(128):
        prompt = [rng.randrange(2, 151936) for _ in range(rng.randint(1500, 2600))]
        engine.add_request(f"long{i}", prompt, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
    # NOTE: max_tokens outlasts the prefill steps, so no early request finishes before the decode step
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    out = engine.scheduler.schedule()
    seqs, _ = _forward_seqs(out.scheduled, patch_drafts=False)
    assert len(seqs) == 128 and all(len(s.token_ids) == 1 for s in seqs)
    runner, graphs = engine.runner, engine.runner.graphs
    before = graphs.num_replays
    graphed = runner.forward(seqs).clone()
    assert graphs.num_replays == before + 1
    runner.graphs = None
    eager = runner.forward(seqs)  # rewrites the same K/V
    triton_backend = runner.backend
    from engine.attention.torch_ref import TorchAttention

    runner.backend = TorchAttention(triton_backend.spec)
    reference = runner.forward(seqs)
    runner.backend, runner.graphs = triton_backend, graphs
    scale = reference.abs().max().item()
    graph_err = (graphed - reference).abs().max().item()
    eager_err = (eager - reference).abs().max().item()
    print(f"logits max {scale:.3f}: graph vs torch {graph_err:.4f}, eager triton vs torch {eager_err:.4f}")
    assert eager_err <= 0.02 * scale, "the eager Triton step parts from the torch reference"
    assert graph_err <= max(2 * eager_err, 0.02 * scale), "the graphed step parts from the reference"
    assert (graphed.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95
    engine._post_process(out, engine._sample(out, graphed))
    for i in range(128):
        engine.abort_request(f"long{i}")
    engine.check_integrity()
