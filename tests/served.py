"""A cluster under its controller with one router following its worker set, as a served router does
(a Dispatcher taking the controller's set every `follow_s`; over request channels with `channels`, as a
Ray Serve router replica reaches its workers), for the integration and GPU tests of role changes and
the autoscaler. Stopped (router, channels, cluster) on leaving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from cluster.config import ClusterConfig
from cluster.controller import ClusterController
from engine import SamplingParams
from router import Dispatcher, DispatcherConfig, LocalPrefillConfig

REMOTE = DispatcherConfig(local_prefill=LocalPrefillConfig(rule="remote"))


@contextlib.asynccontextmanager
async def served(config: ClusterConfig, router_id: str, dispatch: DispatcherConfig = REMOTE, *,
                 channels: bool = False, autoscale_interval_s: float = 1.0, follow_s: float = 0.25,
                 on_follow: Callable[[ClusterController], None] = lambda c: None,
                 ) -> AsyncIterator[tuple[ClusterController, Dispatcher]]:
    controller = ClusterController(config, autoscale_interval_s=autoscale_interval_s)
    await controller.start()
    wrap: Callable[..., object] = lambda workers: workers  # noqa: E731 - in-process or Ray handles as they are
    worker_channels = None
    if channels:
        from ray.actor import ActorHandle

        from router.channels import WorkerChannels

        worker_channels = WorkerChannels(lambda target: isinstance(target, ActorHandle))
        wrap = worker_channels.wrap
    dispatcher = Dispatcher(router_id, wrap(controller.deployment.workers()), poll_timeout_s=0.5, config=dispatch)

    async def follow() -> None:
        while True:
            await asyncio.sleep(follow_s)
            dispatcher.set_workers(wrap(controller.deployment.workers()))
            on_follow(controller)

    follower = asyncio.get_running_loop().create_task(follow())
    try:
        yield controller, dispatcher
    finally:
        follower.cancel()
        await dispatcher.close()
        if worker_channels is not None:
            worker_channels.close()
        await controller.shutdown()


async def tokens_of(dispatcher: Dispatcher, request_id: str, prompt: list[int], params: SamplingParams,
                    delay_s: float = 0.0) -> list[int]:
    """One request's tokens through the router, sent after `delay_s`."""
    await asyncio.sleep(delay_s)
    return [t async for out in dispatcher.generate(request_id, prompt, params) for t in out.new_token_ids]
