"""Moving paged KV blocks between workers: the Transport interface and its implementations.

A worker's KV cache is one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]. A transfer
gathers a request's blocks into one contiguous buffer (`gather_blocks`), moves it over the pair's
transport, and scatters it into the receiver's block ids (`scatter_blocks`).

Transports (pick by name with `create_transport`; ask `supports_cpu`/`supports_cuda`):
  local   in one process, through a shared LocalHub (colocated mode, unit tests)
  gloo    CPU tensors, one ProcessGroupGloo per pair
  nccl    CUDA tensors, one ProcessGroupNCCL per pair (workers need NCCL_WORKER_ENV)
  fault   wraps any of the above and injects drops, delays, failures and kills (chaos tests)

Every pair is formed explicitly (`pair`, blocking, on both sides at once), compares the two KV
layouts (a mismatch raises LayoutMismatchError on both sides), and can be dropped without blocking.
send/recv never block; their handles are polled or waited on with a timeout.

This package does not know which blocks are free or held or what a lease is, and needs no Ray
(`netaddr.resolve_host('auto')` asks Ray for the node's address when it runs inside Ray):
the workers above it own the blocks and call it. The transports import nothing from engine/.
It keeps transports, block layout and pairing only: the messages, the request channel and the
worker clients are `protocol/`'s. `endpoint.TransferEndpoint` is what both worker kinds share (an
engine thread and a transport).
"""

from kvtransfer.fault import FaultRule, FaultTransport
from kvtransfer.layout import KvLayout, LayoutMismatchError, gather_blocks, scatter_blocks
from kvtransfer.local import LocalHub, LocalTransport
from kvtransfer.torch_dist import NCCL_WORKER_ENV, GlooTransport, NcclTransport
from kvtransfer.transport import (
    PairAddress,
    TransferError,
    TransferHandle,
    Transport,
    available_transports,
    binds_network,
    create_transport,
    transport_options,
    register_transport,
)

__all__ = [
    "KvLayout", "LayoutMismatchError", "gather_blocks", "scatter_blocks",
    "PairAddress", "TransferError", "TransferHandle", "Transport",
    "register_transport", "create_transport", "available_transports", "binds_network", "transport_options",
    "LocalHub", "LocalTransport", "GlooTransport", "NcclTransport", "NCCL_WORKER_ENV",
    "FaultRule", "FaultTransport",
]
