"""The Serve application: a controller deployment that owns the worker pools, and the router
ingress (HTTP + gRPC) in front. `build_app` is the import path a Serve config names
(`deploy.app:build_app`); `pdserve serve` calls it too, so both take one schema (ServeAppConfig).
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from cluster.controller import ClusterController
from deploy.schema import ServeAppConfig
from engine.rank import resolve_model_dir
from engine.models import load_arch
from router.ingress import RouterIngress

HEAD_RESOURCE = "node:__internal_head__"
"""Ray's resource that only the head node has."""

GRPC_SERVICER_FUNCTIONS = ["router.proto.pdserve_pb2_grpc.add_GenerationServicer_to_server"]
"""What Serve's gRPC proxy registers (gRPCOptions.grpc_servicer_functions)."""


class ControllerDeployment(ClusterController):
    """ClusterController as a Serve deployment (one replica): pools start with the application."""

    async def __init__(self, config: Any) -> None:  # type: ignore[misc]  # Serve awaits async constructors
        super().__init__(config)
        await self.start()


def build_app(args: dict[str, Any] | ServeAppConfig) -> Application:
    config = args if isinstance(args, ServeAppConfig) else ServeAppConfig.model_validate(args)
    engine = config.cluster.engine
    model_dir = resolve_model_dir(engine.model.model)
    max_model_len = engine.model.max_model_len or load_arch(model_dir).max_position_embeddings
    # NOTE: the controller owns the worker actors (they share its fate): pin it to the head node,
    # so that losing a GPU node loses only that node's workers.
    controller = serve.deployment(ControllerDeployment, name="Controller", num_replicas=1,
                                  ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}
                                  ).bind(config.cluster)
    ingress = serve.deployment(serve.ingress()(RouterIngress), name="Router",
                               num_replicas=config.num_router_replicas, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=max(100, config.router.max_in_flight))
    metrics_dir = config.metrics_dir or str(Path(tempfile.gettempdir()) / f"pdserve-metrics-{uuid.uuid4().hex[:12]}")
    return ingress.bind(controller, config.router, str(model_dir), max_model_len, config.dispatch, grpc=config.grpc,
                        http=config.http, metrics_dir=metrics_dir, block_size=engine.cache.block_size)
