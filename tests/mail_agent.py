"""An agent whose turns about mail pause for approval of a side-effecting call: the
fixture of the HTTP operation and console tests. `mail_worker` serves it on the embedded log."""

from __future__ import annotations

from pathlib import Path

from turnstile import Agent, TestModel
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.provider import ModelRequest
from turnstile.handlers.providers.scripted import echo_reply
from turnstile.streams.agent import TestReply
from turnstile.streams.file_log import FileLog
from turnstile.streams.worker import Worker

CALL = TestModel.calls("send_email", '{"to": "a@b.c", "api_key": "k-123"}')


def respond(request: ModelRequest) -> TestReply:
    """A message about mail, or the decision on one, makes the model call `send_email` (the
    turn the decision starts makes the same call again: an approval lets exactly that call
    run); its result is answered "Sent." (or "Not sent." when it did not run); anything
    else is quoted back."""
    last = request.messages[-1]
    if last.role == "tool":
        return "Not sent." if last.is_error else "Sent."
    if "mail" in last.content or last.content.startswith(("Approved:", "Denied:")):
        return CALL
    return echo_reply(request)


def mail_worker(data: Path, sent: list[str], *, delay_s: float = 0.0) -> Worker:
    agent = Agent("mail", model=TestModel(respond=respond, delay_s=delay_s),
                  debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=100))

    @agent.tool(side_effect=True, needs_approval=True)
    def send_email(to: str, api_key: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return f"sent to {to}"

    providers = agent.providers()
    config = agent.worker_config(providers, {"drain_grace_s": 0.0, "stream_replies": True})
    return Worker(FileLog(data), providers[agent.model.name], config)
