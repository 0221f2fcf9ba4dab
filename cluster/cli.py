"""The `pdserve` command.

Until the router lands (issue "Router and APIs"), `pdserve serve` runs the offline engine on the
model and streams a completion for each prompt it reads (one per line on stdin, or --prompt).
"""

from __future__ import annotations

import argparse
import sys
import time

from engine import LLM, SamplingParams
from engine.config import CacheConfig, ModelConfig, SchedulerConfig

_MODEL = ModelConfig.model_fields
_SCHED = SchedulerConfig.model_fields
_CACHE = CacheConfig.model_fields


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model (for now: the offline engine, prompts on stdin)")
    serve.add_argument("--model", default=_MODEL["model"].default, help=_MODEL["model"].description)
    serve.add_argument("--dtype", default=_MODEL["dtype"].default, help=_MODEL["dtype"].description)
    serve.add_argument("--device", default=_MODEL["device"].default, help=_MODEL["device"].description)
    serve.add_argument("--max-num-seqs", type=int, default=_SCHED["max_num_seqs"].default)
    serve.add_argument("--block-size", type=int, default=_CACHE["block_size"].default)
    serve.add_argument("--prompt", action="append", help="a prompt to complete (repeatable); else read stdin")
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--temperature", type=float, default=0.0)
    return parser


def serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs, block_size=args.block_size
    )
    engine = llm.engine
    print(
        f"pdserve: {engine.arch.architecture} from {engine.model_dir} on {engine.device} ({engine.dtype}), "
        f"KV capacity {engine.capacity_tokens} tokens, ready in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts = args.prompt or None
    if prompts is None:
        print("pdserve: type a prompt per line (Ctrl-D ends)", file=sys.stderr)
        prompts = (line.rstrip("\n") for line in sys.stdin)
    for prompt in prompts:
        if not prompt:
            continue
        for step in llm.stream(prompt, params):
            for out in step:
                print(out.new_text, end="", flush=True)
        print()
    engine.check_integrity()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
