"""EngineLoop: an EngineCore on its own thread.

The engine is not thread-safe: only this thread touches it. Other threads (a worker's asyncio
event loop, a transfer thread) hand it commands with `submit`, which run between steps in
arrival order; each step's outputs go to `on_outputs`, called on this thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.config import SamplingParams
from engine.engine import EngineCore, StepOutput
from engine.stats import EngineStats
from engine.grammar import GrammarError
from engine.process_gc import GcPauses, settle_after_startup
from engine.validation import InvalidRequestError

T = TypeVar("T")
RECENT_STEPS = 512  # steps whose longest wall time the stats report (about 10 s of 20 ms steps)
log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(
        self,
        engine: EngineCore,
        on_outputs: Callable[[list[StepOutput]], None],
        on_error: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 0.05,
        name: str = "engine-loop",
    ) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_error = on_error
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Callable[[EngineCore], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # NOTE: held by a submit's check and put, and by the loop's end while it marks itself stopped: every
        # command put before that mark is failed by its last sweep, none is put after it
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0
        self.step_seconds = 0.0  # wall time inside engine.step(), since start
        self._recent_steps: deque[float] = deque(maxlen=RECENT_STEPS)  # the last steps' wall times
        self.command_seconds = 0.0  # wall time inside submitted commands, since start
        self.gc_pauses = GcPauses()  # the process's collector pauses while this loop runs

    def start(self, freeze_gc: bool = False) -> EngineLoop:
        """freeze_gc: first settle the collector (engine/process_gc.py): only in a process that is this
        worker's alone (EndpointConfig.freeze_gc)."""
        if freeze_gc:
            settle_after_startup()
        self.gc_pauses.start()
        self._thread.start()
        return self

    def submit(self, command: Callable[[EngineCore], T]) -> Future[T]:
        """Runs `command(engine)` on the engine thread before its next step."""
        future: Future[T] = Future()
        with self._closing:
            if self._stopping.is_set():
                future.set_exception(RuntimeError("the engine loop is stopped"))
                return future
            self._commands.put((command, future))
        self._wake.set()
        return future

    def prepare(self, params: SamplingParams) -> None:
        """What a request needs before it joins, done on the caller's thread (never the engine's): its
        grammar compiled into the engine's cache, or InvalidRequestError. Blocks while it compiles:
        an asyncio caller runs it in a thread."""
        if params.grammar is None:
            return
        try:
            self.engine.grammars.compile_within(params.grammar)
        except GrammarError as err:
            raise InvalidRequestError("grammar", str(err)) from None

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        """Engine thread (a command): the engine's stats with where this thread's time went."""
        return dataclasses.replace(self.engine.stats(), num_engine_steps=self.num_steps,
                                   engine_step_seconds=self.step_seconds, engine_command_seconds=self.command_seconds,
                                   longest_recent_step_seconds=max(self._recent_steps, default=0.0),
                                   gc_seconds=self.gc_pauses.seconds,
                                   longest_recent_gc_seconds=self.gc_pauses.longest_recent)

    def _drain(self) -> None:
        commands = self._commands
        while not commands.empty():  # NOTE: no queue.Empty raised each step: this thread alone takes from it
            command, future = commands.get_nowait()
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                future.set_result(command(self.engine))
            except BaseException as err:  # noqa: BLE001 - the submitter gets it
                future.set_exception(err)
            self.command_seconds += time.perf_counter() - started

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain()
                if self.engine.has_unfinished():
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    took = time.perf_counter() - started
                    self.step_seconds += took
                    self._recent_steps.append(took)
                    self.num_steps += 1
                    if outputs:
                        self.on_outputs(outputs)
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as err:  # noqa: BLE001 - reported, then the loop ends
            log.exception("engine loop failed")
            if self.on_error is not None:
                self.on_error(err)
        finally:
            with self._closing:
                self._stopping.set()
            self.gc_pauses.stop()
            self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine loop stopped before running this command"))
