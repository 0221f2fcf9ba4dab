"""ClusterConfig composes the workers' configs: each pool's template (prefill, decode) keeps its own
fields and defaults, and the cluster sets only each worker's id, engine and transport. A template
that sets one of those is refused with an error naming the field; the Serve config's shape parses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig
from decode_worker import DecodeWorkerConfig
from engine import EngineConfig
from prefill_worker import PrefillWorkerConfig


def test_a_worker_config_is_its_pools_template_with_the_clusters_engine_and_transport():
    engine = EngineConfig.model_validate({"cache": {"block_size": 32}})
    cluster = ClusterConfig.model_validate({
        "engine": engine.model_dump(), "mode": "disaggregated",
        "prefill": {"host": "auto", "transfer_timeout_s": 7},
        "decode": {"lease_ttl_s": 3, "pair_timeout_s": 9},
    })
    prefill = cluster.worker_config(cluster.prefill, "prefill-1", "nccl")
    decode = cluster.worker_config(cluster.decode, "decode-0", "gloo", freeze_gc=True)
    assert isinstance(prefill, PrefillWorkerConfig) and isinstance(decode, DecodeWorkerConfig)
    assert (prefill.worker_id, prefill.transport, prefill.host, prefill.transfer_timeout_s) == (
        "prefill-1", "nccl", "auto", 7)
    assert prefill.pair_timeout_s == PrefillWorkerConfig().pair_timeout_s  # the worker's own default, once
    assert (decode.worker_id, decode.lease_ttl_s, decode.pair_timeout_s, decode.freeze_gc) == ("decode-0", 3, 9, True)
    assert prefill.engine == decode.engine == engine
    assert cluster.prefill.worker_id == ""  # the template itself is untouched


@pytest.mark.parametrize("field", ["worker_id", "engine", "transport"])
@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_template_may_not_set_what_the_cluster_sets(pool, field):
    value = {"worker_id": "x", "engine": {}, "transport": "nccl"}[field]
    with pytest.raises(ValidationError, match=f"{pool}.{field} is set by the cluster"):
        ClusterConfig.model_validate({pool: {field: value}})


def test_unknown_template_fields_are_refused():
    with pytest.raises(ValidationError, match="kv_messages"):
        ClusterConfig.model_validate({"prefill": {"kv_messages": 8}})


def test_each_pool_gets_its_tensor_parallel_size():
    cluster = ClusterConfig.model_validate({"engine": {"parallel": {"tensor_parallel_size": 2}}, "decode_tp": 4})
    decode = cluster.worker_config(cluster.decode, "colocated-0", "gloo")
    assert (cluster.tp_of("prefill"), cluster.tp_of("decode")) == (2, 4)
    assert decode.engine.parallel.tensor_parallel_size == 4
    assert decode.engine.model == cluster.engine.model  # everything else is the cluster's engine


def test_a_step_budget_is_refused_for_colocated_engines() -> None:
    from engine.llm import engine_config

    budgeted = engine_config(device="cpu", itl_budget_ms=30.0)
    with pytest.raises(ValidationError, match="itl_budget_ms is a decode worker's budget in disaggregated"):
        ClusterConfig(engine=budgeted, mode="colocated")
    assert ClusterConfig(engine=budgeted, mode="disaggregated").engine.scheduler.itl_budget_ms == 30.0
