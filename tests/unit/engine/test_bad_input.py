"""Bad input gets an error that names the field and the limit, and changes nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import ValidationError

from engine import InvalidRequestError, SamplingParams
from engine.models import DEFAULT_MODEL_DIR, SUPPORTED_ARCHITECTURES


def _copy_default(tmp_path):
    out = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, out)
    return out


def test_missing_weights_file_is_named(tmp_path, make_llm):
    model = _copy_default(tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        make_llm(str(model))


def test_missing_config_is_named(tmp_path, make_llm):
    model = _copy_default(tmp_path)
    (model / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_llm(str(model))


def test_missing_shard_of_index_is_named(tmp_path, make_llm):
    model = _copy_default(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        make_llm(str(model))


def test_missing_tensor_is_named(tmp_path, make_llm):
    from safetensors.torch import load_file, save_file

    model = _copy_default(tmp_path)
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        make_llm(str(model))


def test_unsupported_architecture_lists_supported(tmp_path, make_llm):
    model = _copy_default(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        make_llm(str(model))
    assert "GPT2LMHeadModel" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_max_model_len_above_model_limit(make_llm):
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's max_position_embeddings 2048"):
        make_llm(max_model_len=4096)


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [
        ([], r"prompt: is empty"),
        ([5, 2048], r"prompt_token_ids\[1\]: 2048 is outside the vocabulary \[0, 2048\)"),
        ([5, -1], r"prompt_token_ids\[1\]: -1 is outside"),
        ("too long", r"prompt: has 64 tokens; max_model_len is 64, so a prompt may have at most 63 tokens"),
    ],
)
def test_bad_prompts_name_field_and_limit(make_llm, prompt, pattern):
    llm = make_llm(max_model_len=64)
    if prompt == "too long":
        prompt = [7] * 64
    with pytest.raises(InvalidRequestError, match=pattern):
        llm.generate([prompt], SamplingParams())
    assert not llm.engine.has_unfinished()


def test_bad_prompt_in_a_list_adds_none(make_llm):
    llm = make_llm()
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], [5, 99999]], SamplingParams())
    assert not llm.engine.has_unfinished()


def test_prompt_larger_than_cache(make_llm):
    llm = make_llm(block_size=4, num_blocks=4)
    with pytest.raises(InvalidRequestError, match=r"needs 5 KV blocks; the cache has 4 \(16 tokens\)"):
        llm.generate([[5] * 17], SamplingParams())


def test_stop_token_ids_outside_vocab(make_llm):
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids: 5000 is outside the vocabulary"):
        make_llm().generate([[5, 6]], SamplingParams(stop_token_ids=[5000]))


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("temperature", -0.5, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -2, "greater than or equal to -1"),
        ("min_p", 2.0, "less than or equal to 1"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("presence_penalty", 3.0, "less than or equal to 2"),
        ("frequency_penalty", -2.5, "greater than or equal to -2"),
        ("repetition_penalty", 0.0, "greater than 0"),
        ("logprobs", 21, "less than or equal to 20"),
    ],
)
def test_sampling_params_out_of_range(field, value, limit):
    with pytest.raises(ValidationError) as err:
        SamplingParams(**{field: value})
    text = str(err.value)
    assert field in text and limit in text


def test_sampling_params_reject_unknown_and_inconsistent():
    with pytest.raises(ValidationError, match="tempreature"):
        SamplingParams(tempreature=0.5)
    with pytest.raises(ValidationError, match=r"min_tokens \(9\) must be at most max_tokens \(4\)"):
        SamplingParams(min_tokens=9, max_tokens=4)
    with pytest.raises(ValidationError, match="at most 16"):
        SamplingParams(stop=[str(i) for i in range(17)])


def test_unknown_engine_option_lists_known(make_llm):
    with pytest.raises(TypeError, match="unknown engine option 'blok_size'.*block_size"):
        make_llm(blok_size=8)


def test_duplicate_request_id_rejected(make_llm):
    engine = make_llm().engine
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add_request("a", [5, 6], SamplingParams(max_tokens=2))
    engine.abort_request("a")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:", "mps"])
def test_an_unknown_device_is_named_with_the_choices(device):
    from engine.config import ModelConfig

    with pytest.raises(ValidationError, match=rf"device '{device}' is not 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        ModelConfig(device=device)
    assert ModelConfig(device="cuda:1").device == "cuda:1"
