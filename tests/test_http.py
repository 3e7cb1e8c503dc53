"""The worker's HTTP port, exercised with httpx against the running service: post a message
(202, idempotent by id), read the conversation's state and a turn's timeline (JSON and
HTML), scrape /metrics. Once in-process, once as `turnstile run --http` in its own process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from worker_harness import FAST, serving, until

from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.handlers.schedule import Interval, Schedule
from turnstile.streams.file_log import FileLog
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.service import Service
from turnstile.streams.worker import Worker

ROOT = Path(__file__).parent.parent


@contextlib.asynccontextmanager
async def service(tmp_path: Path, delay_s: float = 0.0) -> AsyncIterator[tuple[Service, httpx.AsyncClient]]:
    async with serving(Worker(FileLog(tmp_path), ScriptedProvider(delay_s=delay_s), FAST)) as running:
        yield running


async def state_of(client: httpx.AsyncClient, conversation: str) -> dict:
    response = await client.get(f"/conversations/{conversation}")
    return response.json() if response.status_code == 200 else {}


async def test_post_a_message_read_the_state_and_the_turn_timeline(tmp_path):
    async with service(tmp_path) as (_svc, client):
        message = {"message_id": "m1", "content": "check the dates"}
        posted = await client.post("/conversations/c1/messages", json=message)
        assert posted.status_code == 202, posted.text
        assert posted.json()["message_id"] == "m1" and posted.headers["Location"] == "/conversations/c1"
        # Without an id the service makes one and says which.
        anon = await client.post("/conversations/c2/messages", json={"content": "hello"})
        assert anon.status_code == 202 and len(anon.json()["message_id"]) == 32

        async def answered() -> bool:
            return [t["outcome"] for t in (await state_of(client, "c1")).get("turns", [])] == ["completed"]

        await until_async(answered)
        state = await state_of(client, "c1")
        assert [h["content"] for h in state["history"]] == ["check the dates", "(scripted reply to) check the dates"]
        assert state["pending"] == [] and state["active"] is None
        [turn] = state["turns"]
        assert turn["input_ids"] == ["m1"] and turn["iterations"] == 1 and turn["attempts"] == 1

        timeline = await client.get(f"/conversations/c1/turns/{turn['turn_id']}")
        assert timeline.status_code == 200 and timeline.headers["Content-Type"].startswith("application/json")
        body = timeline.json()
        assert [e["type"] for e in body["timeline"]] == [
            "TurnClaimed", "AttemptStarted", "ModelResponded", "TurnCompleted"
        ]
        assert body["outcome"] == "completed" and body["outcome_detail"] == "(scripted reply to) check the dates"

        for html in (
            await client.get(f"/conversations/c1/turns/{turn['turn_id']}", headers={"Accept": "text/html"}),
            await client.get(f"/conversations/c1/turns/{turn['turn_id']}?format=html"),
        ):
            assert html.status_code == 200 and html.headers["Content-Type"].startswith("text/html")
            assert '<table class="waterfall">' in html.text and "TurnCompleted" in html.text
            assert "check the dates" in html.text

        # Idempotent by id: the same message again is accepted and not answered twice; the
        # same id for other content is a conflict.
        again = await client.post("/conversations/c1/messages", json=message)
        assert again.status_code == 202 and again.json()["duplicate"] is True and again.json()["status"] == "accepted"
        clash = await client.post("/conversations/c1/messages", json={"message_id": "m1", "content": "other"})
        assert clash.status_code == 409
        await asyncio.sleep(0.3)
        assert len((await state_of(client, "c1"))["turns"]) == 1

        metrics = await client.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["Content-Type"].startswith("text/plain")
        assert 'turnstile_turns_total{outcome="completed"}' in metrics.text


async def until_async(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_a_repost_before_the_worker_folded_the_first_is_still_answered_once(tmp_path):
    async with service(tmp_path, delay_s=0.2) as (svc, client):
        body = {"message_id": "m1", "content": "hi"}
        first, second = await asyncio.gather(
            client.post("/conversations/c1/messages", json=body), client.post("/conversations/c1/messages", json=body)
        )
        assert first.status_code == second.status_code == 202
        await until(lambda: "c1" in svc.worker.states and bool(svc.worker.states["c1"].turns))
        await asyncio.sleep(0.3)
        assert [t.input_ids for t in svc.worker.states["c1"].turns.values()] == [("m1",)]


async def test_bad_requests_and_unknown_things(tmp_path):
    async with service(tmp_path) as (_svc, client):
        assert (await client.get("/conversations/nobody")).status_code == 404
        assert (await client.get("/conversations/nobody/turns/abc")).status_code == 404
        for bad in (b"not json", b'"text"', b'{"content": 5}', b'{"content": ""}', b'{"content": "x", "extra": 1}'):
            response = await client.post("/conversations/c1/messages", content=bad)
            assert response.status_code == 400, bad
            assert "error" in response.json()
        assert (await client.get("/healthz")).json() == {"ok": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_turnstile_run_with_http_and_schedules_as_a_process(tmp_path):
    schedules = tmp_path / "schedules.json"
    schedules.write_text(json.dumps([
        {"id": "hourly", "conversation": "sched", "content": "hourly check-in", "every_s": 3600},
    ]))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "turnstile.streams.cli", "run", "--data", str(tmp_path / "log"), "--quiet-ms", "100",
         "--http", f"127.0.0.1:{port}", "--schedules", str(schedules)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    try:
        with httpx.Client(base_url=base, timeout=5) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline and worker.poll() is None, "the service did not come up"
                time.sleep(0.1)
            posted = client.post("/conversations/c1/messages", json={"message_id": "m1", "content": "hi"})
            assert posted.status_code == 202
            while True:
                c1, sched = client.get("/conversations/c1"), client.get("/conversations/sched")
                done = [
                    r.status_code == 200 and [t["outcome"] for t in r.json()["turns"]] == ["completed"]
                    for r in (c1, sched)
                ]
                if all(done):
                    break
                assert time.monotonic() < deadline, (c1.text, sched.text)
                time.sleep(0.2)
            [pending] = [h for h in sched.json()["history"] if h["role"] == "user"]
            assert pending["content"] == "hourly check-in"
            metrics = client.get("/metrics").text
            assert 'turnstile_turns_total{outcome="completed"} 2.0' in metrics
            assert 'turnstile_scheduled_inputs_total{schedule="hourly"} 1.0' in metrics
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stderr.read() if worker.stderr else ""


@pytest.mark.kafka
async def test_the_service_on_kafka_with_a_schedule(kafka_bootstrap: str, fresh_topics: Topics):  # noqa: F811
    """The views read the conversation's partition straight from the broker; the scheduler
    fires for the partitions this worker owns."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), FAST)
    ping = Schedule("ping", "sched", "anything new?", Interval(3_600_000))
    svc = Service(worker, schedules=[ping], http=("127.0.0.1", 0))
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(svc.run(stop, ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        async with httpx.AsyncClient(base_url=svc.url or "", timeout=30) as client:
            posted = await client.post("/conversations/k1/messages", json={"message_id": "m1", "content": "hi"})
            assert posted.status_code == 202

            async def both_answered() -> bool:
                states = [await state_of(client, c) for c in ("k1", "sched")]
                return all([t["outcome"] for t in s.get("turns", [])] == ["completed"] for s in states)

            await until_async(both_answered, 60)
            sched = await state_of(client, "sched")
            [turn] = sched["turns"]
            assert turn["input_ids"][0].startswith("ping@")
            page = await client.get(f"/conversations/sched/turns/{turn['turn_id']}?format=html")
            assert page.status_code == 200 and "anything new?" in page.text
            metrics = (await client.get("/metrics")).text
            assert 'turnstile_scheduled_inputs_total{schedule="ping"} 1.0' in metrics
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
