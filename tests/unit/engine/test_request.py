"""Request.output_view: the output tokens as a read-only view of token_ids (no copy), equal to
output_token_ids in every way the sampler reads it."""

from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.request import Request


def test_output_view_reads_as_the_output_tokens_and_follows_appends() -> None:
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=8), 0.0)
    view = request.output_view()
    assert len(view) == 0 and list(view) == []
    request.token_ids.extend([10, 11, 12])
    assert len(view) == 3 and list(view) == request.output_token_ids == [10, 11, 12]
    assert (view[0], view[-1], view[1:]) == (10, 12, [11, 12])
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
