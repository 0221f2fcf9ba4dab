"""The gRPC front end's own server in each router replica, bound to the address it is given.

Why not Serve's gRPC proxy: it binds every interface ('[::]:port', ray.serve._private.grpc_util),
whatever the HTTP host says, so `pdserve serve` would expose gRPC beyond 127.0.0.1. This server
binds host:port; replicas on one node share the port (SO_REUSEPORT: the kernel spreads new
connections over them), and gRPC goes straight to a router, without the proxy's hop. Reflection is
on, so `grpcurl` can list the service. Deployments that want Serve's proxy (deploy/serve_config.yaml,
which binds 0.0.0.0 on purpose) leave `ServeAppConfig.grpc` unset and name the servicer in
grpc_options.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection

from router import grpc_service  # noqa: F401 - NOTE: first: it generates router/proto's modules when missing
from router.core import ListenAddress
from router.proto import pdserve_pb2 as pb
from router.proto import pdserve_pb2_grpc as pbg


async def start_grpc_server(servicer: Any, config: ListenAddress) -> grpc.aio.Server:
    """Serves pdserve.v1.Generation (and reflection) on config.host:port with `servicer`'s async
    `Generate` and `Complete` (RouterIngress's, the methods Serve's proxy calls too); raises OSError
    naming the address when it cannot be bound."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    pbg.add_GenerationServicer_to_server(servicer, server)
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    reflection.enable_server_reflection((service, reflection.SERVICE_NAME), server)
    address = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as err:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise OSError(f"gRPC cannot bind {address}: {err}; choose another --grpc-port or --host") from None
    await server.start()
    return server
