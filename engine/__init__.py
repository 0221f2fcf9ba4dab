"""The single-device model runtime every worker kind shares: Llama-family models over a paged KV
cache with prefix caching, continuous batching with chunked prefill and preemption, batched
sampling, speculative decoding (engine/spec/), and the tokenizer. Knows nothing of Ray, transports or HTTP."""

from engine.config import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from engine.engine import EngineCore, StepOutput
from engine.kv_cache import BlockPool
from engine.llm import LLM, engine_config
from engine.output_processor import CompletionOutput, RequestOutput
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.validation import InvalidRequestError

__all__ = [
    "LLM",
    "BlockPool",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "IncrementalDetokenizer",
    "InvalidRequestError",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StepOutput",
    "Tokenizer",
    "engine_config",
]
