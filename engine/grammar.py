"""Structured outputs: a request's grammar (engine.config.GrammarSpec) compiled by xgrammar, and the
mask of a draw's allowed tokens applied to its logits.

- `GrammarCompiler` compiles a spec for one tokenizer's vocabulary. xgrammar caches each compiled
  text, so the second request with a schema costs a lookup. It is safe from any thread: callers
  compile off the engine thread (`compile_within`, which refuses a grammar that takes longer than
  its limit), so a slow grammar never stalls a batch.
- `TokenMask` is a draw's bitmask, still `Filling` while the grammar process writes it
  (engine/grammar_book.py keeps one engine's matchers there); `apply_token_mask` applies it.

NOTE: xgrammar is imported on the first grammar, so a process that never sees one never loads it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.config import GrammarSpec
from engine.pinned import upload

if TYPE_CHECKING:
    import xgrammar

    from engine.host_gate import HostGate

__all__ = [
    "Filling", "GrammarCompiler", "GrammarError", "TokenMask", "apply_token_mask", "device_bitmask", "mask_logits",
]

COMPILE_TIMEOUT_S = 10.0
"""Longest a grammar may take to compile; a slower one is refused (its compile finishes unheeded)."""


COMPILED_KEPT = 256
"""Compiled grammars a compiler keeps by spec (the most recently used)."""


class GrammarError(ValueError):
    """A grammar that does not compile, or not in time; the message is the compiler's."""

    @classmethod
    def too_slow(cls, spec: GrammarSpec, timeout_s: float) -> GrammarError:
        return cls(f"the {spec.kind} did not compile within {timeout_s:g} s; simplify it")


class TokenMask(NamedTuple):
    """Which tokens some logits rows may take: bit t of bitmask[i] set = token t allowed in rows[i]."""

    rows: list[int]  # logits rows, ascending
    # [len(rows), ceil(vocab / 32)] int32, on the host (registered with CUDA when the logits are on
    # it, so its copy is queued behind the device's work instead of waiting for it)
    bitmask: torch.Tensor
    filling: Filling | None = None  # None: filled


class Filling(NamedTuple):
    """A mask the grammar process is still filling (engine/grammar_book.py): the ticket its work
    opens, the gate the device waits on for it (CUDA), and the host's wait for it."""

    ticket: int
    gate: HostGate | None
    wait: Callable[[int], None]

    def before_use(self) -> None:
        """Makes what is queued next see the filled mask: with a gate (CUDA) the device waits and the
        host goes on; without one the host waits for the fill."""
        if self.gate is not None:
            self.gate.wait(self.ticket)
        else:
            self.wait(self.ticket)


def device_bitmask(mask: TokenMask, device: torch.device) -> torch.Tensor:
    """mask's bitmask on device, for what is queued next: a copy queued behind the fill (CUDA: the
    device waits at the gate, not the host), or after the host waited for it (CPU)."""
    if mask.filling is not None:
        mask.filling.before_use()
    return mask.bitmask.to(device, non_blocking=True)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """logits [n, vocab] float with -inf at the tokens each masked row may not take; out of place
    (the caller's logits stay raw, for logprobs)."""
    if mask is None:
        return logits
    return mask_logits(logits, mask.rows, device_bitmask(mask, logits.device))


def mask_logits(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits with -inf where bitmask (on their device) forbids, row i of bitmask for logits row
    rows[i] (ascending); out of place. One kernel over the masked rows (xgrammar's)."""
    import xgrammar as xgr

    if len(rows) == logits.shape[0]:  # NOTE: every row masked (rows ascending): no gather
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=logits.shape[1])
        return masked
    index = upload(rows, torch.long, logits.device)
    picked = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(picked, bitmask, vocab_size=logits.shape[1])
    return logits.index_copy(0, index, picked)


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
            raise GrammarError.too_slow(spec, timeout_s)
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]
