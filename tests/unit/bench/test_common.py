"""bench/common.py's environment and plot title name the model without an absolute path: relative
to the repository inside it, by the directory's name outside it (results travel between checkouts
and machines, and an absolute path names one of them)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import common
from engine.models import DEFAULT_MODEL_DIR


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def _environment(model: str) -> dict:
    args = common.base_parser("test").parse_args(["--model", model, "--device", "cpu", "--num-threads", "1"])
    engine = common.build_engine(args)
    env = common.environment(engine, args)
    common.check_no_leak(engine)
    return env


def _is_absolute_anywhere(text: str) -> bool:
    return str(common.REPO_ROOT) in text or any(Path(word).is_absolute() for word in text.split())


@pytest.mark.parametrize("model", ["default", str(DEFAULT_MODEL_DIR)])
def test_a_model_inside_the_repository_is_named_relative_to_it(model: str) -> None:
    env = _environment(model)
    assert env["model"]["dir"] == "engine/models/default"
    assert env["model"]["name"] == ("default" if model == "default" else "engine/models/default")
    plot_title = common.title("what", env, "workload")
    assert f"model {env['model']['name']} (" in plot_title and not _is_absolute_anywhere(plot_title)


def test_a_model_outside_the_repository_is_named_by_its_directory(tmp_path: Path) -> None:
    model_dir = shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "tiny-llama")
    env = _environment(str(model_dir))
    assert env["model"]["name"] == env["model"]["dir"] == "tiny-llama"
    plot_title = common.title("what", env, "workload")
    assert "model tiny-llama (" in plot_title and not _is_absolute_anywhere(plot_title)


def test_a_title_of_older_results_drops_their_absolute_path() -> None:
    env = _environment("default")
    old = {**env, "model": {**env["model"], "name": "/elsewhere/checkout/bench/shapes/qwen3-0.6b"}}
    assert "model qwen3-0.6b (" in common.title("what", old, "workload")
    inside = {**env, "model": {**env["model"], "name": str(common.REPO_ROOT / "bench" / "shapes" / "qwen3-0.6b")}}
    assert "model bench/shapes/qwen3-0.6b (" in common.title("what", inside, "workload")


def test_free_device_memory_frees_a_dropped_engine() -> None:
    """An engine's parts refer to each other: `del` alone leaves it (and its KV cache) to the cycle collector,
    and a server started next on the GPU found 126 of 140 GiB still held."""
    import gc
    import weakref

    from bench.offline_throughput import run_engine

    args = common.base_parser("test").parse_args(["--device", "cpu", "--num-threads", "1"])
    was_enabled = gc.isenabled()
    gc.disable()  # NOTE: an automatic collection in between would free it without the helper
    try:
        engine = common.build_engine(args, max_num_seqs=4)
        run_engine(engine, [[5, 6, 7, 8]] * 2, [3, 3])
        common.check_no_leak(engine)
        ref = weakref.ref(engine)
        del engine
        common.free_device_memory()
        assert ref() is None
    finally:
        if was_enabled:
            gc.enable()


def test_random_block_tables_give_each_sequence_its_own_blocks() -> None:
    seqs = [(5, 5), (1, 33), (16, 40)]
    tables, starts = common.random_block_tables(seqs, num_blocks=10, block_size=16)
    assert [len(t) for t in tables] == [1, 3, 3] and starts == [0, 5, 6, 22]
    drawn = [b for t in tables for b in t]
    assert len(set(drawn)) == len(drawn) and all(0 <= b < 10 for b in drawn)
    assert common.random_block_tables(seqs, 10, 16) == (tables, starts)  # the same draw for the same step
    with pytest.raises(ValueError, match="10 blocks"):
        common.random_block_tables(seqs + [(1, 64)], num_blocks=10, block_size=16)
