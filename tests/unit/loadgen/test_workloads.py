"""Workload generators (random lengths, prefix sharing, JSONL with errors that name the line), the
BenchConfig checks, and the `pdserve bench` flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from loadgen import (
    BenchConfig,
    WorkloadError,
    build_workload,
    jsonl_workload,
    prefix_workload,
    random_workload,
)
from loadgen.cli import config_from_args


def test_random_token_workload_lengths_ids_and_seed() -> None:
    requests = random_workload(50, (8, 16), (3, 5), seed=4, vocab_size=100)
    assert len(requests) == 50
    assert all(8 <= len(r.prompt) <= 16 and 3 <= r.max_tokens <= 5 for r in requests)
    assert all(isinstance(t, int) and 0 <= t < 100 for r in requests for t in r.prompt)
    assert {len(r.prompt) for r in requests} == set(range(8, 17))  # the whole range is drawn
    assert requests == random_workload(50, (8, 16), (3, 5), seed=4, vocab_size=100)
    assert requests != random_workload(50, (8, 16), (3, 5), seed=5, vocab_size=100)
    fixed = random_workload(5, (12, 12), (7, 7), seed=0, is_text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 and r.max_tokens == 7 for r in fixed)


def test_prefix_workload_really_shares_prefixes() -> None:
    num_prefixes, prefix_len = 3, 32
    requests = prefix_workload(12, num_prefixes, prefix_len, (4, 8), (2, 2), seed=1, vocab_size=500)
    by_prefix: dict[int, list[list[int]]] = {}
    for r in requests:
        by_prefix.setdefault(r.prefix_index, []).append(r.prompt)
        assert prefix_len + 1 + 4 <= len(r.prompt) <= prefix_len + 1 + 8  # prefix, marker, suffix
    assert sorted(by_prefix) == [0, 1, 2] and all(len(p) == 4 for p in by_prefix.values())
    heads = {k: {tuple(p[:prefix_len]) for p in prompts} for k, prompts in by_prefix.items()}
    assert all(len(h) == 1 for h in heads.values())  # every request of a prefix starts with the same tokens
    assert len({next(iter(h)) for h in heads.values()}) == num_prefixes  # and the prefixes differ
    assert len({tuple(r.prompt) for r in requests}) == 12  # every prompt is its own
    texts = prefix_workload(4, 2, 10, (3, 3), (2, 2), seed=1, is_text=True)
    assert texts[0].prompt.split()[:10] == texts[2].prompt.split()[:10] != texts[1].prompt.split()[:10]
    with pytest.raises(WorkloadError, match="num_prefixes=5 is more than num_prompts=4"):
        prefix_workload(4, 5, 10, (3, 3), (2, 2), seed=0)


def test_jsonl_workload_reads_text_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "hello there", "max_tokens": 4}), "", json.dumps({"prompt": [5, 6, 7]}),
             json.dumps({"prompt": "third", "max_tokens": 1})]
    path.write_text("\n".join(lines) + "\n")
    requests = jsonl_workload(path, default_max_tokens=9)
    assert [(r.prompt, r.max_tokens) for r in requests] == [("hello there", 4), ([5, 6, 7], 9), ("third", 1)]
    assert len(jsonl_workload(path, max_prompts=2)) == 2


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "x", "max_tokens": 4', "not valid JSON"),
    ('["x"]', "expected a JSON object"),
    ('{"max_tokens": 4}', "'prompt' must be a non-empty string or a list of token ids"),
    ('{"prompt": [1, -2]}', "'prompt' must be"),
    ('{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be a whole number >= 1, got 0"),
    ('{"prompt": "x", "max_tokens": "4"}', "'max_tokens' must be"),
    ('{"prompt": "x", "n": 2}', r"unknown field\(s\) \['n'\]"),
])
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"prompt": "ok", "max_tokens": 2}}\n\n{line}\n')
    with pytest.raises(WorkloadError, match=rf"bad\.jsonl:3: {message}"):
        jsonl_workload(path)


def test_jsonl_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        jsonl_workload(tmp_path / "absent.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(WorkloadError, match="no prompts"):
        jsonl_workload(tmp_path / "blank.jsonl")


def test_build_workload_follows_the_config(tmp_path: Path) -> None:
    config = BenchConfig(workload="prefix", num_prompts=6, num_prefixes=2, prefix_len=8, input_len="2:3",
                         output_len=5)
    requests = build_workload(config, seed=0)
    assert len(requests) == 6 and {r.prefix_index for r in requests} == {0, 1}
    assert requests == build_workload(config, seed=0) != build_workload(config, seed=1)
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt": [1, 2]}\n')
    chat = BenchConfig(workload="jsonl", dataset=ids, endpoint="chat")
    with pytest.raises(WorkloadError, match="endpoint 'chat' needs text"):
        build_workload(chat, seed=0)


def test_config_checks_name_the_field() -> None:
    assert BenchConfig(input_len="64:256", output_len=16).input_len == (64, 256)
    assert BenchConfig(sweep_rates="1,2,4").rates == (1.0, 2.0, 4.0)
    assert BenchConfig(request_rate=3).rates == (3.0,)
    for kwargs, message in [
        ({"input_len": "5:3"}, "input_len"), ({"output_len": "0"}, "output_len"), ({"input_len": "a"}, "MIN:MAX"),
        ({"sweep_rates": "1,x"}, "sweep_rates"), ({"sweep_rates": "1,-2"}, "rates > 0"),
        ({"request_rate": 0}, "request_rate"), ({"max_concurrency": 0}, "max_concurrency"),
        ({"endpoint": "chat"}, "--prompt-format text"), ({"workload": "jsonl"}, "needs --dataset"),
        ({"dataset": "x.jsonl"}, "read only by workload 'jsonl'"), ({"num_prompt": 3}, "num_prompt"),
    ]:
        with pytest.raises(ValidationError, match=message):
            BenchConfig(**kwargs)


def test_pdserve_bench_flags() -> None:
    from deploy.cli import build_parser

    args = build_parser().parse_args([
        "bench", "--base-url", "http://127.0.0.1:1/v1", "--api-key", "k", "--input-len", "8:16", "--output-len",
        "4", "--sweep-rates", "1,2", "--no-ignore-eos", "--no-progress", "--slo-ttft-ms", "500", "--request-rate",
        "inf", "--endpoint", "chat", "--prompt-format", "text",
    ])
    config = config_from_args(args)
    assert (config.input_len, config.output_len, config.rates) == ((8, 16), (4, 4), (1.0, 2.0))
    assert not config.ignore_eos and not config.is_progress and config.slo_ttft_ms == 500 and config.api_key == "k"
    assert config.endpoint == "chat" and config.request_rate == float("inf")
    defaults = config_from_args(build_parser().parse_args(["bench"]))
    assert defaults.num_prompts == BenchConfig().num_prompts and defaults.ignore_eos and defaults.is_progress
