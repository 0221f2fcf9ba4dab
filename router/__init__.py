"""The router: OpenAI-compatible HTTP and gRPC front ends (RouterCore: tokenization, limits, stop
strings, streaming), and the Dispatcher that drives each request through the prefill and decode
workers. It is handed the workers' handles and never imports cluster/."""

from router.core import ChoiceDelta, RouterConfig, RouterCore, RouterMetrics
from router.dispatch import (
    Dispatcher,
    DispatcherConfig,
    LocalPrefillConfig,
    NoCapacityError,
    RequestFailedError,
    SloConfig,
    Workers,
)
from router.http_app import build_http_app
from router.openai_schema import APIError

__all__ = [
    "APIError",
    "ChoiceDelta",
    "Dispatcher",
    "DispatcherConfig",
    "LocalPrefillConfig",
    "NoCapacityError",
    "RequestFailedError",
    "RouterConfig",
    "RouterCore",
    "RouterMetrics",
    "SloConfig",
    "Workers",
    "build_http_app",
]
