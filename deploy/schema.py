"""ServeAppConfig: the one schema behind `pdserve serve` and the Serve config's application args
(`serve deploy deploy/serve_config.yaml`). Validated once; unknown fields are errors."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cluster.config import ClusterConfig
from router.core import ListenAddress, RouterConfig
from router.dispatch import DispatcherConfig


class ServeAppConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: ClusterConfig = ClusterConfig()
    router: RouterConfig = RouterConfig()
    dispatch: DispatcherConfig = Field(
        DispatcherConfig(),
        description="How each router replica places requests: retries, timeouts, and which prompts skip the "
        "prefill workers (local_prefill).",
    )
    num_router_replicas: int = Field(1, ge=1, le=64, description="Serve replicas of the router (HTTP and gRPC).")
    http: ListenAddress | None = Field(
        None, description="Each router replica serves the HTTP API itself on this address (`pdserve serve` sets it; "
        "the replicas of a node share it); None: only through Serve's HTTP proxy.",
    )
    metrics_dir: str | None = Field(
        None, description="A directory on each node where its router replicas share their counts, so that /metrics "
        "answers for all of them whichever one a scrape reaches; None: a new one under the temp directory.",
    )
    grpc: ListenAddress | None = Field(
        None, description="Each router replica serves gRPC itself on this address (`pdserve serve` sets it: Serve's "
        "gRPC proxy binds every interface); None: only through Serve's gRPC proxy, if grpc_options configure it.",
    )
