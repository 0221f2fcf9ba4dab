"""DraftPrefiller (engine/spec/draft_prefill.py): prompts prefilled together write the KV each
writes alone; split_to_fit groups prompts by the scratch's blocks; prompts that do not fit are
refused with the limit named. (That the KV is the draft's own, as a decode worker's draft would
compute it, is shown end to end in tests/unit/prefill_worker/test_draft_kv.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from engine import ModelConfig, SpeculativeConfig
from engine.models import DEFAULT_MODEL_DIR, load_arch
from engine.spec.draft_prefill import DraftPrefiller, split_to_fit

BLOCK_SIZE = 4


def _prefiller(max_prompt_tokens: int = 64) -> DraftPrefiller:
    spec = SpeculativeConfig(method="draft", draft_model="default")
    return DraftPrefiller(spec, ModelConfig(device="cpu"), load_arch(DEFAULT_MODEL_DIR), torch.device("cpu"),
                          torch.float32, BLOCK_SIZE, max_prompt_tokens)


def _kv(prefiller: DraftPrefiller, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """The prompt's KV [layers, 2, tokens, heads, dim] (the last block's unused slots left out)."""
    kv = prefiller.kv_caches[:, :, blocks]
    return kv.reshape(*kv.shape[:2], -1, *kv.shape[4:])[:, :, :num_tokens].clone()


def test_prompts_together_write_the_kv_each_writes_alone():
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 13, 8)]
    prefiller = _prefiller()
    together = prefiller.prefill(prompts)
    assert together == [[0, 1], [2, 3, 4, 5], [6, 7]]  # from block 0, in order
    kv_together = [_kv(prefiller, b, len(p)) for b, p in zip(together, prompts)]
    for prompt, expected in zip(prompts, kv_together):
        (alone,) = prefiller.prefill([prompt])
        assert alone == list(range(-(-len(prompt) // BLOCK_SIZE)))
        torch.testing.assert_close(_kv(prefiller, alone, len(prompt)), expected)
    assert kv_together[0].abs().sum() > 0


def test_split_to_fit_and_the_limit():
    prefiller = _prefiller(max_prompt_tokens=16)  # 4 blocks
    assert prefiller.fits(16) and not prefiller.fits(17) and not prefiller.fits(0)
    prompts = [[1] * 9, [1] * 4, [1] * 16, [1] * 1]  # 3, 1, 4, 1 blocks
    assert split_to_fit(prompts, prefiller.num_blocks, BLOCK_SIZE) == [[0, 1], [2], [3]]
    with pytest.raises(ValueError, match="do not fit a draft prefill of 16 tokens"):
        prefiller.prefill([[1] * 9, [1] * 9])
    with pytest.raises(ValueError, match="needs speculative method 'draft'"):
        DraftPrefiller(SpeculativeConfig(method="ngram"), ModelConfig(device="cpu"), load_arch(DEFAULT_MODEL_DIR),
                       torch.device("cpu"), torch.float32, BLOCK_SIZE, 16)
