"""On two CUDA GPUs, in bfloat16 (where a row-parallel projection's all-reduce is fused with the norm after
it): TP=2 gives TP=1's greedy tokens and logprobs on a small random checkpoint, step by step until the two
pick different tokens, which they may only where TP=1's top two are within a near-tie (bfloat16 sums in
another order). The engines run in a child process, so a hung collective fails the test, not the run."""

from __future__ import annotations

import json

from tests.gpu import TWO_GPUS, run_child

pytestmark = TWO_GPUS

SCRIPT = """
import json, sys
from engine import LLM, SamplingParams

if __name__ == "__main__":
    prompts = [[0, 17, 400, 33, 1021, 7, 99], list(range(40, 110)), [0, 5, 6, 7], list(range(300, 340))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for size in (1, 2):
        llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", tensor_parallel_size=size, num_blocks=64)
        outs = llm.generate(prompts, params)
        runs[size] = {"parallel": repr(llm.engine.parallel),
                      "seqs": [[o.outputs[0].token_ids, o.outputs[0].top_logprobs] for o in outs]}
        llm.close()
    print("RESULT " + json.dumps(runs))
"""
NEAR_TIE = 0.1  # nats between TP=1's top two within which TP=2 may rightly pick the other (0.0625 seen on 2x H200)
LOGPROB_ABS = 0.15  # bfloat16 partial sums added in another order: up to 0.06 seen (2x H200 and CPU gloo alike)


def test_tp2_gives_tp1_tokens_and_logprobs_in_bfloat16(hf_checkpoints) -> None:
    model = hf_checkpoints("llama")
    runs = json.loads(run_child(SCRIPT, str(model)).split("RESULT ", 1)[1])
    assert "symmetric" in runs["2"]["parallel"], runs["2"]["parallel"]
    deltas = []
    for (want, want_top), (got, got_top) in zip(runs["1"]["seqs"], runs["2"]["seqs"], strict=True):
        for step, (w, g) in enumerate(zip(want_top, got_top, strict=True)):
            if got[step] != want[step]:
                assert w[0][1] - w[1][1] < NEAR_TIE, f"step {step}: TP=2 {got[step]}, TP=1 {want[step]} (top {w})"
                break
            deltas.append(abs(g[0][1] - w[0][1]))
    print(f"compared {len(deltas)} steps, |logprob TP=2 - TP=1| max {max(deltas):.4f} mean "
          f"{sum(deltas) / len(deltas):.4f}")
    assert len(deltas) >= 16, f"only {len(deltas)} steps before a near-tie: too few to compare"
    assert max(deltas) < LOGPROB_ABS
