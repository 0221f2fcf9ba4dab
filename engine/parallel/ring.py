"""A shared-memory ring from rank 0 to the other ranks of a worker (all on one node): rank 0 writes
each step message once, every follower reads it, without a syscall or a socket on either side.

Layout of the segment: a header of one int64 per reader (the last sequence number it consumed),
then NUM_SLOTS slots of SLOT_BYTES, each [seq: int64, size: int64, more: int64, pad, payload].
The writer fills slot seq % NUM_SLOTS once every reader consumed the message that held it, writing
the payload first and `seq` last; a reader waits until its next slot's `seq` is the one it expects,
then copies the payload and publishes its consumed counter. A message longer than a slot spans
consecutive slots (`more` = 1 on all but the last).

NOTE: the order of the writes is what publishes a message: CPython's memoryview stores are plain
stores, ordered on x86 (TSO). Waiting sides spin, then sleep with backoff (an idle follower costs
~nothing; the first step after a long idle waits up to MAX_SLEEP_S). A reader spins for `spin_s`: a
GPU rank's (GPU_SPIN_S) outlasts a step, so a busy follower takes each message as it lands, not up to
a backoff sleep late (rank 0's GPU may wait for it at the step's first collective then); a CPU
rank's is short (its steps are long, and a spinning rank takes a core its peers compute on).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import uuid

__all__ = ["GPU_SPIN_S", "NUM_SLOTS", "RingClosed", "RingReader", "RingWriter", "SLOT_BYTES", "SPIN_S",
           "reader_spin_s"]

SLOT_BYTES = 1 << 20
NUM_SLOTS = 8
_SLOT_HEAD = 32
SPIN_S = 2e-3  # spin this long before sleeping
GPU_SPIN_S = 0.1  # a GPU rank's reader: longer than a decode step (a 70B one at batch 64 is ~35 ms)
MAX_SLEEP_S = 1e-3
_I64 = struct.Struct("<q")
_SLOT = struct.Struct("<qqq")


class RingClosed(RuntimeError):
    """The other side went away (the writer's process died, or it closed the ring)."""


def reader_spin_s(device_type: str) -> float:
    """How long a follower on a device of this type spins for rank 0's next message before it sleeps."""
    return GPU_SPIN_S if device_type == "cuda" else SPIN_S


def _wait(ready: object, alive: object, what: str, spin_s: float) -> None:
    """Spin on ready() for spin_s (0 where the peer is a thread of this process: it must not hold the
    GIL spinning), then sleep with backoff; RingClosed once alive() says the peer is gone."""
    start = time.perf_counter()
    sleep = 1e-5
    checked = start
    while not ready():  # type: ignore[operator]
        now = time.perf_counter()
        if now - start < spin_s:
            continue
        if now - checked > 1.0:
            checked = now
            if not alive():  # type: ignore[operator]
                raise RingClosed(what)
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_S)


_DIR = "/dev/shm"  # NOTE: a plain file mapped by every rank: no resource tracker may unlink it early


def _map(path: str, size: int) -> tuple[mmap.mmap, memoryview]:
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), size)
    return mapped, memoryview(mapped)


class _Ring:
    def __init__(self, path: str, size: int, num_readers: int) -> None:
        self.path = path
        self._mmap, self.buf = _map(path, size)
        self.num_readers = num_readers
        self.slots_at = -(-8 * num_readers // 64) * 64

    def _slot(self, seq: int) -> int:
        return self.slots_at + (seq % NUM_SLOTS) * SLOT_BYTES

    def consumed(self, reader: int) -> int:
        return _I64.unpack_from(self.buf, 8 * reader)[0]

    @staticmethod
    def size_for(num_readers: int) -> int:
        return -(-8 * num_readers // 64) * 64 + NUM_SLOTS * SLOT_BYTES


class RingWriter(_Ring):
    """Rank 0's end; `name` (a file under /dev/shm) is what readers map; `unlink` removes it once
    they have."""

    def __init__(self, num_readers: int) -> None:
        size = self.size_for(num_readers)
        path = os.path.join(_DIR if os.path.isdir(_DIR) else "/tmp", f"pdserve-tp-{uuid.uuid4().hex}")
        with open(path, "wb") as f:
            f.truncate(size)
        super().__init__(path, size, num_readers)
        for r in range(num_readers):
            _I64.pack_into(self.buf, 8 * r, -1)
        for s in range(NUM_SLOTS):
            _SLOT.pack_into(self.buf, self.slots_at + s * SLOT_BYTES, -1, 0, 0)
        self.name = path
        self._seq = 0
        self.readers_alive = lambda: True  # set by the owner: False once a reader's process is gone

    def write(self, payload: bytes) -> None:
        view = memoryview(payload)
        room = SLOT_BYTES - _SLOT_HEAD
        chunks = [view[i : i + room] for i in range(0, max(len(view), 1), room)] or [view]
        for i, chunk in enumerate(chunks):
            seq = self._seq
            oldest = seq - NUM_SLOTS  # the message this slot held last
            _wait(lambda: all(self.consumed(r) >= oldest for r in range(self.num_readers)), self.readers_alive,
                  "a tensor-parallel rank stopped reading its step messages", spin_s=0.0)
            at = self._slot(seq)
            self.buf[at + _SLOT_HEAD : at + _SLOT_HEAD + len(chunk)] = chunk
            _I64.pack_into(self.buf, at + 8, len(chunk))
            _I64.pack_into(self.buf, at + 16, 1 if i < len(chunks) - 1 else 0)
            _I64.pack_into(self.buf, at, seq)  # NOTE: last: publishes the slot
            self._seq += 1

    def unlink(self) -> None:
        """Remove the file once every reader has mapped it (the mappings stay); idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()
        self.unlink()


class RingReader(_Ring):
    """Reader `index` (rank - 1) of the ring `name`; `writer_pid`: rank 0's process, watched while waiting;
    `spin_s`: how long a read spins before it sleeps (SPIN_S, or GPU_SPIN_S on a GPU rank)."""

    def __init__(self, name: str, num_readers: int, index: int, writer_pid: int, spin_s: float = SPIN_S) -> None:
        super().__init__(name, self.size_for(num_readers), num_readers)
        self.index = index
        self.spin_s = spin_s
        self._seq = 0
        self._writer_pid = writer_pid

    def _writer_alive(self) -> bool:
        try:
            os.kill(self._writer_pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def read(self) -> bytes:
        parts = []
        while True:
            seq = self._seq
            at = self._slot(seq)
            _wait(lambda: _I64.unpack_from(self.buf, at)[0] == seq, self._writer_alive,
                  "rank 0 went away (its process ended)",
                  spin_s=self.spin_s if self._writer_pid != os.getpid() else 0.0)
            _, size, more = _SLOT.unpack_from(self.buf, at)
            parts.append(bytes(self.buf[at + _SLOT_HEAD : at + _SLOT_HEAD + size]))
            _I64.pack_into(self.buf, 8 * self.index, seq)
            self._seq += 1
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()
