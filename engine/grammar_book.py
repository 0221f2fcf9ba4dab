"""GrammarBook: one engine's constrained requests, their matchers kept in a grammar process.

The engine thread never waits for grammar work. Each call that changes matchers or needs a mask
(`submit`, `mask`, `accept`, `mask_drafts`) sends one message to the process
(engine/grammar_process.py) and returns: a mask comes back still filling, in a slot of the region
both processes map, and the draw that uses it waits for its ticket (on CUDA the device spins on the
region's first word, engine/host_gate.py; on the CPU the host reads the ticket's ack). Errors of
that work come back on the acks and are raised by the next call (`settle`).

`add` and `compile_within` are calls answered by the process: a request joins with its matcher
built (and a grammar that does not compile, or not in time, is refused) before any work names it.

A matcher is never shipped between workers: it is rebuilt from the grammar and the output so far
(a decode worker's first token from the prefill worker, a moved request's earlier output), and
replaying those tokens gives the very state the earlier worker had.

NOTE: the process starts on the first grammar, so an engine that never sees one starts none.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import GrammarSpec
from engine.grammar import COMPILE_TIMEOUT_S, Filling, GrammarError, TokenMask

if TYPE_CHECKING:
    from engine.grammar_process import Region
    from engine.host_gate import HostGate

__all__ = ["GrammarBook"]

START_TIMEOUT_S = 120.0
"""Longest the grammar process may take to start (its first start imports xgrammar and torch)."""

ADD_TIMEOUT_S = COMPILE_TIMEOUT_S + 5.0
"""Longest `add` waits for its matcher: a compile not done by `compile_within` first, and the replay."""


class _ForkServer:
    """engine/grammar_process.py's fork_server: the one parent of this engine process's grammar
    processes (a Python with xgrammar and torch imported, that forks one per book in milliseconds)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # NOTE: a fresh interpreter (no fork of this one's threads), finding the modules this one finds
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen([sys.executable, "-m", "engine.grammar_process", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._socket = ours
        self._lock = threading.Lock()

    def fork(self, config: dict[str, Any], fds: list[int]) -> int:
        """A grammar process serving fds (work, acks, control, replies, region) under config; its pid."""
        with self._lock:
            self._socket.settimeout(START_TIMEOUT_S)  # NOTE: the first waits for the server's imports
            try:
                socket.send_fds(self._socket, [json.dumps(config).encode()], fds)
                answer = self._socket.recv(1 << 12)
            except (OSError, TimeoutError) as err:
                self.process.kill()  # NOTE: a late answer would be taken for the next fork's: the next call starts anew
                raise GrammarError(f"the grammar processes' fork server (pid {self.process.pid}) did not answer "
                                   f"within {START_TIMEOUT_S:g} s: {err}") from None
            if not answer:
                raise GrammarError(f"the grammar processes' fork server exited with code {self.process.wait(5)}")
            return json.loads(answer)["pid"]


class _ForkServers:
    """NOTE: one fork server per engine process, shared by its books: a process-wide resource like
    multiprocessing's own forkserver (which would re-run the main module in each child)."""

    _lock = threading.Lock()
    _server: _ForkServer | None = None

    @classmethod
    def fork(cls, config: dict[str, Any], fds: list[int]) -> int:
        with cls._lock:
            if cls._server is None or cls._server.process.poll() is not None:  # NOTE: a dead one is replaced
                cls._server = _ForkServer()
            server = cls._server
        return server.fork(config, fds)


class _Process:
    """The started grammar process: its channels, the region's views, and the control calls' answers."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int], capacity: int,
                 words: int, pin_memory: bool) -> None:
        from engine.grammar_process import Region, region_bytes

        size = region_bytes(capacity, words)
        region_fd = os.memfd_create("pdserve-grammar")
        pipes = [os.pipe() for _ in range(4)]  # work and control to the child, acks and replies from it
        theirs = [pipes[0][0], pipes[1][1], pipes[2][0], pipes[3][1], region_fd]
        self.pid = 0
        try:
            os.ftruncate(region_fd, size)
            self._buffer = mmap.mmap(region_fd, size)
            config = {"capacity": capacity, "words": words, "model_dir": str(model_dir), "vocab_size": vocab_size,
                      "stop_token_ids": list(stop_token_ids)}
            self.pid = _ForkServers.fork(config, theirs)
        except BaseException:
            for fd in (pipes[0][1], pipes[1][0], pipes[2][1], pipes[3][0]):
                os.close(fd)
            raise
        finally:
            for fd in theirs:  # NOTE: the child's ends: EOF here when it exits
                os.close(fd)
        self.work, self.control = Connection(pipes[0][1], readable=False), Connection(pipes[2][1], readable=False)
        self.acks, self.replies = Connection(pipes[1][0], writable=False), Connection(pipes[3][0], writable=False)
        self.region: Region = Region.of(self._buffer, capacity, words)
        self._registered = 0  # the region's address while registered with CUDA
        if pin_memory:  # NOTE: the device reads the words and copies the slots without a staging copy
            cudart = torch.cuda.cudart()
            address = torch.frombuffer(self._buffer, dtype=torch.uint8).data_ptr()
            status = cudart.cudaHostRegister(address, size, 3)  # cudaHostRegisterPortable | Mapped
            if status != cudart.cudaError.success:
                self.close()
                raise RuntimeError(f"cudaHostRegister of the grammar region ({size} bytes) failed: {status}")
            self._registered = address
        self._calls = itertools.count(1)
        self._answers: dict[int, Future[str | None]] = {0: Future()}
        self._sending = threading.Lock()  # NOTE: control calls come from several threads
        threading.Thread(target=self._read_replies, name="grammar-replies", daemon=True).start()
        try:
            started = self._answers[0].result(START_TIMEOUT_S)
        except FutureTimeout:
            self.close()
            raise GrammarError(f"the grammar process did not start within {START_TIMEOUT_S:g} s") from None
        if started is not None:
            self.close()
            raise GrammarError(f"the grammar process could not start: {started}")

    def _read_replies(self) -> None:
        while True:
            try:
                call, error = self.replies.recv()
            except (EOFError, OSError):
                break
            answer = self._answers.pop(call, None)
            if answer is not None:  # NOTE: None: its caller stopped waiting (a compile past its limit)
                answer.set_result(error)
        for answer in list(self._answers.values()):
            if not answer.done():
                answer.set_exception(self.exited())

    def exited(self) -> RuntimeError:
        return RuntimeError(f"the grammar process (pid {self.pid}) exited; the constrained requests' matchers are "
                            "lost: restart the worker")

    def is_alive(self) -> bool:
        if self.pid <= 0:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def call(self, message: tuple[Any, ...], timeout_s: float) -> str | None:
        """Sends ("kind", call, ...) with a fresh call number; the answer (an error or None), or
        FutureTimeout after timeout_s."""
        call = next(self._calls)
        answer: Future[str | None] = Future()
        self._answers[call] = answer
        with self._sending:
            self.control.send((message[0], call, *message[1:]))
        try:
            return answer.result(timeout_s)
        finally:
            self._answers.pop(call, None)

    def close(self) -> None:
        """Closes the channels the process reads (it exits on their end), killing it after 5 s, and
        unregisters the region; idempotent."""
        for end in (self.work, self.control):
            end.close()
        deadline = time.monotonic() + 5
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        if self._registered:
            # NOTE: a registration outlives the mapping: unregistered here, or the next region mapped at this
            # address fails to register. Once the device is idle: no queued gate or copy reads it after.
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = 0


class GrammarBook:
    """One engine's constrained requests, by id. Engine thread only, except `compile_within`."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_token_ids: Sequence[int], capacity: int,
                 pin_memory: bool = False) -> None:
        """capacity: the most rows one draw masks (a batch, or a verification's positions)."""
        self._start_args = (Path(model_dir), vocab_size, tuple(stop_token_ids), capacity, -(-vocab_size // 32))
        self.capacity = capacity
        self._pin_memory = pin_memory  # NOTE: the logits are on CUDA: registered slots, draws wait on the device
        self._starting = threading.Lock()
        self._process: _Process | None = None
        self._gate: HostGate | None = None
        self._keys: dict[str, int] = {}  # request id -> its matcher's key in the process
        self._next_key = itertools.count(1)
        self._drops: list[int] = []  # keys to drop, sent with the next work
        self._last_ticket = 0  # the last work's (tickets count up from 1)
        self._acked = 0  # the last ticket whose work's ack was read
        self._errors: list[str] = []  # work that failed, raised by the next settle
        self.work_seconds = 0.0  # the process's time on the work acked so far (stats)
        self.finished_at = 0.0  # when the last work acked was done (time.perf_counter: the process's clock is ours)
        self._turn = 0

    def _started(self) -> _Process:
        with self._starting:  # NOTE: the first grammars' compile calls race from worker threads
            if self._process is None:
                self._process = _Process(*self._start_args, self._pin_memory)
                weakref.finalize(self, self._process.close)  # NOTE: a book dropped unclosed ends its process too
                if self._pin_memory:
                    from engine.host_gate import HostGate

                    self._gate = HostGate(self._process.region.words)
            return self._process

    @property
    def gate(self) -> HostGate | None:
        """Where draws wait for their masks on the device (CUDA, once the process started)."""
        return self._gate

    def close(self) -> None:
        """Ends the process, its matchers with it (their requests are gone: the engine closes); idempotent."""
        process, self._process = self._process, None
        self._keys.clear()
        if process is not None:
            process.close()

    def compile_within(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """Compiles spec into the process's cache, or raises GrammarError (the compiler's message, or
        past timeout_s: the compile runs on unheeded). Any thread: a worker's, so that `add`'s
        compile is a cache hit."""
        process = self._started()
        try:
            error = process.call(("compile", spec), timeout_s)
        except FutureTimeout:
            raise GrammarError.too_slow(spec, timeout_s) from None
        if error is not None:
            raise GrammarError(error)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, request_id: str, spec: GrammarSpec, output: Sequence[int]) -> None:
        """A matcher for request_id, advanced over `output` (tokens generated for it elsewhere).
        GrammarError if the grammar does not compile or `output` does not follow it."""
        key = next(self._next_key)
        try:
            error = self._started().call(("add", key, spec, list(output)), ADD_TIMEOUT_S)
        except FutureTimeout:
            self._drops.append(key)  # NOTE: in case it is built after all
            raise GrammarError(f"the {spec.kind}'s matcher was not built within {ADD_TIMEOUT_S:g} s") from None
        if error is not None:
            raise GrammarError(error)
        self._keys[request_id] = key

    def drop(self, request_id: str) -> None:
        key = self._keys.pop(request_id, None)
        if key is not None:
            self._drops.append(key)

    def settle(self) -> None:
        """Reads the acks that came and raises the first error of the work they answer (each once),
        or if the device gave up waiting for a mask."""
        process = self._process
        while process is not None and self._acked < self._last_ticket and process.acks.poll():
            self._read_ack(process)
        self._raise_errors()
        if self._gate is not None and (late := self._gate.late()):
            raise RuntimeError(f"the device gave up waiting for a constrained draw's mask (ticket {late}, after "
                               f"{self._gate.max_spins} reads): its tokens were drawn unmasked; the grammar "
                               "process stalled, restart the worker")

    def _read_ack(self, process: _Process) -> None:
        try:
            ticket, error, started, self.finished_at = process.acks.recv()
        except (EOFError, OSError):
            raise process.exited() from None
        self._acked = ticket
        self.work_seconds += self.finished_at - started
        if error is not None:
            self._errors.append(error)

    def _raise_errors(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            raise RuntimeError(f"the grammar process: {error}")

    def wait(self, ticket: int) -> None:
        """The host waits until ticket's work is done, raising its error (a CPU draw's wait)."""
        process = self._process
        assert process is not None, "a ticket was taken, so the process started"
        while self._acked < ticket:
            self._read_ack(process)
        self._raise_errors()

    def _send(self, message: tuple[Any, ...]) -> int:
        """Sends ("kind", ticket, drops, ...) with a new ticket; the ticket."""
        self._last_ticket += 1
        ticket = self._last_ticket
        drops, self._drops = self._drops, []
        process = self._process
        assert process is not None, "a matcher was added, so the process started"
        try:
            process.work.send((message[0], ticket, drops, *message[1:]))
        except (BrokenPipeError, OSError):
            raise process.exited() from None
        return ticket

    def _slot(self, rows: int) -> tuple[int, torch.Tensor]:
        """The next of the two slots (a step's plain draw and its verification may each take one) and
        its first `rows` rows. NOTE: a slot is filled again only after the tokens of the draw that read
        it were read, so its copy to the device is done."""
        if rows > self.capacity:
            raise ValueError(f"a draw of {rows} constrained rows is more than the grammar book holds "
                             f"({self.capacity}, the engine's max_num_seqs x (1 + num_draft_tokens))")
        self._turn ^= 1
        assert self._process is not None
        return self._turn, self._process.region.slots[self._turn, :rows]

    def _filling(self, rows: list[int], bitmask: torch.Tensor, ticket: int) -> TokenMask:
        return TokenMask(rows, bitmask, Filling(ticket, self._gate, self.wait))

    def accept(self, tokens: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Advances each listed request's matcher by its new tokens, in order (a batch in one call); a
        request dropped since (it finished with them) is skipped. The tokens were drawn under these
        matchers' masks: a refusal is a bug, raised by a later call. A matcher that took an
        end-of-sequence token is terminated: the request ends."""
        self.submit(tokens, [])

    def submit(self, tokens: Sequence[tuple[str, Sequence[int]]], request_ids: Sequence[str]) -> TokenMask | None:
        """`accept(tokens)`, then the mask of a draw whose row i is request_ids[i] (None: no row is
        constrained; a finished request's row is left out: its draw is dropped), in one message."""
        self.settle()
        masked = [(i, self._keys[rid]) for i, rid in enumerate(request_ids) if rid in self._keys]
        advancing = [(self._keys[rid], list(new)) for rid, new in tokens if rid in self._keys]
        if not masked:
            if advancing:
                self._send(("fill", advancing, 0, []))
            return None
        slot, bitmask = self._slot(len(masked))
        ticket = self._send(("fill", advancing, slot, [k for _, k in masked]))
        return self._filling([i for i, _ in masked], bitmask, ticket)

    def mask(self, request_ids: Sequence[str]) -> TokenMask | None:
        """The mask of one draw whose row i is request_ids[i]; None: no row is constrained."""
        return self.submit([], request_ids)

    def mask_drafts(self, rows: Sequence[tuple[str, Sequence[int]]]) -> TokenMask | None:
        """The mask of one verification: row i is (request id, its K_i drafted tokens), with K_i + 1
        positions. Position k of a constrained row gets the matcher's mask after drafts[:k]; past a
        draft the grammar forbids, the rest are all allowed (verification rejects that draft at the
        position before, so they are never used). The matcher ends where it started (rollback)."""
        self.settle()
        positions: list[int] = []
        constrained: list[tuple[int, list[int]]] = []
        start = 0
        for rid, drafts in rows:
            if rid in self._keys:
                constrained.append((self._keys[rid], list(drafts)))
                positions.extend(range(start, start + len(drafts) + 1))
            start += len(drafts) + 1
        if not positions:
            return None
        slot, bitmask = self._slot(len(positions))
        return self._filling(positions, bitmask, self._send(("drafts", slot, constrained)))
