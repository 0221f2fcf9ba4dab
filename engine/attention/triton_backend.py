"""The Triton attention backend: paged KV, GQA, split-K decode, prefill/extend, sliding window.

One forward = four launches at most, whatever the batch: store the new K/V at their slots (none when
the caller stored them already, k = v = None: the fused ops' rotary kernel does, `takes_stored_kv`), one
decode launch over every sequence with one new token (plus its split-K reduce when the contexts
are split), one prefill launch over every sequence with more. Both attention launches span all
sequences of the batch and skip the other kind on the device, so no per-kind index tensor has to be
built (and copied to the device) each step.

Host work per forward is choosing launch sizes from the host lists of `AttentionMetadata`
(query counts, the longest context); no device value is read back (no synchronization).

CUDA graphs (engine/cuda_graphs.py captures them): `graph_mode(max_context, batch_sizes, device)`
returns a twin of the backend that serves decode-only batches (one query per sequence) and that a
graph can replay, because nothing it launches depends on a value known only at run time:

- the decode launch sizes (num_splits, tokens_per_split) come from `max_context` (the twin's
  `graph_max_context`) and the batch size alone, never from the step's contexts: the host lists
  of its `AttentionMetadata` are fixed per captured size and are not read for launch sizes;
- it reads only block_tables_tensor, seq_lens_tensor, query_start_loc_tensor and slot_mapping,
  which the caller keeps as static buffers filled in place before each replay (block tables
  max_context / block_size columns wide);
- the split-K workspace is one static buffer, allocated by `graph_mode` for the largest need
  over `batch_sizes`, instead of per forward (graphs never run concurrently, so they share it);
- no prefill launch: a batch with any sequence of more than one query is refused.

Padding rows of a captured batch have slot -1 (store_kv skips them: nothing is written) and
seq_len 1 with block 0 in their block-table row: they attend one key that exists and write only
their own output row, which the caller ignores. (seq_len 0 is not allowed: the split-K reduce of a
row without keys divides 0 by 0.) The eager backend's forward is unchanged by all this; a config
with graph_max_context set only fixes its decode launch sizes (and checks contexts against it).

Importing this module imports no Triton: the kernels are defined at the first construction of
`TritonAttention` (NOTE: TRITON_INTERPRET is read then), so registering the backend is free and a
machine without Triton still imports `engine` (the backend then declares supports_cuda=False).

Knows nothing of scheduling; registered under the name "triton".
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from engine.attention.base import AttentionMetadata, AttentionSpec, DecodeRotation, register_backend
from engine.sms import num_sms

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile sizes and the split-K policy. Defaults for head_dim 128 on H100/H200: the FP8 decode tiles and both
    prefill tiles from sweeps on an H200 (the comments below name them); the 16-bit decode tiles a first guess,
    which read a bfloat16 cache at its bandwidth floor at batch 512 (README)."""

    decode_block_n: int = 64  # keys per tile of the decode kernel
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # The decode kernel's tiles over an FP8 cache (its dots in float16): bench.diag.fp8_decode_attention's sweeps
    # (bench/results/fp8_decode_attention_values_f16_*; since the unsigned cache index, _unsigned_tiles_*)
    decode_fp8_block_n: int = 64
    decode_fp8_num_warps: int = 2
    decode_fp8_num_stages: int = 3
    # A launch of at least this many programs an SM (a large batch, its keys whole) over an FP8 cache: one warp a
    # program, four stages. At context 1500 on an H200 its steps ran 4.9% faster at batch 256, 2.1% at 192, 1.3%
    # at 512 (fp8_decode_crowded_tiles_ab_*); taken by every launch they slowed batch 1 by 18%, 8 and 64 by 2-4%
    # (fp8_decode_one_warp_everywhere_ab_*).
    decode_fp8_crowded_programs_per_sm: int = 8
    decode_fp8_crowded_num_warps: int = 1
    decode_fp8_crowded_num_stages: int = 4
    # The prefill kernel's tiles (rows = query tokens x group heads a program; keys a tile), over a 16-bit cache
    # and over an FP8 one: the best of bench.diag.prefill_tiles' sweep at the 8B shape on an H200 over 8 prompts
    # of 1,024, one of 8,192 and 512 new on 3,584 (bench/results/prefill_tiles_nvidia-h200_sweep.json); 128 x 64
    # keys, 8 warps, 2 stages (a first guess) took 1.12-1.18x as long in bfloat16, 1.17-1.31x over FP8.
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    prefill_fp8_block_m: int = 64
    prefill_fp8_block_n: int = 128
    prefill_fp8_num_warps: int = 4
    prefill_fp8_num_stages: int = 3
    # A prefill launch of at least this many new query rows (tokens x query heads) an SM takes the crowded tiles below
    # where they hold at most prefill_crowded_max_tile_tokens query tokens (block_m / group heads): taller, they pay
    # once the launch has rows enough for every SM. bench.diag.prefill_tiles on an H200 (132 SMs): at the 70B shape
    # (64:8 heads) they took 0.84-0.93x the time of the tiles above in bfloat16, 0.90-0.96x over FP8, on all three
    # cases, the fewest rows 512 new tokens on 3,584 (248 an SM); at the 8B shape (32:8) 0.84-0.97x and 0.97-0.99x on
    # 8 x 1,024 and 1 x 8,192, and 1.54x and 1.76x on that chunk (124 rows an SM). In the 8B engine's prompt steps
    # (8 prompts of ~975 tokens beside 399 decodes) the kernel took 11.88 ms against 12.43 over FP8 (32 tokens a
    # tile) and 10.95 against 10.40 in bfloat16 (64 a tile: the bound), bench/results/prefill_crowded_tiles_ab_*.
    prefill_crowded_rows_per_sm: int = 192
    prefill_crowded_max_tile_tokens: int = 32
    prefill_crowded_block_m: int = 256
    prefill_crowded_block_n: int = 64
    prefill_crowded_num_warps: int = 8
    prefill_crowded_num_stages: int = 3
    prefill_fp8_crowded_block_m: int = 128
    prefill_fp8_crowded_block_n: int = 64
    prefill_fp8_crowded_num_warps: int = 4
    prefill_fp8_crowded_num_stages: int = 3
    min_split_tokens: int = 64  # splits per sequence <= its longest context / this
    max_splits: int = 64  # most decode splits per (sequence, KV head)
    target_programs_per_sm: int = 2  # split until decode programs >= this x SMs (or splits run out)
    graph_max_context: int | None = None  # fixed context bound for decode launch sizes (CUDA graphs)
    # Decode batches of at most this many sequences rotate in the decode launch (`rotates`): where it paid at the
    # Llama-3.1-8B shape on an H200 (bench/results/rope_in_decode_small_batches_ab_8b_*): FP8 steps 2.0% faster at
    # batch 1, even at 8 and 16, 0.7-0.9% slower at 32 and 64; W4A16 2.3% and 3.7% faster at 1 and 8, even at 16
    # and 32, 0.8% slower at 64 (and 3.8% slower at 512 with an FP8 cache: rope_in_decode_read_back_ab_8b_*).
    rotate_max_seqs: int = 8

    def __post_init__(self) -> None:
        for name in ("decode_block_n", "decode_fp8_block_n", "prefill_block_m", "prefill_block_n",
                     "prefill_fp8_block_m", "prefill_fp8_block_n", "prefill_crowded_block_m", "prefill_crowded_block_n",
                     "prefill_fp8_crowded_block_m", "prefill_fp8_crowded_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16 (tl.dot tile)")
        for name in ("min_split_tokens", "max_splits", "target_programs_per_sm", "rotate_max_seqs",
                     "decode_fp8_crowded_programs_per_sm", "decode_fp8_crowded_num_warps",
                     "decode_fp8_crowded_num_stages", "prefill_crowded_num_warps", "prefill_crowded_num_stages",
                     "prefill_fp8_crowded_num_warps", "prefill_fp8_crowded_num_stages", "prefill_crowded_rows_per_sm",
                     "prefill_crowded_max_tile_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.graph_max_context is not None and self.graph_max_context < 1:
            raise ValueError(f"graph_max_context={self.graph_max_context} must be at least 1 or None")

    def decode_tiles(self, fp8_cache: bool, programs_per_sm: float = 0.0) -> DecodeTiles:
        """The decode kernel's launch over a cache of FP8 or another dtype, of programs_per_sm programs an SM (its
        grid over the SMs). Its keys a tile do not depend on programs_per_sm (the split plan takes them)."""
        if not fp8_cache:
            return DecodeTiles(self.decode_block_n, self.decode_num_warps, self.decode_num_stages)
        if programs_per_sm >= self.decode_fp8_crowded_programs_per_sm:
            return DecodeTiles(self.decode_fp8_block_n, self.decode_fp8_crowded_num_warps,
                               self.decode_fp8_crowded_num_stages)
        return DecodeTiles(self.decode_fp8_block_n, self.decode_fp8_num_warps, self.decode_fp8_num_stages)

    def prefill_tiles(self, fp8_cache: bool, crowded: bool = False) -> PrefillTiles:
        """The prefill kernel's launch over a cache of FP8 or another dtype, crowded or not (`prefill_launch_tiles`)."""
        if fp8_cache and crowded:
            return PrefillTiles(self.prefill_fp8_crowded_block_m, self.prefill_fp8_crowded_block_n,
                                self.prefill_fp8_crowded_num_warps, self.prefill_fp8_crowded_num_stages)
        if fp8_cache:
            return PrefillTiles(self.prefill_fp8_block_m, self.prefill_fp8_block_n, self.prefill_fp8_num_warps,
                                self.prefill_fp8_num_stages)
        if crowded:
            return PrefillTiles(self.prefill_crowded_block_m, self.prefill_crowded_block_n,
                                self.prefill_crowded_num_warps, self.prefill_crowded_num_stages)
        return PrefillTiles(self.prefill_block_m, self.prefill_block_n, self.prefill_num_warps,
                            self.prefill_num_stages)

    def crowded_prefill_tokens(self, num_heads: int, num_sms: int) -> int:
        """The fewest new query tokens (of sequences with more than one) of a crowded prefill launch."""
        return _cdiv(self.prefill_crowded_rows_per_sm * num_sms, num_heads)

    def takes_crowded_prefill(self, group: int, fp8_cache: bool) -> bool:
        """Whether crowded prefill launches of this group over this cache take the crowded tiles: where these hold at
        most prefill_crowded_max_tile_tokens query tokens."""
        return self.prefill_tiles(fp8_cache, crowded=True).block_m // group <= self.prefill_crowded_max_tile_tokens


class PrefillTiles(NamedTuple):
    block_m: int  # rows (query tokens x group heads) a program
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int


class DecodeTiles(NamedTuple):
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int


def decode_split_plan(
    num_decode_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, config: TritonAttentionConfig,
    fp8_cache: bool = False,
) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode launch: enough programs to fill the device,
    splits of at least min_split_tokens keys, tokens_per_split a multiple of the decode tile's keys
    (`decode_tiles(fp8_cache)`), and num_splits * tokens_per_split >= max_context."""
    programs = max(1, num_decode_seqs * num_kv_heads)
    wanted = _cdiv(config.target_programs_per_sm * num_sms, programs)
    num_splits = max(1, min(wanted, _cdiv(max_context, config.min_split_tokens), config.max_splits))
    block_n = config.decode_tiles(fp8_cache)[0]
    tokens_per_split = _cdiv(_cdiv(max_context, num_splits), block_n) * block_n
    return _cdiv(max_context, tokens_per_split), tokens_per_split


def decode_launch_plan(
    num_decode_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, config: TritonAttentionConfig,
    fp8_cache: bool = False,
) -> tuple[int, int, DecodeTiles]:
    """(num_splits, tokens_per_split, tiles) of a decode launch: `decode_split_plan`'s split, then the tiles of a
    launch of that many programs an SM (`decode_tiles`)."""
    num_splits, tokens_per_split = decode_split_plan(num_decode_seqs, num_kv_heads, max_context, num_sms, config,
                                                     fp8_cache)
    programs_per_sm = num_decode_seqs * num_kv_heads * num_splits / num_sms
    return num_splits, tokens_per_split, config.decode_tiles(fp8_cache, programs_per_sm)


def prefill_launch_tiles(
    num_prefill_tokens: int, num_heads: int, num_kv_heads: int, num_sms: int, config: TritonAttentionConfig,
    fp8_cache: bool = False,
) -> PrefillTiles:
    """The tiles of a prefill launch over num_prefill_tokens new queries of sequences with more than one: the
    crowded ones from `crowded_prefill_tokens` on, where it `takes_crowded_prefill`."""
    crowded = (config.takes_crowded_prefill(num_heads // num_kv_heads, fp8_cache)
               and num_prefill_tokens >= config.crowded_prefill_tokens(num_heads, num_sms))
    return config.prefill_tiles(fp8_cache, crowded)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    return num_sms(device) or 8  # CPU (TRITON_INTERPRET=1 tests): any fixed figure


@register_backend
class TritonAttention:
    name: ClassVar[str] = "triton"
    supports_cpu: ClassVar[bool] = False  # runs on CPU tensors only under TRITON_INTERPRET=1 (tests)
    supports_cuda: ClassVar[bool] = HAS_TRITON
    supports_cuda_graphs: ClassVar[bool] = True  # decode-only batches, through `graph_mode`
    takes_stored_kv: ClassVar[bool] = True  # both launches read the step's K/V from the caches

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
        self.is_graph_mode = False  # set on the twins `graph_mode` returns
        self._workspace: torch.Tensor | None = None  # graph mode: the static split-K workspace

    def graph_mode(self, max_context: int, batch_sizes: Sequence[int], device: torch.device) -> TritonAttention:
        """A twin of this backend for CUDA graphs of decode-only batches of the given sizes whose
        contexts are at most `max_context` tokens (see the module docstring). The caller guarantees
        the context bound: the twin cannot check it without reading the device."""
        if max_context < 1 or not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(
                f"graph mode needs max_context >= 1 and batch sizes >= 1; got {max_context} and {list(batch_sizes)}"
            )
        twin = TritonAttention(self.spec, dataclasses.replace(self.config, graph_max_context=max_context))
        twin.is_graph_mode = True
        # NOTE: the cache's dtype is not known here: room for the larger workspace of either tile plan
        numel = max(twin._graph_workspace_numel(b, device, fp8) for b in batch_sizes for fp8 in (False, True))
        twin._workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
        return twin

    def _graph_split_plan(self, num_seqs: int, device: torch.device, fp8_cache: bool) -> tuple[int, int]:
        assert self.config.graph_max_context is not None
        return decode_split_plan(
            num_seqs, self.spec.num_kv_heads, self.config.graph_max_context, self._sms(device), self.config, fp8_cache
        )

    def _graph_workspace_numel(self, num_seqs: int, device: torch.device, fp8_cache: bool) -> int:
        num_splits, _ = self._graph_split_plan(num_seqs, device, fp8_cache)
        return self._kernels.decode_workspace_numel(num_seqs, self.spec.num_heads, num_splits, self.spec.head_dim)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: in the caches already
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if self.is_graph_mode:
            return self._forward_graph(q, k, v, k_cache, v_cache, meta)
        # NOTE: k and v may be strided views of a fused qkv projection: the kernels take row strides.
        self._kernels.check_dtype("q", q)
        if k is not None:
            self._kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = meta.query_start_loc
        decode_lens = [n for i, n in enumerate(meta.seq_lens) if starts[i + 1] - starts[i] == 1]
        num_decode = len(decode_lens)
        cfg, spec = self.config, self.spec
        tensors = (meta.block_tables_tensor, meta.seq_lens_tensor, meta.query_start_loc_tensor)
        if num_decode:
            self._decode(q, k_cache, v_cache, out, meta, num_decode, max(decode_lens))
        if num_decode < meta.num_seqs:
            tiles = prefill_launch_tiles(starts[-1] - num_decode, spec.num_heads, spec.num_kv_heads,
                                         self._sms(q.device), cfg, k_cache.dtype == torch.float8_e4m3fn)
            self._prefill.prefill_attention(
                q, k_cache, v_cache, out, *tensors, scale=spec.scale, sliding_window=spec.sliding_window,
                **tiles._asdict(),
            )
        return out

    def _forward_graph(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Graph mode: store the new K/V, then one decode launch sized by the batch size alone."""
        num_seqs = meta.num_seqs
        if q.shape[0] != num_seqs or meta.max_query_len != 1:
            raise ValueError(
                f"graph mode runs decode-only batches (one query per sequence); got {q.shape[0]} queries "
                f"for {num_seqs} sequences"
            )
        # NOTE: k and v may be strided views of a fused qkv projection: the kernels take row strides.
        self._kernels.check_dtype("q", q)
        if k is not None:
            self._kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        bound = self.config.graph_max_context
        assert bound is not None  # graph mode's twin has one (graph_mode)
        self._decode(q, k_cache, v_cache, out, meta, num_seqs, bound)
        return out

    def crowded_decode_seqs(self, device: torch.device) -> int | None:
        """The fewest decoding sequences whose launch, its keys whole, is crowded (`decode_tiles`)."""
        return _cdiv(self.config.decode_fp8_crowded_programs_per_sm * self._sms(device), self.spec.num_kv_heads)

    def crowded_prefill_tokens(self, device: torch.device) -> int | None:
        """The fewest new prompt tokens of a crowded launch (`prefill_launch_tiles`), None where the crowded tiles
        serve neither cache dtype at this group."""
        group = self.spec.num_heads // self.spec.num_kv_heads
        if not any(self.config.takes_crowded_prefill(group, fp8) for fp8 in (False, True)):
            return None
        return self.config.crowded_prefill_tokens(self.spec.num_heads, self._sms(device))

    def rotates(self, meta: AttentionMetadata) -> bool:
        """forward_rotated serves a decode batch of at most config.rotate_max_seqs sequences, a row each (not a
        graph's rows of one sequence: a row's keys stored by another row's program would race), of a power-of-two
        head_dim of at least 16 (the kernel's rotation works on whole tiles)."""
        dim = self.spec.head_dim
        return (meta.max_query_len == 1 and not meta.rows_share_sequences
                and meta.num_seqs <= self.config.rotate_max_seqs and dim >= 16 and dim & (dim - 1) == 0)

    def forward_rotated(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence, not yet rotated
        rotation: DecodeRotation,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A decode-only batch in one launch (plus its split reduce): the queries rotated, the new K/V rotated and
        stored by the decode kernel (the rotary kernel's launch saved); sized as `forward` or, in graph mode,
        `_forward_graph` sizes it."""
        num_seqs = meta.num_seqs
        if q.shape[0] != num_seqs or meta.max_query_len != 1 or meta.rows_share_sequences:
            raise ValueError(f"forward_rotated takes decode-only batches, one query per sequence and no two rows of "
                             f"one sequence; got {q.shape[0]} queries for {num_seqs} sequences, rows_share_sequences="
                             f"{meta.rows_share_sequences}")
        self._kernels.check_dtype("q", q)
        # NOTE: q is a strided view of qkv; the output is contiguous
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._decode(q, k_cache, v_cache, out, meta, num_seqs, max(meta.seq_lens), rotation)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
        meta: AttentionMetadata, num_seqs: int, max_context: int, rotation: DecodeRotation | None = None,
    ) -> None:
        """The decode launch (and its reduce) of a batch's num_seqs decoding sequences, split as a context of
        `_decode_context(max_context)` needs (graph mode: graph_max_context, over its static workspace);
        `rotation`: the rotating launch of forward_rotated."""
        cfg, spec = self.config, self.spec
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        num_splits, tokens_per_split, tiles = decode_launch_plan(
            num_seqs, spec.num_kv_heads, self._decode_context(max_context), self._sms(q.device), cfg, fp8
        )
        self._kernels.decode_attention(
            q, k_cache, v_cache, out, meta.block_tables_tensor, meta.seq_lens_tensor, meta.query_start_loc_tensor,
            scale=spec.scale, sliding_window=spec.sliding_window,
            num_splits=num_splits, tokens_per_split=tokens_per_split, max_splits=cfg.max_splits,
            block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages, workspace=self._workspace,
            rotation=rotation, slot_mapping=None if rotation is None else meta.slot_mapping,
        )  # fmt: skip

    def _decode_context(self, max_context: int) -> int:
        """The context a decode launch is sized for: the batch's longest, or graph_max_context where set (which
        it may not exceed)."""
        bound = self.config.graph_max_context
        if bound is None:
            return max_context
        if max_context > bound:
            raise ValueError(f"a decode context of {max_context} tokens exceeds graph_max_context={bound}")
        return bound

    def _sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = _num_sms(device)
        return self._num_sms[device]
