"""The offline API, in the spirit of vLLM: `LLM(model).generate(prompts, SamplingParams(...))`,
and `LLM.stream(...)` yielding each step's news for streaming."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.engine import EngineCore
from engine.output_processor import CompletionOutput, RequestOutput, TextState
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


def engine_config(
    model: str = "default", *, speculative: SpeculativeConfig | dict[str, Any] | None = None, **options: Any
) -> EngineConfig:
    """Builds an EngineConfig from flat keyword options, each routed to the config that owns it;
    speculative decoding comes whole, as a SpeculativeConfig (or its fields as a dict)."""
    parts: dict[type, dict[str, Any]] = {
        ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}, ParallelConfig: {},
    }
    for key, value in options.items():
        owner = next((cls for cls in parts if key in cls.model_fields), None)
        if owner is None:
            known = sorted([*(f for cls in parts for f in cls.model_fields), "speculative"])
            raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
        parts[owner][key] = value
    if isinstance(speculative, dict):
        speculative = SpeculativeConfig(**speculative)
    return EngineConfig(
        model=ModelConfig(**parts[ModelConfig]),
        cache=CacheConfig(**parts[CacheConfig]),
        scheduler=SchedulerConfig(**parts[SchedulerConfig]),
        parallel=ParallelConfig(**parts[ParallelConfig]),
        speculative=speculative or SpeculativeConfig(),
    )


class LLM:
    def __init__(self, model: str = "default", **options: Any) -> None:
        """options: engine_config's; tensor_parallel_size=N starts ranks 1..N-1 on this machine
        (engine/parallel/local.py): call close() to stop them."""
        self.engine = EngineCore(engine_config(model, **options))
        has_tokenizer = (self.engine.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(self.engine.model_dir) if has_tokenizer else None
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine; idempotent."""
        self.engine.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.engine.model_dir} has no tokenizer.json: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        for step in self.stream(prompts, params):
            for out in step:
                final[out.request_id] = out
        return [final[k] for k in sorted(final, key=int)]

    def stream(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[list[RequestOutput]]:
        """Adds the prompts, then yields, step by step, the outputs of requests that changed."""
        prompt_list = _as_prompt_list(prompts)
        param_list = _as_param_list(params, len(prompt_list))
        encoded = [self.encode(p) for p in prompt_list]  # NOTE: encode all first: bad input adds nothing
        states: dict[str, tuple[TextState, RequestOutput]] = {}
        try:
            for ids, sp in zip(encoded, param_list):
                rid = str(next(self._ids))
                completion = CompletionOutput()
                if sp.logprobs is not None:
                    completion.logprobs, completion.top_logprobs = [], []
                output = RequestOutput(rid, ids, [completion])
                states[rid] = (TextState(self.tokenizer, ids, sp), output)
                self.engine.add_request(rid, ids, sp)
            while self.engine.has_unfinished():
                yield [self._apply(states, o) for o in self.engine.step()]
        finally:
            for rid in states:
                self.engine.abort_request(rid)  # a bad prompt or a caller that stops iterating frees all

    def _apply(self, states: dict[str, tuple[TextState, RequestOutput]], step: Any) -> RequestOutput:
        text_state, output = states[step.request_id]
        completion = output.outputs[0]  # the only one: the offline API has no `n`
        completion.token_ids.extend(step.new_token_ids)
        if step.logprobs is not None:
            completion.logprobs.extend(step.logprobs)  # type: ignore[union-attr]
            completion.top_logprobs.extend(step.top_logprobs)  # type: ignore[union-attr]
        new_text, stop = text_state.add(step.new_token_ids)
        if stop is not None:
            self.engine.abort_request(step.request_id)
            completion.finish_reason, completion.stop_reason = "stop", stop
        elif step.finish_reason is not None:
            new_text += text_state.flush()
            completion.finish_reason = step.finish_reason
            if step.finish_reason == "stop":
                completion.stop_reason = completion.token_ids[-1]
        completion.text = text_state.text
        output.new_text = new_text
        output.num_cached_tokens = step.num_cached_tokens
        return output


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _as_param_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    return list(params)
