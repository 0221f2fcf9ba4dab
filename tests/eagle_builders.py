"""An EAGLE-1 head built from transformers' parts, the reference the EAGLE proposer's drafts are
checked against (tests/unit/engine/test_eagle.py, test_draft_loop.py), and a recorder of proposals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.builders import hf_config, load_hf_model

HEAD_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=2048, rms_norm_eps=1e-6, rope_theta=10000.0)


class ReferenceHead:
    """An EAGLE-1 head of transformers' parts: fc, a LlamaDecoderLayer without its input norm, the
    target's embedding and lm_head; run over whole sequences (no cache)."""

    def __init__(self, target: Any, seed: int) -> None:
        torch.manual_seed(seed)
        config = _tf().LlamaConfig(num_hidden_layers=1, **HEAD_SHAPE)
        config._attn_implementation = "eager"
        self.config = config
        self.layer = _tf().models.llama.modeling_llama.LlamaDecoderLayer(config, 0).eval()
        with torch.no_grad():
            for name, p in self.layer.named_parameters():
                p.copy_(torch.randn(p.shape) * 0.15 if "norm" not in name else 1.0 + 0.1 * torch.randn(p.shape))
        self.layer.input_layernorm = torch.nn.Identity()
        self.fc = torch.nn.Linear(128, 64, bias=False)
        with torch.no_grad():
            self.fc.weight.normal_(0.0, 0.15)
        self.rotary = _tf().models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        self.target = target

    def save(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {"fc.weight": self.fc.weight.detach().clone()}
        tensors.update({f"layers.0.{n}": p.detach().clone() for n, p in self.layer.named_parameters()})
        save_file(tensors, str(out / "model.safetensors"))
        raw = self.config.to_dict()
        raw["architectures"] = ["LlamaForCausalLM"]
        (out / "config.json").write_text(json.dumps(raw))
        return out

    @torch.inference_mode()
    def greedy_drafts(self, token_ids: list[int], k: int) -> list[int]:
        """The head's greedy drafts after token_ids (x_0 .. x_n): position j reads (x_{j+1}, h_j) for
        j < n, then its own f in place of h for each draft."""
        ids = torch.tensor([token_ids])
        h = self.target.model(input_ids=ids).last_hidden_state[0]  # after the final norm
        emb = self.target.model.embed_tokens
        inputs = list(token_ids[1:])
        features = [h[j] for j in range(len(token_ids) - 1)]
        drafts: list[int] = []
        for _ in range(k):
            x = self.fc(torch.cat((emb(torch.tensor(inputs)), torch.stack(features)), -1))[None]
            seq = x.shape[1]
            positions = torch.arange(seq)[None]
            mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
            out = self.layer(x, attention_mask=mask, position_ids=positions,
                             position_embeddings=self.rotary(x, positions))
            f = (out[0] if isinstance(out, tuple) else out)[0, -1]
            drafts.append(int(self.target.lm_head(f).argmax()))
            inputs.append(drafts[-1])
            features.append(f)
        return drafts


def record_proposals(llm: Any) -> list[tuple[list[int], Any]]:
    """Each proposed draft with the tokens it follows (wraps the proposer)."""
    seen: list[tuple[list[int], Any]] = []
    propose = llm.engine.proposer.propose

    def recording(requests, generator):  # type: ignore[no-untyped-def]
        drafts = propose(requests, generator)
        seen.extend((list(r.token_ids), d) for r, d in zip(requests, drafts) if d is not None)
        return drafts

    llm.engine.proposer.propose = recording
    return seen




def oracle_head(target_path: Path, out: Path) -> Path:
    """A head that computes what its one-layer target computes: the target's attention output is
    zeroed (o_proj), so each position's output depends on its own token alone; fc passes the token's
    embedding through (rows of unit RMS, so the target's input norm, weight 1, leaves them as they are)
    and the layer is the target's. The head's logits at position j are then the target's at j + 1
    before the final norm (weight 1), a positive multiple of them: every greedy draft is the target's
    own next token, if it is drafted for the right position."""
    model = load_hf_model(target_path)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.norm.weight.fill_(1.0)
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.self_attn.o_proj.weight.zero_()
        layer.self_attn.o_proj.bias.zero_()
    model.save_pretrained(out / "target", safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / "target" / f).write_bytes((target_path / f).read_bytes())
    layer = {f"layers.0.{n}": p.detach().clone() for n, p in model.model.layers[0].named_parameters()}
    fc = torch.zeros(64, 128)
    fc[:, :64] = torch.eye(64)
    (out / "head").mkdir(parents=True)
    save_file({"fc.weight": fc, **layer}, str(out / "head" / "model.safetensors"))
    raw = hf_config("llama").to_dict() | {"num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    (out / "head" / "config.json").write_text(json.dumps(raw))
    return out


def _tf() -> Any:
    import transformers

    return transformers
