"""An EAGLE-1 draft head (Li et al., 2024): one Llama decoder layer that drafts from the target's
hidden states instead of running a model of its own.

At head position j it reads fc([embed(x_{j+1}), h_j]): the next token's embedding (the target's
table) beside h_j, the target's last hidden state at position j (after its final norm, what the
target's lm_head reads). Its decoder layer has no input norm (EAGLE-1 drops the first layer's), and
its output f_j, a guess of h_{j+1}, goes through the target's lm_head to the distribution of
x_{j+2}. Drafting further feeds the head its own f in place of h.

Checkpoint: a directory with config.json (a Llama config of one decoder layer whose hidden_size and
vocab_size are the target's) and safetensors holding fc.weight [hidden, 2 * hidden] (fc.bias if it has
one) and layers.0's attention, MLP and post_attention_layernorm weights in transformers' Llama names,
with or without a `model.` prefix: the layout EAGLE-1 heads are published in and what
bench/eagle_head.py saves. Not read: layers.0.input_layernorm, embed_tokens and lm_head (the
target's serve).

The head's forward has the target model's signature (ids, positions, KV, metadata, backend), so a
ModelRunner and its CUDA graphs run it as they run a model: its features are the rows of `features`,
a static buffer the proposer fills before each forward (row i feeds the forward's i-th token).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models import ArchConfig, LlamaForCausalLM
from engine.models.arch import arch_from_dict
from engine.models.fused_ops import DecoderOps
from engine.models.llama import DecoderLayer, add_norm
from engine.models.loader import CheckpointReader, copy_checked, init_dummy_weights, safetensors_files
from engine.models.rope import RotaryEmbedding

_NOT_READ = ("layers.0.input_layernorm.weight", "embed_tokens.weight", "lm_head.weight")


class EagleHead(nn.Module):
    def __init__(self, arch: ArchConfig, target: LlamaForCausalLM, fc_bias: bool, max_rows: int) -> None:
        """arch: the head's (one layer); max_rows: the most tokens one forward feeds."""
        super().__init__()
        self.arch = arch
        hidden = arch.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(arch)])  # NOTE: a list of one: the checkpoint's names
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1's first layer has none
        self.rotary_emb = RotaryEmbedding(arch.rope, arch.head_dim)
        self.register_buffer("features", torch.zeros(max_rows, hidden), persistent=False)
        self.ops = DecoderOps(triton=False)
        # NOTE: a plain attribute, not a submodule: the target's weights are not the head's.
        self.__dict__["target"] = target

    @property
    def lm_head(self) -> nn.Linear:
        """The target's (the graphs size their output by it)."""
        return self.target.lm_head

    def use_fused_ops(self, enabled: bool) -> None:
        self.ops = DecoderOps(triton=enabled)

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens]: x_{j+1} at head position j
        positions: torch.Tensor,  # [tokens]: j
        kv_caches: torch.Tensor,  # [1, 2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # f [tokens, hidden]
        n = input_ids.shape[0]
        if n > self.features.shape[0]:
            raise ValueError(f"an EAGLE head forward of {n} tokens; its feature buffer holds {self.features.shape[0]}")
        emb = self.target.embed(input_ids)
        x = self.fc(torch.cat((emb.to(self.features.dtype), self.features[:n]), dim=-1))
        layer = self.layers[0]
        cos_sin = self.rotary_emb.cos_sin(positions, x.dtype)
        attn = layer.self_attn(x, cos_sin, kv_caches[0], meta, backend, self.ops, None)
        h, residual = add_norm(self.ops, attn, x, layer.post_attention_layernorm, into=layer.mlp.gate_up_weight)
        return layer.mlp(h, self.ops, None) + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32
        """The target's logits of f [rows, hidden]; f also becomes the next forward's features (row i
        feeds its i-th token): a drafting pass's f is what the next pass reads, so the passes chain on
        the device, inside a CUDA graph too (engine/spec/draft_loop.py runs the head as a model)."""
        self.features[: hidden.shape[0]].copy_(hidden)
        return self.target.compute_logits(hidden)


def load_eagle_head(head_dir: Path, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device,
                    load_format: str, seed: int, max_rows: int) -> EagleHead:
    """The head of `head_dir` for `target`, in `dtype` on `device`; ValueError when it cannot draft
    for the target (another hidden size or vocabulary, more than one layer, a tensor missing)."""
    path = head_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json is missing from the EAGLE head directory {str(head_dir)!r}")
    raw = json.loads(path.read_text())
    raw.setdefault("architectures", ["LlamaForCausalLM"])
    arch = arch_from_dict(raw, str(path))
    t = target.arch
    for field, ours, theirs in (("num_hidden_layers", arch.num_layers, 1), ("hidden_size", arch.hidden_size,
                                t.hidden_size), ("vocab_size", arch.vocab_size, t.vocab_size)):
        if ours != theirs:
            raise ValueError(f"{path}: {field} is {ours}; an EAGLE head for this target needs {theirs} "
                             "(one decoder layer on the target's hidden states and vocabulary)")
    files = [] if load_format == "dummy" else safetensors_files(head_dir)
    reader = CheckpointReader(files)
    try:
        names = {n.removeprefix("model."): n for n in reader.names()}
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                head = EagleHead(arch, target, "fc.bias" in names, max_rows)
        finally:
            torch.set_default_dtype(previous)
        if load_format == "dummy":
            init_dummy_weights(head, seed)  # type: ignore[arg-type]
            return head
        params = dict(head.named_parameters())
        loaded: set[str] = set()
        for name, stored in names.items():
            if name in params:
                copy_checked(params[name], reader.tensor(stored), reader.where(stored), str(path), dtype, device)
                loaded.add(name)
            elif name not in _NOT_READ:
                raise ValueError(f"{reader.where(stored)} is not a tensor of a one-layer EAGLE-1 head "
                                 f"(expected fc.* and layers.0.*)")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"EAGLE head {str(head_dir)!r} lacks tensors: {', '.join(missing)}")
    finally:
        reader.close()
    return head


__all__ = ["EagleHead", "load_eagle_head"]
