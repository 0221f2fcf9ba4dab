"""The target/draft trainer end to end at --size cpu-tiny: both checkpoints load in transformers
with no missing or unexpected keys and give the trainer's own logits on held-out text, the engine
serves them, and the summary's figures follow from its own numbers."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from bench import train_models
from engine import SamplingParams

pytestmark = pytest.mark.slow
MODELS = ("target", "draft")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("trained")
    num_threads = torch.get_num_threads()
    # NOTE: one torch thread: a tiny model gains nothing from more, and they stall on a busy machine.
    argv = ["--out", str(out), "--size", "cpu-tiny", "--device", "cpu", "--num-threads", "1", "--quiet"]
    try:
        summary = train_models.main(argv)
    finally:
        torch.set_num_threads(num_threads)  # --num-threads is process-wide: give the next tests theirs back
    yield out, summary


def _held_out_batch(model_dir: Path) -> torch.Tensor:  # [2, 33]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _, held_out = train_models.split_corpus(max_train_bytes=1, max_held_out_bytes=50_000)
    stream = train_models.pack(tokenizer, held_out, max_tokens=66)
    return train_models.held_out_windows(stream, seq_len=32)


def test_summary_is_written_and_consistent(trained: tuple[Path, dict[str, Any]]) -> None:
    out, summary = trained
    assert json.loads((out / "summary.json").read_text()) == summary
    held = summary["held_out"]
    assert held["num_tokens"] > 0
    for name in MODELS:
        figures = held[name]
        assert math.isfinite(figures["loss"]) and figures["perplexity"] == pytest.approx(math.exp(figures["loss"]))
        run, cfg = summary[name]["train"], summary[name]["config"]
        assert 0 < run["num_steps"] <= cfg["max_steps"] and run["stopped_by"] in ("steps", "time")
        assert run["num_tokens"] == run["num_steps"] * cfg["batch_size"] * cfg["seq_len"]
        assert summary[name]["dir_bytes"] == sum(p.stat().st_size for p in (out / name).iterdir())
    assert 0.0 <= held["draft_greedy_agreement"] <= 1.0
    assert 0.0 < held["draft_expected_acceptance_t1"] <= 1.0 and held["kl_target_draft"] >= 0.0
    assert summary["target"]["num_params"] > 2 * summary["draft"]["num_params"]
    # training moved the target off uniform: its held-out loss is below log(vocab)
    assert held["target"]["loss"] < math.log(summary["corpus"]["vocab_size"])


@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_files_and_special_tokens(trained: tuple[Path, dict[str, Any]], name: str) -> None:
    model_dir = trained[0] / name
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / f).is_file(), f
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    assert [tokenizer.token_to_id(t) for t in specials] == [0, 1, 2, 3]
    assert tokenizer.encode("x = 1").ids[0] == 0  # BOS prepended, as the default model's tokenizer does
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("name", MODELS)
def test_transformers_loads_it_and_matches_the_trainer(trained: tuple[Path, dict[str, Any]], name: str) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = trained[0] / name
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    batch = _held_out_batch(model_dir)
    with torch.no_grad():
        expected = train_models.load_checkpoint(model_dir)(batch)
        actual = hf.eval()(input_ids=batch).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_engine_generates_from_it(trained: tuple[Path, dict[str, Any]], name: str, make_llm) -> None:
    llm = make_llm(str(trained[0] / name))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate(["def main():\n"], params)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert isinstance(out.outputs[0].text, str)
