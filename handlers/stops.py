"""What the turn loop does once a reply has arrived, decided by why the reply ended (its
stop kind) -- never by its text alone.

* A refusal or a content filter ends the turn failed, with a reason and the provider's
  words kept: never "completed" with an empty reply. Tools it asked for do not run. The
  error quotes what the provider says of the refusal, not the reply's text (an Anthropic
  refusal's text is the answer the model had begun).
* A reply cut off by its output allowance (OpenAI `length`, Anthropic `max_tokens`, or the
  context window) ends the turn exhausted on `output_tokens`, keeping the partial text:
  never completed as if it were whole. The tools it asked for do not run: the last call's
  arguments may be cut off, and asking again with the same allowance would be cut off
  again (the model is not told why, so it would repeat the call until the repeat policy
  stopped the turn, blaming the model). A resume with a larger allowance goes on.
* Tool calls run.
* A paused reply (Anthropic `pause_turn`) is sent back as it is and the loop asks again;
  each continuation is an iteration, so the iteration allowance bounds them. The text of
  every part is the reply.
* Otherwise the reply completes the turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.events.outcomes import REFUSAL_ERROR, FailureReason
from turnstile.handlers.provider import ModelReply


@dataclass(frozen=True, slots=True)
class RunTools:
    pass


@dataclass(frozen=True, slots=True)
class AskAgain:
    """Send the reply back unchanged and request the rest of it."""


@dataclass(frozen=True, slots=True)
class Complete:
    reply: str


@dataclass(frozen=True, slots=True)
class Refused:
    reason: FailureReason
    error: str
    text: str | None


@dataclass(frozen=True, slots=True)
class CutOff:
    text: str | None


AfterReply = RunTools | AskAgain | Complete | Refused | CutOff


def after_reply(reply: ModelReply, earlier: str = "") -> AfterReply:
    """`earlier`: the text of the parts of this reply that came before (paused replies)."""
    text = earlier + (reply.text or "")
    if reply.stop == "refusal":
        said = reply.refusal.strip() if reply.refusal else ""
        error = f"{REFUSAL_ERROR}: {said}" if said else f"{REFUSAL_ERROR}."
        return Refused("refusal", error, reply.text or reply.refusal)
    if reply.stop == "content_filter":
        return Refused("content_filter", "The provider's content filter stopped the reply.", text or None)
    if reply.stop == "truncated":
        return CutOff(text or None)
    if reply.tool_calls:
        return RunTools()
    if reply.stop == "pause":
        return AskAgain()
    return Complete(text)
