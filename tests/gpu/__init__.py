"""GPU tests: marked `gpu` (CI deselects them) and skipped on a machine without the GPUs they need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def run_child(script: str, *args: str, timeout_s: float = 240) -> str:
    """`python -c script args` from the repository's root, its stdout; a failure shows its stderr's end. In a
    child process, a collective that hangs fails the test instead of the run. The memory earlier tests left
    cached in this process is handed back first: the child sizes its KV cache from what is free."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
