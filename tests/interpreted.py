"""Triton kernels under the CPU interpreter, for the modules that test them.

TRITON_INTERPRET is read when a kernel is defined (`@triton.jit`, at its module's import), and
again while an interpreted kernel runs. `import_interpreted` defines a kernel module's kernels
with it set, then removes it again (unless it was set before) so that Triton code imported later
in the same session compiles as usual; a test module sets it around each of its tests with the
`interpreted_triton` fixture. If the module was imported earlier without it, its kernels are
compiled ones and the calling test module skips (run it alone then).
tests/unit/engine/attention/test_triton_interpret.py says the same at more length.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest


def import_interpreted(module: str, kernel: str) -> ModuleType:
    """`module` imported with TRITON_INTERPRET=1; skips the calling test module when its `kernel`
    (an attribute) is not an interpreted one, or when triton is missing."""
    was_set = "TRITON_INTERPRET" in os.environ
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        pytest.importorskip("triton")
        imported = importlib.import_module(module)
    finally:
        if not was_set:
            del os.environ["TRITON_INTERPRET"]
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(getattr(imported, kernel), InterpretedFunction):
        pytest.skip(f"{module}'s kernels were compiled before TRITON_INTERPRET was set; run this test module alone",
                    allow_module_level=True)
    return imported


@pytest.fixture
def interpreted_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TRITON_INTERPRET=1 around a test (the interpreter reads it while kernels run)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
