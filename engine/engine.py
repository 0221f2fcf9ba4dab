"""EngineCore: one model on one device, stepping a continuous batch of token-id requests.

`step()` is schedule -> execute -> post-process. Token ids in, token ids out: text, chat
templates and stop strings are the caller's (see `engine.llm` and the router).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionSpec, create_backend
from engine.config import EngineConfig, SamplingParams
from engine.kv_cache import BlockPool, IntegrityError, allocate_kv_tensors, bytes_per_block
from engine.models import DEFAULT_MODEL_DIR, ArchConfig, build_model
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampler import SampleResult, Sampler, SamplingRow
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sizing import num_kv_blocks
from engine.validation import validate_prompt


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int  # free or cached-and-evictable
    num_cached_blocks: int  # registered in the prefix cache (held or not)
    num_preemptions: int  # since start


@dataclass(frozen=True)
class StepOutput:
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[float] | None  # per new token, when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_block_ids: list[int] | None = None  # finished with hold_kv: the blocks now held for the caller
    generator_state: bytes | None = None  # finished with hold_kv and a seed: where the next draw continues


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_model_dir(model: str) -> Path:
    return DEFAULT_MODEL_DIR if model == "default" else Path(model)


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config = config or EngineConfig()
        self.clock = clock
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model.model)
        model, arch = build_model(
            self.model_dir, self.dtype, self.device, config.model.load_format, config.model.seed
        )
        self.arch: ArchConfig = arch
        self.max_model_len = _max_model_len(arch, config.model.max_model_len)
        spec = AttentionSpec(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5, arch.sliding_window)
        backend = create_backend(config.model.attention_backend, spec, self.device)
        block_size = config.cache.block_size
        num_blocks = num_kv_blocks(model, arch, backend, config, self.dtype, self.device, self.max_model_len)
        self.block_bytes = bytes_per_block(arch, block_size, self.dtype)
        kv = allocate_kv_tensors(arch, num_blocks, block_size, self.dtype, self.device)
        self.pool = BlockPool(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.runner = ModelRunner(model, kv, backend, self.device)
        self.sampler = Sampler(arch.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.pool)
        self.generator = torch.Generator(device=self.device).manual_seed(config.model.seed)
        # Blocks held outside running requests, by key: a prefill's finished request awaiting its
        # push (key = request id) or a decode worker's lease (key = lease id).
        self.held: dict[str, list[int]] = {}
        # A request alone must always fit the cache, so it never waits for blocks that cannot come.
        self.max_seq_tokens = min(self.max_model_len, self.capacity_tokens)

    # ---- control
    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *, hold_kv: bool = False
    ) -> None:
        """Queues a request. With `hold_kv` its blocks stay held when it finishes, under its id in
        `held`, until `release_held(request_id)` (the prefill role's KV push)."""
        if request_id in self.scheduler.requests or request_id in self.held:
            raise ValueError(f"request_id {request_id!r} is already running; request ids must be unique")
        prompt = self._validate(prompt_token_ids, params)
        request = Request(request_id, prompt, params, arrival_time=self.clock(), hold_kv=hold_kv)
        request.generator = self._generator_for(params)
        self.scheduler.add(request)

    def _generator_for(self, params: SamplingParams, state: bytes | None = None) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if state is not None:
            generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return generator

    def _validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return validate_prompt(
            prompt_token_ids,
            params,
            vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len,
            max_prompt_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            max_unchunked_tokens=(
                None if self.config.scheduler.enable_chunked_prefill else self.config.scheduler.max_num_batched_tokens
            ),
        )

    def abort_request(self, request_id: str) -> bool:
        """Idempotent: True if the request was live (or its KV held) and now all its blocks are freed."""
        return self.scheduler.abort(request_id) is not None or self.release_held(request_id)

    # ---- KV held outside running requests (disaggregation)
    def reserve(self, key: str, num_blocks: int) -> list[int] | None:
        """Holds `num_blocks` blocks under `key` (a decode worker's lease); None when they cannot be had."""
        if key in self.held:
            raise ValueError(f"{key!r} already holds blocks")
        if not self.pool.can_allocate(num_blocks):
            return None
        self.held[key] = self.pool.allocate(num_blocks)
        return self.held[key]

    def release_held(self, key: str) -> bool:
        """Frees what `key` holds; idempotent."""
        blocks = self.held.pop(key, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        lease_key: str,
        generator_state: bytes | None = None,
    ) -> None:
        """Joins a request whose prompt KV already sits in the blocks held under `lease_key`
        and whose first token was sampled elsewhere (with `generator_state` after that draw)."""
        prompt = self._validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already running; request ids must be unique")
        blocks = self.held.get(lease_key)
        needed = -(-len(prompt) // self.pool.block_size)
        if blocks is None or len(blocks) < needed:
            raise ValueError(f"lease {lease_key!r} holds {len(blocks or [])} blocks; the prompt needs {needed}")
        del self.held[lease_key]
        request = Request(request_id, prompt, params, arrival_time=self.clock(), block_ids=blocks)
        request.token_ids.append(first_token)
        request.num_computed_tokens = len(prompt)
        request.generator = self._generator_for(params, generator_state)
        self.scheduler.commit_computed_blocks(request)
        self.scheduler.add_running(request)


    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled and self.has_unfinished() and not self.scheduler.running:
            raise RuntimeError("the scheduler admitted nothing with nothing running: the KV cache is too small")
        sampled = self._execute(out)
        return self._post_process(out, sampled)

    def _execute(self, out: SchedulerOutput) -> SampleResult | None:
        if not out.scheduled:
            return None
        logits = self.runner.execute(out.scheduled)
        sampling = out.sampling
        if not sampling:
            return None
        rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator) for r in sampling]
        return self.sampler(logits, rows, self.generator)

    def _post_process(self, out: SchedulerOutput, sampled: SampleResult | None) -> list[StepOutput]:
        self.scheduler.advance(out)
        outputs: list[StepOutput] = []
        for i, request in enumerate(out.sampling):
            assert sampled is not None
            token = sampled.token_ids[i]
            request.token_ids.append(token)
            status = self._stop_status(request, token)
            kept, state = None, None
            if status is not None:
                blocks = self.scheduler.finish(request, status)
                if request.hold_kv:
                    kept = self.held[request.request_id] = blocks
                    state = _generator_bytes(request.generator)
            want = request.params.logprobs is not None
            outputs.append(
                StepOutput(
                    request_id=request.request_id,
                    new_token_ids=[token],
                    logprobs=[sampled.logprobs[i]] if want else None,  # type: ignore[list-item]
                    top_logprobs=[sampled.top_logprobs[i]] if want else None,  # type: ignore[list-item]
                    finish_reason=status.value if status is not None else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_block_ids=kept,
                    generator_state=state,
                )
            )
        return outputs

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token in self.arch.eos_token_ids) or token in params.stop_token_ids:
                request.stop_token_id = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_seq_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # ---- invariants
    def check_integrity(self) -> None:
        """The pool's own table holds, and its holders are exactly the live requests' and the
        held keys' blocks."""
        self.pool.check_integrity()
        total_refs = sum(self.pool.ref_count(b) for b in range(self.pool.num_blocks))
        claimed = self.scheduler.num_held_blocks_by_requests() + sum(len(b) for b in self.held.values())
        if total_refs != claimed:
            raise IntegrityError(f"the pool counts {total_refs} block holders, the requests claim {claimed}")


def _generator_bytes(generator: torch.Generator | None) -> bytes | None:
    return bytes(generator.get_state().numpy().tobytes()) if generator is not None else None


def _max_model_len(arch: ArchConfig, asked: int | None) -> int:
    if asked is None:
        return arch.max_position_embeddings
    if asked > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {asked} exceeds the model's max_position_embeddings {arch.max_position_embeddings}"
        )
    return asked
