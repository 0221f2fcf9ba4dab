"""RouterCore: what the HTTP and gRPC front ends share between a parsed request and the
Dispatcher's token stream: the served model's name, tokenization (text, token ids checked against
the vocabulary, chat templates), the router's limits, the compile check of a request's grammar
(structured outputs), fanning n > 1 out into n requests, text through TextState (incremental
detokenization, stop strings), the in-flight limit, and mapping the Dispatcher's errors to APIError
(an HTTP status and OpenAI's error body).

What it does not know: HTTP (requests, SSE, JSON bodies), Ray, or how workers are picked (the
Dispatcher's job). It counts nothing itself: metrics go to the optional `metrics` hook.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from engine.config import DEFAULT_MODEL, GrammarSpec, SamplingParams
from engine.grammar import GrammarCompiler, GrammarError
from engine.models.arch import load_arch
from engine.output_processor import TextState
from engine.tokenizer import Tokenizer
from engine.validation import InvalidRequestError
from protocol.messages import PrefillResultMsg
from router.dispatch import Dispatcher, NoCapacityError, RequestFailedError
from router.spans import SpanRecorder
from router.structured import GrammarSource
from router.tool_calls import preload_xgrammar
from router.ttft_window import TtftWindow
from router.openai_schema import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
)

log = logging.getLogger(__name__)

_COMPILER_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")
"""xgrammar's messages start with its log line's time and source line: not the client's business."""


class RouterConfig(BaseModel):
    """The router's identity and limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_name: str = Field(DEFAULT_MODEL, min_length=1, description="The `model` clients send; /v1/models lists it.")
    max_body_bytes: int = Field(1 << 20, ge=1, description="Largest request body in bytes; a larger one gets 413.")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt in tokens; None (and the upper bound): the model's max_model_len - 1."
    )
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens (or max_completion_tokens) allowed.")
    max_n: int = Field(8, ge=1, description="Most choices (n) one request may ask for.")
    max_in_flight: int = Field(
        256, ge=1, description="Most choices generating at once on this router; a request beyond it gets 429."
    )
    retry_after_s: int = Field(1, ge=0, description="The Retry-After header (seconds) of 429 and 503 answers.")
    api_key: str | None = Field(
        None, min_length=1, description="When set, every route but /health needs 'Authorization: Bearer <api_key>'."
    )


class ListenAddress(BaseModel):
    """Where each router replica serves a front end itself (router/http_server.py, router/grpc_server.py);
    the replicas of a node share the port (SO_REUSEPORT: the kernel spreads new connections over them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", min_length=1, description="Address the server binds ('0.0.0.0': every one).")
    port: int = Field(ge=1, le=65535, description="Its port, shared by the router replicas of a node.")


@dataclass(frozen=True)
class ChoiceDelta:
    """What one step added to one choice. The choice's last delta has a finish_reason; the counts
    are the choice's totals so far (so the last delta's are its usage)."""

    index: int  # prompt p, sample i of n -> p * n + i
    text: str  # new text; '' while a character or a possible stop string is held back
    token_ids: list[int]
    logprobs: list[float] | None  # per token in token_ids, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # per token: (token id, logprob), most likely first
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None  # the stop string or stop token id that ended the choice
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int


class RouterMetrics(Protocol):
    """The metrics hook (cluster/ implements it, e.g. with Prometheus). Calls must be cheap and never raise."""

    def on_choice_finished(
        self, *, finish_reason: str, num_prompt_tokens: int, num_completion_tokens: int,
        num_cached_tokens: int, time_to_first_token_s: float | None, elapsed_s: float,
    ) -> None: ...

    def on_rejected(self, *, status_code: int) -> None: ...  # 429 (max_in_flight) and 503 (no capacity)

    def on_response(self, *, route: str, status_code: int, elapsed_s: float) -> None: ...  # front ends call it

    def on_inter_token(self, *, gap_s: float, num_tokens: int) -> None: ...  # tokens after the first, as they arrive

    def on_prefill_result(self, result: PrefillResultMsg) -> None: ...  # prefill and KV-push timings


@dataclass(frozen=True)
class _ChoiceEnd:
    error: BaseException | None


class RouterCore:
    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        config: RouterConfig,
        max_model_len: int,
        *,
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        grammar_compiler: Callable[[], GrammarCompiler] | None = None,
        ttft_window: TtftWindow | None = None,
    ) -> None:
        """grammar_compiler: builds the compiler of the 400 check of grammars (called on the first
        grammar, on a worker thread); by default the tokenizer's checkpoint's (its tokenizer.json,
        and vocab size and stop ids from its config.json, as the engine reads them)."""
        if max_model_len < 2:
            raise ValueError(f"max_model_len is {max_model_len}; it must be at least 2 (one prompt + one new token)")
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or max_model_len - 1, max_model_len - 1)
        self.metrics = metrics  # may be set later; None: no metrics
        self.clock = clock
        self.num_in_flight = 0  # choices admitted and not yet closed
        self.ttft_window = ttft_window  # the first tokens against the TTFT SLO (the autoscaler's); None: not kept
        self.spans = SpanRecorder(clock=clock)
        self._make_grammar_compiler = grammar_compiler or self._checkpoint_grammar_compiler
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = threading.Lock()
        preload_xgrammar()

    def on_prefill_result(self, result: PrefillResultMsg) -> None:
        """The Dispatcher's hook: the prefill worker's answer of one request (its compute time, and
        what its push, which goes on after the answer, sends)."""
        attempt = result.request_id.partition("#")[2]  # a migrated or retried placement: "rid#n"
        self.spans.event(
            result.request_id.partition("#")[0], "prefill_result", attempt=int(attempt or 0),
            prefill_worker_s=result.prefill_s, kv_push_bytes=result.push_bytes,
            num_cached_prompt_tokens=result.num_cached_tokens,
        )
        if self.metrics is not None:
            self.metrics.on_prefill_result(result)

    # ---- checks and tokenization
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(
                404, f"model: {model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model", code="model_not_found",
            )

    def encode_prompts(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Text (with the tokenizer's special tokens) or token ids (checked against the vocabulary)."""
        encoded: list[list[int]] = []
        for p, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._check_ids(prompt, where)
            encoded.append(self._check_length(ids, where))
        return encoded

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template's prompt; `tools` (OpenAI function tools) are among its variables."""
        try:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt, tools)
        except Exception as err:  # noqa: BLE001 - the template refused these messages, or there is none
            raise bad_request(f"messages: the chat template failed: {err}", "messages") from None
        # NOTE: the template writes its own special tokens (HF's apply_chat_template encodes the same way).
        return self._check_length(self.tokenizer.encode(text, add_special_tokens=False), "messages")

    def _check_ids(self, ids: Sequence[int], where: str) -> list[int]:
        vocab_size = self.tokenizer.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # NOTE: in C; the loop below only names the culprit
            for i, token in enumerate(ids):
                if not 0 <= token < vocab_size:
                    raise bad_request(f"{where}[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})",
                                      where)
        return list(ids)

    def _check_length(self, ids: list[int], where: str) -> list[int]:
        if not ids:
            raise bad_request(f"{where}: is empty; at least 1 token is required", where)
        if len(ids) > self.max_prompt_tokens:
            raise bad_request(
                f"{where}: has {len(ids)} tokens; at most {self.max_prompt_tokens} are allowed "
                f"(max_prompt_tokens; max_model_len is {self.max_model_len})", where,
            )
        return ids

    def sampling_params(
        self, request: CompletionRequest | ChatCompletionRequest, prompts: Sequence[Sequence[int]]
    ) -> SamplingParams:
        """The router's limits on n and max_tokens, then the request's own conversion."""
        if request.n > self.config.max_n:
            raise bad_request(f"n: {request.n} choices asked; at most {self.config.max_n} are allowed (max_n)", "n")
        room = self.max_model_len - max(len(p) for p in prompts)
        name, asked = request.max_tokens_asked
        limit = self.config.max_tokens_limit
        if asked is not None and asked > limit:
            raise bad_request(f"{name}: {asked} is more than this server's limit of {limit} tokens", name)
        if asked is not None and asked > room:
            raise bad_request(
                f"{name}: {asked} tokens do not fit: the prompt has {self.max_model_len - room} tokens and "
                f"max_model_len is {self.max_model_len}, so at most {room} can be generated", name,
            )
        default = min(room, limit)
        if isinstance(request, CompletionRequest):
            default = min(default, DEFAULT_COMPLETION_MAX_TOKENS)
        params = request.to_sampling_params(default)
        vocab_size = self.tokenizer.vocab_size
        for token in params.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise bad_request(
                    f"stop_token_ids: {token} is outside the vocabulary [0, {vocab_size})", "stop_token_ids"
                )
        return params

    async def check_grammar(self, source: GrammarSource | None) -> None:
        """Compiles the request's grammar, off the event loop and within the compiler's time limit,
        so that one that does not compile is a 400 naming its field, with the compiler's message,
        before any worker sees it. Nothing happens without a grammar. The compiler caches each
        text, so a schema sent again is a lookup here (and on the workers, which compile too)."""
        if source is None:
            return
        try:
            await asyncio.to_thread(self._compile_grammar, source.spec)
        except GrammarError as err:
            message = _COMPILER_LOG_PREFIX.sub("", str(err)).strip()
            raise bad_request(f"{source.field}: {message}", source.field) from None

    def _compile_grammar(self, spec: GrammarSpec) -> None:
        with self._grammar_compiler_lock:  # NOTE: worker threads: the first grammars race to build it
            if self._grammar_compiler is None:
                self._grammar_compiler = self._make_grammar_compiler()
            compiler = self._grammar_compiler
        compiler.compile_within(spec)

    def _checkpoint_grammar_compiler(self) -> GrammarCompiler:
        model_dir = self.tokenizer.source_dir
        if model_dir is None:
            raise GrammarError("structured outputs need the model's checkpoint directory, and this router's "
                               "tokenizer was not loaded from one (Tokenizer.from_dir)")
        arch = load_arch(model_dir)
        return GrammarCompiler(model_dir, arch.vocab_size, arch.eos_token_ids)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs name tokens this way)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- generation
    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int = 1
    ) -> AsyncIterator[ChoiceDelta]:
        return self.generate_prompts(request_id, [prompt_ids], params, n)

    async def generate_prompts(
        self, request_id: str, prompts: Sequence[list[int]], params: SamplingParams, n: int = 1
    ) -> AsyncIterator[ChoiceDelta]:
        """Deltas of every choice, interleaved as they come; choice p * n + i samples prompt p as
        request `{request_id}-{p * n + i}` with seed + i (when a seed is given). Raises APIError.
        Admission (max_in_flight) happens at the first `__anext__`; closing the iterator early
        (client gone) aborts every unfinished choice on the workers."""
        num_choices = len(prompts) * n
        if self.num_in_flight + num_choices > self.config.max_in_flight:
            self._rejected(429)
            raise APIError(
                429, f"{self.num_in_flight} choices are in flight and this request adds {num_choices}; "
                f"the limit is max_in_flight = {self.config.max_in_flight}: retry later",
                type="rate_limit_error", code="rate_limit_exceeded", headers=self._retry_after(),
            )
        self.num_in_flight += num_choices
        tasks: list[asyncio.Task[None]] = []
        try:
            if num_choices == 1:  # the common case, without a task and a queue per token
                async with aclosing(self._deltas(f"{request_id}-0", 0, prompts[0], params)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            queue: asyncio.Queue[ChoiceDelta | _ChoiceEnd] = asyncio.Queue()
            for p, prompt in enumerate(prompts):
                for i in range(n):
                    index = p * n + i
                    seeded = params if params.seed is None else params.model_copy(update={"seed": params.seed + i})
                    choice = self._run_choice(f"{request_id}-{index}", index, prompt, seeded, queue)
                    tasks.append(asyncio.create_task(choice))
            num_running = num_choices
            while num_running:
                item = await queue.get()
                if isinstance(item, ChoiceDelta):
                    yield item
                    continue
                num_running -= 1
                if item.error is not None:
                    raise item.error
        except Exception as err:  # noqa: BLE001 - every failure leaves as an APIError
            raise self._to_api_error(err) from None
        finally:
            self.num_in_flight -= num_choices
            for task in tasks:
                task.cancel()  # NOTE: before any await: a cancelled consumer may not get to run another
            if tasks:
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))

    async def _run_choice(
        self, request_id: str, index: int, prompt: list[int], params: SamplingParams,
        queue: asyncio.Queue[ChoiceDelta | _ChoiceEnd],
    ) -> None:
        error: BaseException | None = None
        try:
            async with aclosing(self._deltas(request_id, index, prompt, params)) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - handed to the consumer, which maps it to an APIError
            error = err
        queue.put_nowait(_ChoiceEnd(error))

    async def _deltas(
        self, request_id: str, index: int, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[ChoiceDelta]:
        """One choice's deltas. Leaving early (a stop string, the client gone) closes the Dispatcher's
        stream, which aborts the request on the workers."""
        async with aclosing(self.dispatcher.generate(request_id, prompt, params)) as stream:
            text_state = TextState(self.tokenizer, prompt, params)
            started, first_token_at, last_token_at = self.clock(), None, None
            self.spans.start(request_id)
            choice = (request_id, index)
            if self.ttft_window is not None:
                self.ttft_window.begin(choice)
            num_tokens = num_cached = 0
            try:
                async for out in stream:
                    if out.new_token_ids:
                        now = self.clock()
                        if first_token_at is None:
                            first_token_at = now
                            self.spans.event(request_id, "first_token")
                            if self.ttft_window is not None:
                                self.ttft_window.first_token(choice)
                        elif last_token_at == first_token_at:
                            self.spans.event(request_id, "first_decode_token")
                        if last_token_at is not None and self.metrics is not None:
                            self.metrics.on_inter_token(gap_s=now - last_token_at, num_tokens=len(out.new_token_ids))
                        last_token_at = now
                    num_tokens += len(out.new_token_ids)
                    num_cached = max(num_cached, out.num_cached_tokens)
                    text, stop = text_state.add(out.new_token_ids)
                    finish: str | None = None
                    reason: str | int | None = None
                    if stop is not None:
                        finish, reason = "stop", stop
                    elif out.finish_reason is not None:
                        text += text_state.flush()
                        finish = out.finish_reason
                        if finish == "stop" and out.new_token_ids:
                            reason = out.new_token_ids[-1]
                    yield ChoiceDelta(
                        index=index, text=text, token_ids=list(out.new_token_ids), logprobs=out.logprobs,
                        top_logprobs=out.top_logprobs, finish_reason=finish, stop_reason=reason,
                        num_prompt_tokens=len(prompt), num_completion_tokens=num_tokens, num_cached_tokens=num_cached,
                    )
                    if finish is not None:
                        self.spans.event(request_id, "finished", finish_reason=finish, num_completion_tokens=num_tokens)
                        if self.metrics is not None:
                            self.metrics.on_choice_finished(
                                finish_reason=finish, num_prompt_tokens=len(prompt), num_completion_tokens=num_tokens,
                                num_cached_tokens=num_cached, elapsed_s=self.clock() - started,
                                time_to_first_token_s=None if first_token_at is None else first_token_at - started,
                            )
                        return  # a stop string: leaving the block closes the stream, which aborts the request
                raise RequestFailedError(f"the token stream of choice {index} ended without a finish reason")
            finally:
                if self.ttft_window is not None:
                    self.ttft_window.end(choice)

    # ---- errors
    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.config.retry_after_s)}

    def _rejected(self, status_code: int) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(status_code=status_code)

    def _to_api_error(self, err: BaseException) -> APIError:
        if isinstance(err, APIError):
            return err
        if isinstance(err, NoCapacityError):
            self._rejected(503)
            return APIError(
                503, f"{err}: retry later", type="server_error", code="no_capacity", headers=self._retry_after()
            )
        if isinstance(err, InvalidRequestError):
            return bad_request(str(err), err.field)
        if isinstance(err, RequestFailedError):
            return APIError(500, str(err), type="server_error")
        log.error("request failed", exc_info=err)
        return APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")
