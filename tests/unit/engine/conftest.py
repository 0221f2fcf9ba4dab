"""Fixtures of the engine's unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def interpreted_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels (and triton.language's own jit functions) defined under TRITON_INTERPRET=1:
    the variable is read when `triton` is first imported and when the kernels are defined (see
    test_triton_interpret.py's NOTE), and while they run; restored after the test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_language = pytest.importorskip("triton.language")
    from triton.runtime.interpreter import InterpretedFunction

    from engine.attention import triton_kernels, triton_prefill

    defined = (triton_language.zeros, triton_kernels._decode_kernel, triton_prefill._prefill_kernel)
    if not all(isinstance(f, InterpretedFunction) for f in defined):
        pytest.skip("triton or the kernels were imported without TRITON_INTERPRET=1 earlier in this session")
