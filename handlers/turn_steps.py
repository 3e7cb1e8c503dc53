"""The vocabulary between the turn's state machine (`handlers/turn_machine.py`) and the
executor that carries it out (`streams/turn_runner.py`).

A *command* is what the machine wants done: append an event (already folded into the
machine's state), call a model, run a tool, ask a tool's reconciler, wait until a time,
or finish. A step of the machine is a few `Append`s followed by at most one effect
(`CallModel`, `RunTool`, `Reconcile`, `SleepUntil`) or `Finish`. An *observation* is what
the executor saw when it carried the effect out (or what started the turn), with the time
it saw it: the machine reads no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from turnstile.events import Event, MessageReceived, ToolCall, ToolCallStarted
from turnstile.handlers.claim import ClaimPlan
from turnstile.handlers.provider import ModelReply, ModelRequest, ProviderError
from turnstile.handlers.tools import NotRun

# -- commands ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Append:
    """Append `event` to the log, as `value` (its encoding, which the machine measured
    against the log's limit). `wait=False`: the next command follows at once with nothing
    done outside the log in between, so one round trip acknowledges both."""

    event: Event
    wait: bool
    value: bytes


@dataclass(frozen=True, slots=True)
class CallModel:
    """Send `request` to the model of link `route` of the fallback chain; it may run at most
    `request.time_left_s` (the turn's deadline)."""

    route: int
    request: ModelRequest
    iteration: int


@dataclass(frozen=True, slots=True)
class RunTool:
    """Run the tool of `started` (already on the log) with `arguments`, for at most
    `timeout_s`; `at_deadline`: that limit is the turn's deadline, not the tool timeout."""

    started: ToolCallStarted
    arguments: BaseModel
    timeout_s: float
    at_deadline: bool


@dataclass(frozen=True, slots=True)
class Reconcile:
    """Ask the tool of `call` whether its interrupted run acted (at most `timeout_s`)."""

    call: ToolCall
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SleepUntil:
    """The backoff before the next attempt."""

    due_ms: int


@dataclass(frozen=True, slots=True)
class Report:
    """Something an operator should read in the worker's log (an internal error)."""

    message: str


@dataclass(frozen=True, slots=True)
class Finish:
    """Nothing more to do: the outcome is on the log, or the run must stop."""


Effect = CallModel | RunTool | Reconcile | SleepUntil
Command = Append | Report | Finish | Effect

# -- observations --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claimed:
    """The worker decided to claim `plan`: the turn starts."""

    plan: ClaimPlan
    now_ms: int


@dataclass(frozen=True, slots=True)
class TakenOver:
    """This worker owns a turn whose run stopped mid-attempt (crash, lost partition)."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class ModelAnswered:
    reply: ModelReply
    now_ms: int


@dataclass(frozen=True, slots=True)
class ModelFailed:
    error: ProviderError
    now_ms: int


@dataclass(frozen=True, slots=True)
class ModelCutOff:
    """The deadline came during the model request; it was cancelled."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class ToolReturned:
    """The tool returned. `result` is None when it returned something other than text,
    `returned` names the type of what it returned."""

    result: str | None
    now_ms: int
    returned: str = "str"


@dataclass(frozen=True, slots=True)
class ToolRaised:
    error: str  # "TypeName: message"
    now_ms: int


@dataclass(frozen=True, slots=True)
class ToolTimedOut:
    now_ms: int


@dataclass(frozen=True, slots=True)
class ToolNotStarted:
    """The run was stopped while the call's `ToolCallStarted` was being acknowledged."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What the reconciler said: the call's result, `NOT_RUN` (it had no effect), or None (it
    cannot tell)."""

    result: str | NotRun | None
    now_ms: int


@dataclass(frozen=True, slots=True)
class Woke:
    now_ms: int


@dataclass(frozen=True, slots=True)
class Interrupted:
    """`message` arrived mid-turn (it is on the log) under the `interrupt` double-text
    policy, while the turn could still be withdrawn (`interruptible`); the effect in
    flight, if any, was cancelled."""

    message: MessageReceived
    now_ms: int


@dataclass(frozen=True, slots=True)
class Crashed:
    """Carrying out a command failed unexpectedly (a bug, the log gone)."""

    error: str
    now_ms: int


Observation = (
    Claimed
    | TakenOver
    | ModelAnswered
    | ModelFailed
    | ModelCutOff
    | ToolReturned
    | ToolRaised
    | ToolTimedOut
    | ToolNotStarted
    | Reconciled
    | Woke
    | Interrupted
    | Crashed
)
