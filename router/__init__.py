"""The Serve ingress: OpenAI-compatible HTTP and gRPC, dispatch, streaming, cancellation.
(Being built: issue "Router and APIs".)"""

__all__: list[str] = []
