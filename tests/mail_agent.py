"""An agent whose first turn pauses for approval of a side-effecting call: the fixture of
the HTTP operation and console tests. `mail_worker` serves it on the embedded log."""

from __future__ import annotations

from pathlib import Path

from turnstile import Agent, TestModel
from turnstile.handlers.claim import DebouncePolicy
from turnstile.streams.file_log import FileLog
from turnstile.streams.worker import Worker


def mail_agent(sent: list[str], *, delay_s: float = 0.0) -> Agent:
    """Asked anything, it calls `send_email` (which needs approval): the turn pauses. The
    turn the decision starts makes the same call again (an approval lets exactly that call
    run), then answers "Sent."; every later turn quotes its input back."""
    call = TestModel.calls("send_email", '{"to": "a@b.c", "api_key": "k-123"}')
    model = TestModel(replies=[call, call, "Sent."], delay_s=delay_s)
    agent = Agent("mail", model=model, debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=100))

    @agent.tool(side_effect=True, needs_approval=True)
    def send_email(to: str, api_key: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return f"sent to {to}"

    return agent


def mail_worker(data: Path, sent: list[str], *, delay_s: float = 0.0) -> Worker:
    agent = mail_agent(sent, delay_s=delay_s)
    providers = agent.providers()
    config = agent.worker_config(providers, {"drain_grace_s": 0.0, "stream_replies": True})
    return Worker(FileLog(data), providers[agent.model.name], config)
