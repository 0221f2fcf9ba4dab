"""The Triton attention backend: paged KV, GQA, split-K decode, prefill/extend, sliding window.

One forward = four launches at most, whatever the batch: store the new K/V at their slots, one
decode launch over every sequence with one new token (plus its split-K reduce when the contexts
are split), one prefill launch over every sequence with more. Both attention launches span all
sequences of the batch and skip the other kind on the device, so no per-kind index tensor has to be
built (and copied to the device) each step.

Host work per forward is choosing launch sizes from the host lists of `AttentionMetadata`
(query counts, the longest context); no device value is read back (no synchronization).

CUDA graphs: the decode launch reads only block_tables_tensor, seq_lens_tensor and
query_start_loc_tensor (shapes fixed by the batch size once block_tables is padded to a fixed
width) and its launch sizes (num_splits, tokens_per_split). With
`TritonAttentionConfig(graph_max_context=...)` those come from that fixed context bound instead of
the step's longest context, so they depend on the batch size alone. A capture would also need:
static metadata buffers filled in place before each replay (block tables padded to
graph_max_context / block_size columns), slot_mapping of padded batch rows set to -1 (store_kv
skips them), and the split-K workspace allocated once instead of per forward (`decode_attention`
allocates it with torch.empty, which a capture's private memory pool would also serve).

Importing this module imports no Triton: the kernels are defined at the first construction of
`TritonAttention` (NOTE: TRITON_INTERPRET is read then), so registering the backend is free and a
machine without Triton still imports `engine` (the backend then declares supports_cuda=False).

Knows nothing of scheduling; registered under the name "triton".
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.attention.base import AttentionMetadata, AttentionSpec, register_backend

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile sizes and the split-K policy. Defaults: a first guess for head_dim 128 on H100/H200, not
    yet tuned (`python -m bench.attention_gpu --sweep` times the alternatives)."""

    decode_block_n: int = 64  # keys per tile of the decode kernel
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_block_m: int = 128  # rows (query tokens x group heads) per prefill program
    prefill_block_n: int = 64  # keys per tile of the prefill kernel
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2
    min_split_tokens: int = 256  # a decode split covers at least this many keys
    max_splits: int = 64  # most decode splits per (sequence, KV head)
    target_programs_per_sm: int = 2  # split until decode programs >= this x SMs (or splits run out)
    graph_max_context: int | None = None  # fixed context bound for decode launch sizes (CUDA graphs)

    def __post_init__(self) -> None:
        for name in ("decode_block_n", "prefill_block_m", "prefill_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16 (tl.dot tile)")
        for name in ("min_split_tokens", "max_splits", "target_programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.graph_max_context is not None and self.graph_max_context < 1:
            raise ValueError(f"graph_max_context={self.graph_max_context} must be at least 1 or None")


def decode_split_plan(
    num_decode_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, config: TritonAttentionConfig
) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode launch: enough programs to fill the device,
    splits of at least min_split_tokens keys, tokens_per_split a multiple of decode_block_n, and
    num_splits * tokens_per_split >= max_context."""
    programs = max(1, num_decode_seqs * num_kv_heads)
    wanted = _cdiv(config.target_programs_per_sm * num_sms, programs)
    num_splits = max(1, min(wanted, _cdiv(max_context, config.min_split_tokens), config.max_splits))
    block_n = config.decode_block_n
    tokens_per_split = _cdiv(_cdiv(max_context, num_splits), block_n) * block_n
    return _cdiv(max_context, tokens_per_split), tokens_per_split


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # CPU (TRITON_INTERPRET=1 tests): any fixed figure


@register_backend
class TritonAttention:
    name: ClassVar[str] = "triton"
    supports_cpu: ClassVar[bool] = False  # runs on CPU tensors only under TRITON_INTERPRET=1 (tests)
    supports_cuda: ClassVar[bool] = HAS_TRITON

    def __init__(self, spec: AttentionSpec, config: TritonAttentionConfig | None = None) -> None:
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
        if spec.sliding_window is not None and spec.sliding_window < 1:
            raise ValueError(f"sliding_window={spec.sliding_window} must be at least 1 or None")
        if not HAS_TRITON:
            raise ValueError("the 'triton' attention backend needs the triton package; use 'torch' or install triton")
        # NOTE: defines the kernels on first use (module import), reading TRITON_INTERPRET then.
        from engine.attention import triton_kernels, triton_prefill

        self._kernels, self._prefill = triton_kernels, triton_prefill
        self.spec = spec
        self.config = config or TritonAttentionConfig()
        self._num_sms: dict[torch.device, int] = {}

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        self._kernels.check_dtype("q", q)
        self._kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = meta.query_start_loc
        decode_lens = [n for i, n in enumerate(meta.seq_lens) if starts[i + 1] - starts[i] == 1]
        num_decode = len(decode_lens)
        cfg, spec = self.config, self.spec
        tensors = (meta.block_tables_tensor, meta.seq_lens_tensor, meta.query_start_loc_tensor)
        if num_decode:
            max_context = max(decode_lens)
            if cfg.graph_max_context is not None:
                if max_context > cfg.graph_max_context:
                    raise ValueError(
                        f"a decode context of {max_context} tokens exceeds graph_max_context={cfg.graph_max_context}"
                    )
                max_context = cfg.graph_max_context
            num_splits, tokens_per_split = decode_split_plan(
                num_decode, spec.num_kv_heads, max_context, self._sms(q.device), cfg
            )
            self._kernels.decode_attention(
                q, k_cache, v_cache, out, *tensors,
                scale=spec.scale, sliding_window=spec.sliding_window,
                num_splits=num_splits, tokens_per_split=tokens_per_split,
                block_n=cfg.decode_block_n, num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
            )  # fmt: skip
        if num_decode < meta.num_seqs:
            self._prefill.prefill_attention(
                q, k_cache, v_cache, out, *tensors,
                scale=spec.scale, sliding_window=spec.sliding_window,
                block_m=cfg.prefill_block_m, block_n=cfg.prefill_block_n,
                num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages,
            )  # fmt: skip
        return out

    def _sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = _num_sms(device)
        return self._num_sms[device]
