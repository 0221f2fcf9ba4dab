"""Shared fixtures. Every engine a test builds through `make_engine` is checked after the test:
its BlockPool's integrity holds and no block is held (the block-leak check)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import LLM  # noqa: E402


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    assert not engine.has_unfinished(), "requests still live after the test"
    assert engine.pool.num_held_blocks == 0, f"{engine.pool.num_held_blocks} KV blocks still held"


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    built: list[LLM] = []

    def build(model: str = "default", **options: Any) -> LLM:
        options.setdefault("device", "cpu")
        llm = LLM(model, **options)
        built.append(llm)
        return llm

    yield build
    for llm in built:
        assert_no_leak(llm)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Small random HF checkpoints, one per architecture, made once per session."""
    from tests.builders import make_hf_checkpoint

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_hf_checkpoint(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from more threads, and stall on a busy machine."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
