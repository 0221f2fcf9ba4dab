"""The grammar process: one engine's matchers, stepped in a process of their own.

The engine's process hands each step's grammar work here (advance every constrained request's
matcher by its new tokens, then fill the next draw's allowed-token bitmask) and goes on. Done on a
thread of the engine's process, that work had to take the GIL back from the busy engine thread
after each of xgrammar's calls, a switch interval (5 ms) each time; here it holds a GIL of its own.

Channels (multiprocessing connections, pickled tuples), each with one reader:
- work (the engine thread -> the work loop, in order): ("fill", ticket, drops, advancing, slot,
  keys) and ("drafts", ticket, drops, slot, rows). Each is answered on `acks` with (ticket, error
  or None, started, finished: time.perf_counter, one clock for every process) after the ticket was
  written to the region's first word, whatever happened: a device waiting for it always goes on.
- control (any engine thread -> the control loop): ("compile", call, spec), each on a thread of its
  own, and ("add", call, key, spec, output); answered on `replies` with (call, error or None).
  Call 0 is the start: the compiler built, or why not.

The region (`Region`, a memfd the engine maps too) holds the int64 words [opened ticket, late
ticket] and two bitmask slots of [capacity, words] int32. Invariant: a key is added (its reply
sent) before any work names it and never reused, so the two loops never race on a matcher.

Each grammar process is forked by `fork_server` (`python -m engine.grammar_process`, one per engine
process, which imported xgrammar and torch once and starts no threads of its own): a book's process starts in
milliseconds, not the seconds of those imports, and is no fork of the engine's threads. It exits
when the engine closes its channels or exits.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xgrammar as xgr

from engine.config import GrammarSpec
from engine.grammar import GrammarCompiler, GrammarError

__all__ = ["HEADER_BYTES", "Region", "fork_server", "region_bytes", "serve"]

HEADER_BYTES = 64
"""The region's words [opened ticket, late ticket] (int64), padded: the slots start a cache line on."""


def region_bytes(capacity: int, words: int) -> int:
    return HEADER_BYTES + 2 * capacity * words * 4


class Region(NamedTuple):
    """Views of the shared region: the gate's two words and the two bitmask slots."""

    words: torch.Tensor  # [2] int64: the last ticket opened (written here), a ticket the device gave up on
    slots: torch.Tensor  # [2, capacity, words] int32

    @classmethod
    def of(cls, buffer: mmap.mmap, capacity: int, words: int) -> Region:
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return cls(flat[:16].view(torch.int64), flat[HEADER_BYTES:].view(torch.int32).view(2, capacity, words))


class Matchers:
    """The matchers by key, and the work on them: adds on the control loop, the rest on the work loop."""

    def __init__(self, compiler: GrammarCompiler, slots: torch.Tensor) -> None:
        self.compiler = compiler
        self.slots = slots
        self.by_key: dict[int, xgr.GrammarMatcher] = {}
        self._batch: xgr.BatchGrammarMatcher | None = None  # fills many rows on its threads

    def add(self, key: int, spec: GrammarSpec, output: Sequence[int]) -> None:
        """A matcher advanced over `output` (tokens generated elsewhere); GrammarError if they do not follow."""
        matcher = xgr.GrammarMatcher(self.compiler.compile(spec))  # NOTE: it rolls back any number of tokens
        for i, token in enumerate(output):
            if not matcher.accept_token(token):
                raise GrammarError(f"output token {i} ({token}) does not follow the request's {spec.kind}")
        self.by_key[key] = matcher

    def run(self, message: tuple[Any, ...]) -> None:
        kind, _, drops = message[:3]
        for key in drops:
            self.by_key.pop(key, None)
        if kind == "fill":
            _, _, _, advancing, slot, keys = message
            self._advance(advancing)
            self._fill(self.slots[slot, : len(keys)], keys)
        else:
            _, _, _, slot, rows = message
            self._drafts(self.slots[slot], rows)

    def _advance(self, advancing: list[tuple[int, list[int]]]) -> None:
        """Each (key, new tokens): the tokens were drawn under these matchers' masks, a refusal is a bug."""
        singles = [(self.by_key[k], new[0]) for k, new in advancing if len(new) == 1]
        if singles and not all(xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in singles],
                                                                          [t for _, t in singles])):
            raise RuntimeError("a sampled token was refused by the grammar whose mask it was drawn under")
        for key, new in advancing:
            if len(new) != 1 and not all(self.by_key[key].accept_token(t) for t in new):
                raise RuntimeError(f"sampled tokens {new} were refused by the grammar whose masks they were drawn "
                                   "under")

    def _fill(self, bitmask: torch.Tensor, keys: list[int]) -> None:
        """Row j: the next-token mask of keys[j]'s matcher; a terminated matcher's allows all (its
        draw is dropped)."""
        live = []
        for j, key in enumerate(keys):
            matcher = self.by_key[key]
            if matcher.is_terminated():
                bitmask[j] = -1
            else:
                live.append((j, matcher))
        if len(live) == 1:
            live[0][1].fill_next_token_bitmask(bitmask, live[0][0])
        elif live:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()  # NOTE: half the cores (all of them measured slower)
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask, [j for j, _ in live])

    def _drafts(self, bitmask: torch.Tensor, rows: list[tuple[int, list[int]]]) -> None:
        """Each (key, K drafted tokens) takes the next K + 1 rows: row k the mask after drafts[:k]; past
        a draft the grammar forbids, all allowed (never used). The matcher ends where it started."""
        first = 0
        for key, drafts in rows:
            matcher = self.by_key[key]
            bitmask[first : first + len(drafts) + 1] = -1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, first)
                walked = 0
                for k, token in enumerate(drafts):
                    if not matcher.accept_token(token):
                        break
                    walked += 1
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(bitmask, first + k + 1)
                if walked:
                    matcher.rollback(walked)
            first += len(drafts) + 1


def _error(err: BaseException) -> str:
    return str(err) if isinstance(err, (GrammarError, RuntimeError)) else f"{type(err).__name__}: {err}"


def _control_loop(control: Connection, replies: Connection, matchers: Matchers) -> None:
    sending = threading.Lock()  # NOTE: compile threads answer too

    def reply(call: int, error: str | None) -> None:
        with sending:
            replies.send((call, error))

    def compile(call: int, spec: GrammarSpec) -> None:
        try:
            matchers.compiler.compile(spec)
        except Exception as err:  # noqa: BLE001 - answered to the caller
            reply(call, _error(err))
        else:
            reply(call, None)

    while True:
        try:
            message = control.recv()
        except (EOFError, OSError):
            return
        if message[0] == "compile":
            threading.Thread(target=compile, args=message[1:], name="grammar-compile", daemon=True).start()
            continue
        _, call, key, spec, output = message
        try:
            matchers.add(key, spec, output)
        except Exception as err:  # noqa: BLE001 - answered to the caller
            reply(call, _error(err))
        else:
            reply(call, None)


def serve(work: Connection, acks: Connection, control: Connection, replies: Connection, region_fd: int,
          capacity: int, words: int, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
    """The process's body: returns when the engine closes its ends of the channels (or exits)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: a ^C is the engine's to handle; this ends with it
    buffer = mmap.mmap(region_fd, region_bytes(capacity, words))
    os.close(region_fd)
    region = Region.of(buffer, capacity, words)
    opened = region.words.numpy()
    try:
        compiler = GrammarCompiler(Path(model_dir), vocab_size, stop_token_ids)
    except Exception as err:  # noqa: BLE001 - answered to the engine: every grammar call raises it
        replies.send((0, _error(err)))
        return
    replies.send((0, None))
    matchers = Matchers(compiler, region.slots)
    threading.Thread(target=_control_loop, args=(control, replies, matchers), name="grammar-control",
                     daemon=True).start()
    while True:
        try:
            message = work.recv()
        except (EOFError, OSError):
            return
        ticket, error = message[1], None
        started = time.perf_counter()
        try:
            matchers.run(message)
        except Exception as err:  # noqa: BLE001 - answered on acks: the engine raises it
            error = _error(err)
        finally:
            opened[0] = ticket
        acks.send((ticket, error, started, time.perf_counter()))


def fork_server(requests: socket.socket) -> None:
    """The grammar processes' parent (`python -m engine.grammar_process FD`, one per engine process):
    xgrammar and torch imported once, then per request (a JSON config and five fds: work, acks,
    control, replies, region) a fork that serves them, its pid answered. Single-threaded when it
    forks; exits when the engine process closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # NOTE: the kernel reaps the children: no zombies
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(requests, 1 << 16, 5)
        except OSError:
            return
        if not message:
            return
        config = json.loads(message)
        pid = os.fork()
        if pid == 0:
            requests.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                work, acks, control, replies, region_fd = fds
                serve(Connection(work, writable=False), Connection(acks, readable=False),
                      Connection(control, writable=False), Connection(replies, readable=False), region_fd,
                      config["capacity"], config["words"], config["model_dir"], config["vocab_size"],
                      config["stop_token_ids"])
            except BaseException:  # noqa: BLE001 - the engine sees the EOF; the traceback goes to stderr
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        for fd in fds:  # NOTE: the child's now: EOF in the engine when it exits
            os.close(fd)
        requests.sendall(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    fork_server(socket.socket(fileno=int(sys.argv[1])))
