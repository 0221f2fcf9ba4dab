"""tests/watched.py: a test's event loop that waits forever ends in TimeoutError, with the stack of the await that
never ended; one that ends returns its result."""

from __future__ import annotations

import asyncio

import pytest

from tests.watched import run_watched


async def _waits_forever() -> None:
    await asyncio.Event().wait()


async def _answers() -> int:
    await asyncio.sleep(0)
    return 7


def test_a_hung_loop_ends_in_timeout_error_naming_where_it_waits(capsys) -> None:
    with pytest.raises(TimeoutError, match="ran past 0.3 s"):
        run_watched(_waits_forever(), timeout_s=0.3)
    err = capsys.readouterr().err
    assert "_waits_forever" in err and "1 tasks still waiting" in err
    assert "thread MainThread" in err


def test_a_loop_that_ends_returns_its_result() -> None:
    assert run_watched(_answers(), timeout_s=5.0) == 7
