"""The pure decision after a reply: its stop kind, not its text, says how the turn goes on."""

from __future__ import annotations

import pytest

from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import ModelReply, StopKind
from turnstile.handlers.stops import AskAgain, Complete, CutOff, Refused, RunTools, after_reply

CALL = (ToolCall(call_id="c1", name="search", arguments="{}"),)


def said(
    stop: StopKind, text: str | None = "text", calls: tuple[ToolCall, ...] = (), refusal: str | None = None
) -> ModelReply:
    return ModelReply("m", text, calls, Usage(), finish_reason="x", stop=stop, refusal=refusal)


@pytest.mark.parametrize(
    ("reply", "earlier", "then"),
    [
        (said("end", "done"), "", Complete("done")),
        (said("end", None), "", Complete("")),
        (said("end", "rest"), "first ", Complete("first rest")),
        (said("tool_use", None, CALL), "", RunTools()),
        # Cut off by the allowance: its calls do not run (the last one's arguments may be cut).
        (said("truncated", None, CALL), "", CutOff(None)),
        (said("truncated", "let me look", CALL), "", CutOff("let me look")),
        (said("pause", "searching "), "", AskAgain()),
        (said("truncated", "half a"), "the first ", CutOff("the first half a")),
        (said("truncated", None), "", CutOff(None)),
        (
            said("refusal", "I can't.", refusal="I can't."),
            "",
            Refused("refusal", "The model declined to answer: I can't.", "I can't."),
        ),
        (said("refusal", None), "", Refused("refusal", "The model declined to answer.", None)),
        # The text a refusal cut short is kept, never quoted as the refusal; its words are.
        (said("refusal", "Sure, here is"), "", Refused("refusal", "The model declined to answer.", "Sure, here is")),
        (
            said("refusal", "Sure, here is", refusal="This could enable malware."),
            "",
            Refused("refusal", "The model declined to answer: This could enable malware.", "Sure, here is"),
        ),
        (said("refusal", None, refusal="No."), "", Refused("refusal", "The model declined to answer: No.", "No.")),
        # A refusal or a filter never runs the tools it came with.
        (said("refusal", "no", CALL, "no"), "", Refused("refusal", "The model declined to answer: no", "no")),
        (
            said("content_filter", "Here is", CALL),
            "",
            Refused("content_filter", "The provider's content filter stopped the reply.", "Here is"),
        ),
    ],
)
def test_the_stop_kind_decides_what_follows(reply: ModelReply, earlier: str, then: object) -> None:
    assert after_reply(reply, earlier) == then
