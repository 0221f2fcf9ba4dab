"""Structured outputs across workers, in one process without Ray: a constrained request's first
token is sampled under its grammar on the prefill worker, the decode worker rebuilds the matcher
from it and continues the same constrained stream (1P1D, with n-gram speculation on the decode
workers), and a decode worker killed mid-stream hands its requests on with their output so far:
greedy and seeded outputs equal the offline engine's, token for token, and every one validates."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine import SamplingParams
from engine.config import GrammarSpec
from engine.tokenizer import Tokenizer
from engine.models import DEFAULT_MODEL_DIR
from tests.unit.router.test_migration_inprocess import Cluster, Streams, _offline, _prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 4},
    },
    "required": ["id", "kind", "words"],
}
SPEC = GrammarSpec(kind="json_schema", text=json.dumps(SCHEMA))
SEEDED = SamplingParams(max_tokens=120, temperature=1.0, seed=11, grammar=SPEC)
GREEDY = SamplingParams(max_tokens=120, temperature=0.0, grammar=SPEC)


def _validate(tokens: list[int]) -> None:
    text = Tokenizer.from_dir(DEFAULT_MODEL_DIR).decode(tokens)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("params", [SEEDED, GREEDY], ids=["seeded", "greedy"])
@pytest.mark.parametrize("engine", [{}, {"speculative": {"method": "ngram"}}], ids=["plain", "ngram"])
def test_1p1d_constrained_streams_equal_the_offline_engine(params, engine):
    prompts = _prompts(6, seed=7)
    expected = _offline(prompts, params)

    async def main():
        cluster = Cluster(num_prefill=1, num_decode=1, **engine)
        results = await Streams(cluster.dispatcher, prompts, params).results()
        assert results == expected
        for tokens in results:
            _validate(tokens)
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    asyncio.run(main())


def test_a_killed_decode_worker_s_constrained_requests_continue_exactly():
    prompts = _prompts(6, seed=3)
    expected = _offline(prompts, GREEDY)

    async def main():
        cluster = Cluster()
        streams = Streams(cluster.dispatcher, prompts, GREEDY)
        await streams.until(lambda: all(len(t) >= 4 for t in streams.tokens))
        await cluster.decode["d0"].kill()
        results = await streams.results()
        assert results == expected
        for tokens in results:
            _validate(tokens)
        assert cluster.dispatcher.num_migrations >= 1
        assert set((await cluster.held()).values()) == {0}
        await cluster.close()

    asyncio.run(main())
