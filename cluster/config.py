"""ClusterConfig: what a pdserve deployment runs, validated once; the CLI and the Serve config
take their defaults from here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import EngineConfig


class ClusterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineConfig = EngineConfig()
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="Separate prefill and decode pools, or one pool doing both."
    )
    num_prefill: int = Field(1, ge=0, le=256, description="Prefill workers (disaggregated mode).")
    num_decode: int = Field(1, ge=1, le=256, description="Decode workers, or colocated workers.")
    transport: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="KV transport between workers: 'auto' is nccl with GPUs, gloo without."
    )
    num_gpus_per_worker: float = Field(
        -1, description="GPUs per worker; -1: one when the cluster has GPUs, none otherwise."
    )
    host: str = Field("127.0.0.1", description="Address workers publish for KV pairing.")
    lease_ttl_s: float = Field(30.0, gt=0, description="Unclaimed decode leases are freed after this.")
    transfer_timeout_s: float = Field(30.0, gt=0, description="Longest wait for one KV transfer.")

    @model_validator(mode="after")
    def _check_pools(self) -> ClusterConfig:
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise ValueError("num_prefill must be at least 1 in disaggregated mode")
        return self

    def resolved_transport(self, has_gpus: bool) -> str:
        if self.transport == "auto":
            return "nccl" if has_gpus else "gloo"
        return self.transport

    def resolved_gpus(self, has_gpus: bool) -> float:
        if self.num_gpus_per_worker < 0:
            return 1.0 if has_gpus else 0.0
        return self.num_gpus_per_worker
