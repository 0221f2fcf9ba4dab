"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

Module names equal Hugging Face's, so a checkpoint's tensors load by name. Tokens of all
sequences in a step are concatenated ([num_tokens, hidden]); attention over the paged cache is
the backend's business. Knows nothing of scheduling or sampling.

Tensor parallelism (`tp`, engine/parallel/): each rank builds its part (engine/parallel/shard.py)
and marks each sharded parameter with its `Shard` of the checkpoint tensor, which the loaders read
alone. qkv and gate/up are column-parallel, o_proj and down_proj row-parallel (each followed by an
all-reduce, then the bias), the lm_head vocabulary-parallel (logits all-gathered, every rank gets the full
row). Rank 0 holds the whole embedding and looks every token up; the other ranks add zeros to its rows in the
first all-reduce, so they need no token ids: a step's tokens still on rank 0's device stay there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, DecodeRotation
from engine.models.arch import ArchConfig
from engine.models.fused_ops import DecoderOps, KVStore, rms_norm_ref, takes_fp8
from engine.models.rope import RotaryEmbedding
from engine.parallel import PartialSum, Shard, TensorParallel, TPShard, local_arch
from engine.quant.fp8 import Fp8Path, QuantizedRows
from engine.quant.convert import set_int4_words
from engine.quant.int4 import Int4Path


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalize in float32, cast back, then scale: transformers' order, for equal outputs.
        return rms_norm_ref(x, self.weight, self.eps)


def fused_linears(owner: nn.Module, name: str, parts: dict[str, int], in_features: int, bias: bool) -> None:
    """nn.Linear modules `parts` (name -> out_features) whose weights (and biases) are row slices
    of one tensor, buffer `<name>_weight` (`<name>_bias`): checkpoints load by the parts' names,
    the forward multiplies once. The parts are views, so nothing is stored twice."""
    total = sum(parts.values())
    owner.register_buffer(f"{name}_weight", torch.empty(total, in_features), persistent=False)
    owner.register_buffer(f"{name}_bias", torch.zeros(total) if bias else None, persistent=False)
    owner.register_buffer(f"{name}_weight_scale", None, persistent=False)  # FP8: engine/quant/convert.py
    start = 0
    for part, rows in parts.items():
        linear = nn.Linear(in_features, rows, bias=bias, device="meta")
        linear.weight = nn.Parameter(getattr(owner, f"{name}_weight")[start : start + rows])
        if bias:
            linear.bias = nn.Parameter(getattr(owner, f"{name}_bias")[start : start + rows])
        setattr(owner, part, linear)
        start += rows


def linear_layer(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """An nn.Linear with a `weight_scale` buffer: None, or its FP8 weight's scales (engine/quant/)."""
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.register_buffer("weight_scale", None, persistent=False)
    return linear


def row_parallel(linear: nn.Linear, x: torch.Tensor | QuantizedRows, ops: DecoderOps,
                 tp: TensorParallel | None) -> torch.Tensor:
    """linear(x) where each rank holds some of linear's input columns: partial sums, all-reduced,
    then the bias once."""
    if tp is None:
        return ops.linear(x, linear.weight, linear.weight_scale, linear.bias)
    if linear.bias is None and ops.triton:  # NOTE: maybe a PartialSum: the norm after it sums it (add_norm)
        # one 16-bit row goes into the peers' buffers as it is made (an FP8 or 4-bit weight's dtype is not x's)
        pushed = tp.group.product_later(x, linear.weight) if isinstance(x, torch.Tensor) else None
        if pushed is not None:
            return pushed
        return tp.group.all_reduce_later(ops.linear(x, linear.weight, linear.weight_scale, None))
    partial = ops.linear(x, linear.weight, linear.weight_scale, None)
    out = tp.group.all_reduce(partial)
    return out if linear.bias is None else out + linear.bias


def add_norm(ops: DecoderOps, x: torch.Tensor | PartialSum, residual: torch.Tensor | None, norm: RMSNorm,
             into: torch.Tensor | None = None) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """ops.add_rms_norm, or for a row-parallel projection's PartialSum its all-reduce and the norm in one
    kernel (engine/parallel/symm_kernels.py)."""
    if isinstance(x, PartialSum):
        return x.group.add_rms_norm(x, residual, norm.weight, norm.eps, takes_fp8(into))
    return ops.add_rms_norm(x, residual, norm.weight, norm.eps, into=into)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        hidden = arch.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        fused_linears(self, "qkv", parts, hidden, arch.qkv_bias)
        self.o_proj = linear_layer(self.q_size, hidden, arch.o_bias)
        self.qk_norm = arch.qk_norm
        self.eps = arch.rms_norm_eps
        # (k_scale, v_scale) of an FP8 cache that holds K / k_scale and V / v_scale (engine/quant/kv_scales.py);
        # None: the cache holds K and V as they are
        self.kv_scales: tuple[float, float] | None = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | QuantizedRows,  # [tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: DecoderOps,
        tp: TensorParallel | None,
    ) -> torch.Tensor:
        qkv = ops.linear(x, self.qkv_weight, self.qkv_weight_scale, self.qkv_bias)  # [tokens, q_size + 2 * kv_size]
        tokens = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        k_scale, v_scale = self.kv_scales or (1.0, 1.0)
        # NOTE: the Triton path stores k and v (scaled) in the rotary launch: the backend stores nothing then
        store = (KVStore(v, kv_cache[0], kv_cache[1], meta.slot_mapping, k_scale, v_scale)
                 if ops.triton and backend.takes_stored_kv else None)
        if store is not None and not self.qk_norm and backend.rotates(meta):
            # NOTE: a decode batch, a row a sequence: its decode launch rotates and stores too (a launch less a layer)
            rotation = DecodeRotation(cos, sin, qk[:, self.num_heads:], v, k_scale, *store.inverses())
            out = backend.forward_rotated(qk[:, : self.num_heads], rotation, kv_cache[0], kv_cache[1], meta)
        else:
            q, k = ops.norm_rope_qk(qk, self.num_heads, cos, sin, self.q_norm.weight if self.qk_norm else None,
                                    self.k_norm.weight if self.qk_norm else None, self.eps, store)
            if store is not None:
                k = v = None  # NOTE: in the caches already
            elif self.kv_scales is not None:
                k, v = k / k_scale, v / v_scale
            # NOTE: with scales q . k unchanged, the output of the values' sums scaled back (below)
            out = backend.forward(q if self.kv_scales is None else q * k_scale, k, v, kv_cache[0], kv_cache[1], meta)
        if self.kv_scales is not None:
            out = out * v_scale
        return row_parallel(self.o_proj, out.reshape(tokens, self.q_size), ops, tp)


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hidden, inter = arch.hidden_size, arch.intermediate_size
        fused_linears(self, "gate_up", {"gate_proj": inter, "up_proj": inter}, hidden, arch.mlp_bias)
        self.down_proj = linear_layer(inter, hidden, arch.mlp_bias)

    def forward(self, x: torch.Tensor | QuantizedRows, ops: DecoderOps, tp: TensorParallel | None) -> torch.Tensor:
        gate_up = ops.linear(x, self.gate_up_weight, self.gate_up_weight_scale, self.gate_up_bias)
        return row_parallel(self.down_proj, ops.silu_and_mul(gate_up, into=self.down_proj.weight), ops, tp)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(  # type: ignore[no-untyped-def]
        self, x, residual, cos_sin, kv_cache, meta, backend, ops: DecoderOps, tp: TensorParallel | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to residual (None before the first layer).
        Returns this layer's (output, residual); the sum of the two is transformers' hidden state."""
        h, residual = add_norm(ops, x, residual, self.input_layernorm, into=self.self_attn.qkv_weight)
        x = self.self_attn(h, cos_sin, kv_cache, meta, backend, ops, tp)
        h, residual = add_norm(ops, x, residual, self.post_attention_layernorm, into=self.mlp.gate_up_weight)
        return self.mlp(h, ops, tp), residual


class LlamaBody(nn.Module):
    def __init__(self, arch: ArchConfig, vocab_rows: int) -> None:
        """arch: this rank's shapes (local_arch); vocab_rows: its rows of the embedding."""
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_rows, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.rope, arch.head_dim)


class LlamaForCausalLM(nn.Module):
    """One class for the family; `ArchConfig` switches qkv bias, q/k norm and rope scaling.
    `tp`: this rank's part of a tensor-parallel model (None: the whole model)."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.arch = arch  # the whole model's
        self.tp = tp if tp is not None and tp.shard.size > 1 else None
        shard = self.tp.shard if self.tp is not None else TPShard(0, 1)
        self.local_arch = local = local_arch(arch, shard)
        self.vocab_range = shard.vocab(arch.vocab_size)
        vocab_rows = self.vocab_range[1] - self.vocab_range[0]
        # NOTE: rank 0 embeds every token (a whole table); another rank holds its rows only for a tied lm_head
        self.embeds = shard.rank == 0
        table_rows = arch.vocab_size if self.embeds else vocab_rows if arch.tie_word_embeddings else 0
        self.model = LlamaBody(local, table_rows)
        self.lm_head = nn.Linear(arch.hidden_size, vocab_rows, bias=False)
        if arch.tie_word_embeddings:
            table = self.model.embed_tokens.weight  # rank 0's vocabulary rows [0, vocab_rows) lead its table
            self.lm_head.weight = table if table.shape[0] == vocab_rows else nn.Parameter(table[:vocab_rows])
        # set when the projections are FP8 or 4-bit (engine/quant/convert.py)
        self.fp8_path: Fp8Path | None = None
        self.int4_path: Int4Path | None = None
        self.ops = DecoderOps(triton=False)  # `use_fused_ops` switches to the Triton kernels
        if self.tp is not None:
            self._mark_shards(shard)

    def _mark_shards(self, shard: TPShard) -> None:
        """Each sharded parameter's `shard`: its slice of the checkpoint tensor (what loaders read)."""
        arch, d = self.arch, self.arch.head_dim
        q0, q1 = shard.heads(arch)
        k0, k1 = shard.kv_heads(arch)
        i0, i1 = shard.rows(arch.intermediate_size)
        rows = {"q_proj": Shard(0, q0 * d, q1 * d, arch.num_heads * d),
                "k_proj": Shard(0, k0 * d, k1 * d, arch.num_kv_heads * d),
                "v_proj": Shard(0, k0 * d, k1 * d, arch.num_kv_heads * d),
                "gate_proj": Shard(0, i0, i1, arch.intermediate_size),
                "up_proj": Shard(0, i0, i1, arch.intermediate_size)}
        columns = {"o_proj": Shard(1, q0 * d, q1 * d, arch.num_heads * d),
                   "down_proj": Shard(1, i0, i1, arch.intermediate_size)}
        for name, module in self.named_modules():
            part = name.rsplit(".", 1)[-1]
            if part in rows:
                module.weight.shard = rows[part]
                if module.bias is not None:
                    module.bias.shard = rows[part]
            elif part in columns:
                module.weight.shard = columns[part]  # NOTE: the bias is whole: added once, after the all-reduce
        v0, v1 = self.vocab_range
        if not self.embeds:  # NOTE: no rows (an empty slice) unless a tied lm_head reads them
            table = self.model.embed_tokens.weight
            table.shard = Shard(0, v0, v0 + table.shape[0], arch.vocab_size)
        self.lm_head.weight.shard = Shard(0, v0, v1, arch.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor | PartialSum:
        """The token embeddings; with tensor parallelism rank 0's lookup and the other ranks' zeros, summed (or a
        PartialSum the first layer's norm sums, as row_parallel leaves): the other ranks read no input_ids."""
        if self.embeds:
            x = self.model.embed_tokens(input_ids)
        else:
            weight = self.model.embed_tokens.weight
            x = torch.zeros(input_ids.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
        if self.tp is None:
            return x
        return self.tp.group.all_reduce_later(x) if self.ops.triton else self.tp.group.all_reduce(x)

    def set_kv_scales(self, scales: Sequence[tuple[float, float]] | None) -> None:
        """Each layer's (k_scale, v_scale) of an FP8 cache (None: a unit scale)."""
        if scales is not None and len(scales) != len(self.model.layers):
            raise ValueError(f"{len(scales)} KV-cache scales for {len(self.model.layers)} layers")
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_scales = None if scales is None else tuple(scales[i])

    def use_fused_ops(self, enabled: bool) -> None:
        """Triton kernels for RMSNorm (+ residual), q/k norm + rotary, SwiGLU and the quantized
        projections': CUDA only. 4-bit weights move to the layout their kernel reads (or back)."""
        self.ops = DecoderOps(triton=enabled, fp8_path=self.fp8_path, int4_path=self.int4_path)
        if self.int4_path is not None:
            set_int4_words(self, self.ops.int4.words)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]
        positions: torch.Tensor,  # [tokens]
        kv_caches: torch.Tensor,  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # hidden states [tokens, hidden]
        x = self.embed(input_ids)
        cos_sin = self.model.rotary_emb.cos_sin(positions, self.model.embed_tokens.weight.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos_sin, kv_caches[i], meta, backend, self.ops, self.tp)
        return add_norm(self.ops, x, residual, self.model.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        logits = self.ops.linear(hidden, self.lm_head.weight, None, None)
        if self.tp is not None:
            logits = self.tp.group.all_gather(logits, dim=-1)[:, : self.arch.vocab_size]
        return logits.float()
