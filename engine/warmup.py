"""Compiles, while an engine starts, every Triton kernel variant its steps launch, so that no step
compiles one: a kernel compiled mid-serving stalls its step, and every request in it, by the
seconds the compiler takes (tests/gpu/test_compile_warmup_gpu.py finds them).

A kernel's variants are its constexprs' values; the engine's kernels do not specialize on the
integers that change from step to step (batch rows, sequences, block-table width, split count),
so the values below are the only ones that pick a variant:

| what differs                                    | the kernels                 | warm-up steps |
|-------------------------------------------------|-----------------------------|---------------|
| decode keys split over programs or not          | attention decode (+ reduce) | 1 / 2, 4      |
| one row (launched early: engine/pdl.py) or more | every Triton kernel         | 4, 6 / others |
| decode only (rotates), early or not; split or not | attention decode  | 4, 6 / 9, 10; 6, 9 / 4, 10 |
| decode of a crowded launch (FP8 cache: its tiles) | attention decode  | the last, where the batch reaches it |
| prefill of a crowded launch (its tiles)         | attention prefill           | the last, where a step reaches it |
| one row / <= 8 (early), <= 16, <= 32, more      | FP8 gemv / split-K / scaled | 4, 6 / 2, 7, 1, 5 |
| rows <= 16, <= 32, <= 64, more                  | 4-bit words / dequantize    | 2, 1, 8, 5    |
| unseeded / seeded random rows, truncated rows   | fused race, keyed noise     | the sampler   |
| a grammar's mask in the draw or none           | fused race                  | the sampler   |
| drafts a row, to the next power of two          | fused verification          | the verifier  |
| int32 / int64 tickets                           | a constrained draw's gate   | the gate      |

(A launch with PDL is a variant of its own: Triton keys its compiled kernels by it too.)

The forwards write KV into block 0 of a cache that holds nothing yet (no request owns a block
before the engine has started), and return nothing anyone reads. On CUDA only: elsewhere
nothing compiles (the CPU runs torch, or Triton's interpreter in tests).
"""

from __future__ import annotations

import torch

from engine.config import SamplingParams
from engine.grammar import TokenMask
from engine.runner import ForwardSeq, ModelRunner
from engine.sampler import Sampler, SamplingRow, VerifyRow

LONG_CONTEXT = 1024  # a decode context that splits its keys over programs (more than min_split_tokens)


def warm_up_steps(max_seq_tokens: int, block_size: int, crowded_seqs: int | None = None,
                  crowded_prompts: list[int] | None = None) -> list[list[ForwardSeq]]:
    """The forwards of the table above, every sequence within max_seq_tokens, all in block 0; crowded_seqs: the
    decoding sequences of a crowded decode launch (`AttentionBackend.crowded_decode_seqs`), its keys whole;
    crowded_prompts: the prompt lengths of a crowded prefill launch (`crowded_prompt_lens`; None: none such in
    this engine)."""

    def prompt(n: int) -> ForwardSeq:
        return ForwardSeq(token_ids=[0] * n, start=0, block_ids=[0] * -(-n // block_size), num_logits=1)

    def decode(context: int) -> ForwardSeq:
        return ForwardSeq(token_ids=[0], start=context - 1, block_ids=[0] * -(-context // block_size), num_logits=1)

    cap = max(1, min(max_seq_tokens, LONG_CONTEXT))
    crowded = [[decode(min(5, cap))] * crowded_seqs] if crowded_seqs else []
    crowded += [[prompt(n) for n in crowded_prompts]] if crowded_prompts else []
    return [
        [prompt(min(20, cap)), prompt(min(3, cap)), decode(cap), decode(min(5, cap))],  # 25 rows
        [prompt(min(5, cap)), decode(min(5, cap)), decode(min(3, cap))],  # 7 rows
        [prompt(min(2, cap))],
        [decode(min(5, cap))],
        [prompt(min(64, cap)), prompt(min(37, cap))],  # 101 rows
        [decode(cap)],  # one row, its keys split
        [prompt(min(12, cap))],  # 12 rows
        [prompt(min(40, cap))],  # 40 rows: the 4-bit kernel's 64-row tile
        [decode(cap), decode(min(5, cap))],  # decode only, not early: the rotating launch, its keys split
        [decode(min(5, cap)), decode(min(3, cap))],  # and whole
    ] + crowded


def crowded_prompt_lens(tokens: int | None, max_seq_tokens: int, max_num_seqs: int,
                        max_num_batched_tokens: int) -> list[int] | None:
    """Prompts of 2 to max_seq_tokens tokens, the fewest that together have `tokens` (a crowded prefill launch's:
    `AttentionBackend.crowded_prefill_tokens`; one more where the last would hold one token, a decode's), or None
    where no step can hold them (nor, then, reach one)."""
    if tokens is None or max_seq_tokens < 2:
        return None
    each = min(tokens, max_seq_tokens)
    lens = [each] * (tokens // each) + ([max(2, tokens % each)] if tokens % each else [])
    return lens if len(lens) <= max_num_seqs and sum(lens) <= max_num_batched_tokens else None


def warm_up_runner(runner: ModelRunner, max_seq_tokens: int, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Runs the warm-up forwards on this rank alone (every rank of a tensor-parallel worker runs
    the same ones, so their collectives meet), a crowded decode launch only where max_num_seqs
    sequences reach one, a crowded prefill launch where a step's tokens do. Call before graph capture
    and before any step."""
    if runner.device.type != "cuda":
        return
    crowded = runner.backend.crowded_decode_seqs(runner.device)
    prompts = crowded_prompt_lens(runner.backend.crowded_prefill_tokens(runner.device), max_seq_tokens, max_num_seqs,
                                  max_num_batched_tokens)
    for seqs in warm_up_steps(max_seq_tokens, runner.block_size,
                              crowded if crowded is not None and crowded <= max_num_seqs else None, prompts):
        runner.forward_eager(seqs)
    torch.cuda.synchronize(runner.device)


def warm_up_sampler(sampler: Sampler, vocab_size: int, device: torch.device) -> None:
    """Draws once for each kind of random row, so its kernels compile now."""
    if device.type != "cuda" or not sampler.fused:
        return
    logits = torch.zeros(2, vocab_size, dtype=torch.float32, device=device)
    kinds = [
        (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=0)),  # the fused race
        (SamplingParams(temperature=1.0, top_p=0.5, seed=0), SamplingParams(temperature=1.0, top_p=0.5, seed=1)),
    ]
    generator = torch.Generator(device=device).manual_seed(0)
    for params in kinds:
        sampler(logits, [SamplingRow(p, [0], []) for p in params], generator)
    every_token = TokenMask([0, 1], torch.full((2, -(-vocab_size // 32)), -1, dtype=torch.int32))
    sampler(logits, [SamplingRow(p, [0], []) for p in kinds[0]], generator, every_token)  # the race reading words
    torch.cuda.synchronize(device)


def warm_up_gate(device: torch.device) -> None:
    """Compiles the gate's wait (a constrained draw's, engine/host_gate.py) for int32 and int64 tickets,
    each already open (on words of its own: the book's come with its grammar process)."""
    if device.type != "cuda":
        return
    from engine.host_gate import HostGate

    gate = HostGate(torch.zeros(2, dtype=torch.int64, pin_memory=True))
    for ticket in (0, -(1 << 40)):
        gate.wait(ticket)
    torch.cuda.synchronize(device)


def draft_count_classes(max_drafts: int) -> list[int]:
    """One draft count for each tile the verification kernel takes (the next power of two above
    K + 1) over K in [1, max_drafts]: 2^n - 1 up to max_drafts, and max_drafts."""
    return sorted({min(max_drafts, (1 << n) - 1) for n in range(1, max_drafts.bit_length() + 2)})


def warm_up_verifier(sampler: Sampler, vocab_size: int, device: torch.device, max_drafts: int) -> None:
    """Verifies one row of each draft count class up to max_drafts (the kernel's tile is the next
    power of two above the drafts), with point-mass drafts and with drafted distributions."""
    if device.type != "cuda" or not sampler.fused:
        return
    generator = torch.Generator(device=device).manual_seed(0)
    row = SamplingRow(SamplingParams(temperature=1.0), [0], [])
    for k in draft_count_classes(max_drafts):
        logits = torch.zeros(k + 1, vocab_size, dtype=torch.float32, device=device)
        probs = torch.full((k, vocab_size), 1.0 / vocab_size, dtype=torch.float32, device=device)
        for draft_probs in (None, probs):
            sampler.verify(logits, [VerifyRow(row, [0] * k, draft_probs)], generator)
    torch.cuda.synchronize(device)
