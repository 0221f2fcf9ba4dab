"""The router: drives requests through the prefill and decode workers and streams tokens back.
The OpenAI HTTP and gRPC ingress on Ray Serve comes with issue "Router and APIs"."""

from router.dispatch import Dispatcher, NoCapacityError, RequestFailedError, Workers

__all__ = ["Dispatcher", "NoCapacityError", "RequestFailedError", "Workers"]
