"""Transports over torch.distributed point-to-point ops: gloo (CPU tensors) and NCCL (CUDA tensors).

Pairing, the layout check and dropping live in pair_group.PairGroupTransport; this file holds what
differs per backend: how the group is built, how a transfer's completion is observed, and how a
group is torn down when its pair is dropped.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer.layout import KvLayout
from kvtransfer.pair_group import Pair, PairGroupTransport, Waiter
from kvtransfer.transport import EventHandle, TransferError, TransferHandle, poll_until, register_transport

__all__ = ["GlooTransport", "NcclTransport", "NCCL_WORKER_ENV"]

# Environment every worker process using NcclTransport must start with; the cluster layer puts it
# into the actors' runtime_env (this package never sets environment variables). Without the first
# three, PyTorch's watchdog may tear down the surviving side of a dead pair (shared/gpu/README.md,
# point 5); the last three keep NVLink multicast off on multi-GPU hosts.
NCCL_WORKER_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_TAG_POISON = 7  # nobody ever sends on it: a recv there can only time out (GlooTransport._abort)


@register_transport
class GlooTransport(PairGroupTransport):
    """CPU tensors over a per-pair ProcessGroupGloo (TCP).

    Completion of each send/recv is observed by a Waiter thread per direction of a pair (gloo's
    works cannot be polled). Dropping a pair closes its TCP connection at once, so the peer's
    unfinished transfers fail within milliseconds instead of at the group's timeout.
    """

    name = "gloo"
    supports_cpu = True
    supports_cuda = False

    def _form(self, peer_id: str, rank: int, prefix_store: dist.PrefixStore) -> Pair:
        options = dist.ProcessGroupGloo._Options()
        # NOTE: gloo fixes a pair's op timeout when the group is built (set_timeout() later does not
        # reach send/recv), so it is the per-transfer limit, not the pairing timeout.
        options._timeout = timedelta(seconds=self.max_transfer_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self._host)]  # no env lookup
        group = dist.ProcessGroupGloo(prefix_store, rank, 2, options)
        return Pair(peer_id, rank, group)

    def _start(self, pair: Pair, op: str, tensor: torch.Tensor, tag: int) -> TransferHandle:
        handle = EventHandle(f"{op} {'to' if op == 'send' else 'from'} {pair.peer_id!r}")
        with pair.lock:  # NOTE: under the lock, so a concurrent drop cannot stop the waiter in between
            if pair.is_dropped:
                handle.finish(TransferError(f"{self.self_id!r} dropped its pair with {pair.peer_id!r}"))
                return handle
            try:
                if op == "send":
                    work = pair.group.send([tensor], pair.peer_rank, tag)
                else:
                    work = pair.group.recv([tensor], pair.peer_rank, tag)
            except RuntimeError as e:  # the connection is already gone
                handle.finish(self._explain(pair, e))
                return handle
            waiter = pair.waiters.get(op)
            if waiter is None:
                waiter = pair.waiters[op] = Waiter(pair, op, self._explain)
            waiter.submit(work, handle)
        return handle

    def _abort(self, pair: Pair) -> None:
        # NOTE: gloo's abort()/shutdown() do not wake a blocked wait() (torch 2.13); what does is a
        # wait(timeout) that times out: gloo then closes the pair's connection, every unfinished
        # work on either side fails at once, and our Waiters drain and exit.
        try:
            pair.group.recv([torch.zeros(1)], pair.peer_rank, _TAG_POISON).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the expected timeout, or a connection the peer already closed


class _CudaEventHandle(TransferHandle):
    """An NCCL transfer: done once an event recorded after it on the pair's stream has completed."""

    def __init__(self, what: str, started: torch.cuda.Event, event: torch.cuda.Event, pair: Pair, self_id: str) -> None:
        self._what = what
        self._started = started  # recorded on the pair's stream just before the transfer
        self._event = event
        self._pair = pair
        self._self_id = self_id

    def device_seconds(self) -> float | None:
        if not self._event.query():
            return None
        return self._started.elapsed_time(self._event) / 1e3

    def done(self) -> bool:
        return self._event.query() or self._pair.is_dropped  # query() never blocks the host

    def wait(self, timeout_s: float) -> bool:
        # NOTE: never event.synchronize(): a recv whose sender died never finishes (README point 3).
        if not poll_until(self.done, timeout_s, interval_s=5e-5):  # query() costs ~1 us; transfers ~1 ms
            return False
        if self.error is not None:
            raise self.error
        return True

    @property
    def error(self) -> BaseException | None:
        if self._event.query() or not self._pair.is_dropped:
            return None
        return TransferError(f"{self._what} failed: {self._self_id!r} dropped its pair with {self._pair.peer_id!r}")


@register_transport
class NcclTransport(PairGroupTransport):
    """CUDA tensors over a per-pair ProcessGroupNCCL.

    Workers using it must run with NCCL_WORKER_ENV in their environment (at least
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0, TORCH_NCCL_DUMP_ON_TIMEOUT=0, TORCH_NCCL_ENABLE_MONITORING=0;
    on multi-GPU hosts also NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
    NVSHMEM_DISABLE_NVLS=1), set before the process starts, e.g. in a Ray actor's runtime_env.

    Following shared/gpu/README.md:
      - pairing exchanges the layouts in both directions, which opens NCCL's lazy connection while
        both peers are known alive (the connect blocks the pairing thread, never the engine);
      - each pair has its own CUDA stream; a transfer's handle polls an event recorded after it on
        that stream against the deadline (work.wait() only orders streams, and a recv whose sender
        died never finishes: a synchronize would hang the worker);
      - drop() marks the pair dropped and calls pg.abort() from a daemon thread (it may not return
        for a long time), which releases the GPU for new work and new pairs.
    Before sending, the pair's stream waits on the caller's current stream, so a buffer gathered
    there is complete; received data is safe to read on any stream once the handle is done.
    """

    name = "nccl"
    supports_cpu = False
    supports_cuda = True

    def __init__(self, self_id: str, layout: KvLayout, device: torch.device | str, host: str = "127.0.0.1",
                 max_transfer_s: float = 600.0) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the nccl transport needs a CUDA device, and none is visible here; use gloo on CPUs")
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(self_id, layout, device, host, max_transfer_s)

    def _form(self, peer_id: str, rank: int, prefix_store: dist.PrefixStore) -> Pair:
        # NOTE: NCCL's communicator forms at the first op and, with a peer that never comes, blocks
        # there with no deadline; so both sides first meet in the store, which fails at the pairing's
        # deadline (rendezvous.PollingStore). A peer dying between this and its first op still hangs
        # our pairing thread (never the store, never other pairs).
        prefix_store.set(f"ready/{rank}", "1")
        prefix_store.wait([f"ready/{1 - rank}"])
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=self.max_transfer_s)
        # NOTE: a high-priority stream: a KV push sent during a prefill runs beside the step's kernels
        # instead of waiting for SMs they hold (prefill_worker/layer_push.py)
        options.is_high_priority_stream = True
        with torch.cuda.device(self.device):
            group = dist.ProcessGroupNCCL(prefix_store, rank, 2, options)
            stream = torch.cuda.Stream(device=self.device)
        return Pair(peer_id, rank, group, stream)

    def _start(self, pair: Pair, op: str, tensor: torch.Tensor, tag: int) -> TransferHandle:
        what = f"{op} {'to' if op == 'send' else 'from'} {pair.peer_id!r}"
        with pair.lock:
            if pair.is_dropped:
                failed = EventHandle(what)
                failed.finish(TransferError(f"{self.self_id!r} dropped its pair with {pair.peer_id!r}"))
                return failed
            with torch.cuda.device(self.device):
                pair.stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer of tensor
                with torch.cuda.stream(pair.stream):
                    started = torch.cuda.Event(enable_timing=True)
                    started.record(pair.stream)
                    try:
                        if op == "send":
                            work = pair.group.send([tensor], pair.peer_rank, tag)
                        else:
                            work = pair.group.recv([tensor], pair.peer_rank, tag)
                        work.wait()  # NCCL: orders pair.stream after the op; does not block the host
                    except RuntimeError as e:
                        failed = EventHandle(what)
                        failed.finish(self._explain(pair, e))
                        return failed
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(pair.stream)
                # The caching allocator must not hand this memory out while the transfer may touch it.
                tensor.record_stream(pair.stream)
        return _CudaEventHandle(what, started, event, pair, self.self_id)

    def _abort(self, pair: Pair) -> None:
        try:
            pair.group.abort()  # may block for a long time (README point 4): this is a daemon thread
        except RuntimeError:
            pass
