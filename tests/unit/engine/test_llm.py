"""The offline API keeps vLLM's output shape, so users' vLLM scripts run unchanged: a RequestOutput's
`outputs` is a list of CompletionOutput (one here: the offline API has no `n`)."""

from __future__ import annotations

from engine import CompletionOutput, SamplingParams


def test_a_vllm_style_script_runs_unchanged(make_llm, capsys):
    llm = make_llm()
    prompts = ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)

    # The loop of vLLM's offline-inference example, word for word.
    for out in llm.generate(prompts, params):
        print(out.outputs[0].text)

    outs = llm.generate(prompts, params)
    assert capsys.readouterr().out == "".join(f"{o.outputs[0].text}\n" for o in outs)
    for out in outs:
        assert isinstance(out.outputs, list) and len(out.outputs) == 1
        (completion,) = out.outputs
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert completion.text and len(completion.token_ids) == 8 and completion.finish_reason == "length"
        assert len(completion.logprobs) == len(completion.top_logprobs) == 8
        assert out.finished


def test_streamed_outputs_are_finished_only_at_the_end(make_llm):
    llm = make_llm()
    # NOTE: read `finished` as each step comes: the stream yields one RequestOutput, updated in place.
    seen = [(out.finished, out.outputs[0]) for step in llm.stream(
        "Hello, my name is", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for out in step]
    assert [finished for finished, _ in seen] == [False] * (len(seen) - 1) + [True]
    last = seen[-1][1]
    assert last.finish_reason == "length" and len(last.token_ids) == 5
