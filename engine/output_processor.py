"""Turns the engine's token-id steps into text: incremental detokenization and stop strings.

Shared by the offline `LLM` and the router. A request that hits a stop string is reported
finished here; the caller must then abort it in the engine that still runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int = 0  # its place in RequestOutput.outputs (vLLM's field; always 0 offline: no `n`)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    """One request's output so far. `outputs` is a list, as in vLLM (`out.outputs[0].text`); the
    offline API has no `n`, so it holds exactly one CompletionOutput."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    new_text: str = ""  # text added by the latest step (for streaming)

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and all(c.finish_reason is not None for c in self.outputs)


class TextState:
    """One request's text so far and its stop strings.

    NOTE: while running, the last (longest stop string - 1) characters are held back, so a stop
    string split over steps is never partly streamed; `flush()` releases them at the end.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.text = ""
        self.num_emitted = 0  # characters of `text` already returned
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Returns (new text to show, the stop string matched or None)."""
        if self.detok is None:
            return "", None
        new = self.detok.add(token_ids)
        before = len(self.text)
        self.text += new
        if new and self.params.stop:
            # Only the tail can hold a new match: the new text plus a stop string's length before it.
            search_from = max(0, before - self._hold)
            hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, search_from)) != -1]
            if hits:
                index, stop = min(hits)
                self.text = self.text[: index + len(stop) if self.params.include_stop_str_in_output else index]
                return self.flush(), stop
        end = max(self.num_emitted, len(self.text) - self._hold)
        out, self.num_emitted = self.text[self.num_emitted : end], end
        return out, None

    def flush(self) -> str:
        out, self.num_emitted = self.text[self.num_emitted :], len(self.text)
        return out
