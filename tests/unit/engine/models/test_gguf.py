"""GGUF checkpoints: small random HF checkpoints converted the way llama.cpp converts them
(tests/gguf_builders.py), served by the engine and compared with transformers on the original."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import SamplingParams
from engine.models import build_model
from engine.models.gguf_weights import unpermute_rows
from engine.quant.int4 import dequantize
from engine.tokenizer import Tokenizer
from tests.builders import DEFAULT_MODEL_DIR, assert_greedy_equals_hf, hf_greedy, load_hf_model, make_hf_checkpoint
from tests.gguf_builders import permute, random_k_quant, write_gguf

pytest.importorskip("transformers")

NUM_NEW = 12
PROMPTS = [[0, 17, 400, 33, 1021, 7, 99, 1500, 250], [0, 5, 6, 7], list(range(40, 70))]
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
# Q8_0 moves this random model's (initializer_range 0.3) first-step top-5 logprobs by up to 0.47
# (measured, llama, the 30-token prompt); greedy tokens flip a few steps in. So Q8_0 is checked
# loosely against HF on the original weights, and token for token against HF on Q8_0-rounded ones.
Q8_0_LOGPROB_ATOL = 0.75


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def gguf_files(hf_checkpoints, tmp_path_factory):
    made: dict[tuple[str, Q], Path] = {}

    def get(arch: str, qtype: Q = Q.F32) -> Path:
        if (arch, qtype) not in made:
            out = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{arch}-{qtype.name}.gguf"
            made[arch, qtype] = write_gguf(hf_checkpoints(arch), out, qtype)
        return made[arch, qtype]

    return get


def _greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_greedy_tokens_equal_transformers(arch, hf_checkpoints, gguf_files, make_llm):
    hf = load_hf_model(hf_checkpoints(arch))
    got = _greedy(make_llm(str(gguf_files(arch)), num_blocks=32))
    assert got == [hf_greedy(hf, p, NUM_NEW)[0] for p in PROMPTS], f"{arch}: GGUF tokens differ from transformers"


def _round_to(model, qtype: Q = Q.Q8_0) -> None:
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), qtype), qtype)
                param.copy_(torch.from_numpy(rounded))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_q8_0_dequantized_at_load(arch, hf_checkpoints, gguf_files, make_llm):
    hf = load_hf_model(hf_checkpoints(arch))
    first_step_ref = [hf_greedy(hf, p, 1)[1][0] for p in PROMPTS]
    outs = make_llm(str(gguf_files(arch, Q.Q8_0)), num_blocks=32).generate(PROMPTS, GREEDY)
    for out, ref in zip(outs, first_step_ref):
        top = out.outputs[0].top_logprobs[0]
        got_ids, got_vals = torch.tensor([t for t, _ in top]), torch.tensor([v for _, v in top])
        torch.testing.assert_close(got_vals, ref[got_ids], atol=Q8_0_LOGPROB_ATOL, rtol=0)
    _round_to(hf)
    want = [hf_greedy(hf, p, NUM_NEW)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == want, f"{arch}: Q8_0 tokens differ from HF on Q8_0 weights"


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q5_1])
def test_each_quantizable_type_loads_as_its_dequantized_values(qtype, hf_checkpoints, tmp_path):
    path = write_gguf(hf_checkpoints("qwen3"), tmp_path / "m.gguf", qtype)
    model, _ = build_model(path, torch.float32, torch.device("cpu"))
    weight = load_hf_model(hf_checkpoints("qwen3")).model.layers[1].mlp.down_proj.weight.detach().numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
    down = model.model.layers[1].mlp.down_proj
    if qtype == Q.Q4_0:  # the projections stay 4-bit (test_q4_0_projections_stay_4_bit)
        got = dequantize(down.weight, down.weight_scale, torch.float32).numpy()
    else:
        got = down.weight.detach().numpy()
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, weight) or qtype == Q.F32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_q4_0_projections_stay_4_bit(arch, hf_checkpoints, gguf_files, make_llm):
    """Q4_0 blocks are exactly 4-bit groups of 32 (scale d, zero point 8): the projections load onto
    the 4-bit path (a quarter of float16's bytes) and give HF's tokens on Q4_0-rounded weights (llama:
    through llama.cpp's q/k row permutation, undone on the 4-bit rows and their scales)."""
    llm = make_llm(str(gguf_files(arch, Q.Q4_0)), num_blocks=32)
    assert llm.engine.weights == "4-bit projections on the reference path"
    gate_up = llm.engine.runner.model.model.layers[0].mlp.gate_up_weight
    assert gate_up.dtype == torch.uint8 and gate_up.shape == (256, 32)  # [2 x 128, 64 / 2]
    hf = load_hf_model(hf_checkpoints(arch))
    _round_to(hf, Q.Q4_0)
    assert _greedy(llm) == [hf_greedy(hf, p, NUM_NEW)[0] for p in PROMPTS]


def test_q4_0_projections_split_across_tensor_parallel_ranks(hf_checkpoints, gguf_files, make_llm):
    path = str(gguf_files("llama", Q.Q4_0))
    one = make_llm(path, num_blocks=32).generate(PROMPTS, GREEDY)
    llm = make_llm(path, num_blocks=32, tensor_parallel_size=2)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    two = llm.generate(PROMPTS, GREEDY)
    llm.close()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


_GGUF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                     "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_dequantized_at_load_give_transformers_tokens(qtype, tmp_path, make_llm):
    """K-quant projections (random blocks: the gguf package reads K-quants but cannot write them) are
    dequantized at load to the values gguf's own reader gives: transformers on those values gives the
    same greedy tokens, logprobs within 2e-4 (float32)."""
    hf_dir = make_hf_checkpoint("qwen3", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64)
    hf = load_hf_model(hf_dir)
    params = dict(hf.named_parameters())
    raw = {}
    for layer in range(len(hf.model.layers)):
        for gguf_part, hf_part in _GGUF_PROJECTIONS.items():
            weight = params[f"model.layers.{layer}.{hf_part}.weight"]
            blocks = random_k_quant(weight.shape[0], weight.shape[1], qtype, seed=layer * 10 + len(raw))
            raw[f"blk.{layer}.{gguf_part}.weight"] = (blocks, qtype)
            with torch.no_grad():
                weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy()))
    llm = make_llm(str(write_gguf(hf_dir, tmp_path / "k.gguf", raw=raw)), num_blocks=32)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # dequantized
    assert_greedy_equals_hf(llm, hf, PROMPTS, NUM_NEW)


def test_unpermute_inverts_llama_cpp_permute():
    rows = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    permuted = permute(rows, 4, 4)
    assert not np.array_equal(permuted, rows)
    np.testing.assert_array_equal(unpermute_rows(permuted, 4), rows)
    np.testing.assert_array_equal(unpermute_rows(permute(rows[:32, 0], 4, 2), 2), rows[:32, 0])


TEXTS = ["Hello world", "  leading spaces and\ttabs\nnew lines", "naïve café 東京 🙂", "don't stop: 12345",
         "<|im_start|>user\nhi<|im_end|>", ""]


def test_tokenizer_from_gguf_metadata_equals_tokenizer_json(gguf_files):
    want, got = Tokenizer.from_dir(DEFAULT_MODEL_DIR), Tokenizer.from_dir(gguf_files("qwen3"))
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False), text
        assert got.decode(ids) == want.decode(ids), text
        assert got.decode(ids, skip_special_tokens=False) == want.decode(ids, skip_special_tokens=False), text
    assert got.vocab_size == want.vocab_size
    assert got.special_token_ids == want.special_token_ids
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)
    messages = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(messages) == want.apply_chat_template(messages)


def test_llm_on_a_gguf_encodes_text_and_a_directory_holding_one_gguf_loads(gguf_files, make_llm, tmp_path):
    shutil.copy(gguf_files("qwen2"), tmp_path / "model.gguf")
    llm = make_llm(str(tmp_path), num_blocks=32)
    assert llm.tokenizer is not None and llm.engine.arch.architecture == "Qwen2ForCausalLM"
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode("Hello world")
    assert len(out.outputs[0].token_ids) == 3


def _broken(hf_checkpoints, tmp_path, edit=None, arch="qwen3", **kw) -> Path:
    return write_gguf(hf_checkpoints(arch), tmp_path / "broken.gguf", edit=edit, **kw)


def _build(path: Path):
    return build_model(path, torch.float32, torch.device("cpu"))


def test_wrong_shape_names_the_tensor_and_both_shapes(hf_checkpoints, tmp_path):
    def shrink(t):
        t["blk.1.ffn_up.weight"] = t["blk.1.ffn_up.weight"][:100]

    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight .* shape \(100, 64\).*\(128, 64\)"):
        _build(_broken(hf_checkpoints, tmp_path, shrink))


def test_missing_tensor_is_named(hf_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"lacks tensors the model needs: blk\.0\.attn_k_norm\.weight"):
        _build(_broken(hf_checkpoints, tmp_path, lambda t: t.pop("blk.0.attn_k_norm.weight")))


def test_unknown_tensor_is_named(hf_checkpoints, tmp_path):
    def add(t):
        t["blk.0.attn_sinks.weight"] = np.zeros(4, dtype=np.float32)

    with pytest.raises(ValueError, match=r"blk\.0\.attn_sinks\.weight has no place"):
        _build(_broken(hf_checkpoints, tmp_path, add))


def test_unsupported_architecture_is_named(hf_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma' is not supported; supported: llama, qwen2"):
        _build(_broken(hf_checkpoints, tmp_path, architecture="gemma"))


def test_llama3_rope_frequencies_are_refused(hf_checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"llama3-style rope scaling .*rope_freqs\.weight.* not supported"):
        _build(_broken(hf_checkpoints, tmp_path, arch="llama3"))


def test_a_gguf_model_serves_structured_outputs(hf_checkpoints, tmp_path, make_llm):
    """The engine's model_dir is the GGUF's checkpoint directory, so its grammar compiler finds the
    tokenizer the GGUF's metadata gave."""
    import re

    from engine.config import GrammarSpec, SamplingParams

    gguf = write_gguf(hf_checkpoints("qwen3"), tmp_path / "m.gguf", Q.F32)
    llm = make_llm(str(gguf))
    spec = GrammarSpec(kind="regex", text="(cat|dog)-[0-9]{3}")
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=20, temperature=1.0, grammar=spec))
    assert all(re.fullmatch("(cat|dog)-[0-9]{3}", o.outputs[0].text) for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_model_shards_across_tensor_parallel_ranks(arch, gguf_files, make_llm, one_torch_thread):
    """Each rank keeps its slice of each dequantized tensor (llama's q/k rows unpermuted first)."""
    path = str(gguf_files(arch))
    llm = make_llm(path, num_blocks=32, tensor_parallel_size=2)
    try:
        sharded = _greedy(llm)
    finally:
        llm.close()
    assert sharded == _greedy(make_llm(path, num_blocks=32))
