"""On a CUDA GPU (marked `gpu`): structured outputs through the CUDA paths: the mask applied by
xgrammar's kernel, the fused Triton draw and fused verification with n-gram speculation, CUDA
graphs and asynchronous scheduling. Sampled at temperature 1, so the grammar alone makes every
output valid; greedy constrained output equals the CPU engine's (float32 both)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import SamplingParams
from engine.config import GrammarSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "maxLength": 6},
                                           "kind": {"enum": ["a", "b", "c"]}},
          "required": ["id", "tag", "kind"]}
SPEC = GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))
OPTIONS = dict(device="cuda", dtype="float32", attention_backend="triton", num_blocks=512, max_num_seqs=16)


def _check(text: str) -> None:
    value = json.loads(text)
    assert set(value) <= set(SCHEMA["properties"]) and {"id", "tag", "kind"} <= set(value), text
    assert 0 <= value["id"] <= 999 and len(value["tag"]) <= 6 and value["kind"] in ("a", "b", "c"), text


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_draft_tokens": 4}], ids=["plain", "ngram"])
def test_constrained_sampling_on_cuda_always_validates(make_llm, speculative):
    llm = make_llm(**OPTIONS, speculative=speculative)
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=i if i % 2 else None, grammar=SPEC)
              for i in range(12)]
    params += [SamplingParams(max_tokens=24, temperature=1.0)] * 4  # unconstrained rows in the same batch
    outs = llm.generate([f"p{i}" for i in range(16)], params)
    for out in outs[:12]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        _check(out.outputs[0].text)
    if speculative is not None:  # the drafts were verified under the grammar, not skipped
        assert llm.engine.stats().num_spec_verifications > 0


def test_greedy_constrained_output_equals_the_cpu_engine_s(make_llm):
    torch.backends.cuda.matmul.allow_tf32 = False
    regex = GrammarSpec(kind="regex", text="(red|green|blue)-[0-9]{2,5}")
    params = [SamplingParams(max_tokens=60, temperature=0.0, grammar=g) for g in (SPEC, regex)]
    prompts = ["def main():", "import os"]
    gpu = [o.outputs[0].token_ids for o in make_llm(**OPTIONS).generate(prompts, params)]
    cpu = [o.outputs[0].token_ids for o in make_llm(device="cpu", num_blocks=512).generate(prompts, params)]
    assert gpu == cpu
    assert re.fullmatch("(red|green|blue)-[0-9]{2,5}", make_llm(**OPTIONS).tokenizer.decode(gpu[1]))


def test_a_draw_waits_on_the_device_for_the_grammar_process_not_on_the_host(make_llm):
    """The region is registered with CUDA: with the grammar process stopped, the mask comes back and
    the draw's copy is queued behind the gate without the host waiting; the device waits until the
    process goes on, then reads the filled mask."""
    import os
    import signal
    import threading
    import time

    import xgrammar as xgr

    from engine.grammar import apply_token_mask

    llm = make_llm(**OPTIONS)
    book, vocab = llm.engine.grammars, llm.engine.arch.vocab_size
    book.compile_within(SPEC)
    book.add("r", SPEC, [])
    assert book._process.region.slots.is_pinned()
    pid = book._process.pid
    logits = torch.zeros(1, vocab, device="cuda")
    queued: list[torch.Tensor] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        drawing = threading.Thread(target=lambda: queued.append(apply_token_mask(logits, book.mask(["r"]))))
        drawing.start()
        drawing.join(5)
        assert queued, "the host waited for the stopped grammar process"
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.3)
        assert not done.query()  # the device waits at the gate
    finally:
        os.kill(pid, signal.SIGCONT)
    torch.cuda.synchronize()
    again = book.mask(["r"])  # the same matcher state, filled while the host waits for it
    again.filling.wait(again.filling.ticket)
    expected = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(expected, again.bitmask.clone(), vocab_size=vocab)
    assert torch.equal(queued[0].isfinite().cpu(), expected.isfinite())
    assert 0 < int(expected.isfinite().sum()) < vocab
    book.settle()  # no error, and the device gave up on no ticket


def test_books_closed_in_turn_each_register_their_region():
    """A CUDA registration outlives its mapping: a closed book unregisters its region, so that the
    next book's region (mapped at the same address as often as not) registers, and no CUDA error is
    left behind for a later kernel to report."""
    import gc

    from engine.grammar_book import GrammarBook
    from engine.models import DEFAULT_MODEL_DIR

    addresses = []
    for _ in range(3):
        book = GrammarBook(DEFAULT_MODEL_DIR, 2048, [1], capacity=4, pin_memory=True)
        book.compile_within(SPEC)
        book.add("r", SPEC, [])
        slots = book._process.region.slots  # NOTE: held past close, so the mapping outlives the book
        assert slots.is_pinned()
        addresses.append(slots.data_ptr())
        book.close()
        assert not slots.is_pinned(), "the closed book left its region registered with CUDA"
        del book, slots
        gc.collect()
    print("region addresses", [hex(a) for a in addresses])  # NOTE: a repeat is what failed before
    torch.ones(4, device="cuda").add_(1)
    torch.cuda.synchronize()


def test_no_constrained_step_compiles_a_kernel_after_start(make_llm):
    """The draw that reads a grammar's words (the fused race's masked variant) is compiled while the
    engine starts, not by the first constrained step."""
    from tests.gpu.test_compile_warmup_gpu import compiled_while_serving, forget_compiled_kernels

    forget_compiled_kernels()
    llm = make_llm(**OPTIONS)
    batches = [([30, 7], {"temperature": 0.8, "grammar": SPEC}),
               ([12, 40, 5], {"temperature": 0.8, "seed": 3, "grammar": SPEC})]
    assert compiled_while_serving(llm.engine, batches) == []
