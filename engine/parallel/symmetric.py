"""A tensor-parallel worker's small all-reduces through torch's symmetric memory: each rank's buffer is
mapped into every other rank's address space (CUDA IPC over NVLink), and one kernel reads the peers'
rows and sums them, where NCCL's ring or tree pays its protocol's latency. A decode step's all-reduces
are small ([batch, hidden] in the model dtype, two a layer) and latency-bound.

Measured on 2x H200 (bench/results/allreduce_small_2xh200.json, 64 calls to a CUDA graph): the one-shot kernel
is the fastest up to 32 rows of 4096 bfloat16, the two-shot one above, NCCL's no faster than either up to 256.
So: one-shot up to ONE_SHOT_MAX_BYTES, two-shot (its input copied in first) up to BUFFER_BYTES, NCCL
above (a prefill chunk's rows, bandwidth-bound, where NCCL is not slower).

Both kernels sum every rank's rows in rank order on every rank, so all ranks hold the same bits, and
both end with a barrier of the ranks, so the one buffer is free again once a call returns on any rank.
The all-reduces a norm follows take one kernel with it (engine/parallel/symm_kernels.py) in a buffer of its
own, and a one-row product's pushes another.
A rank whose peer died spins in the barrier (as an NCCL kernel does): its process must go (README,
tensor parallelism)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BUFFER_BYTES", "ONE_SHOT_MAX_BYTES", "SymmetricAllReduce", "takes_fused_norm"]
log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 256 * 1024  # 32 rows of 4096 bfloat16: where the two kernels cross
BUFFER_BYTES = 2 * 1024 * 1024  # 256 rows of 4096 bfloat16: the largest size measured
FLAG_BYTES = 4  # the fused kernel's flags: one uint32 a row and rank in each signal pad
OLDEST_SIGNAL_PAD_BYTES = 2048  # a torch that does not say its signal pads' size made them this size


def fused_rows_max(world: int, signal_pad_bytes: int) -> int:
    """The most rows the fused kernel's signal pads hold a flag for (one a row and rank)."""
    return signal_pad_bytes // (FLAG_BYTES * world)


PUSH_REGION = 16384  # the widest row a product pushes (its peers' lines: a region a half and rank)


def takes_fused_norm(rows: int, row_bytes: int, world: int, signal_pad_bytes: int) -> bool:
    """Whether the all-reduce fused with the norm (engine/parallel/symm_kernels.py) takes ROWS rows of
    ROW_BYTES: the one-shot size, a power-of-two group, and a flag per row and rank within each signal pad
    (past it the kernel would write into memory it does not own)."""
    return (0 < rows * row_bytes <= ONE_SHOT_MAX_BYTES and world & (world - 1) == 0
            and rows <= fused_rows_max(world, signal_pad_bytes))


class SymmetricAllReduce:
    """The symmetric buffer of one group's ranks, and the calls on it. `build` returns None where it
    cannot be made (the CPU, a torch without symmetric memory, ranks that cannot map each other's
    memory); every rank calls it at once, and the caller makes the ranks agree before using it."""

    def __init__(self, buffer: torch.Tensor, fused: torch.Tensor, fused_handle: Any, pushed: torch.Tensor,
                 pushed_handle: Any, group_name: str) -> None:
        self._buffer = buffer  # uint8, BUFFER_BYTES, mapped by every rank
        self._fused = fused  # uint8, two halves of ONE_SHOT_MAX_BYTES: the fused kernel's own, and its pads
        self._fused_handle = fused_handle  # its rendezvous: every rank's buffer and signal pad
        self._name = group_name
        self._signal_pad_bytes = int(getattr(fused_handle, "signal_pad_size", None) or OLDEST_SIGNAL_PAD_BYTES)
        rows = fused_rows_max(fused_handle.world_size, self._signal_pad_bytes)
        self._fused_calls = torch.zeros(rows, dtype=torch.int32, device=buffer.device)  # each row's calls
        self._pushed = pushed  # int32 lines, 2 * world regions of PUSH_REGION, zeroed: the pushed norm's own
        self._pushed_handle = pushed_handle
        self._pushed_calls = torch.zeros(1, dtype=torch.int32, device=buffer.device)
        # NOTE: the kernels' modules import Triton: resolved once here (this is built on CUDA only), not per call
        from engine.models import row_kernels
        from engine.parallel import symm_kernels

        self._rows, self._kernels = row_kernels, symm_kernels
        self._push = row_kernels.Push(pushed_handle.buffer_ptrs_dev, self._pushed_calls, PUSH_REGION,
                                      pushed_handle.rank, pushed_handle.world_size)

    @staticmethod
    def build(name: str, rank: int, size: int, store: Any, backend: Any, device: torch.device
              ) -> SymmetricAllReduce | None:
        """Registers the group's NCCL `backend` under NAME (symmetric memory resolves its groups by name;
        this worker has no default process group) and its ranks with symmetric memory (handles meet in
        STORE), and maps the buffer on every rank (a collective). None, with the reason logged, where
        that fails."""
        if device.type != "cuda":
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            # NOTE: the CUDA backend (peers' memory mapped over CUDA IPC), not NCCL's windows on the group's
            # communicator; either way the ops resolve the group by name (torch 2.11: without the registered group
            # the rendezvous fails)
            if symm_mem.get_backend(device) != "CUDA":
                symm_mem.set_backend("CUDA")
            group = dist.ProcessGroup(dist.PrefixStore("symm/group", store), rank, size)
            group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
            group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
            group._set_group_name(name)
            torch._C._distributed_c10d._register_process_group(name, group)
            symm_mem._SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore("symm", store))
            buffer = symm_mem.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buffer, name)
            fused = symm_mem.empty(2 * ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
            fused_handle = symm_mem.rendezvous(fused, name)
            pushed = symm_mem.empty(2 * size * PUSH_REGION, dtype=torch.int32, device=device)
            pushed.zero_()  # NOTE: no line carries a call's tag before its call (tags start at 1)
            torch.cuda.synchronize(device)  # zeroed before any peer can write into it
            pushed_handle = symm_mem.rendezvous(pushed, name)
        except Exception as err:  # noqa: BLE001 - NCCL stays the path; the reason is logged
            log.warning("symmetric-memory all-reduce unavailable on rank %d (%s: %s); NCCL does them",
                        rank, type(err).__name__, err)
            return None
        return SymmetricAllReduce(buffer, fused, fused_handle, pushed, pushed_handle, name)

    def close(self) -> None:
        """Free the buffer (a mapping every rank holds) once the device is done with it, and forget the group's
        name, before the device group's NCCL communicator is shut down."""
        torch.cuda.synchronize(self._buffer.device)
        del self._buffer, self._fused, self._fused_handle, self._fused_calls
        del self._pushed, self._pushed_handle, self._pushed_calls, self._push
        try:
            torch._C._distributed_c10d._unregister_process_group(self._name)
        except (RuntimeError, AttributeError):
            pass

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether this path takes `tensor` (a contiguous floating tensor of at most BUFFER_BYTES)."""
        nbytes = tensor.numel() * tensor.element_size()
        return (tensor.is_cuda and tensor.is_contiguous() and tensor.dtype in (torch.bfloat16, torch.float16,
                                                                               torch.float32)
                and 0 < nbytes <= BUFFER_BYTES and nbytes % 16 == 0)

    def fuses_norm(self, tensor: torch.Tensor) -> bool:
        """Whether `add_rms_norm` takes these partial sums (16-bit rows, as `takes_fused_norm` says)."""
        return (self.fits(tensor) and tensor.dim() == 2 and tensor.dtype != torch.float32
                and takes_fused_norm(tensor.shape[0], tensor.shape[1] * tensor.element_size(),
                                     self._fused_handle.world_size, self._signal_pad_bytes))

    def add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     quantize: bool) -> tuple[Any, torch.Tensor]:
        """The all-reduce of `partial` (which `fuses_norm`), then DecoderOps.add_rms_norm, in one kernel
        (engine/parallel/symm_kernels.py)."""
        return self._kernels.allreduce_add_rms_norm(self._fused_handle, self._fused_calls, partial, residual, weight,
                                                    eps, quantize)

    def pushes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the one-row product x @ weight.T (a row-parallel projection's, no bias) can push its row into
        the peers' buffers for `pushed_add_rms_norm`: a row_product of at most PUSH_REGION outputs, a multiple of
        its tile's rows, whose row the fused norm takes (`takes_fused_norm`)."""
        n, block_n = weight.shape[0], self._rows.row_config(weight.shape[1])[0]
        return (self._rows.takes_row_product(x, weight)
                and self._rows.push_fits(n, block_n, PUSH_REGION, x.element_size())
                and takes_fused_norm(1, n * x.element_size(), self._push.world, self._signal_pad_bytes))

    def product_pushed(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (which `pushes`), the row also stored into every peer's buffer (`pushed_add_rms_norm`
        sums it)."""
        return self._rows.row_product(x, weight, None, push=self._push)

    def pushed_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, quantize: bool) -> tuple[Any, torch.Tensor]:
        """`add_rms_norm` of a row from `product_pushed`: its peers' rows are in this rank's buffer already."""
        return self._kernels.pushed_add_rms_norm(self._pushed_handle, self._pushed_calls, PUSH_REGION, partial,
                                                 residual, weight, eps, quantize)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `tensor` (which `fits`), as a new tensor; the current stream is
        ordered after it (and a CUDA graph captures it)."""
        n = tensor.numel()
        staged = self._buffer.view(tensor.dtype)[:n]
        if n * tensor.element_size() <= ONE_SHOT_MAX_BYTES:
            out = torch.empty_like(tensor)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, tensor.view(-1), "sum", self._name,
                                                            out=out.view(-1))
            return out
        staged.copy_(tensor.view(-1))
        out = torch.empty_like(tensor)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self._name, out.view(-1))
        return out
