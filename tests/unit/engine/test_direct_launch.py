"""DirectLaunch (engine/direct_launch.py) on the CPU, over a stand-in for a @triton.jit kernel that records
its launches: a key's first launch goes through the launcher (options included) and keeps the variant it
returns, later launches of that key call the variant with the arguments alone, another key compiles its
own; a launcher that returns no variant (Triton's interpreter) is used at every launch; `forget` sends every
key back to the launcher. The compiled path runs on a GPU in tests/gpu/test_sampling_gpu.py."""

from __future__ import annotations

from typing import Any

from engine.direct_launch import DirectLaunch


class _Variant:
    def __init__(self, name: str, calls: list[tuple[Any, ...]]) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid: tuple[int, int, int]):  # type: ignore[no-untyped-def]
        return lambda *args: self.calls.append(("direct", self.name, grid, args))


class _Kernel:
    """Records launcher calls; returns a new variant a call (or None, as the interpreter does)."""

    def __init__(self, returns_variant: bool) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.returns_variant = returns_variant

    def __getitem__(self, grid: tuple[int, int, int]):  # type: ignore[no-untyped-def]
        def launch(*args: Any, **options: Any) -> _Variant | None:
            self.calls.append(("launcher", grid, args, options))
            return _Variant(f"v{len(self.calls)}", self.calls) if self.returns_variant else None

        return launch


def test_a_key_s_variant_is_called_directly_after_its_first_launch() -> None:
    kernel = _Kernel(returns_variant=True)
    launch = DirectLaunch(kernel)
    launch("a", (1, 2, 1), 10, 20, num_warps=4)
    launch("a", (3, 2, 1), 11, 21, num_warps=4)
    launch("b", (1, 1, 1), 12, 22, num_warps=8)
    launch("a", (1, 2, 1), 13, 23, num_warps=4)
    launch("b", (2, 1, 1), 14, 24, num_warps=8)
    assert kernel.calls == [
        ("launcher", (1, 2, 1), (10, 20), {"num_warps": 4}),
        ("direct", "v1", (3, 2, 1), (11, 21)),
        ("launcher", (1, 1, 1), (12, 22), {"num_warps": 8}),
        ("direct", "v1", (1, 2, 1), (13, 23)),
        ("direct", "v3", (2, 1, 1), (14, 24)),
    ]


def test_without_a_compiled_variant_every_launch_takes_the_launcher() -> None:
    kernel = _Kernel(returns_variant=False)
    launch = DirectLaunch(kernel)
    for i in range(3):
        launch("a", (1, 1, 1), i)
    assert [call[0] for call in kernel.calls] == ["launcher"] * 3
    assert [call[2] for call in kernel.calls] == [(0,), (1,), (2,)]


def test_a_forgotten_key_takes_the_launcher_again() -> None:
    kernel = _Kernel(returns_variant=True)
    launch = DirectLaunch(kernel)
    launch("a", (1, 1, 1), 1)
    launch("a", (1, 1, 1), 2)
    launch.forget()
    launch("a", (1, 1, 1), 3)
    launch("a", (1, 1, 1), 4)
    assert [call[:2] for call in kernel.calls] == [("launcher", (1, 1, 1)), ("direct", "v1"),
                                                    ("launcher", (1, 1, 1)), ("direct", "v3")]
