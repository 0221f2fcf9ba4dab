"""A Llama decoder for training, in plain torch, and its two training loops: next-token
cross-entropy (the target) and distillation by KL(target || draft) (the draft).

Parameter names and [out, in] shapes are Hugging Face's `LlamaForCausalLM`'s, so the state dict
saves as a checkpoint that transformers and the engine load by name. The forward is dense and
causal over [batch, seq] windows: no KV cache, no paged attention (the engine's model needs both;
this one never serves). Knows nothing of tokenizers, corpora or files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5


@dataclass(frozen=True)
class ModelShape:
    """The shape of one Llama decoder; vocab_size comes from the tokenizer."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def hf_config(self, vocab_size: int, bos_id: int, eos_id: int, max_positions: int) -> dict:
        """config.json of a transformers `LlamaForCausalLM` of this shape (float32 weights)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": max_positions,
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "initializer_range": INIT_STD,
        }


# ---- the model: module names are transformers' (model.layers.N.self_attn.q_proj, ...)
class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalize in float32, cast back, then scale: transformers' order, for equal logits.
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        hidden = shape.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [batch, heads or kv_heads, seq, head_dim] of x [batch, seq, hidden], q and k rotated
        (cos, sin: [seq, head_dim])."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: [batch, seq, hidden]; cos, sin: [seq, head_dim]
        q, k, v = self.project(x, cos, sin)
        if self.num_kv_heads != self.num_heads:  # q head h reads kv head h // group, as transformers' repeat_kv
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, seq, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, shape: ModelShape, vocab_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)


class TrainLlama(nn.Module):
    def __init__(self, shape: ModelShape, vocab_size: int, seed: int) -> None:
        super().__init__()
        self.shape = shape
        self.model = _Body(shape, vocab_size)
        self.lm_head = nn.Linear(shape.hidden_size, vocab_size, bias=False)
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2]
        self._init_weights(seed)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _init_weights(self, seed: int) -> None:
        """Normal(0, 0.02); the residual outputs (o_proj, down_proj) scaled by 1/sqrt(2 * layers), as GPT-2."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = INIT_STD / math.sqrt(2 * self.shape.num_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
                    param.copy_(torch.randn(param.shape, generator=gen) * std)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(positions), head_dim] of the given positions, computed in float32 as transformers does."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] -> the last layer's output [batch, seq, hidden], before the final norm."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(torch.arange(input_ids.shape[1], device=input_ids.device), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [batch, seq] -> logits [batch, seq, vocab]
        return self.logits(self.hidden(input_ids))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """transformers' tensor names, float32, contiguous, on the CPU: ready for safetensors."""
        return {name: t.detach().float().cpu().contiguous() for name, t in self.state_dict().items()}


# ---- training
@dataclass(frozen=True)
class TrainConfig:
    max_steps: int
    max_seconds: float  # wall-clock bound; the schedule runs on whichever bound is nearer
    batch_size: int
    seq_len: int
    lr: float
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    log_every: int = 50


@dataclass(frozen=True)
class TrainResult:
    num_steps: int
    num_tokens: int
    seconds: float
    final_loss: float  # the last step's training loss
    stopped_by: str  # "steps" or "time": which bound ended the training

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)


class Windows:
    """Random [batch, seq_len + 1] windows of a packed token stream (sequence packing: documents
    concatenated, each opened by BOS, cut at any offset)."""

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int, device: torch.device) -> None:
        if stream.numel() < seq_len + 2:
            raise ValueError(
                f"training stream has {stream.numel()} tokens; seq_len {seq_len} needs at least {seq_len + 2}"
            )
        self.stream, self.seq_len = stream.to(device), seq_len  # NOTE: on the device once, gathered there
        self.offsets = torch.arange(seq_len + 1, device=device)
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, batch_size: int) -> torch.Tensor:  # [batch, seq_len + 1]
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (batch_size,), generator=self.gen)
        return self.stream[starts.to(self.stream.device)[:, None] + self.offsets[None, :]]


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine down to min_lr_fraction of the peak; progress in [0, 1]."""
    if progress < cfg.warmup_fraction:
        return cfg.lr * progress / cfg.warmup_fraction
    decay = (progress - cfg.warmup_fraction) / (1.0 - cfg.warmup_fraction)
    floor = cfg.lr * cfg.min_lr_fraction
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(decay, 1.0)))


def _optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    matrices = [p for n, p in model.named_parameters() if p.ndim >= 2]
    vectors = [p for n, p in model.named_parameters() if p.ndim < 2]  # norms: no weight decay
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _autocast(device: torch.device) -> torch.autocast:
    # bf16 on the GPU; float32 on the CPU, where bf16 matmuls are slower on most cores
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def run_training(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],  # [batch, seq_len + 1] window -> scalar loss
    windows: Windows,
    cfg: TrainConfig,
    device: torch.device,
    label: str,
    log: Callable[[str], None],
) -> TrainResult:
    """AdamW with warm-up and cosine decay, stopped at max_steps or max_seconds, whichever first."""
    optimizer = _optimizer(model, cfg, device)
    model.train()
    start = time.perf_counter()
    step, stopped_by = 0, "steps"
    while step < cfg.max_steps:
        elapsed = time.perf_counter() - start
        progress = max(step / cfg.max_steps, elapsed / cfg.max_seconds)
        if progress >= 1.0:
            stopped_by = "time"
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress, cfg)
        batch = windows.next(cfg.batch_size)
        with _autocast(device):
            loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % cfg.log_every == 0 or step == 1:  # NOTE: float(loss) syncs the GPU: only now and then
            log(f"{label} step {step}/{cfg.max_steps} loss {float(loss.detach()):.3f} lr {lr_at(progress, cfg):.2e} "
                f"{time.perf_counter() - start:.0f}s")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    final = float(loss.detach()) if step else float("nan")
    model.eval()
    return TrainResult(step, step * cfg.batch_size * cfg.seq_len, seconds, final, stopped_by)


def next_token_loss(model: TrainLlama) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(window: torch.Tensor) -> torch.Tensor:
        logits = model(window[:, :-1])  # [batch, seq, vocab]
        return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())

    return loss


def distillation_loss(draft: TrainLlama, target: TrainLlama) -> Callable[[torch.Tensor], torch.Tensor]:
    """KL(target || draft) over the full next-token distribution at temperature 1, mean per token."""

    def loss(window: torch.Tensor) -> torch.Tensor:
        inputs = window[:, :-1]
        with torch.no_grad():
            target_logp = F.log_softmax(target(inputs).float(), dim=-1).flatten(0, 1)  # [tokens, vocab]
        draft_logp = F.log_softmax(draft(inputs).float(), dim=-1).flatten(0, 1)
        return F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")

    return loss
