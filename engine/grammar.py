"""Structured outputs: a request's grammar (engine.config.GrammarSpec) compiled by xgrammar, and one
matcher per constrained request that says which tokens may come next.

- `GrammarCompiler` compiles a spec for one tokenizer's vocabulary. xgrammar caches each compiled
  text, so the second request with a schema costs a lookup. It is safe from any thread: callers
  compile off the engine thread (`compile_within`, which refuses a grammar that takes longer than
  its limit), so a slow grammar never stalls a batch.
- `GrammarBook` is one engine's: a matcher per constrained request. Before each draw, `mask` writes
  the allowed-token bitmask of each constrained row on the host; `accept` advances the matchers by
  the sampled tokens (`submit` does both on the book's thread while the engine thread goes on);
  `mask_drafts` checks a speculation's drafts and rolls the matchers back exactly.
- A matcher is never shipped between workers: it is rebuilt from the grammar and the output so far
  (a decode worker's first token from the prefill worker, a moved request's earlier output), and
  replaying those tokens gives the very state the earlier worker had.

NOTE: xgrammar is imported on the first grammar, so an engine that never sees one never loads it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.config import GrammarSpec
from engine.pinned import upload

if TYPE_CHECKING:
    import xgrammar

    from engine.host_gate import HostGate

__all__ = ["Filling", "GrammarBook", "GrammarCompiler", "GrammarError", "TokenMask", "apply_token_mask"]

COMPILE_TIMEOUT_S = 10.0
"""Longest a grammar may take to compile; a slower one is refused (its compile finishes unheeded)."""


INLINE_ROWS = 8
"""`submit` does at most this many rows' work (accepts and fills) on the caller's thread."""

COMPILED_KEPT = 256
"""Compiled grammars a compiler keeps by spec (the most recently used)."""


class GrammarError(ValueError):
    """A grammar that does not compile, or not in time; the message is the compiler's."""


class TokenMask(NamedTuple):
    """Which tokens some logits rows may take: bit t of bitmask[i] set = token t allowed in rows[i]."""

    rows: list[int]  # logits rows, ascending
    # [len(rows), ceil(vocab / 32)] int32, on the host (pinned when the logits are on CUDA, so its
    # copy is queued behind the device's work instead of waiting for it)
    bitmask: torch.Tensor
    filling: Filling | None = None  # None: filled


class Filling(NamedTuple):
    """A mask still being filled on the grammar book's thread: `done` when it is; on CUDA, `ticket`
    of `gate` opens then too."""

    done: Future[None]
    gate: HostGate | None
    ticket: int

    def before_use(self) -> None:
        """Makes what is queued next see the filled mask: with a gate (CUDA) the device waits and the
        host goes on; without one the host waits for the fill."""
        if self.gate is not None:
            self.gate.wait(self.ticket)
        else:
            self.done.result()


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """logits [n, vocab] float with -inf at the tokens each masked row may not take; out of place
    (the caller's logits stay raw, for logprobs). One kernel over the masked rows (xgrammar's)."""
    if mask is None:
        return logits
    import xgrammar as xgr

    if mask.filling is not None:
        mask.filling.before_use()
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    if len(mask.rows) == logits.shape[0]:  # NOTE: every row masked (rows ascending): no gather
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[1])
        return masked
    index = upload(mask.rows, torch.long, logits.device)
    rows = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(rows, bitmask, vocab_size=logits.shape[1])
    return logits.index_copy(0, index, rows)


def _vocab_type(tokenizer_json: dict[str, Any]) -> tuple[str, bool]:
    """(xgrammar's vocab type name, add_prefix_space) of a tokenizer.json: how its token strings
    map to bytes. ByteLevel (GPT-2, Llama 3, Qwen): bytes as printable characters; ByteFallback
    (Llama 2, Mistral): '<0xNN>' tokens and '▁' for spaces; anything else: the strings themselves."""
    decoder = tokenizer_json.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteFallback" in kinds:
        normalizer = json.dumps(tokenizer_json.get("normalizer"), ensure_ascii=False)
        pre = json.dumps(tokenizer_json.get("pre_tokenizer"), ensure_ascii=False)
        prepends = '"Prepend"' in normalizer and "\u2581" in normalizer
        prefix = prepends or ('"Metaspace"' in pre and '"never"' not in pre)
        return "BYTE_FALLBACK", prefix
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL", False
    return "RAW", False


# A JSON string's characters that need no escape: what a length-bounded string is made of here.
_PLAIN_STRING = r'^[^"\\\x00-\x1f]{%d,%s}$'
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas


def _bounded_strings_as_patterns(node: Any) -> Any:
    """The schema with each length-bounded string (minLength, maxLength; no pattern, format, enum or
    const) written as a pattern of unescaped characters. xgrammar 0.2.8 compiles such a string into
    a rule whose mask takes milliseconds per token (each of a large vocabulary's tokens checked one
    by one) and that lets raw control characters through, which JSON forbids; the pattern's mask
    takes microseconds. Such a string then holds no escape sequences."""
    if isinstance(node, list):
        return [_bounded_strings_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else _bounded_strings_as_patterns(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = out.get("minLength", 0), out.get("maxLength")
        if isinstance(low, int) and (high is None or isinstance(high, int)):  # NOTE: else the compiler refuses them
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = _PLAIN_STRING % (low, "" if high is None else high)
    return out


def _json_schema(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"it is not JSON ({err})") from None
    return json.dumps(_bounded_strings_as_patterns(schema))


class GrammarCompiler:
    """Compiles GrammarSpecs for one model's vocabulary (its tokenizer.json and logits width)."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(f"structured outputs need the model's tokenizer.json; {path} does not exist")
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
        # NOTE: ids past the tokenizer's (a padded logits row) stay '': xgrammar never allows them.
        encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
        for token, i in vocab.items():
            encoded[i] = token
        kind, prefix = _vocab_type(json.loads(path.read_text(encoding="utf-8")))
        self.info = xgr.TokenizerInfo(
            encoded[:vocab_size], vocab_type=getattr(xgr.VocabType, kind), vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids), add_prefix_space=prefix,
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=4, cache_enabled=True)
        # NOTE: by spec, so that a cached grammar costs no schema-to-EBNF conversion either
        self._compiled: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar (the last COMPILED_KEPT kept by spec, all by text in xgrammar's
        cache); GrammarError with the compiler's message."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        c = self._compiler
        compile: Callable[[], xgrammar.CompiledGrammar] = {
            # NOTE: no free whitespace between JSON tokens: a model's whitespace runs can otherwise go
            # on until max_tokens, leaving the JSON unfinished.
            "json_schema": lambda: c.compile_json_schema(_json_schema(spec.text), any_whitespace=False),
            # NOTE: OpenAI's JSON mode: any object, so other keys than none are allowed (not strict).
            "json_object": lambda: c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False),
            "regex": lambda: c.compile_regex(spec.text),
            "ebnf": lambda: c.compile_grammar(spec.text),
            "structural_tag": lambda: c.compile_structural_tag(spec.text),
        }[spec.kind]
        try:
            return compile()
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own kinds
            raise GrammarError(f"the {spec.kind} does not compile: {err}") from None

    def compile_within(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> xgrammar.CompiledGrammar:
        """`compile`, on a thread of its own, given at most timeout_s: a grammar that takes longer is
        refused (its compile runs on, unheeded, and lands in the cache)."""
        done = threading.Event()
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(self.compile(spec))
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                result.append(err)
            done.set()

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        if not done.wait(timeout_s):
            raise GrammarError(f"the {spec.kind} did not compile within {timeout_s:g} s; simplify it")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]


class GrammarBook:
    """One engine's matchers, by request id. Engine thread only, except `compiler` and `compile_within`."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], pin_memory: bool = False) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pin_memory = pin_memory  # NOTE: the logits are on CUDA: pinned masks, and draws wait on the device
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher: fills many rows on its threads
        self._thread: ThreadPoolExecutor | None = None  # `submit`'s
        self._gate: HostGate | None = None  # `submit`'s draws wait on it (CUDA)
        self._working: Future[None] | None = None  # the last work `submit` handed to the thread
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (it reads the vocabulary and imports xgrammar); any thread."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    @property
    def gate(self) -> HostGate:
        """Where `submit`'s draws wait for their masks on the device (built on first use: it imports triton)."""
        if self._gate is None:
            from engine.host_gate import HostGate

            self._gate = HostGate(pin_memory=self._pin_memory)
        return self._gate

    def compile_within(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """Compiles spec into the cache, or raises GrammarError; any thread (a worker's, so that
        `add`'s compile on the engine thread is a cache hit)."""
        self.compiler.compile_within(spec, timeout_s)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, spec: GrammarSpec, output: Sequence[int]) -> None:
        """A matcher for request_id, advanced over `output` (tokens generated for it elsewhere).
        GrammarError if the grammar does not compile or `output` does not follow it."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compiler.compile(spec))  # NOTE: it rolls back any number of tokens
        for i, token in enumerate(output):
            if not matcher.accept_token(token):
                raise GrammarError(f"output token {i} ({token}) does not follow the request's {spec.kind}")
        self._matchers[request_id] = matcher

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def settle(self) -> None:
        """Waits for the work `submit` handed to the thread, and raises its error if it failed, or if
        the device gave up waiting for a mask. Every call that touches a matcher on this thread
        settles first."""
        working, self._working = self._working, None
        if working is not None:
            working.result()
        if self._gate is not None and (late := self._gate.late()):
            raise RuntimeError(f"the device gave up waiting for a constrained draw's mask (ticket {late}, after "
                               f"{self._gate.max_spins} reads): its tokens were drawn unmasked; the host's "
                               "grammar thread stalled, restart the worker")

    def accept(self, tokens: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Advances each listed request's matcher by its new tokens, in order (a batch of single
        tokens in one call). The tokens were drawn under these matchers' masks: a refusal is a bug,
        raised. A matcher that took an end-of-sequence token is terminated: the request ends."""
        self.settle()
        self._advance([(self._matchers[rid], list(new)) for rid, new in tokens])

    def submit(self, tokens: Sequence[tuple[str, Sequence[int]]], request_ids: Sequence[str]) -> TokenMask | None:
        """`accept(tokens)`, then the mask of a draw whose row i is request_ids[i] (None: no row is
        constrained), on the book's own thread (xgrammar releases the GIL): the mask comes back at
        once, still `filling`, and the engine thread goes on. The next call that touches a matcher
        settles first, raising the work's error."""
        self.settle()
        advancing = [(self._matchers[rid], list(new)) for rid, new in tokens]
        masked = [(i, self._matchers[rid]) for i, rid in enumerate(request_ids) if rid in self._matchers]
        bitmask = self._bitmask(len(masked)) if masked else None
        if len(advancing) + len(masked) <= INLINE_ROWS:  # NOTE: less work than a hand-off to the thread
            self._advance(advancing)
            return self._fill(masked, bitmask)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        gate = self.gate if bitmask is not None and self._pin_memory else None
        ticket = gate.take() if gate is not None else 0

        def work() -> None:
            try:
                self._advance(advancing)
                self._fill(masked, bitmask)
            finally:
                if gate is not None:
                    gate.open(ticket)

        self._working = self._thread.submit(work)
        if bitmask is None:
            return None
        return TokenMask([i for i, _ in masked], bitmask, Filling(self._working, gate, ticket))

    @staticmethod
    def _advance(advancing: list[tuple[Any, list[int]]]) -> None:
        import xgrammar as xgr

        singles = [(m, new[0]) for m, new in advancing if len(new) == 1]
        if singles and not all(xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in singles],
                                                                          [t for _, t in singles])):
            raise RuntimeError("a sampled token was refused by the grammar whose mask it was drawn under")
        for matcher, new in advancing:
            if len(new) != 1 and not all(matcher.accept_token(t) for t in new):
                raise RuntimeError(f"sampled tokens {new} were refused by the grammar whose masks they were drawn "
                                   "under")

    def _bitmask(self, rows: int) -> torch.Tensor:
        """[rows, words] int32 to fill, from a ring of two pinned buffers (a step's plain draw and its
        verification may each take one). NOTE: a buffer is filled again only after the tokens of the
        draw that read it were read, so its copy to the device is done."""
        words = -(-self.compiler.vocab_size // 32)
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.shape[0] < rows:
            buffer = self._buffers[self._turn] = torch.empty(
                (max(rows, 256), words), dtype=torch.int32, pin_memory=self._pin_memory
            )
        return buffer[:rows]

    def mask(self, request_ids: Sequence[str]) -> TokenMask | None:
        """The mask of one draw whose row i is request_ids[i]: a bitmask row per constrained one
        (a finished request's row is left out: its draw is dropped). None: no row is constrained."""
        self.settle()
        masked = [(i, self._matchers[rid]) for i, rid in enumerate(request_ids) if rid in self._matchers]
        return self._fill(masked, self._bitmask(len(masked)) if masked else None)

    def _fill(self, masked: list[tuple[int, Any]], bitmask: torch.Tensor | None) -> TokenMask | None:
        """(draw row, matcher) -> the draw's mask, in bitmask (None: no row is masked); a terminated
        matcher's row allows all (its draw is dropped)."""
        if bitmask is None:
            return None
        live = []
        for j, (_, matcher) in enumerate(masked):
            if matcher.is_terminated():
                bitmask[j] = -1
            else:
                live.append((j, matcher))
        if len(live) == 1:
            live[0][1].fill_next_token_bitmask(bitmask, live[0][0])
        elif live:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()  # NOTE: half the cores (all of them measured slower)
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, [j for j, _ in live])
        return TokenMask([i for i, _ in masked], bitmask)

    def mask_drafts(self, rows: Sequence[tuple[str, Sequence[int]]]) -> TokenMask | None:
        """The mask of one verification: row i is (request id, its K_i drafted tokens), with K_i + 1
        positions. Position k of a constrained row gets the matcher's mask after drafts[:k]; past a
        draft the grammar forbids, the rest are all allowed (verification rejects that draft at the
        position before, so they are never used). The matcher ends where it started (rollback)."""
        self.settle()
        positions: list[int] = []
        matchers: list[tuple[int, Any, Sequence[int]]] = []
        start = 0
        for rid, drafts in rows:
            matcher = self._matchers.get(rid)
            if matcher is not None:
                matchers.append((len(positions), matcher, drafts))
                positions.extend(range(start, start + len(drafts) + 1))
            start += len(drafts) + 1
        if not positions:
            return None
        bitmask = self._bitmask(len(positions))
        for first, matcher, drafts in matchers:
            bitmask[first : first + len(drafts) + 1] = -1
            if matcher.is_terminated():
                continue
            matcher.fill_next_token_bitmask(bitmask, first)
            walked = 0
            for k, token in enumerate(drafts):
                if not matcher.accept_token(token):
                    break
                walked += 1
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, first + k + 1)
            if walked:
                matcher.rollback(walked)
        return TokenMask(positions, bitmask)
