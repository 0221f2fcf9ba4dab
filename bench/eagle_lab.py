"""Would an EAGLE-1 head draft for the trained pair better than its draft model? Trains one and
compares them by exact simulation and lab costs. Lab only: an EAGLE proposer built on these heads
lost to the draft model in the engine and was deleted (bench/results/eagle_vs_draft_*, README).

1. Trains a head (bench/eagle_head.py: one decoder layer on the target's hidden states, KL to the
   target over --steps unrolled drafting steps) for --head-seconds on the pair's training corpus
   (bench.train_models' split, the target's tokenizer).
2. Held-out, teacher-forced: each drafting step's expected acceptance at T=1 (mean of
   sum_v min(p, q)) for the head, beside the draft model's first step.
3. Held-out prompts, speculative decoding simulated exactly (bench/spec_sim.py; batch 1, K drafted
   per verification, no adaptive K): acceptance per drafted token and tokens per verification of
   the draft model and of the head, at T=0 and T=1, same prompts and seeds.
4. On a GPU, each step's pieces in CUDA graphs (bench/draft_costs.py: plain torch ops for every
   model alike, so their ratios and not their levels carry over to the engine), and a projection:
   tokens per verification x plain step / (verification + drafting).

    python -m bench.eagle_lab --pair DIR [--head-seconds 90] [--save-head DIR2] [--out bench/results]
DIR: bench.train_models' --out (target/, draft/, held_out.txt). --head DIR2 measures a head saved
before (bench/eagle_head.py save_head) instead of training one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import save_plot
from bench.draft_costs import Costs
from bench.eagle_head import EagleHead, head_loss, load_head, save_head
from bench.spec_sim import HeadDrafter, ModelDrafter, simulate
from bench.train_llama import TrainConfig, TrainLlama, Windows, run_training
from bench.train_models import SIZES, load_checkpoint, prepare_corpus, resolve_device


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", type=Path, required=True, help="bench.train_models' --out folder.")
    p.add_argument("--size", default="gpu", choices=list(SIZES), help="The train_models size the pair was trained at.")
    p.add_argument("--head", type=Path, default=None, help="A saved head to measure (no training).")
    p.add_argument("--save-head", type=Path, default=None, help="Where to save the trained head.")
    p.add_argument("--head-seconds", type=float, default=90.0)
    p.add_argument("--head-steps", type=int, default=2_000, help="Training steps at most.")
    p.add_argument("--unroll", type=int, default=4, help="Drafting steps unrolled in training (training-time test).")
    p.add_argument("--lr", type=float, default=5e-4, help="2e-3 diverged within 70 steps on an H200 (no input norm)")
    p.add_argument("--batch-size", type=int, default=None, help="Default: the size's.")
    p.add_argument("--k", type=int, default=4, help="Drafts per verification.")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--tag", default="pair88m")
    args = p.parse_args(argv)
    for name in ("head_seconds", "head_steps", "unroll", "k", "num_prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


@torch.no_grad()
def expected_acceptance(target: TrainLlama, draft: TrainLlama, head: EagleHead, windows: torch.Tensor,
                        steps: int) -> dict[str, Any]:
    """Mean sum_v min(p, q) at T=1 over held-out windows, teacher-forced: the draft model's next token,
    and the head's drafting step s from a chain started s - 1 indices earlier (head.unrolled)."""
    device = target.lm_head.weight.device
    sums = [0.0] * (steps + 1)
    counts = [0] * (steps + 1)
    for batch in windows.split(8):
        inputs = batch[:, :-1].to(device)
        seq = inputs.shape[1]
        h = target.hidden(inputs)
        p = F.softmax(target.logits(h).float(), -1)
        q = F.softmax(draft(inputs).float(), -1)
        sums[0] += float(torch.minimum(p, q).sum())
        counts[0] += p.shape[0] * p.shape[1]
        for s, f in enumerate(head.unrolled(inputs[:, 1:], head.features(h)[:, : seq - 1], steps), start=1):
            qh = F.softmax(head.logits(f[:, s - 1 :]).float(), -1)
            ph = p[:, s:]
            sums[s] += float(torch.minimum(ph, qh).sum())
            counts[s] += ph.shape[0] * ph.shape[1]
    return {
        "draft_model_next_token": sums[0] / counts[0],
        "head_by_step": [sums[s] / counts[s] for s in range(1, steps + 1)],
        "num_tokens": counts[0],
    }


def held_out_prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    text = (args.pair / "held_out.txt").read_text(errors="replace")
    ids = tokenizer.encode(text).ids
    if len(ids) < args.prompt_len + 1:
        raise ValueError(f"held_out.txt has {len(ids)} tokens; --prompt-len is {args.prompt_len}")
    rng = random.Random(args.seed)
    return [ids[s : s + args.prompt_len] for s in (rng.randrange(len(ids) - args.prompt_len)
                                                   for _ in range(args.num_prompts))]


def projection(sim: dict[str, Any], costs: dict[str, float]) -> dict[str, float]:
    """Speculative over plain decode speed, from the simulated tokens per verification and the costs."""
    loops = {"draft_model": costs["draft_model_loop"], "head": costs["head_loop"]}
    return {
        f"{drafter}_t{t}": sim[f"{drafter}_t{t}"]["tokens_per_verification"] * costs["plain_step"]
        / (costs["verification"] + loops[drafter])
        for drafter in loops
        for t in ("0", "1")
    }


def plot(record: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        ax1, ax2, ax3 = fig.subplots(1, 3)
        names = [f"{d}_t{t}" for d in ("draft_model", "head") for t in ("0", "1")]
        sim = record["simulated"]
        ax1.bar(names, [sim[n]["accepted_per_drafted"] for n in names])
        ax1.set_title("accepted per drafted token (simulated)")
        ax1.tick_params(axis="x", rotation=30)
        steps = record["teacher_forced_acceptance_t1"]["head_by_step"]
        ax2.plot(range(1, len(steps) + 1), steps, marker="o", label="head, step s")
        ax2.axhline(record["teacher_forced_acceptance_t1"]["draft_model_next_token"], color="gray", ls="--",
                    label="draft model, next token")
        ax2.set_xlabel("drafting step")
        ax2.set_title("held-out expected acceptance, T=1")
        ax2.legend()
        proj = record.get("projected_speedup")
        if proj:
            ax3.bar(list(proj), list(proj.values()))
            ax3.axhline(2.0, color="gray", ls="--")
            ax3.set_title("projected speedup over plain (lab costs)")
            ax3.tick_params(axis="x", rotation=30)
        else:
            ax3.set_axis_off()

    return draw


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    target = load_checkpoint(args.pair / "target").to(device).requires_grad_(False)
    draft = load_checkpoint(args.pair / "draft").to(device).requires_grad_(False)
    plan = SIZES[args.size]
    corpus = prepare_corpus(plan, target.lm_head.weight.shape[0], args.pair / "target")
    cfg = TrainConfig(args.head_steps, args.head_seconds, args.batch_size or plan.batch_size, plan.seq_len, args.lr)
    if args.head is not None:
        head, training = load_head(args.head, target), {"loaded_from": str(args.head)}
    else:
        head = EagleHead(target, args.seed).to(device)
        windows = Windows(corpus.train_stream, plan.seq_len, args.seed + 7, device)
        run = run_training(head, head_loss(head, target, args.unroll), windows, cfg, device, "head", print)
        if not math.isfinite(run.final_loss):
            raise RuntimeError(f"the head's training diverged: final loss {run.final_loss}")
        training = {"num_steps": run.num_steps, "seconds": run.seconds, "final_loss": run.final_loss,
                    "tokens_per_s": run.tokens_per_s, "unroll": args.unroll, "lr": args.lr,
                    "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}
        if args.save_head is not None:
            save_head(args.save_head, head, args.unroll)
    head.requires_grad_(False)
    eval_windows = corpus.eval_windows[: args.eval_windows]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        teacher = expected_acceptance(target, draft, head, eval_windows, args.unroll)
    print(f"teacher-forced acceptance T=1: draft model {teacher['draft_model_next_token']:.3f}, "
          f"head by step {[round(x, 3) for x in teacher['head_by_step']]}")

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, draft, head = target.to(dtype), draft.to(dtype), head.to(dtype)
    prompts = held_out_prompts(args, corpus.tokenizer)
    sim: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    drafters = {"draft_model": ModelDrafter(draft), "head": HeadDrafter(head, target)}
    for t in (0.0, 1.0):
        for name, drafter in drafters.items():
            counts, outs = simulate(target, drafter, prompts, args.k, t, args.max_tokens, args.seed)
            sim[f"{name}_t{t:g}"] = counts.summary()
            outputs[f"{name}_t{t:g}"] = outs
            print(name, f"T={t:g}", json.dumps(sim[f"{name}_t{t:g}"]))
    # Exact at T=0: both drafters must leave the target's greedy output as it is.
    greedy_equal = outputs["draft_model_t0"] == outputs["head_t0"]

    record: dict[str, Any] = {
        "lab_only": "simulated decoding and lab costs of an EAGLE-1 head (the engine's: bench.spec_decode)",
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "pair": str(args.pair),
        "target_params": target.num_params,
        "draft_params": draft.num_params,
        "head_params": head.num_params,
        "head_training": training,
        "workload": {"k": args.k, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "dtype": str(dtype), "seed": args.seed},
        "teacher_forced_acceptance_t1": teacher,
        "simulated": sim,
        "greedy_outputs_equal": greedy_equal,
    }
    if device.type == "cuda":
        costs = Costs(target, draft, head, args.k, args.prompt_len + args.max_tokens // 2).measure(count=20)
        record["costs_s"] = costs
        record["projected_speedup"] = projection(sim, costs)
        print("costs (us):", {n: round(c * 1e6, 1) for n, c in costs.items()})
        print("projected:", {n: round(v, 2) for n, v in record["projected_speedup"].items()})
    record["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    slug = record["device_name"].lower().replace(" ", "-")
    stem = args.out / f"eagle_lab_{args.tag}_{slug}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    save_plot(stem.with_suffix(".png"), plot(record),
              f"EAGLE-style head vs draft model (lab only), {record['device_name']}, K={args.k}, "
              f"{args.num_prompts} held-out prompts x {args.max_tokens} tokens")
    return record


if __name__ == "__main__":
    main()
