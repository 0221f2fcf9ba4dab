"""What every rank of a worker builds alike, in the same order (a tensor-parallel model's
collectives run while building: the activation profile, graph capture): its part of the model, its
attention backend, its KV cache of the block count all ranks agree on, and its runner.

Rank 0's EngineCore adds the scheduler, sampler and proposer around its parts; the other ranks
(engine/parallel/follower.py) only run the steps rank 0 hands them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionBackend, AttentionSpec, create_backend
from engine.config import EngineConfig
from engine.cuda_graphs import cuda_graphs_enabled, graph_max_rows
from engine.kv_cache import allocate_kv_tensors, bytes_per_block, kv_cache_dtype
from engine.models import DEFAULT_MODEL_DIR, ArchConfig, LlamaForCausalLM, build_model
from engine.models.arch import load_arch
from engine.models.gguf_file import GGUFMetadata, arch_from_gguf, find_gguf
from engine.models.gguf_tokenizer import checkpoint_dir
from engine.models.loader import checkpoint_kv_scales
from engine.parallel import TensorParallel
from engine.quant.kv_scales import KvScales
from engine.runner import ModelRunner, StepLeader
from engine.sizing import num_kv_blocks
from engine.warmup import warm_up_runner


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_model_dir(model: str) -> Path:
    """The checkpoint directory; a GGUF file's is a cache directory made for it (engine/models/gguf_tokenizer.py)."""
    return DEFAULT_MODEL_DIR if model == "default" else checkpoint_dir(Path(model))


def max_model_len(arch: ArchConfig, asked: int | None) -> int:
    if asked is None:
        return arch.max_position_embeddings
    if asked > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {asked} exceeds the model's max_position_embeddings {arch.max_position_embeddings}"
        )
    return asked


def checkpoint_arch(model_dir: Path) -> ArchConfig:
    """The architecture of a checkpoint directory or GGUF file, read without its weights."""
    gguf = find_gguf(model_dir)
    return arch_from_gguf(GGUFMetadata.open(gguf)) if gguf is not None else load_arch(model_dir)


@dataclass
class RankParts:
    model: LlamaForCausalLM
    arch: ArchConfig  # the whole model's
    local_arch: ArchConfig  # this rank's heads and rows (the whole model's without tensor parallelism)
    backend: AttentionBackend
    kv_dtype: torch.dtype  # the cache's (CacheConfig.kv_cache_dtype)
    kv_scales: KvScales | None  # an FP8 cache's per-layer scales from the checkpoint (None: a unit scale)
    block_bytes: int  # this rank's KV bytes per block


def build_parts(config: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype,
                tp: TensorParallel | None) -> RankParts:
    """tp: this rank's part only (the model checks the sizes divide before allocating anything)."""
    m = config.model
    model, arch = build_model(model_dir, dtype, device, m.load_format, m.seed, m.fused_ops, tp, m.quantization)
    local = model.local_arch
    spec = AttentionSpec(local.num_heads, local.num_kv_heads, local.head_dim, local.head_dim**-0.5,
                         local.sliding_window)
    backend = create_backend(m.attention_backend, spec, device)
    kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
    fp8_cache = kv_dtype == torch.float8_e4m3fn
    scales = checkpoint_kv_scales(model_dir, m.load_format, arch.num_layers) if fp8_cache else None
    model.set_kv_scales(scales)
    return RankParts(model, arch, local, backend, kv_dtype, scales,
                     bytes_per_block(local, config.cache.block_size, kv_dtype))


def build_cache(config: EngineConfig, parts: RankParts, device: torch.device, max_model_len: int,
                tp: TensorParallel | None, extra_bytes_per_block: int = 0) -> torch.Tensor:
    """The KV cache; with tensor parallelism every rank gets the fewest blocks any rank can hold
    (block ids mean the same on every rank)."""
    num_blocks = num_kv_blocks(parts.model, parts.local_arch, parts.backend, config, parts.kv_dtype, device,
                               max_model_len, extra_bytes_per_block)
    if tp is not None:
        num_blocks = tp.group.min_int(num_blocks)
    return allocate_kv_tensors(parts.local_arch, num_blocks, config.cache.block_size, parts.kv_dtype, device)


def build_runner(config: EngineConfig, parts: RankParts, kv: torch.Tensor, device: torch.device,
                 max_seq_tokens: int, tp: TensorParallel | None) -> ModelRunner:
    """The runner, handing each step to the other ranks when this is rank 0 of several; CUDA graphs
    captured (on every rank alike) where they run."""
    leader = StepLeader(tp.group) if tp is not None and tp.shard.rank == 0 else None
    runner = ModelRunner(parts.model, kv, parts.backend, device, leader)
    # NOTE: before capture: graphs then find every kernel compiled
    warm_up_runner(runner, max_seq_tokens, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
    if cuda_graphs_enabled(config.model, device, parts.backend):
        # NOTE: after the KV cache exists (its tensors are graph inputs) and before any step.
        runner.capture_decode_graphs(graph_max_rows(config), max_seq_tokens)
    return runner
