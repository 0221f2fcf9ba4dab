"""Time to first token through Ray alone: a Dispatcher in this process (no HTTP, no Serve router
replica) drives a running `pdserve serve`'s workers by their actor handles. Beside the offline
engine's TTFT and the router's own, it splits what serving adds into Ray + the workers' threads,
the router replica, and HTTP. Prints one JSON object: {"ttft_s": [...]}.

    python -m bench.ray_path_ttft --address HOST:PORT --prompts FILE.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path


async def measure(workers: object, prompts: list[list[int]]) -> list[float]:
    from engine import SamplingParams
    from router import Dispatcher

    dispatcher = Dispatcher("bench-ray-path", workers)  # type: ignore[arg-type]
    out = []
    try:
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            stream = dispatcher.generate(f"ray-path-{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0,
                                                                                 ignore_eos=True))
            async for output in stream:
                if output.new_token_ids:
                    out.append(time.perf_counter() - started)
                    break
            await stream.aclose()
    finally:
        await dispatcher.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the Ray address `pdserve serve` printed")
    parser.add_argument("--prompts", type=Path, required=True, help="a JSON list of token-id prompts")
    args = parser.parse_args()
    from deploy.cli import APP_NAME, _token_auth_for

    _token_auth_for(args.address)  # NOTE: before importing ray
    import ray
    from ray import serve

    from router import Workers

    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    try:
        controller = serve.get_deployment_handle("Controller", app_name=APP_NAME)
        _, prefill, decode = controller.workers.remote().result(timeout_s=60)
        ttfts = asyncio.run(measure(Workers(prefill=prefill, decode=decode), json.loads(args.prompts.read_text())))
    finally:
        ray.shutdown()
    json.dump({"ttft_s": ttfts}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
