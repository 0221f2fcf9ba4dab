"""Offline throughput on nano-vllm's published workload, against Hugging Face transformers and
against the floors, in one run:

  (1) pdserve's engine: 256 sequences, prompt and output lengths each uniform in [100, 1024]
      (Python's random, seed 0: 142,827 prompt and 133,966 output tokens), temperature 0.6,
      ignore EOS, dummy weights at the model's shape; output tokens per second.
  (2) transformers' `generate` on the same model shape and workload, static batches of
      --hf-batch (padding, every row run to its batch's longest max_tokens; only each request's
      own max_tokens count as useful output), as the baseline.
  (3) decode step time by batch size and context, beside the memory floor: (weight bytes + KV
      bytes read by the step) / measured device-to-device copy bandwidth.
  (4) prefill of one --prefill-len prompt: achieved FLOP/s against a measured bf16 matmul peak.

    python -m bench.offline_throughput --model bench/shapes/qwen3-0.6b --load-format dummy
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from bench.common import base_parser, build_engine, environment, free_device_memory, synchronize, title, write_results
from engine import EngineCore, SamplingParams


def nano_vllm_workload(num_seqs: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Exactly nano-vllm's bench.py: prompts first, then max_tokens, from one seeded stream."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, max_tokens


def run_engine(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.6, ignore_eos=True))
    synchronize(engine.device)
    start = time.perf_counter()
    num_out = steps = 0
    while engine.has_unfinished():
        num_out += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    synchronize(engine.device)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": num_out, "steps": steps, "output_tok_per_s": num_out / elapsed,
            "preemptions": engine.stats().num_preemptions}


def run_hf(model_dir: str, prompts: list[list[int]], max_tokens: list[int], batch: int, device: torch.device,
           dtype: torch.dtype) -> dict[str, Any]:
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    useful = 0
    synchronize(device)
    start = time.perf_counter()
    for b in range(0, len(prompts), batch):
        rows, lens = prompts[b : b + batch], max_tokens[b : b + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=True, temperature=0.6, pad_token_id=0)
        useful += sum(lens)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del model
    return {"elapsed_s": elapsed, "useful_output_tokens": useful, "output_tok_per_s": useful / elapsed, "batch": batch}


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes read + written per second of a large device-to-device copy (median of 10)."""
    if device.type != "cuda":
        return None
    src = torch.randn(1 << 28, device=device, dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times[3:])


def matmul_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times[3:])


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads (a tensor-parallel rank's: its shards): every parameter's and buffer's
    storage (each once: the fused projections' parts are views) but the embedding table's; a tied lm_head's rows
    (on a tensor-parallel rank 0, the first rows of its whole table) once."""
    embedding = model.model.embed_tokens.weight.untyped_storage()
    lm_head = model.lm_head.weight
    tied = lm_head.untyped_storage().data_ptr() == embedding.data_ptr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if t is not None}
    storages.pop(embedding.data_ptr())
    return sum(storages.values()) + (lm_head.numel() * lm_head.element_size() if tied else 0)


def decode_step_times(engine: EngineCore, batches: list[int], contexts: list[int], bandwidth: float | None,
                      num_steps: int = 16) -> list[dict[str, Any]]:
    arch, out = engine.arch, []
    weight_bytes = step_weight_bytes(engine.runner.model)
    rng = random.Random(1)
    for context in contexts:
        for batch in batches:
            if batch * (context + 5 * num_steps) > engine.capacity_tokens:  # NOTE: 3 timed runs, and decodes
                # during prefill
                continue
            for i in range(batch):
                prompt = [rng.randrange(arch.vocab_size) for _ in range(context)]
                # NOTE: max_tokens outlasts the prefill steps (the first requests decode while later ones
                # prefill); the requests are aborted after the timed steps.
                engine.add_request(f"d{i}", prompt, SamplingParams(max_tokens=100_000, ignore_eos=True,
                                                                    temperature=0))
            while engine.stats().num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                    for r in engine.scheduler.running):
                engine.step()  # prefill all
            running = len(engine.scheduler.running)  # fewer than batch: the cache could not hold them all
            graphs = engine.runner.graphs
            replays_before = graphs.num_replays if graphs is not None else 0
            # NOTE: consecutive steps, synchronized only at both ends, timed as one: the period at
            # which a decoding sequence gets its tokens. A synchronization around every step would
            # also time what asynchronous scheduling overlaps (the next step's host work).
            times = []
            for _ in range(3):
                synchronize(engine.device)
                start = time.perf_counter()
                for _ in range(num_steps):
                    engine.step()
                synchronize(engine.device)
                times.append((time.perf_counter() - start) / num_steps)
            for i in range(batch):
                engine.abort_request(f"d{i}")
            kv_bytes = engine.block_bytes / engine.pool.block_size * running * context  # the sequences that ran
            floor = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None
            step = statistics.median(times)
            graph_steps = (graphs.num_replays - replays_before) if graphs is not None else 0
            out.append({"batch": batch, "context": context, "num_running": running, "graph_steps": graph_steps,
                        "step_s": step,
                        "floor_s": floor, "floor_fraction": floor / step if floor else None})
            print(f"decode batch {batch:4d} (running {running:4d}, {graph_steps} graphed) ctx {context:5d}: "
                  f"{step * 1e3:8.2f} ms"
                  + (f"  floor {floor * 1e3:.2f} ms ({floor / step:.0%})" if floor else ""), flush=True)
    return out


def prefill_utilization(engine: EngineCore, length: int, peak: float | None) -> dict[str, Any]:
    arch, rng = engine.arch, random.Random(2)
    times = []
    for i in range(4):
        engine.add_request(f"p{i}", [rng.randrange(arch.vocab_size) for _ in range(length)],
                           SamplingParams(max_tokens=1, ignore_eos=True))
        synchronize(engine.device)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        synchronize(engine.device)
        times.append(time.perf_counter() - start)
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * length * length  # causal: half of 4*T^2*H*D
    # the decoder's products for every prompt token, the LM head's for the one row sampled (an embedding row
    # is a lookup, not a product)
    lm_head = arch.vocab_size * arch.hidden_size
    embedding = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) - lm_head
    decoder = arch.num_params - embedding - lm_head
    flops = 2 * decoder * length + 2 * lm_head + attention
    step = statistics.median(times[1:])
    return {"prompt_len": length, "step_s": step, "flops": flops, "flops_per_s": flops / step,
            "matmul_peak_flops_per_s": peak, "fraction_of_peak": flops / step / peak if peak else None}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=128, help="0 skips the transformers baseline")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--decode-batches", default="1,8,32,64,128,256")
    parser.add_argument("--decode-contexts", default="512,2048")
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prefill-model", default=None, help="shape for (4); default: --model")
    args = parser.parse_args()
    engine = build_engine(args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          attention_backend=args.attention_backend)
    prompts, max_tokens = nano_vllm_workload(args.num_seqs, args.seed)
    vocab = engine.arch.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]  # a no-op at real shapes (vocab > 10000)
    if args.quick:
        prompts, max_tokens = [p[:20] for p in prompts[:8]], [min(m, 16) for m in max_tokens[:8]]
    warm = nano_vllm_workload(8, 99)
    run_engine(engine, [[t % vocab for t in p[:64]] for p in warm[0]], [8] * 8)  # warm-up: kernels, allocator
    record: dict[str, Any] = {"workload": {"num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                                           "output_tokens": sum(max_tokens), "temperature": 0.6, "ignore_eos": True}}
    record["pdserve"] = run_engine(engine, prompts, max_tokens)
    record["pdserve"]["async_scheduling"] = engine.async_scheduling
    print("pdserve", record["pdserve"], flush=True)
    if engine.async_scheduling:
        # The same engine with synchronous steps, side by side (the step reads each step's tokens
        # before it schedules the next). NOTE: switched between runs, with no request live.
        engine.async_scheduling = False
        record["pdserve_sync"] = run_engine(engine, prompts, max_tokens)
        engine.async_scheduling = True
        print("pdserve, synchronous steps", record["pdserve_sync"], flush=True)
    bandwidth, peak = copy_bandwidth(engine.device), matmul_peak(engine.device)
    record["measured"] = {"copy_bytes_per_s": bandwidth, "bf16_matmul_flops_per_s": peak}
    batches = [int(b) for b in args.decode_batches.split(",")]
    contexts = [int(c) for c in args.decode_contexts.split(",")]
    record["decode_steps"] = decode_step_times(engine, batches, contexts, bandwidth)
    env = environment(engine, args)
    model_dir, device, dtype = str(engine.model_dir), engine.device, engine.dtype
    del engine  # NOTE: its KV cache holds most of the GPU; transformers needs the memory back
    free_device_memory()
    if args.hf_batch:
        record["hf_transformers"] = run_hf(model_dir, prompts, max_tokens, args.hf_batch, device, dtype)
        record["speedup_vs_hf"] = record["pdserve"]["output_tok_per_s"] / record["hf_transformers"]["output_tok_per_s"]
        print("hf", record["hf_transformers"], f"pdserve / hf = {record['speedup_vs_hf']:.2f}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.prefill_model:
        args.model = args.prefill_model
    engine = build_engine(args, max_num_batched_tokens=max(args.prefill_len, 2048),
                          attention_backend=args.attention_backend)
    if args.prefill_model:
        record["prefill_model"] = environment(engine, args)["model"]
    record["prefill"] = prefill_utilization(engine, min(args.prefill_len, engine.max_model_len - 1), peak)
    print("prefill", record["prefill"], flush=True)

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        names, values = ["pdserve"], [record["pdserve"]["output_tok_per_s"]]
        if "pdserve_sync" in record:
            names.append("pdserve sync")
            values.append(record["pdserve_sync"]["output_tok_per_s"])
        if "hf_transformers" in record:
            names.append("HF transformers")
            values.append(record["hf_transformers"]["output_tok_per_s"])
        ax1.bar(names, values)
        ax1.set_ylabel("output tokens / s")
        for context in contexts:
            rows = [r for r in record["decode_steps"] if r["context"] == context]
            ax2.plot([r["batch"] for r in rows], [r["step_s"] * 1e3 for r in rows], "o-", label=f"step, ctx {context}")
            if rows and rows[0]["floor_s"]:
                ax2.plot([r["batch"] for r in rows], [r["floor_s"] * 1e3 for r in rows], "--",
                         label=f"memory floor, ctx {context}")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("decode batch")
        ax2.set_ylabel("ms per step")
        ax2.legend(fontsize=7)

    workload = (f"{len(prompts)} seqs, {record['workload']['prompt_tokens']} prompt / "
                f"{record['workload']['output_tokens']} output tokens (nano-vllm, seed {args.seed})")
    write_results(args.out, "offline_throughput", env, record, plot, title("Offline throughput", env, workload))


if __name__ == "__main__":
    main()
