import random, time, statistics, torch
from bench.profile_step import fill
from engine import EngineCore, engine_config, SamplingParams
from engine.sampler import _apply_min_tokens, _apply_penalties
eng = EngineCore(engine_config("bench/shapes/qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                               max_num_batched_tokens=16384))
fill(eng, 256, 512, 0.6, random.Random(0))
for _ in range(3): eng.step()
sync = torch.cuda.synchronize
def t(fn, n=10):
    ts = []
    for _ in range(n):
        sync(); a = time.perf_counter(); r = fn(); sync(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e3, r
out = eng.scheduler.schedule()
logits = eng.runner.execute(out.scheduled); sync()
print("logits", logits.dtype, logits.shape, logits.is_contiguous())
from engine.engine import _row
rows = [_row(s.request) for s in out.scheduled]
s = eng.sampler
print("rows", t(lambda: [_row(s2.request) for s2 in out.scheduled])[0])
print("float", t(lambda: logits.float())[0])
print("min_tokens+pen", t(lambda: _apply_penalties(_apply_min_tokens(logits, rows, s.eos_token_ids), rows))[0])
print("temps", t(lambda: torch.tensor([r.params.temperature for r in rows], device="cuda"))[0])
print("randint", t(lambda: torch.randint(0, 1 << 62, (256,), device="cuda", generator=eng.generator))[0])
temps = torch.tensor([r.params.temperature for r in rows], device="cuda"); seeds = torch.randint(0, 1 << 62, (256,), device="cuda")
from engine import sampling_kernels
print("race", t(lambda: sampling_kernels.race(logits, temps, seeds))[0])
print("sampler call", t(lambda: s(logits, rows, eng.generator))[0])
print("engine._sample", t(lambda: eng._sample(out, logits))[0])
# host-only timing without sync of the whole sampler call (launch cost)
sync(); a = time.perf_counter(); r = s(logits, rows, eng.generator); b = time.perf_counter(); print("call incl. tolist, no pre-sync", (b - a) * 1e3)
for fn_name in ("schedule", "execute"):
    pass
ts = []
for _ in range(10):
    sync(); a = time.perf_counter(); o = eng.scheduler.schedule(); b = time.perf_counter(); lg = eng.runner.execute(o.scheduled); c = time.perf_counter(); sync(); d = time.perf_counter()
    sm = eng._sample(o, lg); e = time.perf_counter(); eng._post_process(o, sm); f = time.perf_counter()
    ts.append((b - a, c - b, d - c, e - d, f - e))
print("schedule, execute host, execute gpu wait, sample, post (ms):", [round(statistics.median(x) * 1e3, 3) for x in zip(*ts)])
