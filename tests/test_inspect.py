"""`turnstile inspect`: the conversation rebuilt from the log by an independent reader."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from builders import claim, message, started
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from rich.console import Console
from worker_harness import FAST, events_of, running, until

from turnstile.events import TurnCompleted, encode
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams import cli
from turnstile.streams.file_log import FileLog
from turnstile.streams.inspect_cli import inspect
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.views import build_view, state_json, turn_json
from turnstile.streams.worker import Worker

NOW = SystemClock().now_ms
ROOT = Path(__file__).parent.parent


def console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200, color_system=None), out


async def two_turns_and_one_pending(tmp_path: Path) -> FileLog:
    log = FileLog(tmp_path)
    async with running(log, ScriptedProvider()):
        await publish(log, message_event("c1", "check the dates", NOW(), "m1"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 1)
        await publish(log, message_event("c1", "also compare the refund rules", NOW(), "m2"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 2)
    # Written with no worker running: a pending message and a turn left active by a dead owner.
    m3, m4 = message("m3", NOW(), "waiting", conv="c1"), message("m4", NOW(), "not yet", conv="c1")
    c = claim(["m3"], NOW(), 4, run_id="dead-run", conv="c1")
    for event in (m3, c, started(c, NOW()), m4):
        await log.append(log.topics.events, "c1", encode(event))
    return log


async def test_inspect_shows_history_pending_active_turn_and_timelines(tmp_path):
    await two_turns_and_one_pending(tmp_path)
    con, out = console()
    view = await inspect("c1", broker=None, data=tmp_path, topics=Topics(), console=con)
    text = out.getvalue()
    assert [h.content for h in view.state.history] == [
        "check the dates", "(scripted reply to) check the dates",
        "also compare the refund rules", "(scripted reply to) also compare the refund rules",
    ]
    assert list(view.state.pending) == ["m4"]
    assert view.state.active is not None and view.state.active.input_ids == ("m3",)
    for expected in ("check the dates", "assistant (completed)", "m4", "not yet", "active turn", "dead-run"[:8],
                     "outcome completed", "TurnClaimed", "ModelResponded", "TurnCompleted", "attempts 1",
                     "iterations 1", "outcome active"):
        assert expected in text, expected
    # One panel per turn, in claim order; the dead owner's turn is still active.
    turns = list(view.turns.values())
    assert [t.input_ids for t in turns] == [("m1",), ("m2",), ("m3",)]
    assert [t.outcome for t in turns] == ["completed", "completed", None]
    assert turns[0].duration_ms is not None and turns[0].cost_usd == 0.0



def test_records_the_workers_dead_letter_for_their_key_are_shown_by_no_reader(tmp_path, capsys):
    # Given a conversation with one message, then a message and a claim of it for the same
    # conversation written under another key (the workers dead-letter both as key_mismatch)
    log = FileLog(tmp_path)
    real = message("m1", 10, conv="c1")
    for key, event in (("c1", real), ("evil", message("m2", 20, conv="c1")), ("evil", claim(["m2"], 30, 1, conv="c1"))):
        asyncio.run(log.append(log.topics.events, key, encode(event)))
    # then the view of c1 holds only m1, pending, and counts the two as not folded
    view = build_view("c1", log.read_all(log.topics.events))
    assert (list(view.state.pending), view.state.active, view.undecodable) == (["m1"], None, 2)
    # and tail lists only m1 (`tail` shows what the workers fold)
    assert cli.main(["tail", "--data", str(tmp_path), "--conversation", "c1"]) == 0
    out = capsys.readouterr().out
    assert "m1" in out and "m2" not in out and "claimed" not in out.lower()

async def test_views_as_json(tmp_path):
    log = await two_turns_and_one_pending(tmp_path)
    view = build_view("c1", log.read_all(log.topics.events))
    state = state_json(view)
    assert [p["input_id"] for p in state["pending"]] == ["m4"]
    assert state["active"]["input_ids"] == ["m3"] and state["active"]["attempt_state"] == "open"
    assert [t["outcome"] for t in state["turns"]] == ["completed", "completed", None]
    first = turn_json("c1", next(iter(view.turns.values())))
    assert [e["type"] for e in first["timeline"]] == [
        "TurnClaimed", "AttemptStarted", "ModelResponded", "TurnCompleted"
    ]
    assert first["attempts"][0]["model"] == "scripted-1" and first["iterations"] == 1


def test_an_export_to_a_file_that_cannot_be_written_is_named(tmp_path, capsys):
    asyncio.run(two_turns_and_one_pending(tmp_path))
    (tmp_path / "a-file").write_text("not a folder")
    turn = next(iter(build_view("c1", FileLog(tmp_path).conversation_records("c1")).turns))
    code = cli.main(["export-turn", "--data", str(tmp_path), "c1", turn, "-o", str(tmp_path / "a-file" / "t.html")])
    assert code == 73 and f"cannot write {tmp_path / 'a-file' / 't.html'} (Not a directory)" in capsys.readouterr().err


def test_inspect_cli_on_the_embedded_log(tmp_path):
    asyncio.run(two_turns_and_one_pending(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "inspect", "--data", str(tmp_path), "c1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False, env={"COLUMNS": "200", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    assert "outcome completed" in result.stdout and "also compare the refund rules" in result.stdout
    assert "pending" in result.stdout and "not yet" in result.stdout


def test_inspect_json_is_the_http_apis_shapes_with_every_turns_timeline_and_prints_no_control_character(
    tmp_path, capsys
):
    # Given the two answered turns, the pending message and the dead owner's turn, and a
    # message whose text carries a CSI (C1), an ESC (C0) sequence and a DEL
    log = asyncio.run(two_turns_and_one_pending(tmp_path))
    hostile = message("m5", NOW(), "red \x9b31m \x1b[2J \x7f", conv="c1")
    asyncio.run(log.append(log.topics.events, "c1", encode(hostile)))
    # When an auditor asks for it as JSON
    assert cli.main(["inspect", "--data", str(tmp_path), "c1", "--json"]) == 0
    out = capsys.readouterr().out
    # Then it is one JSON document: the conversation as GET /conversations/c1 has it, each
    # turn as GET .../turns/{id} has it
    printed = json.loads(out)
    view = build_view("c1", log.read_all(log.topics.events))
    assert {k: v for k, v in printed.items() if k not in ("turns", "undecodable")} == {
        k: v for k, v in state_json(view).items() if k != "turns"
    }
    assert printed["turns"] == [turn_json("c1", t) for t in view.turns.values()]
    assert [t["outcome"] for t in printed["turns"]] == ["completed", "completed", None]
    assert printed["turns"][0]["timeline"][-1]["type"] == "TurnCompleted" and printed["undecodable"] == 0
    # and the client's control characters reach the terminal escaped, the text intact
    assert printed["pending"][-1]["content"] == "red \x9b31m \x1b[2J \x7f"
    assert not {"\x9b", "\x1b", "\x7f"} & set(out)


@pytest.mark.kafka
async def test_inspect_on_kafka(kafka_bootstrap: str, fresh_topics: Topics):  # noqa: F811
    group = f"g-{uuid.uuid4().hex[:8]}"
    worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), FAST)
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await publish(publisher, message_event("k1", "hello kafka", NOW(), "m1"))
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            con, out = console()
            view = await inspect("k1", broker=f"kafka://{kafka_bootstrap}", data=Path("."), topics=fresh_topics,
                                 console=con)
            if any(t.outcome == "completed" for t in view.turns.values()):
                break
            assert asyncio.get_running_loop().time() < deadline, "no completed turn in time"
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await publisher.producer.stop()
    assert "(scripted reply to) hello kafka" in out.getvalue()
    assert [h.role for h in view.state.history] == ["user", "assistant"] and not view.state.pending
