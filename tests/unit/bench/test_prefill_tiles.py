"""bench.diag.prefill_tiles' bookkeeping (no GPU): the causal FLOPs it divides by, the best and first-guess tiles it
reports, and its plot from a result's fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.diag import prefill_tiles
from engine.attention.triton_backend import TritonAttentionConfig


def test_causal_flops_count_the_visible_pairs() -> None:
    # a fresh prompt of 2 tokens sees 1 + 2 keys; 1 new token on a prefix of 3 sees 4
    shape = prefill_tiles.Shape(heads=8, kv_heads=2, head_dim=64)
    per_pair = 4 * 8 * 64
    assert prefill_tiles.causal_flops([(2, 2)], shape) == 3 * per_pair
    assert prefill_tiles.causal_flops([(1, 4), (2, 2)], shape) == 7 * per_pair


def rows() -> list[dict]:
    tiles = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
    return [
        {"cache": "bf16", "case": "8 x 1024", **tiles, "default": True, "us": 300.0, "tflops": 200.0},
        {"cache": "bf16", "case": "8 x 1024", **tiles, "block_n": 128, "default": False, "us": 250.0, "tflops": 240.0},
        {"cache": "bf16", "case": "8 x 1024", **tiles, "block_m": 256, "default": False, "error": "OutOfResources"},
        {"cache": "fp8", "case": "8 x 1024", **tiles, "default": True, "us": 280.0, "tflops": 214.0},
    ]


def test_best_by_case_names_the_fastest_and_the_first_guess() -> None:
    best = prefill_tiles.best_by_case(rows())
    assert best["bf16 8 x 1024"]["default_us"] == 300.0
    assert best["bf16 8 x 1024"]["best"]["us"] == 250.0 and best["bf16 8 x 1024"]["best"]["block_n"] == 128
    assert best["fp8 8 x 1024"]["best"]["us"] == best["fp8 8 x 1024"]["default_us"] == 280.0


def test_replot_draws_a_png_beside_the_result(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = tmp_path / "prefill_tiles_gpu.json"
    result.write_text(json.dumps({"device_name": "NVIDIA H200", "rows": rows(), "sdpa_us": {"8 x 1024": 164.0},
                                  "shape": {"heads": 32, "kv_heads": 8, "head_dim": 128}, "num_sms": 132,
                                  "cases": {"8 x 1024": {"seqs": prefill_tiles.CASES["8 x 1024"]}},
                                  "best": prefill_tiles.best_by_case(rows())}))
    prefill_tiles.main(["--replot", str(result)])
    assert result.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_the_product_s_tiles_are_crowded_where_a_case_s_rows_fill_the_sms(cache) -> None:
    """On 132 SMs: the 70B shape's cases all take the crowded tiles; the 8B shape's prompt steps do over FP8 (32
    query tokens a tile), not in bfloat16 (64: past prefill_crowded_max_tile_tokens); its 512-token chunk (124 rows
    an SM) never does."""
    config = TritonAttentionConfig()
    fp8 = cache == "fp8"
    crowded, plain = config.prefill_tiles(fp8, True)._asdict(), config.prefill_tiles(fp8)._asdict()
    eight_b, seventy_b = prefill_tiles.Shape(32, 8), prefill_tiles.Shape(64, 8)
    cases = prefill_tiles.CASES
    for name in ("8 x 1024", "1 x 8192"):
        assert prefill_tiles.product_tiles(cache, cases[name], eight_b, 132) == (crowded if fp8 else plain)
    chunk = cases["extend 512 on 3584"]
    assert prefill_tiles.product_tiles(cache, chunk, eight_b, 132) == plain
    for seqs in cases.values():
        assert prefill_tiles.product_tiles(cache, seqs, seventy_b, 132) == crowded
