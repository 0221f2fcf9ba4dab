"""On two CUDA GPUs: a tensor-parallel engine that ran CUDA-graph steps closes within seconds. Each rank frees its
graphs before its group shuts down: NCCL's shutdown waited forever on 2x H200 while a graph that captured its
collectives was alive. The engine runs in a child process, so a hang fails the test instead of the run."""

from __future__ import annotations

from tests.gpu import TWO_GPUS, run_child

pytestmark = TWO_GPUS

SCRIPT = """
import time
from engine import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM("bench/shapes/qwen3-0.6b", load_format="dummy", dtype="bfloat16", tensor_parallel_size=2)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", list(range(100 + i, 400 + i)),
                           SamplingParams(max_tokens=32, ignore_eos=True, temperature=0))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    replays = engine.runner.graphs.num_replays
    start = time.perf_counter()
    llm.close()
    print(f"tokens {tokens} replays {replays} parallel {engine.parallel!r} close_s {time.perf_counter() - start:.2f}")
"""


def test_a_tp2_engine_that_ran_graph_steps_closes_within_seconds() -> None:
    line = run_child(SCRIPT).strip().splitlines()[-1]
    print(line)
    fields = line.split()
    assert int(fields[1]) == 4 * 32 and int(fields[3]) > 0, line  # every token, graph steps among them
    assert "symmetric memory" in line, line  # the small all-reduces' path on GPUs that map each other's memory
    assert float(fields[-1]) < 20.0, line
