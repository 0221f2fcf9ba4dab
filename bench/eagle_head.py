"""An EAGLE-1 draft head (Li et al., 2024) for a TrainLlama target, and its training (lab only; an
EAGLE proposer in the engine lost to the draft model and was deleted: README). `save_head` writes
the EAGLE-1 layout (a one-layer Llama config.json and safetensors) that bench.eagle_lab --head reads.

The head is one Llama decoder layer without its input norm (EAGLE-1 drops the first layer's). At
index j it reads fc([embed(x_{j+1}), h_j]): the next token's embedding (the target's table) beside
h_j, the target's last hidden state at j after its final norm (`features`: what the target's lm_head
reads), and outputs f_j, its guess of h_{j+1}, which the target's lm_head (frozen, shared) turns into
the distribution of x_{j+2} (`logits`). Drafting d_2 .. d_K feeds the head its own f in place of h,
so it is trained as it drafts (EAGLE-3's training-time test): step s of the unrolled training reads
step s-1's outputs shifted by one, and its attention sees what decoding would show it: keys of true
features up to the chain's start, then one key from each earlier step (ttt_mask).
Loss: KL(target || head) over the full next-token distribution at temperature 1, every step.

Checkpoint (`save_head`, `load_head`): config.json (a Llama config of one layer, architectures
["LlamaForCausalLM"], plus the target it was trained on) and model.safetensors with `fc.weight` and
`layers.0.*` in transformers' Llama names, float32: the layout EAGLE-1 heads are published in. The
target's embedding, final norm and lm_head are not in it (shared); layers.0.input_layernorm.weight is
saved and read by no one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from bench.train_llama import RMS_NORM_EPS, ROPE_THETA, DecoderLayer, ModelShape, TrainLlama

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [batch, kv_heads, seq, head_dim]


def ttt_mask(seq: int, step: int, device: torch.device) -> torch.Tensor:
    """[seq, step * seq] bool: which keys query j of unrolled step `step` (1-based) may read, the keys
    being step 1's, then step 2's, ... then its own. Decoding draft d_s from a chain started at index
    c = j - s + 1, it sees step 1's keys at indices <= c (true features) and step k's key at c + k - 1."""
    j = torch.arange(seq, device=device)[:, None]
    i = torch.arange(seq, device=device)[None, :]
    blocks = [i <= j - step + 1] + [i == j - step + k for k in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


class EagleHead(nn.Module):
    def __init__(self, target: TrainLlama, seed: int) -> None:
        super().__init__()
        t = target.shape
        self.shape = ModelShape(t.hidden_size, t.intermediate_size, 1, t.num_heads, t.num_kv_heads, t.head_dim)
        self.fc = nn.Linear(2 * t.hidden_size, t.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(self.shape)])  # NOTE: a list of one: Llama's tensor names
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not name.endswith("norm.weight"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        # NOTE: a plain attribute, not a submodule: the target is frozen and saved apart.
        self.__dict__["target"] = target

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]  # type: ignore[return-value]

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's last hidden states (TrainLlama.hidden, before its final norm) as the head reads
        them: after that norm."""
        return self.target.model.norm(hidden)

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """The head's outputs' logits: the target's lm_head, no norm before it."""
        return self.target.lm_head(f)

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(x_{j+1}), h_j]): [batch, seq] tokens, [batch, seq, hidden] features."""
        emb = self.target.model.embed_tokens(tokens).to(features.dtype)
        return self.fc(torch.cat((emb, features), dim=-1))

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[KV] | None,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """The decoder layer over x [batch, seq, hidden]; its attention reads `keys` (earlier steps'),
        then its own, under `mask` (None: causal over its own only). Returns the output and its KV."""
        layer, shape = self.layer, self.shape
        attn = layer.self_attn
        batch, seq, _ = x.shape
        q, k, v = attn.project(x, cos, sin)  # NOTE: no input norm (EAGLE-1)
        all_k = torch.cat([kk for kk, _ in keys or []] + [k], dim=2)
        all_v = torch.cat([vv for _, vv in keys or []] + [v], dim=2)
        group = shape.num_heads // shape.num_kv_heads
        all_k, all_v = all_k.repeat_interleave(group, dim=1), all_v.repeat_interleave(group, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, all_k, all_v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, seq, shape.num_heads * shape.head_dim))
        return x + layer.mlp(layer.post_attention_layernorm(x)), (k, v)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Causal over one sequence of (x_{j+1}, feature_j) pairs: [batch, seq] -> f [batch, seq, hidden]."""
        x = self.inputs(tokens, features)
        cos, sin = self.target.rope(torch.arange(tokens.shape[1], device=tokens.device), x.dtype)
        return self.attend(x, cos, sin, None, None)[0]

    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: `steps` passes over [batch, seq]; pass s > 1 reads pass s-1's outputs
        shifted right by one (its index 0 keeps the true feature: its loss is masked). Returns each
        pass's f [batch, seq, hidden]."""
        seq = tokens.shape[1]
        cos, sin = self.target.rope(torch.arange(seq, device=tokens.device), features.dtype)
        keys: list[KV] = []
        outs: list[torch.Tensor] = []
        feats = features
        for step in range(1, steps + 1):
            x = self.inputs(tokens, feats)
            mask = ttt_mask(seq, step, tokens.device)
            f, kv = self.attend(x, cos, sin, keys, mask)
            keys.append(kv)
            outs.append(f)
            feats = torch.cat((features[:, :1], f[:, :-1].to(features.dtype)), dim=1)
        return outs


def head_loss(head: EagleHead, target: TrainLlama, steps: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mean over the unrolled steps of KL(target || head) per token, on [batch, seq + 1] windows:
    step s at index j drafts x_{j+2} from a chain started at j - s + 1, so indices j < s - 1 are left out."""

    def loss(window: torch.Tensor) -> torch.Tensor:
        inputs = window[:, :-1]
        seq = inputs.shape[1]
        with torch.no_grad():
            h = target.hidden(inputs)  # [batch, seq, hidden]
            target_logp = F.log_softmax(target.logits(h).float(), dim=-1)  # p_j: the distribution of x_{j+1}
            feats = head.features(h)
        outs = head.unrolled(inputs[:, 1:], feats[:, : seq - 1], steps)  # index j: (x_{j+1}, h_j) -> x_{j+2}
        total = torch.zeros((), device=window.device)
        for step, f in enumerate(outs, start=1):
            logp = F.log_softmax(head.logits(f[:, step - 1 :]).float(), dim=-1).flatten(0, 1)
            ref = target_logp[:, step:].flatten(0, 1)
            total = total + F.kl_div(logp, ref, log_target=True, reduction="batchmean")
        return total / steps

    return loss


def head_config(head: EagleHead, unroll: int) -> dict:
    target, shape = head.target, head.shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "vocab_size": target.lm_head.weight.shape[0],
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
        "eagle": {"version": 1, "training_unroll": unroll, "target_num_hidden_layers": target.shape.num_layers},
    }


def save_head(out: Path, head: EagleHead, unroll: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head_config(head, unroll), indent=2) + "\n")
    tensors = {name: t.detach().float().cpu().contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_head(head_dir: Path, target: TrainLlama) -> EagleHead:
    """The head `save_head` wrote, for `target` (which must be the one it read: same hidden size, layer
    count and vocabulary), in eval mode, on the target's device."""
    config = json.loads((head_dir / "config.json").read_text())
    expected = {"hidden_size": target.shape.hidden_size, "vocab_size": target.lm_head.weight.shape[0],
                "target_num_hidden_layers": target.shape.num_layers}
    found = {**config, **config.get("eagle", {})}
    for key, value in expected.items():
        if found.get(key) != value:
            raise ValueError(f"{head_dir}/config.json: {key} is {found.get(key)}, the target's is {value}: "
                             "this head was trained on another target")
    head = EagleHead(target, seed=0)
    head.load_state_dict(load_file(str(head_dir / "model.safetensors")))
    return head.to(target.lm_head.weight.device).eval()
