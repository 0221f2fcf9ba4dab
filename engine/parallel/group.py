"""The process groups of one tensor-parallel worker, made without a default process group (as the
KV pairs are), over a TCPStore that rank 0 hosts.

Two groups of the same ranks:
  device  NCCL on CUDA, gloo on the CPU: the model's all-reduces and all-gathers, and the tensors
          of a step's hand-off (input tokens still on rank 0's device);
  host    gloo: rank 0's step messages (pickled; one broadcast when they fit HEADER_BYTES).
The host group's timeout is long: a follower waits there for the next step however idle the worker
is; a rank that dies closes its TCP connections, which fails the others' host ops at once.
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GroupAddress", "TPGroup", "HEADER_BYTES"]

HEADER_BYTES = 1 << 16  # a step message up to this size (less 8) is one broadcast; larger ones two
_IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks of one worker meet: rank 0's store."""

    host: str
    port: int


def host_store(host: str) -> dist.TCPStore:
    """Rank 0's store (port chosen by the OS); its address is (host, store.port)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


class TPGroup:
    """Rank `rank` of `size`. Building one blocks until every rank builds its own (call it from all
    ranks at once); `timeout_s` bounds that and every device collective."""

    def __init__(self, address: GroupAddress, rank: int, size: int, device: torch.device, prefix: str = "tp",
                 timeout_s: float = 600.0, store: dist.TCPStore | None = None) -> None:
        """store: rank 0 passes the store it hosts at `address` (host_store); the others connect."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.rank, self.size, self.device = rank, size, torch.device(device)
        if store is None:
            store = dist.TCPStore(address.host, address.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s))
        self._store = store
        self.host_group = self._gloo(dist.PrefixStore(f"{prefix}/host", store), address.host, _IDLE_TIMEOUT)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=timeout_s)
            with torch.cuda.device(self.device):
                self.device_group: Any = dist.ProcessGroupNCCL(
                    dist.PrefixStore(f"{prefix}/device", store), rank, size, options)
        else:
            self.device_group = self._gloo(dist.PrefixStore(f"{prefix}/device", store), address.host,
                                           timedelta(seconds=timeout_s))
        self._header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        self._aborted = threading.Event()

    def _gloo(self, store: dist.PrefixStore, host: str, timeout: timedelta) -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, self.rank, self.size, options)

    # ---- the model's collectives (device group)
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns `tensor`. On CUDA it orders the current stream after
        the reduction without blocking the host (and is captured by CUDA graphs)."""
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all), concatenated along `dim` in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.device_group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.device_group.broadcast([tensor], options).wait()
        return tensor

    # ---- rank 0's messages (host group)
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 passes `obj`; every rank returns it. Blocks a follower until rank 0 sends."""
        header = self._header
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = len(payload)
            head = min(size, HEADER_BYTES - 8)
            header[:8] = torch.tensor([size], dtype=torch.int64).view(torch.uint8)
            header[8 : 8 + head] = torch.frombuffer(bytearray(payload[:head]), dtype=torch.uint8)
        self.host_group.broadcast([header], options).wait()
        size = int(header[:8].view(torch.int64).item())
        head = min(size, HEADER_BYTES - 8)
        if size <= head:
            return obj if self.rank == 0 else pickle.loads(header[8 : 8 + size].numpy().tobytes())
        rest = torch.empty(size - head, dtype=torch.uint8)
        if self.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8))
        self.host_group.broadcast([rest], options).wait()
        if self.rank == 0:
            return obj
        return pickle.loads(header[8 : 8 + head].numpy().tobytes() + rest.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest `value` any rank passes (e.g. the KV blocks every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.host_group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def close(self) -> None:
        """Shut the groups down once every rank is done with them (NCCL's communicator is destroyed
        here, not at interpreter exit, where its destructor can hang the process)."""
        for group in (self.device_group, self.host_group):
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):
                pass

    def abort(self) -> None:
        """Tear the device group down without waiting for peers (a rank died). NCCL's abort may block
        for long (shared/gpu/README.md), so it runs on a daemon thread; idempotent."""
        if self._aborted.is_set():
            return
        self._aborted.set()
        threading.Thread(target=self._abort, name=f"tp-abort-{self.rank}", daemon=True).start()

    def _abort(self) -> None:
        for group in (self.device_group, self.host_group):
            try:
                group.abort()
            except (RuntimeError, AttributeError):
                pass
