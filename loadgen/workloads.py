"""Workloads: the list of BenchRequests a run sends. Random prompts (token ids or random words, fixed
or ranged lengths), a prefix-sharing workload (a few long shared prefixes, each request one of them
plus a short unique suffix), and a JSONL file of prompts. The same seed gives the same requests.

Knows nothing of HTTP or of arrival times; it never tokenizes (the server's usage counts tokens).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.config import BenchConfig

# Common short English words: random text prompts are made of these, about one token a word.
WORDS = (  # noqa: SIM905
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part"
).split()


class WorkloadError(ValueError):
    """A workload that cannot be built: a bad JSONL line (named by file and line), bad sizes."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    max_tokens: int
    prefix_index: int | None = None  # the shared prefix it starts with (prefix workload)


def _tokens(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def random_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], *, seed: int,
    vocab_size: int = 2048, is_text: bool = False,
) -> list[BenchRequest]:
    """Independent random prompts of INPUT_LEN tokens (or words) asking for OUTPUT_LEN tokens each."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n = _length(rng, input_len)
        prompt: str | list[int] = _words(rng, n) if is_text else _tokens(rng, n, vocab_size)
        requests.append(BenchRequest(prompt, _length(rng, output_len)))
    return requests


def prefix_workload(
    num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: tuple[int, int], output_len: tuple[int, int],
    *, seed: int, vocab_size: int = 2048, is_text: bool = False,
) -> list[BenchRequest]:
    """NUM_PREFIXES random prefixes of PREFIX_LEN tokens (or words); request i starts with prefix
    i % NUM_PREFIXES (so the prefixes take turns) and ends with a random suffix of its own."""
    if num_prefixes > num_prompts:
        raise WorkloadError(f"num_prefixes={num_prefixes} is more than num_prompts={num_prompts}: "
                            "some prefixes would never be shared")
    rng = random.Random(seed)
    prefixes: list[Any] = [_words(rng, prefix_len) if is_text else _tokens(rng, prefix_len, vocab_size)
                           for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        k, n = i % num_prefixes, _length(rng, suffix_len)
        # NOTE: a unique marker first, so two suffixes never coincide even when drawn short.
        if is_text:
            prompt: str | list[int] = f"{prefixes[k]} {i} {_words(rng, n)}"
        else:
            prompt = prefixes[k] + [i % vocab_size] + _tokens(rng, n, vocab_size)
        requests.append(BenchRequest(prompt, _length(rng, output_len), prefix_index=k))
    return requests


def _parse_line(line: str, where: str, default_max_tokens: int) -> BenchRequest:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: expected a JSON object like {{\"prompt\": ..., \"max_tokens\": ...}}, "
                            f"got {type(data).__name__}")
    prompt = data.get("prompt")
    is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise WorkloadError(f"{where}: 'prompt' must be a non-empty string or a list of token ids >= 0, "
                            f"got {prompt!r:.60}")
    max_tokens = data.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be a whole number >= 1, got {max_tokens!r}")
    unknown = set(data) - {"prompt", "max_tokens"}
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}; a line has 'prompt' and 'max_tokens'")
    return BenchRequest(prompt, max_tokens)


def jsonl_workload(path: Path, *, max_prompts: int | None = None, default_max_tokens: int = 128) -> list[BenchRequest]:
    """One request a non-blank line of PATH, {"prompt": str | [ids], "max_tokens": int}, in file
    order, at most MAX_PROMPTS; a bad line raises WorkloadError naming the file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise WorkloadError(f"cannot read the JSONL dataset {path}: {err}") from None
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if max_prompts is not None and len(requests) >= max_prompts:
            break
        if line.strip():
            requests.append(_parse_line(line, f"{path}:{lineno}", default_max_tokens))
    if not requests:
        raise WorkloadError(f"{path}: no prompts (every line is blank)")
    return requests


def build_workload(config: BenchConfig, seed: int) -> list[BenchRequest]:
    """The workload CONFIG asks for, drawn with SEED."""
    is_text = config.prompt_format == "text"
    if config.workload == "jsonl":
        assert config.dataset is not None  # BenchConfig checks it
        requests = jsonl_workload(config.dataset, max_prompts=config.num_prompts,
                                  default_max_tokens=config.output_len[1])
        if config.endpoint == "chat":
            for i, r in enumerate(requests):
                if not isinstance(r.prompt, str):
                    raise WorkloadError(f"{config.dataset}: prompt {i} is token ids; endpoint 'chat' needs text")
        return requests
    if config.workload == "prefix":
        return prefix_workload(config.num_prompts, config.num_prefixes, config.prefix_len, config.input_len,
                               config.output_len, seed=seed, vocab_size=config.vocab_size, is_text=is_text)
    return random_workload(config.num_prompts, config.input_len, config.output_len, seed=seed,
                           vocab_size=config.vocab_size, is_text=is_text)
