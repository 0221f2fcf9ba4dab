"""Checks a request before it enters the engine; each error names the field, the value and the limit."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import SamplingParams


class InvalidRequestError(ValueError):
    """Bad input from a client: the message says which field and what the limit is."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_prompt(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    max_prompt_blocks: int,
    block_size: int,
    max_unchunked_tokens: int | None,
) -> list[int]:
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidRequestError("prompt", "is empty; at least 1 token is required")
    for i, token in enumerate(prompt):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"prompt_token_ids[{i}]", f"{token!r} is outside the vocabulary [0, {vocab_size})"
            )
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"has {len(prompt)} tokens; max_model_len is {max_model_len}, so a prompt may have at most "
            f"{max_model_len - 1} tokens (one more is generated)",
        )
    needed = -(-(len(prompt) + 1) // block_size)
    if needed > max_prompt_blocks:
        raise InvalidRequestError(
            "prompt",
            f"has {len(prompt)} tokens and needs {needed} KV blocks; the cache has {max_prompt_blocks} "
            f"({max_prompt_blocks * block_size} tokens)",
        )
    if max_unchunked_tokens is not None and len(prompt) > max_unchunked_tokens:
        raise InvalidRequestError(
            "prompt",
            f"has {len(prompt)} tokens; without chunked prefill at most max_num_batched_tokens = "
            f"{max_unchunked_tokens} fit one step",
        )
    for token in params.stop_token_ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequestError("stop_token_ids", f"{token} is outside the vocabulary [0, {vocab_size})")
    return prompt
