"""Frozen, validated configuration of the engine: what to load, how big the KV cache is, how the
scheduler batches, whether it speculates, and how each request samples.

Every model here rejects unknown fields and is never changed after creation; defaults are
defined once, here, and the CLI reads them from these models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "default"
"""The name of the embedded tiny model that ships inside the package and needs no download."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """Which checkpoint to run and in what precision."""

    model: str = Field(DEFAULT_MODEL, description=(
        "HF checkpoint directory, a GGUF file (llama/qwen2/qwen3; Q4_0 projections stay 4-bit, the rest is "
        "dequantized at load; or a directory "
        "holding one .gguf and no safetensors), or 'default' for the embedded model."
    ))
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weight and activation dtype; 'auto' is bfloat16 on GPU and float32 on CPU."
    )
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto",
        description="'dummy' builds random weights at the checkpoint's shape (config.json or the GGUF "
        "metadata only); 'auto' reads safetensors, or a GGUF file.",
    )
    quantization: Literal["auto", "fp8"] = Field(
        "auto",
        description="'fp8': the decoder's projections in FP8 E4M3 (W8A8: per-channel weight scales, dynamic "
        "per-token activation scales; engine/quant/), quantized at load from a bfloat16 checkpoint or read from "
        "an FP8 compressed-tensors one (llm-compressor's; transformers' block-scaled 'fp8' loads dequantized and is "
        "requantized per channel). 'auto': FP8 when the checkpoint's config.json says it "
        "is, 4-bit weight-only for an AutoAWQ or GPTQ checkpoint, else `dtype`. On CUDA GPUs of compute "
        "capability 8.9+ "
        "(Ada, Hopper) with bfloat16 FP8 runs Triton kernels and torch._scaled_mm; elsewhere a reference path "
        "computes the same numbers slowly (the engine logs which).",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output in tokens; default and upper limit: the model's own."
    )
    device: str = Field("auto", description="'auto' (cuda when available), 'cpu', or 'cuda[:N]'.")
    seed: int = Field(0, description="Seed of dummy weights and of requests that bring no seed of their own.")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="'torch' (reference, any device), 'triton' (CUDA), or 'auto' (the fastest the device runs: "
        "triton on CUDA, torch on the CPU).",
    )
    fused_ops: bool = Field(
        True,
        description="On CUDA, Triton kernels for RMSNorm (+ residual add), q/k norm + rotary and SwiGLU instead of "
        "PyTorch's unfused ops (engine/models/fused_ops.py), and one kernel for the sampler's draw of rows with "
        "only a temperature (engine/sampling_kernels.py); ignored on the CPU.",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly. Otherwise, when the device is CUDA and the attention backend is "
        "'triton', steps of at most cuda_graph_max_rows tokens replay CUDA graphs captured at start for 1, 2, 4, "
        "... rows up to that (engine/cuda_graphs.py): decode steps, speculative verifications, and steps whose "
        "prompts or chunks are short; longer prefills, and every step on the CPU or with the 'torch' backend, "
        "run eagerly.",
    )
    cuda_graph_max_rows: int | None = Field(
        None,
        ge=1,
        description="Tokens in the largest captured CUDA graph. None: max_num_seqs x (1 + num_draft_tokens with "
        "speculation), at least 512, at most max_num_batched_tokens.",
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
            return value
        raise ValueError(f"device {value!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")


class CacheConfig(_Frozen):
    """The paged KV cache: block geometry and how much memory it may take."""

    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV block.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of GPU memory pdserve may use in all (weights, activations, KV)."
    )
    cpu_kv_cache_bytes: int = Field(256 << 20, ge=1 << 16, description="KV budget in bytes on the CPU.")
    num_blocks: int | None = Field(
        None, ge=2, description="Fixed number of KV blocks; overrides the memory-based sizing (tests, benchmarks)."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse full KV blocks of identical prompt prefixes.")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="'fp8': the paged cache holds K and V as FP8 E4M3 (half of bfloat16's bytes: twice the tokens, "
        "half the bytes a prefill worker pushes), stored with a unit scale (values as they are, saturating at "
        "+-448) and read by the attention kernels directly; 'auto': the model's dtype.",
    )


class SchedulerConfig(_Frozen):
    """Iteration-level batching limits."""

    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one running batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step: decode tokens plus prefill chunks."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split prompts longer than the step's remaining budget across steps."
    )
    itl_budget_ms: float | None = Field(
        None, gt=0,
        description="Inter-token latency budget: while requests decode, a step adds prompt tokens (chunks of prompts "
        "being prefilled, new prompts) only as many as the engine's measured prefill rate fits in the room its "
        "measured decode step time leaves in this budget (at least one block's worth, so prompts progress); "
        "None: the token budget alone. `pdserve serve --slo-tpot-ms` sets it to a share of the TPOT SLO "
        "(router.dispatch.SloConfig.step_budget_ms).",
    )
    async_scheduling: bool | None = Field(
        None,
        description="Queue step N+1 on the device before reading step N's sampled tokens, so the host's "
        "scheduling and post-processing overlap the device's work (engine/engine.py says how). None: on "
        "CUDA. With speculative decoding, only for steps that do not draft (batches past "
        "disable_above_batch_size); steps with penalized or KV-holding requests wait for the tokens as before.",
    )


class SpeculativeConfig(_Frozen):
    """Speculative decoding: a proposer drafts up to `num_draft_tokens` tokens per running request and
    the target checks them all in one step (engine/spec/). Exact: greedy output is the output without
    speculation; sampled output follows the target's distribution (rejection sampling; seeded
    requests: the output without speculation, below).

    The draft model runs on the target's device with the target's dtype, load_format and seed, in a
    paged KV cache and block pool of its own.

    Seeds: a seeded request gives the tokens of sampling without speculation for the same seed,
    whatever was drafted: the target accepts a drafted token only where it equals the token its own
    draw for that output position gives (engine/sampler.py). A draft model's draws for a seeded
    request share that noise, so its drafts are often accepted, though less often than rejection
    sampling would (which unseeded requests get). Unseeded requests draw from the engine's shared
    generator: whether a step drafts, which can depend on the batch (disable_above_batch_size, the
    draft gate's measurements, the token budget, free blocks), changes their tokens, never their
    distribution.
    """

    method: Literal["none", "ngram", "draft"] = Field(
        "none", description="'none' (off), 'ngram' (prompt lookup, no model) or 'draft' (a smaller model)."
    )
    num_draft_tokens: int = Field(4, ge=1, le=32, description="Most tokens drafted per request and step (K).")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest suffix of the context looked up.")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest suffix looked up (tried first).")
    draft_model: str | None = Field(
        None, description="draft: HF checkpoint directory of a model with the target's tokenizer, or 'default'."
    )
    draft_num_blocks: int | None = Field(
        None, ge=2, description="draft: KV blocks of the draft's own cache; default: the target's plus lookahead."
    )
    enable_adaptive_draft_length: bool = Field(
        True, description="Draft fewer tokens for requests whose drafts are often rejected (K per request)."
    )
    min_draft_gain: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="Adaptive K: draft the k-th token only while a**k reaches this, a being the request's "
        "measured acceptance per drafted token.",
    )
    disable_above_batch_size: int | None = Field(
        32,
        ge=0,
        description="No drafting while more requests than this are running (a large batch already keeps the GPU "
        "busy, and verifying drafts costs more than it saves); below it the engine drafts where it measures "
        "drafting faster (engine/spec/gate.py). None: no limit.",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method='draft' needs draft_model: the checkpoint directory of the draft model")
        return self

    @property
    def is_enabled(self) -> bool:
        return self.method != "none"


class ParallelConfig(_Frozen):
    """How many GPUs one worker spans."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description="Ranks (GPUs) of one worker: each holds 1/N of the heads, MLP rows and vocabulary "
        "(engine/parallel/); N must divide the model's attention heads and intermediate size, and its KV "
        "heads and N must divide one another.",
    )


class EngineConfig(_Frozen):
    """Everything one engine needs."""

    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()


MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per token (OpenAI's limit)."""

MAX_STOP_STRINGS = 16
"""Most stop strings one request may carry."""

MAX_GRAMMAR_CHARS = 65536
"""Longest grammar text (a JSON schema as JSON, a regex, an EBNF grammar, a structural tag) one request
may carry: with the compile time limit (engine/grammar.py), what bounds the work one grammar asks for."""


class GrammarSpec(_Frozen):
    """What a request's output must match: engine/grammar.py compiles it with xgrammar, once per text.

    | kind           | text                                                             |
    |----------------|------------------------------------------------------------------|
    | json_schema    | a JSON schema, as JSON text                                      |
    | json_object    | '' (any JSON object)                                             |
    | regex          | a regular expression the whole output matches                    |
    | ebnf           | an EBNF grammar (GBNF-style, xgrammar's dialect) with a `root`   |
    | structural_tag | an xgrammar structural tag, as JSON text (tool calls)            |
    """

    kind: Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
    text: str = Field("", max_length=MAX_GRAMMAR_CHARS)

    @model_validator(mode="after")
    def _check(self) -> GrammarSpec:
        if self.kind == "json_object" and self.text:
            raise ValueError("a json_object grammar carries no text")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"a {self.kind} grammar needs its text")
        return self


class SamplingParams(_Frozen):
    """How one request samples and when it stops (vLLM's and OpenAI's meanings)."""

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    min_tokens: int = Field(0, ge=0, description="Stop conditions other than max_tokens wait for this many tokens.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 or 0 keeps all.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus: smallest set whose probability reaches top_p.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p times the top probability.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, description="Divides positive (multiplies negative) logits of seen tokens."
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from generated tokens' logits.")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence from generated tokens' logits."
    )
    seed: int | None = Field(None, description="Same seed, same prompt, same parameters: same output.")
    stop: tuple[str, ...] = Field((), description="Stop strings; the output ends before the first one.")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end the output (kept in it).")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Return the sampled token's logprob and this many alternatives."
    )
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    grammar: GrammarSpec | None = Field(
        None,
        description="The output must match this (structured outputs); it ends when the grammar is complete and "
        "an end-of-sequence token follows. min_tokens does not hold such an output open.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value: object) -> object:
        if isinstance(value, str):
            return (value,)
        return tuple(value) if isinstance(value, list) else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_tuple(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
