"""The process groups of one tensor-parallel worker, made without a default process group (as the
KV pairs are), over a TCPStore that rank 0 hosts.

Two groups of the same ranks, a symmetric buffer, and a ring:
  device  NCCL on CUDA, gloo on the CPU: the model's all-reduces and all-gathers, and the tensors
          of a step's hand-off (input tokens still on rank 0's device);
  symmetric  on CUDA where every rank can map the others' memory: the small all-reduces (a decode
          step's) in one kernel each (engine/parallel/symmetric.py), NCCL doing the rest;
  host    gloo: what the ranks agree on while they build (the KV block count);
  ring    shared memory (engine/parallel/ring.py), rank 0 to the others: each step message,
          pickled. Measured against a broadcast over the host group (bench/results/tp_handoff_cpu.json):
          lower latency at every size, and a fraction of rank 0's host time per step.
Every rank of a worker is on one node (a placement-group bundle), so the ring's file is theirs.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from engine.parallel.ring import RingReader, RingWriter, reader_spin_s
from engine.parallel.symmetric import SymmetricAllReduce

__all__ = ["GroupAddress", "PartialSum", "TPGroup", "host_store", "shutdown_beside"]


class PartialSum(NamedTuple):
    """One rank's partial sums of a row-parallel projection, their all-reduce left to the norm that follows
    (TPGroup.all_reduce_later)."""

    tensor: torch.Tensor
    group: TPGroup
    pushed: bool = False  # its product stored it into the peers' buffers too (TPGroup.product_later)

_IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks of one worker meet: rank 0's store."""

    host: str
    port: int


def host_store(host: str) -> dist.TCPStore:
    """Rank 0's store (port chosen by the OS); its address is (host, store.port)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def shutdown_beside(group: TPGroup) -> threading.Thread:
    """Rank 0's group.shutdown() on a daemon thread, started: it returns once the other ranks shut
    theirs down, and a rank that never does must not hold close() (join the thread with a timeout)."""
    thread = threading.Thread(target=group.shutdown, name=f"tp-shutdown-{group.rank}", daemon=True)
    thread.start()
    return thread


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
        self.ring_writer: RingWriter | None = None
        self._ring_reader: RingReader | None = None
        self._send_lock = threading.Lock()
        if rank == 0:
            self.ring_writer = RingWriter(size - 1)
            store.set(f"{prefix}/ring", json.dumps([self.ring_writer.name, os.getpid()]))
        else:
            name, writer_pid = json.loads(store.get(f"{prefix}/ring"))
            self._ring_reader = RingReader(name, size - 1, rank - 1, writer_pid, reader_spin_s(self.device.type))
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
        self._symmetric: SymmetricAllReduce | None = None
        if self.device.type == "cuda":
            symmetric = SymmetricAllReduce.build(f"pdserve/{prefix}/{address.host}:{address.port}", rank, size,
                                                 store, self.device_group, self.device)
            if self.min_int(int(symmetric is not None)) == 1:  # NOTE: every rank takes the same path
                self._symmetric = symmetric
        if rank == 0:
            assert self.ring_writer is not None
            self.ring_writer.unlink()  # NOTE: every rank mapped it before joining the groups: nothing can leak it now
        self._aborted = threading.Event()
        self._store_lock = threading.Lock()  # NOTE: a TCPStore object runs one operation at a time

    # ---- reports from the ranks to rank 0 (the store): what a side thread of a rank finished
    def report(self, key: str, value: str) -> None:
        with self._store_lock:
            self._store.set(f"report/{key}", value)

    def reports(self, keys: list[str]) -> list[str] | None:
        """The values of every key once all are reported (then forgotten), else None; never blocks."""
        full = [f"report/{k}" for k in keys]
        with self._store_lock:
            if not self._store.check(full):
                return None
            values = [self._store.get(k).decode() for k in full]
            for k in full:
                self._store.delete_key(k)
        return values

    def _gloo(self, store: dist.PrefixStore, host: str, timeout: timedelta) -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, self.rank, self.size, options)

    # ---- the model's collectives (device group)
    @property
    def reduces_symmetrically(self) -> bool:
        """Whether small all-reduces take the symmetric-memory kernels (else NCCL, or gloo on the CPU)."""
        return self._symmetric is not None

    def all_reduce_later(self, tensor: torch.Tensor) -> torch.Tensor | PartialSum:
        """`tensor`'s all-reduce, or, where the norm after it can take the two in one kernel (small rows on
        symmetric memory), `tensor` as a PartialSum for that norm (TPGroup.add_rms_norm)."""
        if self._symmetric is not None and self._symmetric.fuses_norm(tensor):
            return PartialSum(tensor, self)
        return self.all_reduce(tensor)

    def product_later(self, x: torch.Tensor, weight: torch.Tensor) -> PartialSum | None:
        """A row-parallel projection's one-row product x @ weight.T (no bias), pushed into every peer's symmetric
        buffer as it is made, its all-reduce left to the norm after it; None where the product cannot push (then
        multiply, and `all_reduce_later`)."""
        if self._symmetric is None or not self._symmetric.pushes(x, weight):
            return None
        return PartialSum(self._symmetric.product_pushed(x, weight), self, pushed=True)

    def add_rms_norm(self, partial: PartialSum, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     quantize: bool) -> tuple[Any, torch.Tensor]:
        """DecoderOps.add_rms_norm of `partial` summed over the ranks, the sum in the same kernel."""
        assert self._symmetric is not None and partial.group is self
        if partial.pushed:
            return self._symmetric.pushed_add_rms_norm(partial.tensor, residual, weight, eps, quantize)
        return self._symmetric.add_rms_norm(partial.tensor, residual, weight, eps, quantize)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: a new tensor (small ones, symmetric memory) or `tensor` summed in place;
        use the result. On CUDA it orders the current stream after the reduction without blocking the
        host (and is captured by CUDA graphs)."""
        if self._symmetric is not None and self._symmetric.fits(tensor):
            return self._symmetric(tensor)
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all), concatenated along `dim` in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.device_group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    # ---- rank 0's messages (the ring)
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 passes `obj`; every rank returns it. A follower waits until rank 0 sends (RingClosed
        once rank 0's process is gone)."""
        if self.ring_writer is not None:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            with self._send_lock:  # NOTE: the engine thread's steps and other threads' RankCalls share the ring
                self.ring_writer.write(payload)
            return obj
        assert self._ring_reader is not None
        return pickle.loads(self._ring_reader.read())

    def min_int(self, value: int) -> int:
        """The smallest `value` any rank passes (e.g. the KV blocks every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.host_group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def close(self) -> None:
        """Shut the groups down, then the ring (a follower, once it left its loop)."""
        self.shutdown()
        self.close_ring()

    def shutdown(self) -> None:
        """Shut the groups down (NCCL's communicator is destroyed here, not at interpreter exit, where
        its destructor can hang the process). On CUDA a rank's shutdown returns once every rank has
        called its own (seen on 2x H200: a follower waited in it while rank 0 waited for that follower
        to exit), so rank 0 calls this while the others call theirs."""
        if self._symmetric is not None:
            self._symmetric.close()
            self._symmetric = None
        for group in (self.device_group, self.host_group):
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):
                pass

    def close_ring(self) -> None:
        """Rank 0: after the followers left (they read Stop from it)."""
        for ring in (self.ring_writer, self._ring_reader):
            if ring is not None:
                ring.close()
        self.ring_writer = self._ring_reader = None

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
