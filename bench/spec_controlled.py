"""Speculative decoding's machinery at a real shape, driven by a LAB-ONLY proposer of controlled acceptance.

LAB ONLY: `OracleProposer` lives here, never in the product. It proposes the target's own greedy
continuation, taken from a plain run of the same prompts, each drafted token kept with probability
a and otherwise replaced by a wrong one; every result this writes says "lab-only proposer". It
measures what the engine's speculative path (drafting, the verification step's K + 1 rows a
request, acceptance, bookkeeping) gains where a decode step is memory-bound (Llama-3.1-8B reads 16
GB of weights a step), which no toy pair can show.

For each batch B of --batches: B requests of a --context-token random prompt and --max-tokens
greedy tokens (ignore_eos). A plain engine (no speculation) runs them first, for the
continuations; then, in the same process, for each (a, K) of --accepts x --ks the speculating
engine (method 'ngram' built, its proposer swapped for the oracle; adaptive K off, drafting at
every batch size) and the plain engine run them in turn. Timed from the step after every request
has its first token to the end, the device synchronised: ms per output token of a request
(decode seconds / tokens per request). Reported: the speedup plain / speculative (medians of
--repeats pairs), the measured acceptance per tested draft, tokens a verification yields against
(1 - a^(K+1)) / (1 - a), and whether every speculative output equals the plain one (greedy
verification is exact). The random weights are made decisive first (`make_decisive`, also lab only):
otherwise rounding, not the proposer, would set the acceptance.

    python -m bench.spec_controlled --model bench/shapes/llama-3.1-8b --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import gc
import json
import random
import statistics
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from bench.common import base_parser, build_engine, check_no_leak, decode_window, environment, random_prompts
from bench.common import save_plot, title, write_results
from bench.spec_decode import predicted_tokens_per_step
from engine import EngineCore, SamplingParams, SpeculativeConfig
from engine.request import Draft
from engine.spec.base import DraftRequest

LABEL = "lab-only proposer (the target's own continuation, each token kept with probability a)"
DECISIVE = ("random weights made decisive: lm_head = embed_tokens, o_proj and down_proj x 1e-3, so greedy decoding "
            "repeats the last token by a wide margin; step times do not depend on weight values")


@torch.inference_mode()
def make_decisive(engine: EngineCore) -> None:
    """LAB ONLY. Random weights at a real shape leave the argmax to rounding (near-ties everywhere), and
    a verification step computes its rows in another batch shape than a plain step, so 'the target's
    own continuation' would be rejected for rounding alone. With lm_head = embed_tokens and the
    layers' outputs scaled down, the residual stream stays close to the input token's embedding, whose
    logit (|e|^2) beats every other (e . e') by a wide margin: greedy decoding repeats its last token,
    the same in any batch shape. No kernel's work depends on the weights' values."""
    model = engine.runner.model
    model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(1e-3)
        layer.mlp.down_proj.weight.mul_(1e-3)


class OracleProposer:
    """LAB ONLY: drafts K tokens of the plain run's continuation, each kept with probability a (else the
    next token id, which greedy verification rejects). Point masses; no KV of its own."""

    name: ClassVar[str] = "oracle-lab-only"
    kv_bytes_per_block = 0

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], accept: float, k: int, vocab_size: int,
                 seed: int) -> None:
        self.continuations = continuations
        self.k = k
        self.accept = accept
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def bind(self, num_target_blocks: int, max_seq_tokens: int) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest], generator: torch.Generator | None) -> list[Draft | None]:
        drafts: list[Draft | None] = []
        for r in requests:
            continuation = self.continuations[tuple(r.token_ids[: r.num_prompt_tokens])]
            n = len(r.token_ids) - r.num_prompt_tokens
            wanted = continuation[n : n + min(self.k, r.max_draft_tokens)]
            kept = [t if self.rng.random() < self.accept else (t + 1) % self.vocab_size for t in wanted]
            drafts.append(Draft(kept) if kept else None)
        return drafts

    def chain(self, request_ids: Sequence[str], verified: torch.Tensor, generator: torch.Generator | None) -> bool:
        return False  # NOTE: drafts from the host's tokens, after each verification is read

    def skip(self) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        pass


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """(ms per output token of a request in the decode window, each request's tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    wall, decoded, _, tokens = decode_window(engine, len(prompts))
    check_no_leak(engine)
    return wall / (decoded / len(prompts)) * 1e3, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def plot(record: dict[str, Any]) -> Any:
    def draw(fig: Any) -> None:
        axes = fig.subplots(1, len(record["batches"]), squeeze=False)[0]
        for ax, batch in zip(axes, record["batches"]):
            for k in sorted({r["k"] for r in batch["runs"]}):
                rows = [r for r in batch["runs"] if r["k"] == k]
                ax.plot([r["accept"] for r in rows], [r["speedup"] for r in rows], marker="o", label=f"K={k}")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xlabel("a (probability a drafted token is the target's)")
            ax.set_ylabel("speedup over plain decoding")
            ax.set_title(f"batch {batch['batch']}: plain {batch['plain_ms_per_token']:.2f} ms/token", fontsize=9)
            ax.legend(fontsize=8)

    return draw


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--accepts", default="0.5,0.6,0.7,0.8,0.9,1.0")
    parser.add_argument("--ks", default="1,2,4,6,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this result file")
    args = parser.parse_args()
    if args.plot is not None:
        record = json.loads(args.plot.read_text())
        save_plot(args.plot.with_suffix(".png"), plot(record),
                  title(f"Speculative decoding, {LABEL}", record["environment"], record["workload"]))
        return
    batches = [int(b) for b in args.batches.split(",")]
    accepts = [float(a) for a in args.accepts.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    plain = build_engine(args, max_num_seqs=max(batches), num_blocks=args.num_blocks)
    gc.collect()
    spec_config = SpeculativeConfig(method="ngram", num_draft_tokens=max(ks), enable_adaptive_draft_length=False,
                                    disable_above_batch_size=None)
    spec = build_engine(args, max_num_seqs=max(batches), num_blocks=args.num_blocks, speculative=spec_config)
    vocab = plain.arch.vocab_size
    for engine in (plain, spec):
        make_decisive(engine)
    record: dict[str, Any] = {
        "proposer": LABEL,
        "weights": DECISIVE,
        "workload": f"context {args.context}, {args.max_tokens} greedy tokens a request, {args.repeats} pairs a "
                    f"point; {LABEL}",
        "batches": [],
    }
    for batch in batches:
        prompts = random_prompts(batch, args.context, vocab, args.seed + batch)
        run(plain, prompts, 8, f"warm{batch}")
        _, outputs = run(plain, prompts, args.max_tokens, f"ref{batch}")
        continuations = {tuple(p): o for p, o in zip(prompts, outputs)}
        rows = []
        plain_all: list[float] = []
        for k in ks:
            for a in accepts:
                oracle = OracleProposer(continuations, a, k, vocab, seed=int(a * 1000) + k)
                spec.proposer = oracle  # type: ignore[assignment]
                # NOTE: the curve is the drafting machinery's at each a and K: the draft gate, which would
                # stop drafting where it loses (engine/spec/gate.py), is left out
                spec.draft_gate = None
                spec_ms, plain_ms, same = [], [], 0
                before = spec.stats()
                for r in range(args.repeats):
                    ms, got = run(spec, prompts, args.max_tokens, f"s{batch}-{k}-{a}-{r}")
                    spec_ms.append(ms)
                    same += sum(g == o for g, o in zip(got, outputs))
                    plain_ms.append(run(plain, prompts, args.max_tokens, f"p{batch}-{k}-{a}-{r}")[0])
                after = spec.stats()
                accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
                tested = accepted + after.num_spec_rejections - before.num_spec_rejections
                steps = after.num_spec_verifications - before.num_spec_verifications
                emitted = after.num_spec_emitted_tokens - before.num_spec_emitted_tokens
                row = {
                    "k": k, "accept": a,
                    "spec_ms_per_token": statistics.median(spec_ms), "plain_ms_per_token": statistics.median(plain_ms),
                    "speedup": statistics.median(plain_ms) / statistics.median(spec_ms),
                    "measured_acceptance": accepted / tested if tested else None,
                    "tokens_per_verification": emitted / steps if steps else None,
                    "predicted_tokens_per_verification": predicted_tokens_per_step(a, k),
                    "outputs_equal_plain": f"{same} of {batch * args.repeats}",
                }
                plain_all.extend(plain_ms)
                print(json.dumps({"batch": batch, **row}), flush=True)
                rows.append(row)
        record["batches"].append({"batch": batch, "plain_ms_per_token": statistics.median(plain_all), "runs": rows})
    env = environment(plain, args)
    write_results(args.out, "spec_controlled", env, record, plot(record),
                  title(f"Speculative decoding, {LABEL}", env, record["workload"]))


if __name__ == "__main__":
    main()
