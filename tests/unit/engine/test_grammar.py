"""Structured outputs in the engine (engine/grammar.py): the compiler's errors and limits, the
sampler's mask, and constrained generation at temperature 1 with the random-weight default model,
so the grammar alone makes the outputs valid; the same with asynchronous scheduling, n-gram
speculation, and a request continued on another engine (its matcher rebuilt from its output)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch

from engine.config import GrammarSpec, SamplingParams
from engine.grammar import GrammarCompiler, GrammarError, TokenMask, apply_token_mask
from engine.grammar_book import GrammarBook
from engine.models import DEFAULT_MODEL_DIR
from engine.sampler import Sampler, SamplingRow
from engine.validation import InvalidRequestError

VOCAB = 2048  # the default model's
EOS = 1

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                               "role": {"enum": ["admin", "guest", "owner"]}},
                "required": ["id", "role"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1,
                                "maxItems": 3}},
        "required": ["tags"],
    },
    "bounded_number": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                       "level": {"type": "integer", "minimum": 3, "maximum": 7}},
        "required": ["score", "level"],
    },
}


def _json_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", text=json.dumps(schema))


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(DEFAULT_MODEL_DIR, VOCAB, [EOS])


# ---- the compiler


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec(kind="json_schema", text="{not json"), "json_schema does not compile"),
        (GrammarSpec(kind="regex", text="(unclosed"), "regex does not compile"),
        (GrammarSpec(kind="ebnf", text="root ::= missing_rule"), "ebnf does not compile"),
    ],
)
def test_a_grammar_that_does_not_compile_raises_the_compilers_message(compiler, spec, words) -> None:
    with pytest.raises(GrammarError, match=words) as err:
        compiler.compile_within(spec)
    assert len(str(err.value)) > len(words) + 10, "the compiler's own message follows"


def test_a_grammar_slower_than_its_limit_is_refused(compiler) -> None:
    spec = GrammarSpec(kind="regex", text="[a-z]{1,40}@[a-z]{1,40}\\.(com|org|net){1,3}")
    with pytest.raises(GrammarError, match="did not compile within"):
        compiler.compile_within(spec, timeout_s=1e-6)
    assert compiler.compile_within(spec) is not None  # a real limit lets it through


def test_grammar_text_is_bounded() -> None:
    with pytest.raises(ValueError, match="at most 65536"):
        GrammarSpec(kind="regex", text="a" * 65537)
    with pytest.raises(ValueError, match="needs its text"):
        GrammarSpec(kind="regex")


def test_json_strings_with_a_length_bound_allow_no_raw_control_character(compiler) -> None:
    """xgrammar 0.2.8 lets raw control characters into length-bounded strings; JSON forbids them."""
    import xgrammar as xgr

    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    matcher = xgr.GrammarMatcher(compiler.compile(_json_spec(SCHEMAS["flat"])))
    for token in tokenizer.encode('{"name": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = _allowed(bitmask[0])
    controls = [t for t in range(2, VOCAB) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))]
    assert controls, "the vocabulary has control-character tokens"
    assert not set(controls) & allowed
    assert len(allowed) > 100  # and ordinary characters are allowed


def _allowed(bits: torch.Tensor) -> set[int]:
    unpacked = ((bits.unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[:VOCAB]
    return set(unpacked.nonzero().flatten().tolist())


# ---- the sampler's mask


def test_masked_rows_draw_only_allowed_tokens_and_keep_raw_logprobs() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=generator)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 0: token 5 only
    bitmask[1, 1] = (1 << 3) | (1 << 7)  # row 2: tokens 35 and 39
    mask = TokenMask([0, 2], bitmask)
    rows = [SamplingRow(SamplingParams(temperature=t, logprobs=0), (), ()) for t in (1.0, 0.0, 1.0)]
    sampler = Sampler([EOS])
    seen = set()
    for _ in range(50):
        result = sampler(logits, rows, generator, mask)
        assert result.token_ids[0] == 5
        assert result.token_ids[1] == int(logits[1].argmax())  # unmasked row untouched
        assert result.token_ids[2] in (35, 39)
        seen.add(result.token_ids[2])
        expected = torch.log_softmax(logits[0], -1)[5].item()
        assert result.logprobs[0] == pytest.approx(expected, abs=1e-5)  # of the raw logits
    assert seen == {35, 39}
    assert torch.equal(logits, torch.randn(3, 64, generator=torch.Generator().manual_seed(0)))  # not changed


# ---- the book's process


@pytest.fixture
def book():
    book = GrammarBook(DEFAULT_MODEL_DIR, VOCAB, [EOS], capacity=16)
    yield book
    book.close()


def _add_rows(book: GrammarBook, rows: int) -> list[str]:
    ids = [f"r{i}" for i in range(rows)]
    for rid in ids:
        book.add(rid, _json_spec(SCHEMAS["nested"]), [])
    return ids


def _filled(mask: TokenMask) -> torch.Tensor:
    if mask.filling is not None:
        mask.filling.before_use()  # NOTE: on the CPU the host waits for the fill
    return mask.bitmask


def test_submit_returns_the_mask_while_the_process_still_fills_it(book, compiler) -> None:
    import signal
    import threading

    import xgrammar as xgr

    ids = _add_rows(book, 12)
    pid = book._process.pid
    os.kill(pid, signal.SIGSTOP)  # NOTE: the process can do nothing until SIGCONT
    try:
        returned: list[TokenMask] = []
        submitting = threading.Thread(target=lambda: returned.append(book.submit([], ids)))
        submitting.start()
        submitting.join(10)
        assert returned, "submit waited for the process"
        mask = returned[0]
        assert mask.filling is not None and mask.rows == list(range(12))
        assert not book._process.acks.poll(0.5)  # nothing answered: the mask is not filled yet
    finally:
        os.kill(pid, signal.SIGCONT)
    masked = apply_token_mask(torch.zeros(12, VOCAB), mask)  # the host waits for the fill
    expected = xgr.allocate_token_bitmask(1, VOCAB)
    xgr.GrammarMatcher(compiler.compile(_json_spec(SCHEMAS["nested"]))).fill_next_token_bitmask(expected)
    for row, bits in zip(masked, mask.bitmask):
        assert torch.equal(bits, expected[0])  # the process's fill is xgrammar's own
        assert set(row.isfinite().nonzero().flatten().tolist()) == _allowed(bits)  # the filled mask applied


def test_an_error_in_the_process_is_raised_by_the_next_call(book) -> None:
    ids = _add_rows(book, 12)
    refused = next(t for t in range(VOCAB) if t not in _allowed(_filled(book.mask(["r0"]))[0]))
    book.submit([(rid, [refused]) for rid in ids], ids)  # returns: the process finds the refusal
    with pytest.raises(RuntimeError, match="refused by the grammar"):
        _filled(book.mask(ids))
    _filled(book.mask(ids))  # raised once; the book goes on


def test_bad_grammars_and_bad_output_are_refused_by_the_process_with_its_message(book) -> None:
    with pytest.raises(GrammarError, match="regex does not compile"):
        book.compile_within(GrammarSpec(kind="regex", text="(unclosed"))
    with pytest.raises(GrammarError, match="regex does not compile"):
        book.add("r", GrammarSpec(kind="regex", text="(unclosed"), [])
    a = _token("a")
    with pytest.raises(GrammarError, match=r"output token 1 \(\d+\) does not follow the request's regex"):
        book.add("r", GrammarSpec(kind="regex", text="ab"), [a, a])
    assert "r" not in book and len(book) == 0


def test_a_draw_past_the_books_capacity_is_refused(book) -> None:
    ids = _add_rows(book, 17)
    with pytest.raises(ValueError, match="17 constrained rows is more than the grammar book holds"):
        book.mask(ids)


def test_a_dead_process_is_a_clear_error_not_a_hang(book) -> None:
    import signal

    ids = _add_rows(book, 2)
    _filled(book.mask(ids))
    os.kill(book._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"grammar process \(pid \d+\) exited"):
        for _ in range(3):  # NOTE: the first send may land in the pipe's buffer; its wait finds the EOF
            _filled(book.mask(ids))


def test_close_ends_the_process_and_a_dropped_book_ends_it_too() -> None:
    import gc
    import time

    def gone(process) -> bool:
        deadline = time.monotonic() + 10
        while process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not process.is_alive()

    book = GrammarBook(DEFAULT_MODEL_DIR, VOCAB, [EOS], capacity=4)
    book.add("r", GrammarSpec(kind="regex", text="ab"), [])
    process = book._process
    assert process.is_alive()
    book.close()
    assert gone(process)
    book = GrammarBook(DEFAULT_MODEL_DIR, VOCAB, [EOS], capacity=4)
    book.add("r", GrammarSpec(kind="regex", text="ab"), [])
    process = book._process
    del book
    gc.collect()
    assert gone(process)


def test_a_dead_fork_server_is_replaced_and_its_children_live_on(book) -> None:
    from engine.grammar_book import _ForkServers

    book.add("r", GrammarSpec(kind="regex", text="ab"), [])
    server = _ForkServers._server
    assert server is not None
    server.process.kill()
    server.process.wait(10)
    assert len(_allowed(_filled(book.mask(["r"]))[0])) >= 1  # the forked process serves on
    other = GrammarBook(DEFAULT_MODEL_DIR, VOCAB, [EOS], capacity=4)
    try:
        other.add("s", GrammarSpec(kind="regex", text="ab"), [])  # a fresh server forks its process
        assert _ForkServers._server is not server
        assert _allowed(_filled(other.mask(["s"]))[0]) == _allowed(_filled(book.mask(["r"]))[0])
    finally:
        other.close()


def _token(ch: str) -> int:
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode(ch, add_special_tokens=False)[0]


# ---- constrained generation with the default model


def _validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True}, {"speculative": {"method": "ngram"}}],
                         ids=["sync", "async", "ngram"])
def test_json_schemas_at_temperature_one_always_validate(make_llm, options) -> None:
    llm = make_llm(**options)
    prompts, params, schemas = [], [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for j in range(4):
            prompts.append(f"{name} {j}")
            params.append(SamplingParams(max_tokens=160, temperature=1.0, seed=i * 10 + j if j % 2 else None,
                                         grammar=_json_spec(schema)))
            schemas.append(schema)
    # unconstrained requests share the batch
    prompts += ["free text"] * 4
    params += [SamplingParams(max_tokens=20, temperature=1.0)] * 4
    outputs = llm.generate(prompts, params)
    for out, schema in zip(outputs, schemas):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        _validate(out.outputs[0].text, schema)
    assert all(len(out.outputs[0].token_ids) == 20 for out in outputs[len(schemas):])
    assert llm.engine.stats().grammar_work_seconds > 0  # the grammar process's work, counted for the metrics
    assert len(llm.engine.grammars) == 0  # every matcher dropped


def test_regex_ebnf_and_json_object_outputs_match(make_llm) -> None:
    llm = make_llm()
    regex = GrammarSpec(kind="regex", text=r"(red|green|blue)-[0-9]{2,4}")
    ebnf = GrammarSpec(kind="ebnf", text='root ::= "yes" | "no" | "maybe " [a-c]')
    obj = GrammarSpec(kind="json_object")
    outputs = llm.generate(
        ["a", "b", "c", "d", "e", "f"],
        [SamplingParams(max_tokens=40, temperature=1.0, grammar=g) for g in (regex, regex, ebnf, ebnf)]
        + [SamplingParams(max_tokens=300, temperature=0.0, grammar=obj)] * 2,
    )
    for out in outputs[:2]:
        assert re.fullmatch(r"(red|green|blue)-[0-9]{2,4}", out.outputs[0].text), out.outputs[0].text
    for out in outputs[2:4]:
        assert re.fullmatch(r"yes|no|maybe [a-c]", out.outputs[0].text), out.outputs[0].text
    for out in outputs[4:]:
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # a long object cut by max_tokens is still a prefix of one
            assert text.startswith("{")


def test_seeded_constrained_output_is_the_same_with_async_scheduling_and_speculation(make_llm) -> None:
    spec = _json_spec(SCHEMAS["nested"])
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=spec) for s in range(6)]
    greedy = SamplingParams(max_tokens=120, temperature=0.0, grammar=spec)
    texts = []
    engines = []
    for options in ({}, {"async_scheduling": True}, {"speculative": {"method": "ngram", "num_draft_tokens": 3}}):
        llm = make_llm(**options)
        outputs = llm.generate(["p"] * 7, [*params, greedy])
        texts.append([o.outputs[0].token_ids for o in outputs])
        engines.append(llm.engine)
    assert texts[0] == texts[1] == texts[2]
    assert engines[1].async_scheduling and engines[2].stats().num_spec_verifications > 0


def test_a_continued_request_rebuilds_its_matcher_from_its_earlier_output(make_llm) -> None:
    """A moved request: another engine gets prompt + the output so far (num_prior_output_tokens) and
    continues the very stream, constrained from where the first engine stopped."""
    spec = _json_spec(SCHEMAS["array"])
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=7, grammar=spec)
    whole = make_llm().generate(["move me"], params)[0].outputs[0]
    prompt = make_llm().encode("move me")
    k = 5
    rest = make_llm().generate([[*prompt, *whole.token_ids[:k]]], params)  # without the prior: another state
    engine = make_llm().engine
    engine.add_request("moved", [*prompt, *whole.token_ids[:k]], params.model_copy(update={"max_tokens": 80 - k}),
                       num_prior_output_tokens=k)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert whole.token_ids[:k] + tokens == whole.token_ids
    _validate(whole.text, SCHEMAS["array"])
    assert rest[0].outputs[0].token_ids != whole.token_ids[k:]  # the replay is what makes it equal


def test_prior_output_the_grammar_forbids_is_a_clear_error(make_llm) -> None:
    llm = make_llm()
    prompt = llm.encode("x") + llm.encode("not json")
    with pytest.raises(InvalidRequestError, match="grammar: output token 0"):
        llm.engine.add_request("r", prompt, SamplingParams(grammar=GrammarSpec(kind="json_object")),
                               num_prior_output_tokens=2)
    assert len(llm.engine.grammars) == 0


def test_the_grammar_ends_the_output_even_under_min_tokens(make_llm) -> None:
    llm = make_llm()
    spec = GrammarSpec(kind="regex", text="ok")
    out = llm.generate(["q"], SamplingParams(max_tokens=30, min_tokens=20, temperature=1.0, grammar=spec))[0]
    assert out.outputs[0].text == "ok"
    assert out.outputs[0].finish_reason == "stop"


def test_a_drafted_token_the_grammar_forbids_is_rejected_and_the_matcher_rolls_back(make_llm) -> None:
    llm = make_llm(speculative={"method": "ngram", "num_draft_tokens": 4})
    engine = llm.engine
    spec = GrammarSpec(kind="regex", text="ab(c|d)e+")
    engine.add_request("r", llm.encode("x"), SamplingParams(max_tokens=8, temperature=0.0, grammar=spec))
    tok = llm.tokenizer
    a, b, c, e, z = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abcez")
    book = engine.grammars
    before = _filled(book.mask(["r"])).clone()
    mask = book.mask_drafts([("r", [a, b, z, e]), ("free", [a, a])])
    assert mask.rows == [0, 1, 2, 3, 4]  # the constrained row's 5 positions only
    first, second, third = (_allowed(_filled(mask)[k]) for k in range(3))
    assert a in first and b not in first and z not in first
    assert b in second and a not in second
    assert c in third and z not in third  # so verification rejects the drafted z here
    assert len(_allowed(mask.bitmask[3])) == VOCAB  # past the forbidden draft: never used
    assert torch.equal(_filled(book.mask(["r"])), before)  # rolled back exactly
    engine.abort_request("r")
    assert "r" not in book
