"""The `pdserve` command: `serve` (a local or joined Ray cluster serving HTTP and gRPC), `status`
(the workers, their load and KV use), `generate` (the offline engine, no Ray), `bench` (a load
generator for any OpenAI-compatible server: loadgen/).

It lives in deploy/ (not cluster/, as DESIGN.md first had it) because it runs the Serve
application that deploy/ builds, and imports point downwards only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from cluster.autoscaler import AutoscalerConfig
from cluster.config import ClusterConfig
from deploy.schema import ServeAppConfig
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kvtransfer.netaddr import free_port
from router.core import ListenAddress, RouterConfig
from router.dispatch import DispatcherConfig, LocalPrefillConfig, SloConfig

APP_NAME = "pdserve"


def _default(model: type, field: str) -> Any:
    return model.model_fields[field].default


def _help(model: type, field: str) -> str:
    return model.model_fields[field].description or ""


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (model, dtype, device, KV cache, batching), defaults and help from its configs;
    `serve`, `generate` and bench/goodput.py share them."""
    for field, kind in (("model", str), ("dtype", str), ("device", str), ("load_format", str), ("quantization", str),
                        ("max_model_len", int), ("attention_backend", str)):
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=_default(ModelConfig, field),
                            help=_help(ModelConfig, field))
    for field in ("block_size", "num_blocks"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=_default(CacheConfig, field),
                            help=_help(CacheConfig, field))
    parser.add_argument("--gpu-memory-utilization", type=float, default=_default(CacheConfig, "gpu_memory_utilization"))
    parser.add_argument("--kv-cache-dtype", default=_default(CacheConfig, "kv_cache_dtype"),
                        help=_help(CacheConfig, "kv_cache_dtype"))
    parser.add_argument("--enforce-eager", action="store_true", help=_help(ModelConfig, "enforce_eager"))
    for field in ("max_num_seqs", "max_num_batched_tokens"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=_default(SchedulerConfig, field),
                            help=_help(SchedulerConfig, field))
    parser.add_argument("--tensor-parallel-size", "--tp", type=int,
                        default=_default(ParallelConfig, "tensor_parallel_size"),
                        help=_help(ParallelConfig, "tensor_parallel_size"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over OpenAI HTTP and gRPC")
    add_engine_flags(serve)
    mode = serve.add_mutually_exclusive_group()
    mode.add_argument("--colocated", action="store_true", help="one pool doing prefill and decode (the default)")
    mode.add_argument("--prefill", type=int, default=None, help="prefill workers: disaggregated mode")
    serve.add_argument("--decode", type=int, default=_default(ClusterConfig, "num_decode"),
                       help="decode workers (or colocated workers)")
    for pool in ("prefill", "decode"):
        serve.add_argument(f"--{pool}-tp", type=int, default=None, help=_help(ClusterConfig, f"{pool}_tp"))
    serve.add_argument("--transport", default=_default(ClusterConfig, "transport"),
                       help=_help(ClusterConfig, "transport"))
    serve.add_argument("--address", default=None, help="join a running Ray cluster ('auto', or host:port)")
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC servers bind")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve.add_argument("--grpc-port", type=int, default=9000, help="gRPC port")
    serve.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY; none: open)")
    serve.add_argument("--max-in-flight", type=int, default=_default(RouterConfig, "max_in_flight"),
                       help=_help(RouterConfig, "max_in_flight") + " (each router replica's own count)")
    serve.add_argument("--num-router-replicas", type=int, default=_default(ServeAppConfig, "num_router_replicas"),
                       help="router processes; those of a node all serve --port and --grpc-port (SO_REUSEPORT)")
    serve.add_argument("--local-prefill-rule", default=_default(LocalPrefillConfig, "rule"),
                       help=_help(LocalPrefillConfig, "rule"))
    serve.add_argument("--local-prefill-max-tokens", type=int,
                       default=_default(LocalPrefillConfig, "max_short_prompt_tokens"),
                       help="prompts shorter than this skip the prefill workers under 'short_or_cached' (0: none)")
    serve.add_argument("--slo-ttft-ms", type=float, default=None, help=_help(SloConfig, "ttft_ms"))
    serve.add_argument("--slo-tpot-ms", type=float, default=None,
                       help=_help(SloConfig, "tpot_ms") + " With --local-prefill-rule slo, the router prefills each "
                       "prompt where its first token comes sooner without breaking it.")
    serve.add_argument("--autoscale-max-gpus", type=int, default=None,
                       help="size the pools against --slo-ttft-ms and --slo-tpot-ms while serving, within this many "
                       "GPUs (cluster/autoscaler.py); default: fixed pool sizes")
    serve.add_argument("--autoscale-min-prefill", type=int, default=_default(AutoscalerConfig, "min_prefill"),
                       help=_help(AutoscalerConfig, "min_prefill"))
    serve.add_argument("--config", default=None,
                       help="a JSON file with a whole ServeAppConfig: its values win over the flags; where it leaves "
                       "http, grpc or router.api_key unset, --host/--port/--grpc-port and --api-key fill them")
    serve.add_argument("--exit-after", type=float, default=None, help="stop after this many seconds (smoke tests)")

    status = sub.add_parser("status", help="workers of a running pdserve, their load and KV use")
    status.add_argument("--address", default="auto")
    status.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="Also write the autoscaler's readings of its last 20 minutes to FILE as JSON: per round "
                        "(about a second) the pools' sizes and pressures and the prefill pressure's terms.")

    generate = sub.add_parser("generate", help="complete prompts with the offline engine (no Ray)")
    add_engine_flags(generate)
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable); else one per line on stdin")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)

    from loadgen.cli import add_arguments as add_bench_arguments  # light: pydantic only, no HTTP

    bench_parser = sub.add_parser("bench", help="load-test an OpenAI-compatible server: latency, throughput, goodput")
    add_bench_arguments(bench_parser)

    from deploy.plan_cli import add_arguments as add_plan_arguments

    plan = sub.add_parser("plan", help="the layout of N GPUs (colocated or xPyD) with the best goodput under SLOs")
    add_engine_flags(plan)
    add_plan_arguments(plan)
    return parser


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The values of add_engine_flags' flags, by engine option name (engine.llm.engine_config's keywords)."""
    names = ("model", "dtype", "device", "load_format", "quantization", "max_model_len", "attention_backend",
             "enforce_eager", "block_size", "num_blocks", "gpu_memory_utilization", "kv_cache_dtype", "max_num_seqs",
             "max_num_batched_tokens", "tensor_parallel_size")
    return {n: getattr(args, n) for n in names}


def _autoscaler(args: argparse.Namespace) -> AutoscalerConfig | None:
    if args.autoscale_max_gpus is None:
        return None
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise SystemExit("pdserve serve: --autoscale-max-gpus sizes the pools against the SLOs: give --slo-ttft-ms "
                         "and --slo-tpot-ms too")
    return AutoscalerConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, max_gpus=args.autoscale_max_gpus,
                            min_prefill=args.autoscale_min_prefill)


def _refuse_ignored_flags(args: argparse.Namespace) -> None:
    """Exits naming a flag that would do nothing in the mode the others ask for."""
    if args.prefill is not None and args.prefill < 1:
        raise SystemExit(f"pdserve serve: --prefill {args.prefill}: disaggregated mode needs at least 1 prefill "
                         "worker; leave --prefill out to serve colocated")
    if args.prefill is None:
        given = [flag for flag, value, default in (
            ("--prefill-tp", args.prefill_tp, None),
            ("--local-prefill-rule", args.local_prefill_rule, _default(LocalPrefillConfig, "rule")),
            ("--local-prefill-max-tokens", args.local_prefill_max_tokens,
             _default(LocalPrefillConfig, "max_short_prompt_tokens")),
        ) if value != default]
        if given:
            raise SystemExit(f"pdserve serve: {', '.join(given)} apply to prefill workers, which colocated mode has "
                             "none of: give --prefill N too, or leave them out")
    if args.autoscale_max_gpus is None and args.autoscale_min_prefill != _default(AutoscalerConfig, "min_prefill"):
        raise SystemExit("pdserve serve: --autoscale-min-prefill bounds the autoscaler, which only "
                         "--autoscale-max-gpus starts: give it too, or leave --autoscale-min-prefill out")


def app_config(args: argparse.Namespace) -> ServeAppConfig:
    from engine.llm import engine_config

    if args.config:
        with open(args.config) as f:
            config = ServeAppConfig.model_validate(json.load(f))
        # NOTE: a file without listen addresses would serve neither port, and one without a key would
        # drop --api-key ($PDSERVE_API_KEY) silently: the flags fill what it leaves unset
        router = config.router if config.router.api_key is not None else \
            config.router.model_copy(update={"api_key": args.api_key})
        return config.model_copy(update={
            "router": router,
            "http": config.http or ListenAddress(host=args.host, port=args.port),
            "grpc": config.grpc or ListenAddress(host=args.host, port=args.grpc_port),
        })
    _refuse_ignored_flags(args)
    options = engine_options(args)
    slo = SloConfig(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    cluster = ClusterConfig(
        # NOTE: disaggregated, a share of the TPOT SLO is the engines' inter-token latency budget
        # (SchedulerConfig.itl_budget_ms: a decode worker's local prefills keep to it); colocated engines
        # get none: on 2x H200 it cut colocated goodput at TPOT <= 20 ms from 16 to 4 req/s (prompts
        # squeezed into the room left, TTFT p90 3.8 s at 8 req/s; bench/results/adaptive_2xh200*)
        engine=engine_config(options.pop("model"), itl_budget_ms=slo.step_budget_ms if args.prefill else None,
                             **options),
        mode="disaggregated" if args.prefill else "colocated",
        num_prefill=args.prefill or 1,
        num_decode=args.decode,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        autoscaler=_autoscaler(args),
        transport=args.transport,
    )
    router = RouterConfig(model_name=args.model, api_key=args.api_key, max_in_flight=args.max_in_flight)
    local = LocalPrefillConfig(rule=args.local_prefill_rule, max_short_prompt_tokens=args.local_prefill_max_tokens)
    dispatch = DispatcherConfig(local_prefill=local, slo=slo)
    return ServeAppConfig(cluster=cluster, router=router, dispatch=dispatch,
                          num_router_replicas=args.num_router_replicas,
                          http=ListenAddress(host=args.host, port=args.port),
                          grpc=ListenAddress(host=args.host, port=args.grpc_port))


def _token_auth_for(address: str | None) -> None:
    """Ray 2.60 turns token auth on by itself only for a cluster it finds ('auto'); joining one by
    explicit address needs RAY_AUTH_MODE=token, which this sets when this machine has a token."""
    explicit = address not in (None, "auto", "local")
    if explicit and "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def serve_command(args: argparse.Namespace) -> int:
    _token_auth_for(args.address)  # NOTE: before importing ray, which reads RAY_AUTH_MODE at import
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from deploy.app import build_app
    from router.proto.codegen import ensure_generated

    stop = _stop_on_signals()
    config = app_config(args)
    assert config.http is not None and config.grpc is not None  # app_config sets both
    http, grpc = config.http, config.grpc
    for address, flag in ((http, "--port"), (grpc, "--grpc-port")):
        # NOTE: before Ray starts: its failure would come 25 s later
        _check_port_free(address.host, address.port, flag if not args.config else f"{flag} (or --config's)")
    ensure_generated()
    # NOTE: the router replicas serve --port themselves (router/http_server.py); Serve's HTTP proxy, which
    # Serve always starts, gets a free port of its own on the same host.
    proxy_port = free_port(http.host)
    started = time.monotonic()
    # NOTE: "local" starts a new cluster even when another one runs on this machine.
    # NOTE: Ray's and Serve's own start-up lines (token auth, "ready at" Serve's proxy port...) off: the
    # banner below says what serves where; their errors still show.
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    context = ray.init(address=args.address or "local", include_dashboard=False, log_to_driver=False,
                       logging_level=logging.ERROR)
    _stop_on_signals(stop)  # NOTE: again: ray.init put Ray's own SIGTERM handler in place, which aborts the process
    # NOTE: the router replicas' shared counts on this node (deploy.schema); the other nodes keep theirs
    own_metrics_dir = config.metrics_dir is None  # a directory the file names is the file's to keep
    if own_metrics_dir:
        config = config.model_copy(update={"metrics_dir": tempfile.mkdtemp(prefix="pdserve-metrics-")})
    try:
        # NOTE: no Serve gRPC proxy (it binds every interface): the router replicas serve gRPC on host:grpc_port.
        serve.start(http_options=HTTPOptions(host=http.host, port=proxy_port))
        try:
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:  # Serve names the failed deployment; its replicas' errors are in its status
            raise SystemExit(f"pdserve: the application failed to start: {err}\n{_deployment_errors()}") from err
        c = config.cluster
        pools = (f"{c.num_prefill} prefill + {c.num_decode} decode" if c.mode == "disaggregated"
                 else f"{c.num_decode} colocated")
        print(f"pdserve: serving {config.router.model_name!r} with {pools} worker(s), "
              f"ready in {time.monotonic() - started:.1f} s", flush=True)
        routers = f"{config.num_router_replicas} router replica{'s' if config.num_router_replicas > 1 else ''}"
        if args.address:  # NOTE: a replica serves the port of the node it runs on
            routers += " on the nodes they run on"
        print(f"  HTTP  http://{http.host}:{http.port}/v1  (OpenAI API; /health, /metrics; served by {routers}; "
              f"Serve's proxy also on :{proxy_port})", flush=True)
        print(f"  Ray   {context.address_info['gcs_address']}  (pdserve status --address ...)", flush=True)
        print(f"  gRPC  {grpc.host}:{grpc.port}  (pdserve.v1.Generation, reflection on)", flush=True)
        _wait(stop, args.exit_after)
    finally:
        if args.address:  # a cluster this joined goes on: take the app off it
            serve.shutdown()
        # NOTE: the local cluster ray.init started ends with this, Serve and the workers included;
        # serve.shutdown() first made Ctrl-C wait 30 s for Serve's controller (measured ~55 s to exit).
        ray.shutdown()
        if own_metrics_dir and config.metrics_dir is not None:
            shutil.rmtree(config.metrics_dir, ignore_errors=True)
    return 0


def _deployment_errors() -> str:
    """Each unhealthy deployment of the app with Serve's message for it (a replica's constructor's traceback):
    with log_to_driver off they would be in Ray's session logs only."""
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception as err:  # noqa: BLE001 - the cause is reported already; this only adds detail
        return f"(Serve's status could not be read: {err})"
    if app is None:
        return "(Serve lists no such application)"
    lines = [f"  {name}: {getattr(d.status, 'value', d.status)}: {d.message}"  # NOTE: a str enum; its bare name
             for name, d in app.deployments.items() if d.status != "HEALTHY"]
    return "\n".join(lines) or f"  (every deployment healthy; application: {app.status}: {app.message})"


def _check_port_free(host: str, port: int, flag: str) -> None:
    """Exits naming the port when something listens on it already (the router replica would fail to
    bind it once the whole cluster had started, and say so only in Ray's logs)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to take
        try:
            sock.bind((host, port))
        except OSError as err:
            raise SystemExit(f"pdserve serve: {host}:{port} is in use ({err.strerror}): stop what listens there, "
                             f"or pass {flag} with a free port") from None


def _wait(done: threading.Event, exit_after: float | None) -> None:
    try:
        done.wait(exit_after)
    except KeyboardInterrupt:
        pass


def _stop_on_signals(done: threading.Event | None = None) -> threading.Event:
    """An event set by SIGINT (Ctrl-C) or SIGTERM (`done`, or a new one). Installed by the server itself, so both
    stop it even when it was started with SIGINT ignored (a background job of a non-interactive script)."""
    done = done if done is not None else threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    return done


def status_command(args: argparse.Namespace) -> int:
    _token_auth_for(args.address)  # NOTE: before importing ray, which reads RAY_AUTH_MODE at import
    import ray
    from ray import serve

    try:
        ray.init(address=args.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except ConnectionError:
        print(f"pdserve status: no Ray cluster runs at --address {args.address}, so no pdserve either: start one "
              "with `pdserve serve`, or pass the address it printed (its 'Ray' line)", file=sys.stderr)
        return 1
    logging.getLogger("ray.serve").setLevel(logging.ERROR)  # NOTE: its handle logs an INFO line with an object repr
    try:
        try:
            controller = serve.get_deployment_handle("Controller", app_name=APP_NAME)
        except Exception:  # noqa: BLE001 - Serve says it in several ways: no app, no controller
            print(f"pdserve status: the Ray cluster at --address {args.address} runs no pdserve application "
                  f"({APP_NAME!r}): start one with `pdserve serve`", file=sys.stderr)
            return 1
        rows = controller.stats.remote().result(timeout_s=30)
        decisions = controller.decisions.remote().result(timeout_s=30)
        decisions += controller.decisions.remote(held_back=True).result(timeout_s=30)
        decisions.sort(key=lambda d: -d[0])  # NOTE: oldest first, as each list is
        first_tokens = controller.first_tokens.remote().result(timeout_s=30)
        trace = controller.pressure_trace.remote().result(timeout_s=30) if args.trace is not None else None
    finally:
        ray.shutdown()
    print(f"{'worker':<16}{'role':>8}{'running':>8}{'waiting':>8}{'KV used':>12}{'leases':>8}{'pushing':>8}"
          f"{'step max':>10}{'gc max':>8}{'channels':>10}  health")
    for row in rows:
        if isinstance(row, str):
            print(f"{'?':<16}  unreachable: {row}")
            continue
        kv = f"{row.num_blocks - row.num_free_blocks}/{row.num_blocks}"
        role = "decode*" if row.computes_every_prompt else row.role
        step_ms = f"{row.longest_recent_step_seconds * 1e3:.0f}ms"
        gc_ms = f"{max(row.longest_recent_gc_seconds, row.follower_longest_gc_seconds) * 1e3:.0f}ms"
        print(f"{row.worker_id:<16}{role:>8}{row.num_running:>8}{row.num_waiting:>8}{kv:>12}{row.num_leases:>8}"
              f"{row.num_pushing:>8}{step_ms:>10}{gc_ms:>8}{row.num_channels:>10}  "
              f"{'ok' if row.is_healthy else 'FAILED'}")
    print("step max: the longest of a worker's last 512 engine steps; gc max: the longest garbage-collector pause "
          "of the last 10 s in its processes (every rank's)")
    if any(not isinstance(row, str) and row.computes_every_prompt for row in rows):
        print("decode*: no prefill worker is left; it computes every prompt it is sent, as a colocated worker")
    for row in rows:
        if not isinstance(row, str) and row.weights:
            print(f"engine of {row.worker_id}: weights {row.weights}, KV cache {row.kv_cache_dtype}"
                  + (f" ({row.kv_scales} scales)" if row.kv_scales else "")
                  + (f", {row.parallel}" if row.parallel else ""))
    if trace is not None:
        args.trace.write_text(json.dumps(trace))
        print(f"autoscaler readings: {len(trace)} written to {args.trace}")
    if first_tokens is not None:
        num, late = first_tokens
        print(f"first tokens over the routers' last 10 s: {num}, {late} of them later than the TTFT SLO")
    if decisions:
        print("autoscaler decisions (latest last):")
        for ago_s, pool, num_workers, why in decisions[-10:]:
            print(f"  {ago_s:7.0f} s ago  {pool} -> {num_workers} workers: {why}")
    return 0


def generate_command(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    options = engine_options(args)
    llm = LLM(options.pop("model"), **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts = args.prompt or (line.rstrip("\n") for line in sys.stdin)
    for prompt in prompts:
        if prompt:
            for step in llm.stream(prompt, params):
                print("".join(o.new_text for o in step), end="", flush=True)
            print()
    return 0


def plan_command(args: argparse.Namespace) -> int:
    from deploy.plan_cli import run

    return run(args, engine_options(args))


def bench_command(args: argparse.Namespace) -> int:
    from loadgen.cli import run_command

    return run_command(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"serve": serve_command, "status": status_command, "generate": generate_command,
                "bench": bench_command, "plan": plan_command}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
