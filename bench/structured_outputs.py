"""Structured outputs on one GPU: what a JSON schema on every request costs, beside the same run
unconstrained, in one process:

  (1) throughput on nano-vllm's workload (256 sequences, prompt and output lengths uniform in
      [100, 1024], temperature 0.6, ignore EOS, dummy weights at the model's shape): unconstrained,
      then every request under LONG_SCHEMA (records of bounded fields, at least 100,000 of them, so
      no output completes before its max_tokens and both runs generate the same tokens), in turns
      A B, B A, ...; output tokens per second and the ratio per round, and where the host's time went
      (waiting for the device's tokens, the grammar book's work, the engine thread's wait for it) and
      the device's (its waits at the gate for masks still filling).
  (2) batch 1, one request of --batch1-tokens output tokens, plain and constrained in turns (4 each,
      ABBA): median time per token, their difference (what the grammar adds per token), and the
      host's mask fill per token timed on its own.
  (3) the grammar work of one step of 64 and 256 constrained rows (advance a token, fill every mask),
      call to mask ready (where a draw waiting at its gate goes on), alone and while another thread
      runs Python half the time or all of it (what the engine thread's own work costs the fill): in
      the grammar process (the product), and on a thread of this process (the design before it,
      built here as the baseline).
  (4) compile time of the test schemas (tests/unit/engine/test_grammar.py's set, repeated here):
      first compile with a fresh compiler, and the cached one.

The vocabulary: the GPU machines have no Qwen3 tokenizer and no downloads; `--train-vocab N` trains a
byte-level BPE of N tokens on this machine's Python sources (bench.train_models.corpus_files: the
standard library, then installed packages, up to 200 MB; the HF tokenizers trainer, deterministic
for one set of files) and pads it to the model's logits width: a real BPE vocabulary of the model's
size, not Qwen's own. The mask's cost follows the vocabulary's size and makeup, so the figures hold
for a vocabulary like it. NOTE: the committed H100 figures trained on the sorted union of the two
directories' files (before corpus_files served here), so another 200 MB than a run now takes.

    python -m bench.structured_outputs --model bench/shapes/qwen3-0.6b --load-format dummy --train-vocab 151643

On the GPU machines (no xgrammar, pydantic or Ray there): `bash bench/make_bench_bundle.sh .benchbundle` here,
carry [".benchbundle"], and start the command with
`tar -xJf .benchbundle/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.common import base_parser, build_engine, check_no_leak, environment, synchronize, title, write_results
from bench.offline_throughput import nano_vllm_workload
from bench.train_models import corpus_files
from engine import EngineCore, SamplingParams
from engine.config import GrammarSpec
from engine.grammar import GrammarCompiler
from engine.grammar_book import GrammarBook

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "ok"],
}
LONG_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 100000}},
               "required": ["records"]}
# tests/unit/engine/test_grammar.py's SCHEMAS
TEST_SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "role": {"enum": ["admin", "guest", "owner"]}},
                 "required": ["id", "role"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                        "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "bounded_number": {"type": "object", "properties": {"score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                                        "level": {"type": "integer", "minimum": 3, "maximum": 7}},
                       "required": ["score", "level"]},
    "long_records": LONG_SCHEMA,
}


CORPUS_BYTES = 200 << 20  # of Python sources: enough for 151,643 merges


def train_vocab(model_dir: Path, vocab_size: int, out: Path) -> dict[str, Any]:
    """A copy of model_dir's config with a trained byte-level BPE tokenizer.json of vocab_size tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files, size = [], 0
    for _, f in corpus_files(site_packages=True):  # the stdlib's sources, then the installed packages'
        if size >= CORPUS_BYTES:
            break
        files.append(f)
        size += os.path.getsize(f)
    started = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((Path(f).read_text(encoding="utf-8", errors="ignore") for f in files), trainer)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    tokenizer.save(str(out / "tokenizer.json"))
    lengths = sorted(len(t) for t in tokenizer.get_vocab())
    if tokenizer.get_vocab_size() < vocab_size:
        raise RuntimeError(f"the corpus ({size} bytes) gave {tokenizer.get_vocab_size()} tokens of {vocab_size}")
    return {"files": len(files), "bytes": size, "vocab_size": tokenizer.get_vocab_size(),
            "mean_token_chars": statistics.fmean(lengths), "max_token_chars": lengths[-1],
            "train_s": time.perf_counter() - started}


def _timed(fn: Any, totals: dict[str, float], key: str) -> Any:
    """fn, each call's duration added to totals[key] (on whichever thread calls it)."""

    def call(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            totals[key] += time.perf_counter() - started

    return call


class HostClock:
    """Where a run's grammar time goes, timed around this engine's grammar book (an instrument on the
    instance; the engine is unchanged): `seconds["calls"]` the engine thread in the book's calls
    (reading acks, sending the work), `seconds["wait"]` the host waiting for a fill (a CPU draw's; on
    CUDA the device waits instead, at the gate); the process's own work is the book's work_seconds."""

    def __init__(self, engine: EngineCore) -> None:
        self.seconds = {"calls": 0.0, "wait": 0.0}
        self.book = book = engine.grammars
        for name in ("submit", "mask_drafts"):  # NOTE: mask() and accept() are submits
            setattr(book, name, _timed(getattr(book, name), self.seconds, "calls"))
        book.wait = _timed(book.wait, self.seconds, "wait")  # type: ignore[method-assign]
        self._gate_events: list[tuple[Any, Any]] = []
        if book.gate is not None:  # the device's waits at the gate, between events around each
            gate, wait = book.gate, book.gate.wait

            def timed_wait(ticket: int) -> None:
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
                wait(ticket)
                after.record()
                self._gate_events.append((before, after))

            gate.wait = timed_wait  # type: ignore[method-assign]

    def read(self) -> dict[str, float]:
        """The totals so far; the device's time at the gate since the last read (synchronized before)."""
        events, self._gate_events = self._gate_events, []
        return {"grammar_calls_s": self.seconds["calls"], "grammar_wait_s": self.seconds["wait"],
                "grammar_process_work_s": self.book.work_seconds,
                "device_gate_s": sum(a.elapsed_time(b) for a, b in events) / 1e3}


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int], grammar: GrammarSpec | None,
        clock: HostClock | None = None) -> dict:
    """One timed run; with a clock, the host's time by part: waiting for the device's tokens
    (engine.wait_seconds), the engine thread in the grammar book's calls and waiting for its fills,
    the grammar process's work, and the device's waits at the gate."""
    if grammar is not None:
        engine.grammars.compile_within(grammar)  # as a worker does, off the timed path
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=m, temperature=0.6, ignore_eos=True, grammar=grammar))
    synchronize(engine.device)
    before = (engine.wait_seconds, clock.read()) if clock else None
    start = time.perf_counter()
    num_out = steps = 0
    while engine.has_unfinished():
        num_out += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    synchronize(engine.device)
    elapsed = time.perf_counter() - start
    check_no_leak(engine)
    result = {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_per_s": num_out / elapsed, "steps": steps}
    if clock and before:
        after = clock.read()
        result["host"] = {"device_wait_s": engine.wait_seconds - before[0],
                          **{k: after[k] - before[1][k] for k in after if k != "device_gate_s"},
                          "device_gate_s": after["device_gate_s"]}
    return result


def profile_runs(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int],
                 spec: GrammarSpec, top: int = 30) -> dict[str, Any]:
    """One unconstrained and one constrained run under cProfile (this thread: the engine's): the
    functions whose own time grows most with the grammar, and each run's total."""
    import cProfile
    import pstats

    own: dict[str, dict[str, tuple[float, int]]] = {}
    elapsed: dict[str, float] = {}
    for name, grammar in (("unconstrained", None), ("json_schema", spec)):
        profiler = cProfile.Profile()
        profiler.enable()
        elapsed[name] = run(engine, prompts, max_tokens, grammar)["elapsed_s"]
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        own[name] = {f"{Path(f).name}:{line}:{fn}": (tt, calls) for (f, line, fn), (_, calls, tt, _, _) in stats.items()}
    plain, constrained = own["unconstrained"], own["json_schema"]
    grown = sorted(constrained, key=lambda k: constrained[k][0] - plain.get(k, (0.0, 0))[0], reverse=True)[:top]
    return {"elapsed_s": elapsed, "own_s": {k: {"unconstrained": plain.get(k, (0.0, 0))[0],
                                                 "json_schema": constrained[k][0], "calls": constrained[k][1]}
                                             for k in grown}}


def fill_cost(compiler: GrammarCompiler, spec: GrammarSpec, num_tokens: int) -> dict[str, float]:
    """The host's mask fill per token for one matcher walking num_tokens allowed tokens (seeded choice)."""
    import random

    import xgrammar as xgr

    rng = random.Random(0)
    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    times = []
    for _ in range(num_tokens):
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        allowed = (((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[: compiler.vocab_size]).nonzero()
        assert matcher.accept_token(int(allowed[rng.randrange(len(allowed))]))
    times.sort()
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": times[int(0.9 * len(times))] * 1e3,
            "max_ms": times[-1] * 1e3, "mean_ms": statistics.fmean(times) * 1e3}


def _spin(stop: threading.Event, busy_s: float, idle_s: float) -> None:
    """Keeps the interpreter busy (pure Python) for busy_s, then sleeps idle_s (the GIL free), until stop."""
    while not stop.is_set():
        until = time.perf_counter() + busy_s
        while time.perf_counter() < until:
            pass
        if idle_s:
            time.sleep(idle_s)


class _ProcessBook:
    """The product's grammar work: a GrammarBook, its matchers in the grammar process (unregistered
    slots: the host waits for each fill)."""

    def __init__(self, engine: EngineCore, spec: GrammarSpec, rows: int) -> None:
        arch = engine.arch
        self.book = GrammarBook(engine.model_dir, arch.vocab_size, arch.eos_token_ids, rows)
        self.ids = [f"b{i}" for i in range(rows)]
        for rid in self.ids:
            self.book.add(rid, spec, [])

    @property
    def work_seconds(self) -> float:
        return self.book.work_seconds

    def step(self, tokens: list[int], moving: list[bool]) -> tuple[torch.Tensor, float]:
        """The filled bitmask, and when it was ready (the ticket's word written: a waiting draw goes on)."""
        mask = self.book.submit([(rid, [t]) for rid, t, m in zip(self.ids, tokens, moving) if m], self.ids)
        assert mask is not None and mask.filling is not None
        mask.filling.before_use()
        return mask.bitmask, self.book.finished_at

    def close(self) -> None:
        self.book.close()


class _ThreadBook:
    """Baseline (measured beside the product, not part of it): the design before the grammar process,
    the matchers in this process and each step's advance and fill on one thread of it."""

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec, rows: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.matchers = [xgr.GrammarMatcher(compiler.compile(spec)) for _ in range(rows)]
        self.batch = xgr.BatchGrammarMatcher()
        self.bitmask = xgr.allocate_token_bitmask(rows, compiler.vocab_size)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.work_seconds = 0.0

    def step(self, tokens: list[int], moving: list[bool]) -> tuple[torch.Tensor, float]:
        """The filled bitmask, and when it was ready (the work's end on the thread, where it opened its gate)."""

        def work() -> float:
            started = time.perf_counter()
            moved = [(m, t) for m, t, go in zip(self.matchers, tokens, moving) if go]
            if moved:
                assert all(self.xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in moved],
                                                                           [t for _, t in moved]))
            self.batch.batch_fill_next_token_bitmask(self.matchers, self.bitmask)
            finished = time.perf_counter()
            self.work_seconds += finished - started
            return finished

        return self.bitmask, self.thread.submit(work).result()

    def close(self) -> None:
        self.thread.shutdown()


def batch_fill_cost(engine: EngineCore, compiler: GrammarCompiler, spec: GrammarSpec, rows: int, steps: int,
                    spread: int = 200) -> dict[str, Any]:
    """The grammar work of one step of `rows` constrained requests (each matcher advanced by a token,
    then every row's mask filled), from the call to the mask ready (where a draw waiting at its gate
    would go on; the same clock in both processes), by design: the grammar process
    (the product's GrammarBook) and, beside it, a thread of this process (the design before). The rows
    in spread-out states (`spread` steps first, each row advancing or not by a coin); per step: alone,
    while another thread runs Python half the time (2 ms on, 2 ms off: an engine thread that also
    waits for its device), and all the time; with the mean of the work itself (on the process or the
    thread). Tokens: drawn from each row's mask (seeded)."""
    shifts = torch.arange(32, dtype=torch.int32)
    out: dict[str, Any] = {"rows": rows, "steps": steps}
    for design, book in (("process", _ProcessBook(engine, spec, rows)), ("thread", _ThreadBook(compiler, spec, rows))):
        generator = torch.Generator().manual_seed(0)

        def draw(bitmask: torch.Tensor) -> list[int]:
            """An allowed token of each row: a random word with a bit set, then a random bit of it (not
            uniform over tokens; cheap at a large vocabulary)."""
            scores = torch.rand(bitmask.shape, generator=generator) * (bitmask != 0)
            word = scores.argmax(dim=1)
            bits = (bitmask.gather(1, word[:, None]) >> shifts) & 1  # [rows, 32]
            bit = (torch.rand(bits.shape, generator=generator) * bits).argmax(dim=1)
            return (word * 32 + bit).tolist()

        tokens = draw(book.step([], [False] * rows)[0])
        coin = torch.Generator().manual_seed(1)
        for _ in range(spread):
            moving = (torch.rand(rows, generator=coin) < 0.5).tolist()
            drawn = draw(book.step(tokens, moving)[0])
            tokens = [d if m else t for d, t, m in zip(drawn, tokens, moving)]
        modes: dict[str, Any] = {}
        for name, duty in (("alone", None), ("python_half_the_time", (0.002, 0.002)),
                           ("python_all_the_time", (1.0, 0.0))):
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop, *duty), daemon=True) if duty else None
            if spinner is not None:
                spinner.start()
            times = []
            work_before = book.work_seconds
            try:
                for _ in range(steps):
                    started = time.perf_counter()
                    bitmask, ready_at = book.step(tokens, [True] * rows)
                    times.append(ready_at - started)
                    tokens = draw(bitmask)
            finally:
                stop.set()
                if spinner is not None:
                    spinner.join(timeout=10)
            modes[name] = {"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
                           "max_ms": max(times) * 1e3, "work_mean_ms": (book.work_seconds - work_before) / steps * 1e3}
        book.close()
        out[design] = modes
    return out


def compile_times(model_dir: Path, engine: EngineCore) -> dict[str, dict[str, float]]:
    arch = engine.arch
    compiler = GrammarCompiler(model_dir, arch.vocab_size, arch.eos_token_ids)  # fresh: an empty cache
    out = {}
    for name, schema in TEST_SCHEMAS.items():
        spec = GrammarSpec(kind="json_schema", text=json.dumps(schema))
        started = time.perf_counter()
        compiler.compile(spec)
        first = time.perf_counter() - started
        started = time.perf_counter()
        compiler.compile(spec)
        out[name] = {"first_ms": first * 1e3, "cached_ms": (time.perf_counter() - started) * 1e3}
    return out


def _plot_fill(ax: Any, fills: list[dict[str, Any]]) -> None:
    """Part (3): median ms from the call to the filled mask, by rows and the other thread's duty, by design."""
    modes = ("alone", "python_half_the_time", "python_all_the_time")
    labels = [f"{f['rows']} rows\n{m.replace('python_', 'busy ').replace('_', ' ')}" for f in fills for m in modes]
    for k, (design, color) in enumerate((("process", "tab:blue"), ("thread", "tab:gray"))):
        values = [f[design][m]["median_ms"] for f in fills for m in modes]
        ax.bar([i + 0.4 * k for i in range(len(values))], values, width=0.4, color=color, label=design)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("grammar work of one step: call to mask ready")
    ax.legend()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--train-vocab", type=int, default=0, help="train a byte-level BPE of this many tokens")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="turns of (unconstrained, constrained)")
    parser.add_argument("--batch1-tokens", type=int, default=512)
    parser.add_argument("--fill-steps", type=int, default=50, help="timed steps of the grammar book alone, by rows")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--fill-only", action="store_true", help="parts (3) and (4) alone (the host's share)")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, one run of each under cProfile: the engine thread's functions by "
                             "the time the constrained run adds (a diagnosis: cProfile slows Python several-fold)")
    args = parser.parse_args()
    record: dict[str, Any] = {"method": "one process; runs in turns A B, B A, ... (A unconstrained); times of "
                                        "engine.step() loops from the first step to the last token, synchronized"}
    shape = args.model
    if args.train_vocab:
        vocab_dir = Path(tempfile.mkdtemp(prefix="bench-vocab-"))
        record["vocabulary"] = train_vocab(Path(args.model), args.train_vocab, vocab_dir)
        record["vocabulary"]["made_from"] = "this machine's Python sources (byte-level BPE)"
        args.model = str(vocab_dir)
    engine = build_engine(args, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = engine.arch.vocab_size
    long_spec = GrammarSpec(kind="json_schema", text=json.dumps(LONG_SCHEMA))
    record["compile"] = compile_times(engine.model_dir, engine)
    print("compile", json.dumps(record["compile"]))
    compiler = GrammarCompiler(engine.model_dir, vocab, engine.arch.eos_token_ids)
    fill_rows, spread = ((16, 64), 20) if args.quick else ((64, 256), 200)
    record["batch_fill"] = [batch_fill_cost(engine, compiler, long_spec, rows, args.fill_steps, spread)
                            for rows in fill_rows]
    print("batch_fill", json.dumps(record["batch_fill"]))
    env = environment(engine, args)
    env["model"]["name"] = shape  # NOTE: the shape's directory; the vocabulary is record["vocabulary"]
    vocabulary = f"vocabulary: {'trained BPE ' + str(args.train_vocab) if args.train_vocab else args.model}"
    if args.fill_only:
        paths = write_results(args.out, "structured_outputs_fill", env, record,
                              lambda fig: _plot_fill(fig.subplots(1, 1), record["batch_fill"]),
                              title("Grammar work of one step: the grammar process vs a thread", env,
                                    f"{vocabulary}; LONG_SCHEMA on every row"))
        print("wrote", *paths)
        return

    prompts, max_tokens = nano_vllm_workload(args.num_seqs, args.seed)
    prompts = [[t % vocab for t in p] for p in prompts]
    if args.quick:
        prompts, max_tokens = [p[:20] for p in prompts[:8]], [min(m, 24) for m in max_tokens[:8]]
    warm = [[t % vocab for t in p[:256]] for p in nano_vllm_workload(len(prompts), 99)[0]]
    run(engine, warm, [32] * len(warm), None)  # warm-up at full batch: kernels, graphs, allocator, both paths
    run(engine, warm, [32] * len(warm), long_spec)
    run(engine, prompts, max_tokens, None)  # NOTE: a whole run too: the first measured ~8% slower than the rest
    record["workload"] = {"num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                          "output_tokens": sum(max_tokens), "temperature": 0.6, "ignore_eos": True,
                          "schema": LONG_SCHEMA}
    rounds: list[dict[str, Any]] = []
    clock = HostClock(engine)
    for r in range(args.rounds):
        if r % 2 == 0:
            plain = run(engine, prompts, max_tokens, None, clock)
            constrained = run(engine, prompts, max_tokens, long_spec, clock)
        else:  # NOTE: in turns A B, B A: neither always runs first
            constrained = run(engine, prompts, max_tokens, long_spec, clock)
            plain = run(engine, prompts, max_tokens, None, clock)
        assert plain["output_tokens"] == constrained["output_tokens"] == sum(max_tokens)
        rounds.append({"unconstrained": plain, "json_schema": constrained,
                       "ratio": constrained["output_tok_per_s"] / plain["output_tok_per_s"]})
        print(f"round {r}: unconstrained {plain['output_tok_per_s']:.0f} tok/s, json_schema "
              f"{constrained['output_tok_per_s']:.0f} tok/s, ratio {rounds[-1]['ratio']:.3f}; host "
              f"{json.dumps({'unconstrained': plain['host'], 'json_schema': constrained['host']})}")
    record["throughput"] = {"rounds": rounds, "mean_ratio": statistics.fmean(r["ratio"] for r in rounds)}
    if args.profile:
        record["profile"] = profile_runs(engine, prompts, max_tokens, long_spec)
        print("profile", json.dumps(record["profile"]))

    one = prompts[0][:256]
    batch1: dict[str, list[float]] = {"unconstrained_ms_per_token": [], "json_schema_ms_per_token": []}
    for turn in range(4):
        pair = (("unconstrained_ms_per_token", None), ("json_schema_ms_per_token", long_spec))
        for key, spec in pair if turn % 2 == 0 else pair[::-1]:
            result = run(engine, [one], [args.batch1_tokens], spec)
            batch1[key].append(result["elapsed_s"] / result["output_tokens"] * 1e3)
    plain_ms, json_ms = (statistics.median(batch1[k]) for k in batch1)
    record["batch1"] = {**batch1, "tokens": args.batch1_tokens, "grammar_ms_per_token": json_ms - plain_ms,
                        "host_fill": fill_cost(compiler, long_spec, args.batch1_tokens)}
    print("batch1", json.dumps(record["batch1"]))

    def plot(fig: Any) -> None:
        ax1, ax2, ax3, ax4 = fig.subplots(1, 4)
        tp = [statistics.fmean(r[k]["output_tok_per_s"] for r in rounds) for k in ("unconstrained", "json_schema")]
        ax1.bar(["unconstrained", "JSON schema"], tp, color=["tab:gray", "tab:blue"])
        ax1.set_title(f"nano-vllm workload: output tok/s (ratio {record['throughput']['mean_ratio']:.3f})")
        ax2.bar(["unconstrained", "JSON schema"], [plain_ms, json_ms], color=["tab:gray", "tab:blue"])
        ax2.set_title(f"batch 1: ms per token (+{json_ms - plain_ms:.3f} ms)")
        names = list(record["compile"])
        ax3.bar(names, [record["compile"][n]["first_ms"] for n in names], color="tab:green")
        ax3.set_title("first compile, ms")
        ax3.tick_params(axis="x", rotation=30)
        _plot_fill(ax4, record["batch_fill"])

    paths = write_results(args.out, "structured_outputs", env, record, plot,
                          title("Structured outputs: JSON schema on every request vs unconstrained", env,
                                f"{len(prompts)} seqs, nano-vllm workload; {vocabulary}"))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
