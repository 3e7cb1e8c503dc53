"""What a paused turn says: the work it keeps, and how to continue it."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from turnstile.events import ToolCall

RESULT_EXCERPT_CHARS = 300


@dataclass(frozen=True, slots=True)
class DoneCall:
    """A tool call of this attempt that has a result: what a pause keeps."""

    tool: str
    arguments: str
    ok: bool
    result: str


def kept_work(last_text: str | None, done: Iterable[DoneCall], blocked: tuple[ToolCall, ...] = ()) -> str:
    """The reply so far, the tools that ran, with results, and the calls requested but not
    run (the resumed turn may make them again)."""
    lines = [last_text] if last_text else []
    done = list(done)
    if done:
        lines.append("Completed operations:")
        for call in done:
            status = "ok" if call.ok else "failed"
            lines.append(f"- {call.tool}({_excerpt(call.arguments)}) -> {status}: {_excerpt(call.result)}")
    if blocked:
        # (the calls themselves, arguments whole, are the pause's `blocked_calls`)
        lines.append("Requested but not run (the turn stopped first):")
        lines.extend(f"- {c.name}({_excerpt(c.arguments)}) [call {c.call_id}]" for c in blocked)
    return "\n".join(lines)


def kept_in_brief(last_text: str | None, done: int, blocked: int) -> str:
    """What a pause keeps when its work listed in full would pass the log's limit (thousands
    of calls in one reply): the reply's start and how much there was. The calls and their
    results stay on the log, each in its own event."""
    lines = [_excerpt(last_text)] if last_text else []
    lines.append(
        f"{done} operation(s) completed and {blocked} call(s) requested but not run: too many to list in one "
        "log value (each call's ToolCallStarted and ToolCallFinished on the log holds it)."
    )
    return "\n".join(lines)


def _excerpt(text: str) -> str:
    # The pause is one log value: large arguments or results quoted whole could pass its limit.
    return text if len(text) <= RESULT_EXCERPT_CHARS else text[:RESULT_EXCERPT_CHARS] + "..."


def resume_hint(conversation_id: str, turn_id: str, why: str) -> str:
    return (
        f"Paused because {why}. The completed work is kept above. To continue, run `turnstile resume "
        f"{shlex.quote(conversation_id)}` (a ResumeRequested with resumes_turn_id={turn_id}): it starts a "
        "new turn with a fresh budget that sees this one."
    )


def paused_because(hint: str) -> str | None:
    """The `why` a `resume_hint` was made with (None: not a hint of that form)."""
    head, found, _rest = hint.partition(". The completed work is kept above.")
    return head.removeprefix("Paused because ") if found and head.startswith("Paused because ") else None


def waiting_for_approval(call: ToolCall) -> str:
    # (the call itself, arguments whole, is the pause's `pending_call`)
    return f"Waiting for approval to call {call.name} with arguments {_excerpt(call.arguments)} (call {call.call_id})."


def approval_hint(conversation_id: str, turn_id: str, call: ToolCall) -> str:
    command = f"turnstile approve|deny {shlex.quote(conversation_id)} {shlex.quote(call.call_id)}"
    return (
        f"Approve or deny it with `{command}` (an "
        f"InputInjected of source 'approval' carrying approval={{turn_id: {turn_id}, call_id: "
        f"{call.call_id}, approved: true|false}}); it starts a new turn that sees this request."
    )


def deadline_reached(deadline_ms: int, during: str) -> str:
    """`during`: "during a model request", "while search ran"."""
    return f"the time limit ({deadline_ms / 1000:g} s) was reached {during}"
