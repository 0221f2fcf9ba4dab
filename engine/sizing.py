"""How many KV blocks fit: a byte budget on the CPU; on a GPU, what `gpu_memory_utilization`
leaves after the weights and the activation peak of a measured worst-case step."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend
from engine.config import EngineConfig
from engine.kv_cache import allocate_kv_tensors, bytes_per_block
from engine.models import ArchConfig, LlamaForCausalLM


def num_kv_blocks(
    model: LlamaForCausalLM,
    arch: ArchConfig,
    backend: AttentionBackend,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    extra_bytes_per_block: int = 0,
) -> int:
    """`dtype`: the cache's (kv_cache_dtype). `extra_bytes_per_block`: memory that grows with each
    block beside the target's KV (a draft model's KV for the same tokens); the budget is shared out with it."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = bytes_per_block(arch, cache.block_size, dtype) + extra_bytes_per_block
    if device.type != "cuda":
        num = cache.cpu_kv_cache_bytes // per_block
    else:
        peak = profile_activation_bytes(model, arch, backend, config, dtype, device, max_model_len)
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_kv_budget(cache.gpu_memory_utilization, total, free, torch.cuda.memory_allocated(device), peak,
                               str(device))
        num = budget // per_block
    if num < 2:
        raise ValueError(
            f"the KV cache gets {num} blocks of {per_block} bytes; raise "
            f"{'gpu_memory_utilization' if device.type == 'cuda' else 'cpu_kv_cache_bytes'} or use a smaller model"
        )
    return int(num)


def gpu_kv_budget(utilization: float, total: int, free: int, allocated: int, peak: int, device: str) -> int:
    """The KV bytes `utilization` of the device leaves after this process's `allocated` bytes (the weights)
    and the activation `peak`. They must also fit in what is `free` now: memory other processes hold is
    not ours to count on, and allocating past it would fail later with a bare out-of-memory error."""
    budget = int(total * utilization) - allocated - peak
    if budget > free - peak:
        gib = 1 << 30
        others = max(0, total - free - allocated)
        most = max(0.0, (free + allocated) / total)
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives {device}'s KV cache {budget / gib:.1f} GiB, but only "
            f"{free / gib:.1f} GiB of its {total / gib:.1f} GiB is free and the largest step needs "
            f"{peak / gib:.1f} GiB of it; other processes (or this one's caches) hold {others / gib:.1f} GiB: "
            f"set gpu_memory_utilization at most {int(most * 100) / 100:.2f} or free the device"
        )
    return budget


@torch.inference_mode()
def profile_activation_bytes(
    model: LlamaForCausalLM,
    arch: ArchConfig,
    backend: AttentionBackend,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """Peak extra memory of the largest step the scheduler may build: one full token budget
    (as one sequence) plus logits for `max_num_seqs` rows."""
    from engine.attention import AttentionMetadata

    num_tokens = min(config.scheduler.max_num_batched_tokens, max_model_len)
    block_size = config.cache.block_size
    num_blocks = -(-num_tokens // block_size)
    kv = allocate_kv_tensors(arch, num_blocks, block_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    blocks = list(range(num_blocks))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=[0, num_tokens],
        seq_lens=[num_tokens],
        block_tables=[blocks],
        block_tables_tensor=torch.tensor([blocks], dtype=torch.int32, device=device),
        seq_lens_tensor=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc_tensor=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), kv, meta, backend)
    # A verifying request returns logits for its drafted positions too.
    spec = config.speculative
    rows_per_seq = 1 + (spec.num_draft_tokens if spec.is_enabled else 0)
    rows = min(config.scheduler.max_num_seqs * rows_per_seq, num_tokens)
    model.compute_logits(hidden[:rows]).softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del kv, hidden
    torch.cuda.empty_cache()
    return int(peak * 1.1) + (64 << 20)  # margin for allocator fragmentation and sampling temporaries
