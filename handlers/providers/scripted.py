"""A deterministic in-process provider, for the demo and for tests of the engine itself.

It answers from a function of the request, so the same transcript always gets the same
reply; an optional delay stands in for a slow model.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass

from turnstile.events import Usage
from turnstile.handlers.provider import ModelReply, ModelRequest, ProtocolFamily, ReplyStream


@dataclass(frozen=True, slots=True)
class Scripted:
    """One scripted answer: a reply or an error, after `delay_s` seconds."""

    reply: ModelReply | Exception
    delay_s: float = 0.0


def echo_reply(request: ModelRequest) -> ModelReply:
    """Quotes the final user input back, so a reader can see exactly what the turn answered."""
    final = request.messages[-1].content if request.messages else ""
    words = sum(len(m.content.split()) for m in request.messages)
    return ModelReply(
        model=request.model,
        text=f"(scripted reply to) {final}",
        tool_calls=(),
        usage=Usage(input_tokens=words, output_tokens=len(final.split()) + 4),
        finish_reason="stop",
    )


class ScriptedProvider:
    family: ProtocolFamily = "scripted"

    def __init__(self, script: Callable[[ModelRequest], Scripted] | None = None, delay_s: float = 0.0) -> None:
        self._script = script or (lambda request: Scripted(echo_reply(request), delay_s))
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        self.requests.append(request)
        step = self._script(request)
        reply = step.reply
        # Streamed, the reply's words arrive one by one over the delay, as a model's would.
        words = re.findall(r"\s*\S+", reply.text or "") if stream is not None and isinstance(reply, ModelReply) else []
        if not words:
            if step.delay_s:
                await asyncio.sleep(step.delay_s)
            if isinstance(reply, Exception):
                raise reply
            return reply
        assert stream is not None and isinstance(reply, ModelReply)
        for word in words:
            if step.delay_s:
                await asyncio.sleep(step.delay_s / len(words))
            await stream.delta(word)
        return reply

    async def aclose(self) -> None:
        return None
