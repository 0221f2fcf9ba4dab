"""The draft model's loop graph (engine/spec/draft_loop.py) on the CPU, through the Triton
interpreter: its passes give the tokens, distributions and KV of catching up and drafting pass by
pass through the eager runner with the same noise (everything but the capture and replay, which the GPU run
of bench.spec_decode exercises); and which rows it serves."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionSpec
from engine.config import SamplingParams
from engine.kv_cache import allocate_kv_tensors
from engine.models import DEFAULT_MODEL_DIR, build_model
from engine.pinned import HostStaging
from engine.runner import ForwardSeq, ModelRunner
from engine.spec.draft_loop import DraftLoopGraphs, LoopRow


def test_loop_passes_equal_drafting_pass_by_pass(interpreted_kernels):
    """Requests with one and two tokens to catch up: the loop's first pass (their last two tokens
    as two rows each) and the passes after it give the tokens, distributions and KV of catching up
    and drafting pass by pass through the eager runner, with the noise the loop drew."""
    from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig

    torch.manual_seed(0)
    cpu, block_size, passes = torch.device("cpu"), 4, 3
    model, arch = build_model(DEFAULT_MODEL_DIR, torch.float32, cpu)
    spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
    config = TritonAttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16, min_split_tokens=16)
    backend = TritonAttention(spec, config)
    eager = ModelRunner(model, allocate_kv_tensors(arch, 24, block_size, torch.float32, cpu), backend, cpu)
    tables = [[5, 0, 11, 2], [3, 14, 9, 21], [19, 1, 22, 7]]
    prompts = [torch.randint(2, arch.vocab_size, (n,)).tolist() for n in (5, 9, 7)]
    cached = [len(prompts[0]) - 1, len(prompts[1]) - 2, len(prompts[2]) - 1]  # KV held: 1, 2 and 1 to catch up
    eager.forward([ForwardSeq(t[:c], 0, b, 0) for t, c, b in zip(prompts, cached, tables)])
    loop = DraftLoopGraphs(model, eager.kv_caches.clone(), backend, HostStaging(cpu), passes, max_batch=4,
                           max_context=16)
    assert loop.sizes == [1, 2, 4]

    temperatures = [0.0, 0.7, 1.3]  # greedy, then two random rows
    rows = [LoopRow(len(p) - 1, (p[-2], p[-1]), t, temp) for p, t, temp in zip(prompts, tables, temperatures)]
    out = loop.run(rows, torch.Generator().manual_seed(1))
    assert out is not None and loop.num_runs == 1
    tokens, dists = out
    assert tokens.shape == (passes, 3) and dists.shape == (passes, 3, arch.vocab_size)

    # Pass by pass through the eager runner, with the noise the loop drew.
    logits = eager.forward([ForwardSeq(t[c:], c, b, 1) for t, c, b in zip(prompts, cached, tables)])
    fed: list[int] = []  # the last pass's draws
    for i in range(passes):
        if i:
            logits = eager.forward([ForwardSeq([fed[j]], len(prompts[j]) + i - 1, tables[j], 1) for j in range(3)])
        fed = []
        for j, temp in enumerate(temperatures):
            if temp == 0.0:
                want = int(logits[j].argmax())
                want_dist = torch.nn.functional.one_hot(torch.tensor(want), arch.vocab_size).float()
            else:
                want_dist = torch.softmax(logits[j] / temp, dim=-1)
                want = int((want_dist / loop.noise[i, j]).argmax())
            assert int(tokens[i, j]) == want, (i, j)
            torch.testing.assert_close(dists[i, j], want_dist, atol=1e-5, rtol=1e-4)
            fed.append(want)
    # The loop stored the caught-up tokens' and fed drafts' KV where the eager passes did (padding
    # row 3 stored nothing; the KV it wrote again at start - 1 is the same).
    torch.testing.assert_close(loop.kv_caches, eager.kv_caches, atol=1e-5, rtol=1e-5)
    # A row at position 0 has no token before it: the loop does not serve it.
    assert loop.run([LoopRow(0, (0, prompts[0][0]), tables[0], 0.0)], None) is None


def test_a_chained_run_equals_a_run_of_the_rows_moved_on(interpreted_kernels):
    """`chain` moves each row on the device by its verification (m accepted: its last token at
    start + m + 1, the one before it d_m, or its old last token when m = 0) and runs the loop again:
    the same draws and KV as a fresh `run` of the rows so moved, for m = 0, m = K and one between;
    a row no request drafts from any more (-1) is padding from then on and stores nothing."""
    from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig

    torch.manual_seed(0)
    cpu, block_size, k = torch.device("cpu"), 4, 3
    model, arch = build_model(DEFAULT_MODEL_DIR, torch.float32, cpu)
    spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
    backend = TritonAttention(spec, TritonAttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16))
    eager = ModelRunner(model, allocate_kv_tensors(arch, 40, block_size, torch.float32, cpu), backend, cpu)
    tables = [[5, 0, 11, 2, 30], [3, 14, 9, 21, 31], [19, 1, 22, 7, 32], [8, 12, 25, 26, 33]]
    prompts = [torch.randint(2, arch.vocab_size, (n,)).tolist() for n in (5, 9, 7, 6)]
    eager.forward([ForwardSeq(t[:-1], 0, b, 0) for t, b in zip(prompts, tables)])
    chained = DraftLoopGraphs(model, eager.kv_caches.clone(), backend, HostStaging(cpu), k, max_batch=4,
                              max_context=24)
    rows = [LoopRow(len(p) - 1, (p[-2], p[-1]), t, 0.0) for p, t in zip(prompts, tables)]
    out = chained.run(rows, None)
    assert out is not None
    drafted = out[0].clone()  # [k, rows]
    accepted, last = [0, k, 1, 2], [101, 102, 103, 104]  # row 3's request stopped: order -1
    order = [1, 0, 2, -1]  # row j's verification is number order[j]
    verified = torch.zeros(6, dtype=torch.int32)
    for j, v in enumerate(order[:3]):
        verified[v], verified[3 + v] = accepted[j], last[j]
    fresh = DraftLoopGraphs(model, chained.kv_caches.clone(), backend, HostStaging(cpu), k, max_batch=4,
                            max_context=24)
    tokens, dists = chained.chain(verified, order, tables, False, None)
    moved = []
    for j in range(3):
        m, start = accepted[j], rows[j].start
        before = int(drafted[m - 1, j]) if m else rows[j].tokens[1]
        moved.append(LoopRow(start + m + 1, (before, last[j]), tables[j], 0.0))
    want = fresh.run(moved, None)
    assert want is not None
    assert torch.equal(tokens[:, :3], want[0])
    torch.testing.assert_close(dists[:, :3], want[1])
    torch.testing.assert_close(chained.kv_caches, fresh.kv_caches)  # the padding row stored nothing
    with pytest.raises(ValueError, match="continues the last run's 4 rows"):
        chained.chain(verified, order[:2], tables[:2], False, None)


def test_loop_serves_temperature_and_greedy_rows_proposing_up_to_its_k():
    plain, greedy = SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)
    assert DraftLoopGraphs.serves([plain, greedy], [0, 3], [4, 4], k=4)
    assert DraftLoopGraphs.serves([plain, greedy], [0, 3], [4, 2], k=4)  # adaptive K: the first 2 of 4 drafted
    assert not DraftLoopGraphs.serves([plain, greedy], [0, 3], [4, 5], k=4)  # more than the loop drafts
    assert not DraftLoopGraphs.serves([plain, greedy], [0, 3], [4, 0], k=4)
    for odd in (SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, top_k=5),
                SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, min_p=0.1),
                SamplingParams(temperature=0.0, repetition_penalty=1.2)):
        assert not DraftLoopGraphs.serves([plain, odd], [0, 0], [4, 4], k=4), odd
    assert not DraftLoopGraphs.serves([SamplingParams(temperature=0.8, min_tokens=5)], [2], [4], k=4)  # EOS masked
    assert DraftLoopGraphs.serves([SamplingParams(temperature=0.8, min_tokens=5)], [5], [4], k=4)


def _with_a_loop(llm, k: int):  # type: ignore[no-untyped-def]
    """Gives the engine's draft model a loop graph of k passes (run eagerly on the CPU, through the
    interpreted kernels) and the fused verification, as on CUDA, which chained runs follow; its proposer."""
    from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig

    llm.engine.sampler.fused = True
    proposer = llm.engine.proposer
    arch = proposer.arch
    spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
    backend = TritonAttention(spec, TritonAttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16))
    proposer.loop = DraftLoopGraphs(proposer.model, proposer.runner.kv_caches, backend, proposer.runner.staging, k,
                                    max_batch=4, max_context=llm.engine.max_seq_tokens + k)
    return proposer


def _count_pass_by_pass(proposer) -> list[int]:  # type: ignore[no-untyped-def]
    """The drafting jobs of each step the proposer drafts pass by pass, from now on (a list it fills)."""
    by_pass: list[int] = []
    pass_by_pass = proposer._pass_by_pass

    def counted(jobs, drafting, *args):  # type: ignore[no-untyped-def]
        by_pass.append(len(drafting))
        return pass_by_pass(jobs, drafting, *args)

    proposer._pass_by_pass = counted
    return by_pass


@pytest.mark.parametrize(("draft", "adaptive"), [("own", False), ("poor", False), ("poor", True)])
def test_the_proposer_drafts_through_the_loop(interpreted_kernels, make_llm, hf_checkpoints, draft, adaptive):
    """The draft model's proposer with a loop graph (run eagerly here, through the interpreter)
    gives the tokens of plain decoding: the target as its own draft gets every greedy draft
    accepted (two tokens to catch up a step), a random model of the same vocabulary gets most
    rejected (one token to catch up); with adaptive K its requests propose fewer than the loop
    drafts, and still draft through it."""
    from engine import SpeculativeConfig

    # NOTE: a poor draft's steps make one token each, every one through the interpreted kernels: fewer of them
    greedy = SamplingParams(max_tokens=24 if draft == "own" else 12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 300, 17], list(range(40, 61)), [7] * 9]
    plain = [o.outputs[0].token_ids for o in make_llm(block_size=4).generate(prompts, greedy)]
    draft_model = "default" if draft == "own" else str(hf_checkpoints("llama"))
    spec = SpeculativeConfig(method="draft", draft_model=draft_model, num_draft_tokens=3,
                             enable_adaptive_draft_length=adaptive)
    llm = make_llm(block_size=4, speculative=spec)
    proposer = _with_a_loop(llm, 3)
    by_pass = _count_pass_by_pass(proposer)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
    # No step drafts pass by pass: the first (the prompts to catch up) catches up in one forward, then loops.
    assert not any(by_pass), by_pass
    stats = llm.engine.stats()
    # The loop drafts every step but those near max_tokens (fewer than K drafts): at least 4 of the own
    # draft's 6 steps; from the second on, each run is queued behind the verification before it
    # (chained), its inputs moved on the device.
    assert proposer.loop.num_runs >= 4
    assert proposer.num_chained >= proposer.loop.num_runs - 2, (proposer.num_chained, proposer.loop.num_runs)
    if draft == "own":
        assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    else:
        assert stats.num_spec_rejections > 0 and proposer.loop.num_runs >= 6
    if adaptive:  # some steps proposed fewer than the 3 drafted
        assert stats.num_spec_draft_tokens < 3 * stats.num_spec_verifications


def test_chained_runs_draft_the_target_s_own_distribution_at_temperature(interpreted_kernels, make_llm):
    """Sampled at T = 0.8 with the target as its own draft, chained loop runs (their inputs moved on
    the device by each verification) draft from the distribution the target verifies with: no
    drafted token is rejected. A chained run fed a wrong token or position would draft from
    another distribution and see rejections."""
    from engine import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=3)
    llm = make_llm(block_size=4, speculative=spec)
    proposer = _with_a_loop(llm, 3)
    # The second request stops first: the chained runs go on with its row left as padding.
    params = [SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True) for n in (24, 10)]
    outputs = llm.generate([[5, 9, 300, 17], list(range(40, 51))], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [24, 10]
    stats = llm.engine.stats()
    assert proposer.num_chained >= 4, proposer.num_chained
    assert stats.num_spec_draft_tokens >= 15 and stats.num_spec_rejections == 0, stats


def test_a_proposal_s_drafts_outlive_the_loop_s_next_run():
    """A proposal's device tokens are its own copy, even of a single pass: the loop graph's draws
    are views of its static output, which its next run overwrites, while the draft of a request
    left unscheduled in its step is still to be fed to the target from the device."""
    from engine.spec.base import DraftRequest
    from engine.spec.draft_model import _DraftRead, _DraftSeq, _Job

    static = torch.tensor([[7, 8]])  # the loop's tokens [passes = 1, rows]
    jobs = [_Job(DraftRequest(f"r{i}", [1, 2, 3], 2, SamplingParams(), 0, 1), _DraftSeq(), 1, True, token_ids=[-1])
            for i in range(2)]
    read = _DraftRead(jobs, [(static[0], jobs)])
    static[0] = torch.tensor([0, 0])  # the next run
    assert read.tokens.tolist() == [7, 8]
    read.read()
    assert [j.token_ids for j in jobs] == [[7], [8]]


@pytest.mark.parametrize(("plain_steps", "async_scheduling"), [(0, False), (1, False), (2, True)])
def test_a_chained_run_is_dropped_when_steps_decode_without_drafting(interpreted_kernels, make_llm, plain_steps,
                                                                     async_scheduling):
    """A chained run assumes the next step verifies its drafts. When steps decode without drafting
    in between (the batch over disable_above_batch_size, or the engine's choice), its drafts and
    the draft cache it wrote follow tokens the request no longer has: the next proposal must not
    adopt it. With the target as its own draft at T = 0.8 a proposal drafted from a stale cache
    shows as rejections. Adaptive K at min_draft_gain 0.9 proposes one token a step (of the loop's
    3), so a verification and a plain step leave the request within the run's reach. The plain steps
    run synchronously, or asynchronously as on CUDA; none: the control."""
    from engine import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", draft_model="default", num_draft_tokens=3, min_draft_gain=0.9)
    llm = make_llm(block_size=4, speculative=spec, async_scheduling=async_scheduling)
    proposer = _with_a_loop(llm, 3)
    engine = llm.engine
    drafts_now, steps = engine._drafts_now, [0]
    plain = set(range(4, 4 + plain_steps)) | set(range(9, 9 + plain_steps))

    def gated() -> bool:  # NOTE: steps 4.. and 9.. decode without drafting
        return steps[0] not in plain and drafts_now()

    engine._drafts_now = gated
    by_pass = _count_pass_by_pass(proposer)
    engine.add_request("r", [5, 9, 300, 17], SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True))
    for _ in range(80):
        if not engine.has_unfinished():
            break
        engine.step()
        steps[0] += 1
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert proposer.num_chained >= 4, proposer.num_chained
    assert stats.num_spec_draft_tokens >= 15 and stats.num_spec_rejections == 0, stats
    # No drafting step ran pass by pass (after plain steps too: those tokens caught up first, in one forward)
    assert not any(by_pass), by_pass
