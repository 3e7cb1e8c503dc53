"""A Replayer, after Temporal's: does this code still decide what the recorded run decided?

A *history* is what one executor saw and did for one turn: the log of the conversation
before it started (the folded start state: earlier turns, the inputs, a dead owner's
events), then each step as recorded -- the observation fed to `decide`, the ids the
machine drew, and the commands it returned. Replaying feeds the same observations with
the same ids to today's `decide` and compares the commands, step by step. A change that
would decide differently on a recorded history (another event, another field value,
another effect) is a `Divergence` naming the history and the step -- the signal that the
change breaks turns in flight when it is deployed, or that the recording must be renewed
on purpose.

Pure: histories come in as parsed JSON values (`tests/replays/*.jsonl` are lines of them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from turnstile.events import EVENT_ADAPTER, Event, MessageReceived, ToolCall, Usage
from turnstile.handlers.claim import ClaimPlan
from turnstile.handlers.provider import ChatMessage, ModelReply, ProtocolFamily, ProviderError
from turnstile.handlers.turn_machine import decide, machine_for
from turnstile.handlers.turn_settings import TurnSettings
from turnstile.handlers.turn_steps import (
    Append,
    CallModel,
    Claimed,
    Command,
    Crashed,
    Finish,
    Interrupted,
    ModelAnswered,
    ModelCutOff,
    ModelFailed,
    Observation,
    Reconcile,
    Reconciled,
    Report,
    RunTool,
    SleepUntil,
    TakenOver,
    ToolNotStarted,
    ToolRaised,
    ToolReturned,
    ToolTimedOut,
    Woke,
)
from turnstile.projections import ApprovalGrant, PendingInput, apply_event, new_state

JSON = dict[str, Any]

# Observations whose fields are plain values (str, int, None): recorded as they are.
_PLAIN: dict[str, type[Observation]] = {
    cls.__name__: cls
    for cls in (
        TakenOver,
        ModelCutOff,
        ToolReturned,
        ToolRaised,
        ToolTimedOut,
        ToolNotStarted,
        Reconciled,
        Woke,
        Crashed,
    )
}


def observation_json(seen: Observation) -> JSON:
    kind = type(seen).__name__
    match seen:
        case Claimed(plan=plan):
            inputs = [asdict(i) for i in plan.inputs]
            body: JSON = {"turn_id": plan.turn_id, "inputs": inputs, "history_boundary": plan.history_boundary}
            return {"type": kind, "now_ms": seen.now_ms, "plan": body}
        case ModelAnswered(reply=reply):
            return {"type": kind, "now_ms": seen.now_ms, "reply": _reply_json(reply)}
        case Interrupted(message=message):
            return {"type": kind, "now_ms": seen.now_ms, "message": message.model_dump(mode="json")}
        case ModelFailed(error=e):
            error = {
                "kind": e.kind,
                "message": e.message,
                "retryable": e.retryable,
                "status": e.status,
                "retry_after_s": e.retry_after_s,
                "provider_message": e.provider_message,
            }
            if e.usage is not None:  # (a billed malformed reply; histories before it have none)
                error["usage"] = e.usage.model_dump(mode="json")
            return {"type": kind, "now_ms": seen.now_ms, "error": error}
    return {"type": kind, **asdict(seen)}


def observation_of(data: Mapping[str, Any]) -> Observation:
    fields = {k: v for k, v in data.items() if k != "type"}
    match data["type"]:
        case "Claimed":
            plan = fields["plan"]
            inputs = tuple(_pending_input(i) for i in plan["inputs"])
            return Claimed(ClaimPlan(plan["turn_id"], inputs, plan["history_boundary"]), fields["now_ms"])
        case "ModelAnswered":
            return ModelAnswered(_reply_of(fields["reply"]), fields["now_ms"])
        case "Interrupted":
            return Interrupted(MessageReceived.model_validate(fields["message"]), fields["now_ms"])
        case "ModelFailed":
            e = dict(fields["error"])
            usage = None if (billed := e.pop("usage", None)) is None else Usage.model_validate(billed)
            error = ProviderError(e.pop("kind"), e.pop("message"), **e, usage=usage)
            return ModelFailed(error, fields["now_ms"])
    cls = _PLAIN.get(data["type"])
    if cls is None:
        raise ValueError(f"unknown observation {data['type']!r}")
    return cls(**fields)


def command_json(command: Command) -> JSON:
    """Everything of a command a decision sets, in a form compared as JSON."""
    kind = type(command).__name__
    match command:
        case Append(event=event, wait=wait):
            return {"type": kind, "wait": wait, "event": event.model_dump(mode="json")}
        case CallModel(request=r):
            request = {
                "model": r.model,
                "max_output_tokens": r.max_output_tokens,
                "time_left_s": r.time_left_s,
                "tools": [t.name for t in r.tools],
                "messages": [_message_json(m) for m in r.messages],
            }
            return {"type": kind, "route": command.route, "iteration": command.iteration, "request": request}
        case RunTool(started=started):
            return {
                "type": kind,
                "call_id": started.call_id,
                "tool": started.tool,
                "idempotency_key": started.idempotency_key,
                "arguments": command.arguments.model_dump(mode="json"),
                "timeout_s": command.timeout_s,
                "at_deadline": command.at_deadline,
            }
        case Reconcile(call=call):
            return {"type": kind, "call": call.model_dump(mode="json"), "timeout_s": command.timeout_s}
        case SleepUntil() | Report() | Finish():
            return {"type": kind, **asdict(command)}
    raise AssertionError(command)


def step_json(seen: Observation, ids: Sequence[str], commands: Iterable[Command]) -> JSON:
    return {"observation": observation_json(seen), "ids": list(ids), "commands": [command_json(c) for c in commands]}


@dataclass(frozen=True, slots=True)
class History:
    name: str
    conversation_id: str
    log: tuple[Event, ...]
    steps: tuple[JSON, ...]


def history_of(name: str, lines: Iterable[Mapping[str, Any]]) -> History:
    """A history from its recorded lines: one header (`conversation_id`), `{"log": event}`
    lines, then `{"observation", "ids", "commands"}` steps."""
    conversation, log, steps = None, [], []
    for line in lines:
        if "conversation_id" in line and "log" not in line and "observation" not in line:
            conversation = line["conversation_id"]
        elif "log" in line:
            log.append(EVENT_ADAPTER.validate_python(line["log"]))
        elif "observation" in line:
            steps.append(dict(line))
    if conversation is None:
        raise ValueError(f"history {name}: no header line with the conversation id")
    return History(name, conversation, tuple(log), tuple(steps))


@dataclass(frozen=True, slots=True)
class Divergence:
    history: str
    step: int  # 1-based
    observation: str
    detail: str
    recorded: Any
    decided: Any

    def __str__(self) -> str:
        return (
            f"history {self.history}, step {self.step} ({self.observation}): {self.detail}\n"
            f"  recorded: {self.recorded}\n  decided:  {self.decided}"
        )


class _OutOfIds(Exception):
    pass


def replay(history: History, settings: TurnSettings, family: ProtocolFamily) -> Divergence | None:
    """None when today's `decide` returns the recorded commands at every step."""
    state = new_state(history.conversation_id)
    for event in history.log:
        apply_event(state, event)  # a refused event is ignored by every reader alike
    ids: deque[str] = deque()

    def new_id() -> str:
        if not ids:
            raise _OutOfIds
        return ids.popleft()

    machine = machine_for(state, settings, family, new_id)
    for number, step in enumerate(history.steps, start=1):
        seen = step["observation"]
        ids.clear()
        ids.extend(step["ids"])
        try:
            decided = [command_json(c) for c in decide(machine, observation_of(seen))]
        except _OutOfIds:
            return Divergence(history.name, number, seen["type"], "drew more ids than recorded", step["ids"], None)
        divergence = _compare(step["commands"], decided)
        if divergence is not None:
            detail, recorded, now = divergence
            return Divergence(history.name, number, seen["type"], detail, recorded, now)
        if ids:
            return Divergence(history.name, number, seen["type"], "drew fewer ids than recorded", step["ids"], None)
    return None


def _compare(recorded: list[JSON], decided: list[JSON]) -> tuple[str, Any, Any] | None:
    for index, (was, now) in enumerate(zip(recorded, decided, strict=False), start=1):
        if was != now:
            where, old, new = _difference(was, now, was.get("type", "command"))
            return f"command {index} differs at {where}", old, new
    if len(recorded) != len(decided):
        was_types = [c["type"] for c in recorded]
        now_types = [c["type"] for c in decided]
        return f"{len(recorded)} commands recorded, {len(decided)} decided", was_types, now_types
    return None


def _difference(was: Any, now: Any, path: str) -> tuple[str, Any, Any]:
    """The first place two JSON values differ, as a dotted path, and the two values there."""
    if isinstance(was, dict) and isinstance(now, dict):
        for key in sorted({*was, *now}):
            if was.get(key) != now.get(key):
                return _difference(was.get(key), now.get(key), f"{path}.{key}")
    if isinstance(was, list) and isinstance(now, list) and len(was) == len(now):
        for index, (a, b) in enumerate(zip(was, now, strict=True)):
            if a != b:
                return _difference(a, b, f"{path}[{index}]")
    return path, was, now


def _reply_json(reply: ModelReply) -> JSON:
    data: JSON = {
        "model": reply.model,
        "text": reply.text,
        "tool_calls": [c.model_dump(mode="json") for c in reply.tool_calls],
        "usage": reply.usage.model_dump(mode="json"),
        "finish_reason": reply.finish_reason,
        "stop": reply.stop,
        "native": None if reply.native is None else [dict(b) for b in reply.native],
    }
    if not reply.usage_reported:  # (histories recorded before it was known have it reported)
        data["usage_reported"] = False
    return data


def _reply_of(data: Mapping[str, Any]) -> ModelReply:
    return ModelReply(
        data["model"],
        data["text"],
        tuple(ToolCall.model_validate(c) for c in data["tool_calls"]),
        Usage.model_validate(data["usage"]),
        data["finish_reason"],
        data["stop"],
        None if data["native"] is None else tuple(data["native"]),
        data.get("usage_reported", True),
    )


def _message_json(message: ChatMessage) -> JSON:
    return {
        "role": message.role,
        "content": message.content,
        "tool_calls": [c.model_dump(mode="json") for c in message.tool_calls],
        "tool_call_id": message.tool_call_id,
        "is_error": message.is_error,
        "native": None if message.native is None else [dict(b) for b in message.native],
    }


def _pending_input(data: Mapping[str, Any]) -> PendingInput:
    grant = data.get("grant")
    fields = {**data, "grant": None if grant is None else ApprovalGrant(**grant)}
    return PendingInput(**fields)
