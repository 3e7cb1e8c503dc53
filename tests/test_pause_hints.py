"""The commands a paused turn suggests can be pasted into a shell as they are."""

from __future__ import annotations

import shlex

from turnstile.events import ToolCall
from turnstile.handlers.pauses import approval_hint, paused_because, resume_hint


def _command(hint: str) -> list[str]:
    return shlex.split(hint.split("`")[1])


def test_a_resume_hint_quotes_a_conversation_id_a_shell_would_split_or_run():
    # Given a conversation id with a space and a command substitution in it
    hint = resume_hint("team a; $(rm -rf x)", "t-1", "the time limit was reached")
    # then the suggested command, split as a shell splits it, names exactly that conversation
    assert _command(hint) == ["turnstile", "resume", "team a; $(rm -rf x)"]


def test_an_approval_hint_quotes_the_conversation_and_the_call():
    call = ToolCall(call_id="call 1", name="send", arguments="{}")
    hint = approval_hint("it's mine", "t-1", call)
    assert _command(hint) == ["turnstile", "approve|deny", "it's mine", "call 1"]


def test_a_plain_id_is_left_as_it_is():
    assert "`turnstile resume conv-1`" in resume_hint("conv-1", "t-1", "why")


def test_the_reason_a_resume_hint_was_made_with_reads_back_from_it() -> None:
    why = "server_error: HTTP 500: down. Twice; no fallback model left"  # (a period inside, too)
    assert paused_because(resume_hint("c 1", "t" * 64, why)) == why
    assert paused_because("Waiting for approval to call send with arguments {} (call c1).") is None
