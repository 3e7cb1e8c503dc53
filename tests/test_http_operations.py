"""Approve, deny and resume over HTTP: the same decisions as the CLI's, the input event
written, the new logical turn id answered; every refusal a JSON 4xx that says why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from mail_agent import mail_worker
from worker_harness import events_of, serving, until

from turnstile.events import InputInjected, ResumeRequested, TurnClaimed, TurnCompleted
from turnstile.streams.file_log import FileLog


async def until_status(client: httpx.AsyncClient, conversation: str, status: str = "paused") -> None:
    """Until the worker has folded the conversation to `status`: operations are decided
    from its state, which may be a moment behind the log."""
    for _ in range(200):
        listed = (await client.get("/conversations", params={"status": status})).json()["conversations"]
        if [row["conversation_id"] for row in listed] == [conversation]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{conversation} never {status}")


async def test_a_paused_call_is_approved_over_http_and_its_turn_is_the_one_answered(tmp_path: Path) -> None:
    sent: list[str] = []
    async with serving(mail_worker(tmp_path, sent)) as (_svc, client):
        assert (await client.post("/conversations/c1/messages", json={"content": "mail me"})).status_code == 202
        log = FileLog(tmp_path)
        await until_status(client, "c1")
        waiting = (await client.get("/conversations/c1")).json()["awaiting_approval"]
        assert (waiting["call_id"], waiting["tool"]) == ("call-1", "send_email") and "a@b.c" in waiting["arguments"]

        wrong = await client.post("/conversations/c1/approve", json={"call_id": "call-9"})
        assert wrong.status_code == 409 and "not 'call-9'" in wrong.json()["error"]
        resume = await client.post("/conversations/c1/resume", json={})
        assert resume.status_code == 409 and "turnstile approve|deny c1 call-1" in resume.json()["error"]
        approved = await client.post("/conversations/c1/approve", json={"call_id": "call-1", "note": "fine"})
        assert approved.status_code == 202, approved.text
        body = approved.json()
        assert body["input_id"].startswith("approval:") and body["input_id"].endswith(":call-1")

        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        events = events_of(log, "c1")
        [injected] = [e for e in events if isinstance(e, InputInjected)]
        assert injected.approval is not None and injected.approval.approved and "Note: fine" in injected.content
        assert [e.turn_id for e in events if isinstance(e, TurnClaimed)][-1] == body["turn_id"]
        assert sent == ["a@b.c"]
        await until_status(client, "c1", "idle")
        assert (await client.get("/conversations/c1")).json()["awaiting_approval"] is None
        # Twice is harmless: the same decision, taken by a turn already, is a duplicate and
        # nothing is written (it was a 409 "nothing paused"); the other one is refused.
        written = len(events_of(log, "c1"))
        again = await client.post("/conversations/c1/approve", json={"call_id": "call-1"})
        assert again.status_code == 202 and again.json() == {
            "conversation_id": "c1", "input_id": body["input_id"], "turn_id": body["turn_id"], "duplicate": True,
        }  # fmt: skip
        changed = await client.post("/conversations/c1/deny", json={"call_id": "call-1"})
        assert changed.status_code == 409 and "was approved already" in changed.json()["error"]
        assert len(events_of(log, "c1")) == written


async def test_deny_and_resume_and_the_requests_that_are_refused(tmp_path: Path) -> None:
    sent: list[str] = []
    async with serving(mail_worker(tmp_path, sent)) as (_svc, client):
        await client.post("/conversations/c1/messages", json={"content": "mail me"})
        log = FileLog(tmp_path)
        await until_status(client, "c1")
        for path, body, status in (
            ("/conversations/c1/approve", {}, 400),  # no call id: a malformed request
            # A note past the bound is refused with the reason (it was a 500 and a traceback).
            ("/conversations/c1/approve", {"call_id": "call-1", "note": "n" * 200_000}, 409),
            ("/conversations/c1/resume", {"note": "n" * 10_001}, 409),
            ("/conversations/c1/approve", {"call_id": 5}, 400),
            ("/conversations/c1/approve", {"call_id": "call-1", "extra": 1}, 400),
            ("/conversations/c1/resume", {"call_id": "call-1"}, 400),
            ("/conversations/c1/approve", {"call_id": "c" * 257}, 400),  # longer than any tool call's
            ("/conversations/c1/approve", {"call_id": ""}, 400),
            ("/conversations/c1/approve", {"call_id": "a\nb"}, 409),  # a model's id may be so: not the paused one
            ("/conversations/c1/explode", {}, 404),
            ("/conversations/nobody/resume", {}, 404),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == status and "error" in response.json(), (path, body, response.text)
        assert (await client.post("/conversations/c1/deny", content=b"not json")).status_code == 400

        denied = await client.post("/conversations/c1/deny", json={"call_id": "call-1", "note": "not now"})
        assert denied.status_code == 202
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        assert sent == []  # denied: the tool never ran
        await until_status(client, "c1", "idle")
        nothing = await client.post("/conversations/c1/resume")
        assert nothing.status_code == 409 and "nothing to resume" in nothing.json()["error"]
        assert not any(isinstance(e, ResumeRequested) for e in events_of(log, "c1"))


async def test_two_decisions_sent_at_once_one_stands_and_the_other_is_refused_not_lost_in_the_dead_letters(
    tmp_path: Path,
) -> None:
    sent: list[str] = []
    async with serving(mail_worker(tmp_path, sent)) as (_svc, client):
        await client.post("/conversations/c1/messages", json={"content": "mail me"})
        await until_status(client, "c1")
        # given both decided from the same state (nothing decided yet), when both are written
        approve, deny = await asyncio.gather(
            client.post("/conversations/c1/approve", json={"call_id": "call-1", "note": "fine"}),
            client.post("/conversations/c1/deny", json={"call_id": "call-1", "note": "no"}),
        )
        # then the one the log took first is 202, the other 409 (it was 202, then dead-lettered)
        assert sorted((approve.status_code, deny.status_code)) == [202, 409], (approve.text, deny.text)
        stood, refused = (approve, deny) if approve.status_code == 202 else (deny, approve)
        # (refused before its append when the worker had folded the first by then, after it if not)
        assert refused.json()["error"].endswith("the first one stands"), refused.text
        log = FileLog(tmp_path)
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        claimed = [e for e in events_of(log, "c1") if isinstance(e, TurnClaimed)][-1]
        assert claimed.turn_id == stood.json()["turn_id"]
        assert sent == (["a@b.c"] if stood is approve else [])  # the decision that stood is the one carried out
