"""The gRPC front end (pdserve.v1.Generation) over RouterCore: the same validation, limits and
streaming as the HTTP API, in protobuf. Errors become gRPC status codes (400 -> INVALID_ARGUMENT,
401 -> UNAUTHENTICATED, 404 -> NOT_FOUND, 429/503 -> RESOURCE_EXHAUSTED/UNAVAILABLE).
SamplingOptions' `constraint` (json_schema, json_object, regex, grammar, choice, structural_tag) is
the HTTP API's structured outputs; a bad one is INVALID_ARGUMENT naming `sampling.<field>`.

Knows nothing of Serve: the ingress passes the request and a context with set_code/set_details
and invocation_metadata (grpc's or Serve's).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import ValidationError

from router import structured
from router.core import ChoiceDelta, RouterCore
from router.openai_schema import APIError, CompletionRequest, bad_request, from_validation_error
from router.proto.codegen import ensure_generated
from router.structured import GrammarFieldError, GrammarSource

ensure_generated()
from router.proto import pdserve_pb2 as pb  # noqa: E402

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed", "logprobs")


def to_completion_request(request: pb.GenerateRequest) -> CompletionRequest:
    """The proto as an OpenAI completion request, so both front ends share one set of checks."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise bad_request("prompt: set text or token_ids", "prompt")
    prompt: Any = [request.text] if kind == "text" else [list(request.token_ids.ids)]
    sampling = request.sampling
    fields: dict[str, Any] = {"prompt": prompt}
    if sampling.max_tokens:
        fields["max_tokens"] = sampling.max_tokens
    for name in _OPTIONAL:
        if sampling.HasField(name):
            fields[name] = getattr(sampling, name)
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        fields["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        fields["ignore_eos"] = True
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as err:
        # NOTE: HTTP's message (the limit, the value sent), with the proto's field names
        names = {name: f"sampling.{name}" for name in fields if name != "prompt"}
        names["prompt"] = kind
        raise from_validation_error(err, names) from None


def grammar_of(sampling: pb.SamplingOptions) -> GrammarSource | None:
    """SamplingOptions' constraint (its oneof), named `sampling.<field>` in errors; None without one."""
    kind = sampling.WhichOneof("constraint")
    field = f"sampling.{kind}"
    try:
        if kind == "json_schema":
            return structured.json_schema(sampling.json_schema, field)
        if kind == "json_object":
            return structured.json_object(field) if sampling.json_object else None
        if kind == "regex":
            return structured.regex(sampling.regex, field)
        if kind == "grammar":
            return structured.ebnf(sampling.grammar, field)
        if kind == "choice":
            return structured.choice(list(sampling.choice.options), field)
        if kind == "structural_tag":
            return structured.structural_tag(sampling.structural_tag, field)
    except GrammarFieldError as err:
        raise bad_request(str(err), err.field) from None
    return None


def check_api_key(core: RouterCore, metadata: Any) -> None:
    key = core.config.api_key
    if key is None:
        return
    pairs = dict(metadata or ())
    auth = pairs.get("authorization", "")
    if auth != f"Bearer {key}":
        raise APIError(401, "authorization: a valid 'Bearer <api key>' metadata entry is required",
                       type="authentication_error", code="invalid_api_key")


def _response(request_id: str, delta: ChoiceDelta, text: str) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=request_id, text=text, token_ids=delta.token_ids,
                              finish_reason=delta.finish_reason or "")
    if delta.logprobs is not None:
        out.logprobs.extend(delta.logprobs)
    for alternatives in delta.top_logprobs or []:
        out.top_logprobs.add(alternatives=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in alternatives])
    if delta.finish_reason is not None:
        out.usage.CopyFrom(pb.Usage(prompt_tokens=delta.num_prompt_tokens,
                                    completion_tokens=delta.num_completion_tokens,
                                    cached_prompt_tokens=delta.num_cached_tokens))
    return out


async def generate(core: RouterCore, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
    """Server streaming: one message per step that added tokens; the last has finish_reason and usage."""
    try:
        check_api_key(core, context.invocation_metadata())
        completion = to_completion_request(request)
        prompts = core.encode_prompts(completion.prompt)
        params = core.sampling_params(completion, prompts)
        grammar = grammar_of(request.sampling)
        if grammar is not None:
            params = params.model_copy(update={"grammar": grammar.spec})  # a GrammarSpec is validated when built
            await core.check_grammar(grammar)
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        async for delta in core.generate(request_id, prompts[0], params):
            yield _response(request_id, delta, delta.text)
    except APIError as err:
        context.set_code(_STATUS.get(err.status_code, grpc.StatusCode.INTERNAL))
        context.set_details(err.message)


async def complete(core: RouterCore, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
    """Unary: the whole completion in one message."""
    whole = pb.GenerateResponse()
    async for part in generate(core, request, context):
        whole.request_id = part.request_id
        whole.text += part.text
        whole.token_ids.extend(part.token_ids)
        whole.logprobs.extend(part.logprobs)
        whole.top_logprobs.extend(part.top_logprobs)
        whole.finish_reason = part.finish_reason
        if part.HasField("usage"):
            whole.usage.CopyFrom(part.usage)
    return whole
