"""The largest value the embedded log takes, at its edges. It takes what a Kafka topic with
the broker's defaults takes and no more, so what runs embedded runs on a default broker;
every reader (the worker, tail, inspect, the views) decodes all it took; and a turn whose
reply is over the limit fails at once with the reason instead of writing what no reader would read
(a message of 200,000 characters may be 1.2 MB of JSON: a control character escapes to
six bytes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from worker_harness import FAST, events_of, running, until

from turnstile.events import AttemptFailed, MessageReceived, ModelResponded, TurnCompleted, TurnFailed, encode
from turnstile.handlers.provider import ModelReply, ModelRequest
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
from turnstile.projections.audit import audit
from turnstile.streams import cli
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import BROKER_DEFAULT_MAX_MESSAGE_BYTES, RecordRefused, value_limit
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import SystemClock
from turnstile.streams.views import build_view

CONV = "c1"
LIMIT = value_limit(BROKER_DEFAULT_MAX_MESSAGE_BYTES, CONV)  # 1,048,446 bytes for this key


def message_of(size: int, message_id: str = "m1") -> MessageReceived:
    """A message whose encoded value is exactly `size` bytes, within the 200,000 characters a
    content may have: six bytes for each control character, one for each letter."""
    base = len(encode(message_event(CONV, "x", SystemClock().now_ms(), message_id))) - 1
    six, ones = divmod(size - base, 6)
    event = message_event(CONV, "\x01" * six + "x" * ones, SystemClock().now_ms(), message_id)
    assert len(encode(event)) == size and len(event.content) <= 200_000
    return event


async def test_the_embedded_log_takes_a_value_exactly_at_a_default_brokers_limit_and_not_a_byte_more(tmp_path):
    log = FileLog(tmp_path)
    assert log.max_value_bytes(log.topics.events, CONV) == LIMIT
    await log.append(log.topics.events, CONV, encode(message_of(LIMIT)))
    with pytest.raises(RecordRefused, match=f"a record of {LIMIT + 1:,} bytes is over what turnstile.events takes"):
        await log.append(log.topics.events, CONV, encode(message_of(LIMIT + 1, "m2")))
    assert [e.message_id for e in events_of(log, CONV) if isinstance(e, MessageReceived)] == ["m1"]


def short_reply(request: ModelRequest) -> Scripted:
    return Scripted(ModelReply(request.model, "noted", (), echo_reply(request).usage, "stop"))


async def answered_at_the_limit(log: FileLog) -> None:
    await log.append(log.topics.events, CONV, encode(message_of(LIMIT)))
    async with running(log, ScriptedProvider(short_reply), FAST):
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, CONV)), 30)


def test_a_message_at_the_limit_is_answered_and_every_reader_decodes_it(tmp_path, capsys):
    # Given a message of the largest size the log takes (over the 1,000,000 bytes the
    # readers other than the worker decoded before: they showed its turn as never written)
    log = FileLog(tmp_path)
    asyncio.run(answered_at_the_limit(log))
    # then inspect, tail and the views read all of it
    view = build_view(CONV, log.read_all(log.topics.events))
    assert view.undecodable == 0 and view.state.events_applied == 5
    assert [entry.event.type for turn in view.turns.values() for entry in turn.entries][-1] == "TurnCompleted"
    assert cli.main(["tail", "--data", str(tmp_path)]) == 0
    assert "COMPLETED" in capsys.readouterr().out
    assert cli.main(["inspect", "--data", str(tmp_path), CONV]) == 0
    assert "did not decode" not in capsys.readouterr().out


async def test_a_reply_over_the_limit_fails_its_turn_with_the_reason_and_writes_nothing_unreadable(tmp_path):
    # Given a model that echoes the message: a reply as large as the largest message
    log = FileLog(tmp_path)
    big = message_event(CONV, "\x01" * 200_000, SystemClock().now_ms(), "m1")
    assert len(encode(big)) > LIMIT
    with pytest.raises(RecordRefused):
        await log.append(log.topics.events, CONV, encode(big))
    await log.append(log.topics.events, CONV, encode(message_of(LIMIT)))  # the echo's event is over the limit
    calls: list[ModelRequest] = []

    def echo(request: ModelRequest) -> Scripted:
        calls.append(request)
        return Scripted(echo_reply(request))

    async with running(log, ScriptedProvider(echo), FAST):
        await until(lambda: any(isinstance(e, TurnFailed) for e in events_of(log, CONV)), 30)
    # the reply is not written (the log would refuse it), nor asked for again (another costs
    # as much): the attempt and the turn fail at once, saying why in what the user reads
    [attempt] = [e for e in events_of(log, CONV) if isinstance(e, AttemptFailed)]
    assert not attempt.retryable and "ModelResponded of 1,048," in attempt.reason and len(calls) == 1
    [failed] = [e for e in events_of(log, CONV) if isinstance(e, TurnFailed)]
    assert failed.error.startswith("The model's reply is too large to record (")
    assert f"over the {LIMIT:,} the events topic takes" in failed.error
    # nothing over the limit is on the log, and every reader reads all of it
    assert not any(isinstance(e, ModelResponded) for e in events_of(log, CONV))
    assert build_view(CONV, log.read_all(log.topics.events)).undecodable == 0
    assert audit(log.read_all(log.topics.events)).ok


def test_send_refuses_a_message_the_log_does_not_take_with_the_reason(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "send", "--conversation", CONV, "--text", "-"],
        input="\x01" * 200_000, capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 65, result.stderr
    assert "the log does not take this input: a record of 1,200," in result.stderr
    assert "Traceback" not in result.stderr
