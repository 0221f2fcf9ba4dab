"""PrefillWorkerConfig: a prefill worker's settings beside its endpoint's (transport, timeouts)."""

from __future__ import annotations

from pydantic import Field, model_validator

from kvtransfer.endpoint import EndpointConfig


class PrefillWorkerConfig(EndpointConfig):
    early_handshake: bool = Field(
        False,
        description="Ask the decode worker to post its receive while the prompt is computed (when the prompt "
        "fits one engine step, nothing waits in the engine and no other push to that decode worker is under "
        "way), so the push does not wait for that round trip after the prefill; the first token then follows "
        "the KV over the pair. Off by default: with answer_before_push the first token no longer waits for the "
        "push, and the handshake's work beside the step delayed it (2x H100, 2,048-token prompts: +3.7% TTFT over "
        "colocated with it, +2.5% without at the Llama-3.1-8B shape; +7.0% and -3.2% at Qwen3-0.6B; "
        "bench/results/disagg_2xh100_*_late.json). Needed for kv_messages > 1.",
    )
    kv_messages: int = Field(
        1,
        ge=1,
        description="After an early handshake, the prompt's KV goes in this many messages (groups of consecutive "
        "layers, at most one a layer), each sent as soon as the prefill step has queued its layers, so on a GPU "
        "the transfer overlaps the rest of the prefill; 1: one message, gathered and sent once the first token "
        "is sampled.",
    )
    answer_before_push: bool = Field(
        True,
        description="Answer the router with the first token as soon as it is sampled, the handshake, KV and token "
        "going on in the background, when the decode worker can report their failure itself: the lease is "
        "attached and the pair with it formed (pairing checks the layouts, and its failure must reach the router "
        "in the answer), or an early handshake was accepted. The push then leaves the time to first token (and "
        "delays the second). A push that then fails reaches the router through the decode worker's token stream "
        "(its receive fails or times out after transfer_timeout_s, it refuses the KvReady, or the lease expires), "
        "and the request moves on with its first token kept. False: the answer waits for the push (and carries "
        "its timings).",
    )
    ship_draft_kv: bool = Field(
        True,
        description="When engine.speculative drafts with a model (the decode workers' draft): compute each prompt's "
        "draft KV here too, after its first token, on a CUDA stream of its own, and send it to decode workers that "
        "run the same draft, so their draft does not compute the prompt inside a step of their batch. Prompts "
        "longer than one engine step's token budget are left to the decode worker's draft.",
    )

    @model_validator(mode="after")
    def _groups_need_early_handshake(self) -> PrefillWorkerConfig:
        check_kv_messages(self.kv_messages, self.early_handshake)
        return self


def check_kv_messages(kv_messages: int, early_handshake: bool) -> None:
    """Layer groups (kv_messages > 1) are sent during the prefill only after an early handshake."""
    if kv_messages > 1 and not early_handshake:
        raise ValueError(f"kv_messages={kv_messages} needs early_handshake=True (layer groups are sent during the "
                         "prefill only after an early handshake); set early_handshake=True, or kv_messages=1")


__all__ = ["PrefillWorkerConfig", "check_kv_messages"]
