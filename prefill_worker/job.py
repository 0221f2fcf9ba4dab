"""PrefillJob: one request's life on a prefill worker, as one record with a state enum.

    QUEUED --engine took it--> COMPUTING --first token--> ANSWERED --KV sends issued--> PUSHING --sent--> DONE
                                                              \\--nothing to decode-----------------------> DONE

Allowed transitions (`PrefillJob.move` refuses any other):

| from      | to                                                   |
|-----------|------------------------------------------------------|
| QUEUED    | COMPUTING, FAILED, ABORTED                           |
| COMPUTING | ANSWERED, FAILED, ABORTED                            |
| ANSWERED  | PUSHING, DONE, FAILED, ABORTED                       |
| PUSHING   | DONE, FAILED, ABORTED                                |
| DONE, FAILED, ABORTED: final                                     |

Who hears what. Up to ANSWERED the router waits for the prefill call: a failure or an abort there
is its answer. From ANSWERED on the router has the first token and hears only the decode worker:
a push that cannot start tells the decode worker (KvReadyMsg.failure), which frees the lease and
reports it on the request's token stream, as it does a refused handshake, a failed receive or an
expired lease; a decode worker that died is seen by the router itself. So the prefill worker never
reports a push's outcome to the router.

The job holds the prompt's blocks (held by the engine under the request id) from COMPUTING until its
final transition, which hands them to the prefix cache (`on_end`). An abort in PUSHING lets the sends
finish (the decode side has posted its receives) and ends the job ABORTED.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import StepOutput
from prefill_worker.pushes import Gathered
from protocol.clients import DecodeClient
from protocol.messages import DraftKvOffer, PrefillResultMsg, PrefillTaskMsg


class JobState(enum.Enum):
    QUEUED = "queued"
    COMPUTING = "computing"
    ANSWERED = "answered"
    PUSHING = "pushing"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.ABORTED})
_ENDS = frozenset({JobState.FAILED, JobState.ABORTED})
_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.COMPUTING}) | _ENDS,
    JobState.COMPUTING: frozenset({JobState.ANSWERED}) | _ENDS,
    JobState.ANSWERED: frozenset({JobState.PUSHING, JobState.DONE}) | _ENDS,
    JobState.PUSHING: frozenset({JobState.DONE}) | _ENDS,
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.ABORTED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A transition the table in this module's docstring does not allow: a bug, never bad input."""


@dataclass
class PrefillJob:
    task: PrefillTaskMsg
    decode: DecodeClient  # the lease's decode worker
    first_token: asyncio.Future[StepOutput]  # set from the engine's step (or by an abort)
    on_end: Callable[[PrefillJob], None]  # called once, by the final transition
    arrived_at: float = field(default_factory=time.perf_counter)
    sampled_at: float = 0.0  # when its first token was sampled (time.perf_counter)
    state: JobState = JobState.QUEUED
    is_aborted: bool = False  # asked to abort: the job ends ABORTED at its next transition
    reason: str | None = None  # why it failed or was aborted
    history: list[JobState] = field(default_factory=list)  # the states it left, in order
    draft_offer: DraftKvOffer | None = None  # the draft's KV this worker computes for it, offered with KvReady
    gathered: Gathered | None = None  # the prompt's KV in one buffer, once the first token is sampled
    answered: PrefillResultMsg | None = None  # the answer the router got
    push: asyncio.Task[None] | None = None  # from ANSWERED until the job ends

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.task.request.prompt_token_ids)

    def move(self, to: JobState, reason: str | None = None) -> None:
        """The one place a job changes state. Once aborted, a final move ends it ABORTED whatever
        it was (an abort wins over DONE and FAILED); the final move calls `on_end`."""
        if self.is_aborted and to.is_final:
            to, reason = JobState.ABORTED, self.reason
        if to not in _ALLOWED[self.state]:
            raise IllegalTransitionError(f"prefill job {self.request_id!r}: {self.state.value} -> {to.value}")
        self.history.append(self.state)
        self.state = to
        if reason is not None:
            self.reason = reason
        if to.is_final:
            self.on_end(self)

    def abort(self) -> bool:
        """Marks the job aborted (its next final move ends it ABORTED); True when it had not ended."""
        if self.state.is_final:
            return False
        self.is_aborted = True
        self.reason = self.reason or "aborted"
        return True


__all__ = ["IllegalTransitionError", "JobState", "PrefillJob"]
