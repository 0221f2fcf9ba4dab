"""kv_messages > 1 (layer groups sent during the prefill) needs the early handshake: a config asking
for groups without it is refused with an error that names both fields, in ClusterConfig and in
PrefillWorkerConfig."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig
from prefill_worker import PrefillWorkerConfig


@pytest.mark.parametrize("make", [
    lambda **kw: ClusterConfig(mode="disaggregated", **kw),
    lambda **kw: PrefillWorkerConfig(worker_id="p0", **kw),
], ids=["cluster", "prefill-worker"])
def test_layer_groups_without_the_early_handshake_are_refused(make):
    with pytest.raises(ValidationError, match="kv_messages=8 needs early_handshake=True"):
        make(kv_messages=8)
    assert make(kv_messages=8, early_handshake=True).kv_messages == 8
    assert make().kv_messages == 1 and make().early_handshake is False
