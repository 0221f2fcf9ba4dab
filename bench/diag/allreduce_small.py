"""Small all-reduces as a tensor-parallel decode step makes them (a hidden row per sequence, bfloat16, at
batch 1-256), on the GPUs of one host, one process each: NCCL's all_reduce as pdserve makes it, NCCL on
buffers registered as symmetric windows (its symmetric kernels, NCCL 2.27+), and torch's symmetric-memory
one-shot and two-shot all-reduces (peer loads over NVLink, no multicast; `_copy`: the input is an ordinary
tensor, copied into the symmetric buffer first, as a model's activations would be). Each variant's result is checked
against the sum first, then the device time of `--calls` calls captured in one CUDA graph (a step's
all-reduces: 2 a layer, 64 at the 8B shape's 32 layers), the median of 10 replays, on every rank. A
variant that is not built in, or fails, records why and the others go on (every rank takes the same path:
each decides from what it has, then the ranks agree before any collective of that variant).

    python -m bench.diag.allreduce_small --out DIR [--rows 1 8 32 64 256] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import graph_seconds

VARIANTS = ("nccl", "nccl_symmetric_window", "symm_mem_one_shot", "symm_mem_one_shot_copy", "symm_mem_two_shot")


def _agree(ok: bool, device: torch.device) -> bool:
    """Whether every rank can run a variant (an all-reduce of each rank's yes)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _variant(name: str, n: int, rank: int, device: torch.device, group_name: str,
             pools: dict[str, Any]) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """The variant's input buffer (n elements) and its call (returns the reduced tensor)."""
    if name == "nccl":
        t = torch.empty(n, dtype=torch.bfloat16, device=device)
        return t, lambda: (dist.all_reduce(t), t)[1]
    if name == "nccl_symmetric_window":
        if "nccl" not in pools:
            backend = dist.group.WORLD._get_backend(device)
            pool = torch.cuda.MemPool(backend.mem_allocator)
            backend.register_mem_pool(pool, symm=True)  # NOTE: symm=False would be plain user-buffer registration
            pools["nccl"] = pool
        with torch.cuda.use_mem_pool(pools["nccl"]):
            t = torch.empty(n, dtype=torch.bfloat16, device=device)
        return t, lambda: (dist.all_reduce(t), t)[1]
    import torch.distributed._symmetric_memory as symm_mem

    t = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(t, group_name)
    out = torch.empty_like(t)
    if name == "symm_mem_one_shot":
        return t, lambda: torch.ops.symm_mem.one_shot_all_reduce_out(t, "sum", group_name, out=out)
    if name == "symm_mem_one_shot_copy":
        local = torch.empty_like(t)  # NOTE: an ordinary tensor, as a layer's output is
        return local, lambda: torch.ops.symm_mem.one_shot_all_reduce_copy_out(t, local, "sum", group_name, out=out)
    if name == "symm_mem_two_shot":
        return t, lambda: (torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group_name), t)[1]
    raise ValueError(f"unknown variant {name!r}")


def _rank_main(rank: int, world: int, port: int, config: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group_name = dist.group.WORLD.group_name
    pools: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    for rows in config["rows"]:
        n = rows * config["hidden"]
        base = torch.randn(n, generator=torch.Generator().manual_seed(rows), dtype=torch.float32).to(device)
        expected = base * sum(range(1, world + 1))
        results[str(rows)] = {}
        for name in config["variants"]:
            record: dict[str, Any] = {}
            try:
                t, call = _variant(name, n, rank, device, group_name, pools)
                built = True
            except Exception as err:  # noqa: BLE001 - recorded; the ranks agree below before any collective
                built, record["error"] = False, f"{type(err).__name__}: {err}"[:300]
            if not _agree(built, device):
                record.setdefault("error", "another rank could not build it")
                results[str(rows)][name] = record
                continue
            try:
                t.copy_((base * (rank + 1)).to(torch.bfloat16))
                reduced = call().float()
                record["max_abs_err"] = float((reduced - expected).abs().max())
                record["ok"] = bool(torch.allclose(reduced, expected, atol=0.1 * world, rtol=0.02))
                record["us_per_call"] = graph_seconds(call, device, config["calls"]) / config["calls"] * 1e6
            except Exception as err:  # noqa: BLE001 - recorded (a failure here is the same on every rank)
                record["error"] = f"{type(err).__name__}: {err}"[:300]
            results[str(rows)][name] = record
            dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--hidden", type=int, default=4096, help="elements a row (Llama-3.1-8B: 4096)")
    parser.add_argument("--calls", type=int, default=64, help="all-reduces in one CUDA graph")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: {torch.cuda.device_count()} CUDA devices are visible")
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"rows": args.rows, "hidden": args.hidden, "calls": args.calls, "variants": args.variants}
    mp.spawn(_rank_main, args=(args.gpus, _free_port(), config, str(args.out)), nprocs=args.gpus, join=True)
    ranks = [json.loads((args.out / f"rank{r}.json").read_text()) for r in range(args.gpus)]
    doc = {"benchmark": "allreduce_small", "device_name": torch.cuda.get_device_name(0), "gpus": args.gpus,
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())), **config,
           "ranks": ranks}
    (args.out / "allreduce_small.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['device_name']} x{args.gpus}, torch {doc['torch']}, NCCL {doc['nccl']}: us per all-reduce "
          f"({args.calls} in a CUDA graph), rank 0")
    print(f"{'rows':>6} {'KiB':>7} " + " ".join(f"{v:>22}" for v in args.variants))
    for rows in args.rows:
        cells = []
        for v in args.variants:
            r = ranks[0][str(rows)][v]
            cells.append(f"{r['us_per_call']:.1f}{'' if r.get('ok') else ' WRONG'}" if "us_per_call" in r
                         else r.get("error", "?")[:22])
        print(f"{rows:>6} {rows * args.hidden * 2 / 1024:>7.0f} " + " ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
