"""Builders shared by tests: small random Hugging Face checkpoints of each supported architecture.

transformers is a test-only dependency: it creates the checkpoints here and serves as the
reference the engine is compared against; the engine itself never imports it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "engine" / "models" / "default"

_COMMON: dict[str, Any] = dict(
    vocab_size=2048,  # the default model's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so that greedy choices are not near-ties a rounding difference flips.
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)

ARCHITECTURES = ("llama", "llama3", "mistral", "qwen2", "qwen3")


def hf_config(name: str) -> Any:
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**_COMMON, attention_bias=True)
    if name == "llama3":
        scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64, rope_theta=500000.0)
        return tf.LlamaConfig(**_COMMON, rope_scaling=scaling)
    if name == "mistral":
        return tf.MistralConfig(**_COMMON, sliding_window=24)
    if name == "qwen2":
        return tf.Qwen2Config(**_COMMON)
    if name == "qwen3":
        return tf.Qwen3Config(**_COMMON)
    raise ValueError(f"unknown test architecture {name!r}; known: {ARCHITECTURES}")


def make_hf_checkpoint(name: str, out: Path, seed: int = 0, **overrides: Any) -> Path:
    """overrides: config fields changed from the architecture's test config (e.g. vocab_size)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = hf_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if name == "qwen2":  # HF initializes biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.3)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, out / f)
    return out


def load_hf_model(path: Path) -> Any:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens by full recomputation (no KV cache), with each step's log-softmax."""
    ids = list(prompt)
    logprobs: list[torch.Tensor] = []
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, -1))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], logprobs


def assert_greedy_equals_hf(llm: Any, model: Any, prompts: list[list[int]], num_tokens: int,
                            atol: float = 2e-4) -> None:
    """The engine `llm`'s greedy tokens for `prompts` equal transformers' `model`'s (hf_greedy), and
    its top-5 logprobs are within `atol` of the reference's at every step."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        want, want_logprobs = hf_greedy(model, prompt, num_tokens)
        assert out.outputs[0].token_ids == want
        for top, ref in zip(out.outputs[0].top_logprobs, want_logprobs, strict=True):
            ids = torch.tensor([t for t, _ in top])
            torch.testing.assert_close(torch.tensor([v for _, v in top]), ref[ids], atol=atol, rtol=0)
