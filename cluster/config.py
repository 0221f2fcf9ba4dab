"""ClusterConfig: what a pdserve deployment runs, validated once; the CLI and the Serve config
take their defaults from here.

Placement: `prefill_resources` / `decode_resources` are Ray custom resources each worker of the
pool asks for, so a pool lands only on nodes that offer them. The cluster YAMLs in
deploy/clusters/ give every prefill node `pdserve_prefill: <its GPU count>` and every decode node
`pdserve_decode: <its GPU count>` (PREFILL_RESOURCE, DECODE_RESOURCE); asking 1 of it per worker
puts one worker per GPU on the right node type.
"""

from __future__ import annotations

import math
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.autoscaler import AutoscalerConfig
from decode_worker import DecodeWorkerConfig
from engine import EngineConfig
from kvtransfer.endpoint import EndpointConfig
from prefill_worker import PrefillWorkerConfig

PREFILL_RESOURCE = "pdserve_prefill"
"""The custom resource the cluster YAMLs give prefill nodes (one unit per GPU)."""
DECODE_RESOURCE = "pdserve_decode"
"""The custom resource the cluster YAMLs give decode nodes (one unit per GPU)."""

W = TypeVar("W", bound=EndpointConfig)
_SET_BY_CLUSTER = frozenset({"worker_id", "engine", "transport"})
# Ray sets these from num_cpus / num_gpus / memory; they cannot be asked for as custom resources.
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class ClusterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineConfig = EngineConfig()
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="Separate prefill and decode pools, or one pool doing both."
    )
    num_prefill: int = Field(1, ge=0, le=256, description="Prefill workers (disaggregated mode).")
    num_decode: int = Field(1, ge=1, le=256, description="Decode workers, or colocated workers.")
    prefill_tp: int | None = Field(
        None, ge=1, le=64,
        description="GPUs (tensor-parallel ranks) of each prefill worker; None: engine.parallel.tensor_parallel_size.",
    )
    decode_tp: int | None = Field(
        None, ge=1, le=64,
        description="GPUs (tensor-parallel ranks) of each decode (or colocated) worker; None: "
        "engine.parallel.tensor_parallel_size.",
    )
    autoscaler: AutoscalerConfig | None = Field(
        None, description="Size the pools against the SLOs while serving (cluster/autoscaler.py); None: fixed sizes.",
    )
    transport: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="KV transport between workers: 'auto' is nccl with GPUs, gloo without."
    )
    num_gpus_per_worker: float = Field(
        -1, description="GPUs per worker; -1: one when the cluster has GPUs, none otherwise."
    )
    prefill: PrefillWorkerConfig = Field(
        default_factory=PrefillWorkerConfig,
        description="What every prefill worker is configured with (its KV host, timeouts); the cluster sets "
        "each worker's worker_id, engine and transport.",
    )
    decode: DecodeWorkerConfig = Field(
        default_factory=DecodeWorkerConfig,
        description="What every decode (or colocated) worker is configured with (its KV host, timeouts, "
        "lease_ttl_s); the cluster sets each worker's worker_id, engine and transport.",
    )
    prefill_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each prefill worker asks for (and each of its placement-group "
        "bundles holds), e.g. {'pdserve_prefill': 1}: prefill workers then land only on nodes offering them. "
        "Empty: anywhere.",
    )
    decode_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each decode worker (or colocated worker) asks for, e.g. "
        "{'pdserve_decode': 1}. Empty: anywhere.",
    )

    @model_validator(mode="after")
    def _check_pools(self) -> ClusterConfig:
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise ValueError("num_prefill must be at least 1 in disaggregated mode")
        if self.mode == "colocated" and self.engine.scheduler.itl_budget_ms is not None:
            # NOTE: measured: on 2x H200 it cut colocated goodput at TPOT <= 20 ms from 16 to 4 req/s
            # (bench/results/adaptive_2xh200*; deploy/cli.py leaves it out for colocated mode too)
            raise ValueError("engine.scheduler.itl_budget_ms is a decode worker's budget in disaggregated mode; "
                             "colocated engines keep none: leave it out, or serve disaggregated")
        for name in ("prefill", "decode"):
            fixed = getattr(self, name).model_fields_set & _SET_BY_CLUSTER
            if fixed:
                raise ValueError(f"{name}.{sorted(fixed)[0]} is set by the cluster for each worker; set it on the "
                                 "ClusterConfig itself (engine, transport), or leave it out (worker_id)")
        for field in ("prefill_resources", "decode_resources"):
            for name, amount in getattr(self, field).items():
                _check_resource(field, name, amount)
        return self

    def tp_of(self, pool: Literal["prefill", "decode"]) -> int:
        """Ranks (GPUs) of each worker of `pool` ('decode' also names the colocated pool)."""
        asked = self.prefill_tp if pool == "prefill" else self.decode_tp
        return asked if asked is not None else self.engine.parallel.tensor_parallel_size

    def worker_config(self, template: W, worker_id: str, transport: str, **update: object) -> W:
        """One worker's config: the pool's template with this worker's id, the cluster's engine (with
        the pool's tensor-parallel size) and transport (resolved for the cluster's hardware)."""
        pool: Literal["prefill", "decode"] = "prefill" if isinstance(template, PrefillWorkerConfig) else "decode"
        parallel = self.engine.parallel.model_copy(update={"tensor_parallel_size": self.tp_of(pool)})
        engine = self.engine.model_copy(update={"parallel": parallel})
        return template.model_copy(update={"worker_id": worker_id, "engine": engine, "transport": transport,
                                           **update})

    def resolved_transport(self, has_gpus: bool) -> str:
        if self.transport == "auto":
            return "nccl" if has_gpus else "gloo"
        return self.transport

    def resolved_gpus(self, has_gpus: bool) -> float:
        if self.num_gpus_per_worker < 0:
            return 1.0 if has_gpus else 0.0
        return self.num_gpus_per_worker


def _check_resource(field: str, name: str, amount: float) -> None:
    """Ray's own rules for an actor's custom resources, checked here so a bad config fails at
    validation rather than when the first actor is created."""
    if not name or name in _RAY_BUILTIN_RESOURCES:
        raise ValueError(
            f"{field}: {name!r} is not a custom resource name; use a name of your own such as "
            f"{PREFILL_RESOURCE!r} or {DECODE_RESOURCE!r} (CPU, GPU and memory come from num_gpus_per_worker)"
        )
    if not math.isfinite(amount) or amount <= 0 or (amount > 1 and not float(amount).is_integer()):
        raise ValueError(
            f"{field}[{name!r}] is {amount}; it must be in (0, 1] or a whole number above 1 (Ray's rule)"
        )
