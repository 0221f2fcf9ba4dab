"""bench/k_quants.py's Q4_K blocks, read back by the `gguf` package's own dequantizer (nobody here wrote it):
close to the weights, closer than gguf's Q4_0 of the same bits, zero rows exact; and a Q4_K GGUF that
bench/gguf_write.py writes from a checkpoint serves transformers' tokens on the values gguf reads from it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench.gguf_write import gguf_tensor_name, write_gguf
from bench.k_quants import BLOCK_BYTES, quantize_q4_k
from tests.builders import assert_greedy_equals_hf, load_hf_model, make_hf_checkpoint

pytest.importorskip("transformers")


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


def test_q4_k_blocks_decode_through_gguf_close_to_the_weights():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 1024)) * 0.02).astype(np.float32)
    x[1] = np.abs(x[1]) + 0.01  # all positive: a min of 0
    x[2] *= 50.0  # another magnitude
    x[3, 7] = 1.0  # an outlier in its sub-block
    x[4] = 0.0
    blocks = quantize_q4_k(x)
    assert blocks.shape == (48, 1024 // 256 * BLOCK_BYTES) and blocks.dtype == np.uint8
    got = gguf.quants.dequantize(blocks, Q.Q4_K)
    assert not got[4].any()
    rows = [_rel_rms(got[i], x[i]) for i in range(48) if i != 4]
    assert max(rows) < 0.1, rows
    q4_0 = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0)
    assert _rel_rms(got, x) < 0.9 * _rel_rms(q4_0, x)  # Q4_K's sub-block mins and searched scales pay


def test_q4_k_needs_rows_of_whole_super_blocks():
    with pytest.raises(ValueError, match="a multiple of 256 values; got 320"):
        quantize_q4_k(np.zeros((2, 320), dtype=np.float32))


def test_a_q4_k_gguf_serves_transformers_tokens_on_the_values_gguf_reads(tmp_path, make_llm):
    hf_dir = make_hf_checkpoint("qwen3", tmp_path / "hf", hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_gguf(hf_dir, tmp_path / "q4k.gguf", Q.Q4_K)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_down.weight"].tensor_type == Q.Q4_K  # 512 columns: Q4_K
    hf = load_hf_model(hf_dir)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            t = tensors[gguf_tensor_name(name)]
            param.copy_(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(param.shape).copy()))
    llm = make_llm(str(path), num_blocks=32)
    assert_greedy_equals_hf(llm, hf, [[0, 17, 400, 33, 1021, 7], [0, 5, 6, 7]], 12)
