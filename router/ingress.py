"""RouterIngress: the body of the router's Ray Serve replicas. One Dispatcher and RouterCore per
replica, serving the OpenAI HTTP API (FastAPI, built at replica start) and the gRPC service, on
servers of its own where given addresses (`pdserve serve`: every replica of a node on the same
ports) and to Serve's proxies.

It is handed a controller handle (anything whose `workers(ttft_counts)` returns (version, prefill
handles, decode handles)) and follows worker replacements by polling that version, telling it each
time how its first tokens stand against the TTFT SLO. Knows nothing of how pools are made.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from engine.process_gc import settle_after_startup
from engine.tokenizer import Tokenizer
from router import grpc_service
from router.core import ListenAddress, RouterConfig, RouterCore
from protocol.api import WorkerStatsMsg
from router.dispatch import Dispatcher, DispatcherConfig, Workers
from router.channels import WorkerChannels
from router.follow import WorkerSetFollower
from router.grpc_server import start_grpc_server
from router.http_app import build_http_app
from router.http_server import start_http_server
from router.metrics import PrometheusMetrics
from router.ttft_window import TtftWindow

log = logging.getLogger(__name__)


class RouterIngress:
    async def __init__(  # type: ignore[misc]  # Serve awaits async constructors
        self, controller: Any, config: RouterConfig, model_dir: str, max_model_len: int,
        dispatch: DispatcherConfig | None = None, refresh_s: float = 1.0, grpc: ListenAddress | None = None,
        http: ListenAddress | None = None, metrics_dir: str | None = None, block_size: int = 16,
    ) -> None:
        from ray.actor import ActorHandle

        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        # NOTE: first, what __del__ closes: Serve calls it after a constructor that raised too.
        # The workers' per-request calls and token batches over the request channel (a direct socket
        # per worker); Ray actor handles are the ones given one.
        self.channels = WorkerChannels(lambda target: isinstance(target, ActorHandle))
        self.grpc_server: Any = None
        self.http_server: Any = None
        self.publishing: asyncio.Task[None] | None = None
        self.dispatcher = Dispatcher(
            self.router_id, Workers(prefill={}, decode={}), config=dispatch,
            on_prefill_result=lambda result: self.core.on_prefill_result(result), block_size=block_size,
        )
        # NOTE: a scrape reaches any replica of the node (a shared port, or Serve's proxy): each shares its counts
        metrics = PrometheusMetrics(config.model_name, worker_stats=self._worker_stats, replica=self.router_id,
                                    shared_dir=Path(metrics_dir) if metrics_dir is not None else None)
        ttft_ms = self.dispatcher.config.slo.ttft_ms
        window = None if ttft_ms is None else TtftWindow(self.router_id, ttft_ms / 1e3, time.monotonic)
        self.core = RouterCore(self.dispatcher, Tokenizer.from_dir(model_dir), config, max_model_len, metrics=metrics,
                               ttft_window=window)
        self.http_app = build_http_app(self.core, self.router_id)  # NOTE: `app` is Serve's wrapper's property
        # NOTE: each poll of the worker set carries this router's first tokens against the TTFT SLO (the autoscaler's)
        self.follower = WorkerSetFollower(
            self.dispatcher, lambda: controller.workers.remote(window.counts() if window is not None else None),
            refresh_s, wrap=self.channels.wrap)
        await self.follower.start()
        # its own gRPC server where asked (`pdserve serve`), else Serve's gRPC proxy: both call Generate/Complete
        if grpc is not None:
            self.grpc_server = await start_grpc_server(self, grpc)
        if http is not None:
            self.http_server = await start_http_server(self.http_app, http)
        if metrics.shared is not None:
            self.publishing = asyncio.get_running_loop().create_task(metrics.shared.publish_every_interval())
        settle_after_startup()  # NOTE: a replica's process is this router's alone (Serve starts one per replica)

    async def _worker_stats(self) -> list[WorkerStatsMsg]:
        workers = self.dispatcher.workers
        clients = [*workers.prefill.values(), *workers.decode.values()]
        rows = await asyncio.gather(*(c.stats() for c in clients), return_exceptions=True)
        return [r for r in rows if isinstance(r, WorkerStatsMsg)]

    def __serve_build_asgi_app__(self) -> Any:
        return self.http_app

    async def __del__(self) -> None:  # Serve calls it when the replica shuts down
        if self.publishing is not None:  # NOTE: its last counts stay in the node's sum: its requests happened
            self.publishing.cancel()
        if self.http_server is not None:
            await self.http_server.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
        self.channels.close()

    # ---- gRPC (pdserve.v1.Generation): the replica's own server and Serve's gRPC proxy both call these
    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:  # noqa: N802
        async for response in grpc_service.generate(self.core, request, grpc_context):
            yield response

    async def Complete(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await grpc_service.complete(self.core, request, grpc_context)
