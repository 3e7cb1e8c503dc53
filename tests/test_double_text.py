"""Double-text policy: a message that arrives while a turn is active is queued for the next
turn (`enqueue`, the default) or refused at once with `MessageRejected` (`reject`)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from builders import claim, completed, eid, message, started
from worker_harness import FAST, events_of, running, until

from turnstile.events import MessageRejected, TurnClaimed, TurnCompleted, decode
from turnstile.handlers.claim import DoubleTextPolicy, refusal_on_arrival, rejection_event, rejects_on_arrival
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections import apply_event, new_state
from turnstile.streams.file_log import FileLog
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import WorkerConfig

NOW = SystemClock().now_ms
ROOT = Path(__file__).parent.parent


def rejected(message_id: str, turn_id: str, at: int = 50, conv: str = "conv-1") -> MessageRejected:
    return MessageRejected(
        event_id=eid(), conversation_id=conv, occurred_at=at, message_id=message_id, reason="turn_active",
        active_turn_id=turn_id, text="not taken",
    )


# -- the policy and the fold --------------------------------------------------------------
def test_the_policy_is_per_conversation_with_a_default():
    policy = DoubleTextPolicy("enqueue", {"strict": "reject"})
    assert policy.of("strict") == "reject" and policy.of("other") == "enqueue"
    assert DoubleTextPolicy().of("any") == "enqueue"
    with pytest.raises(ValueError):
        DoubleTextPolicy("drop")  # type: ignore[arg-type]


def test_only_a_message_folded_during_an_active_turn_is_refused():
    state = new_state("conv-1")
    reject = DoubleTextPolicy("reject")
    assert apply_event(state, message("m1", 10)) is None
    assert not rejects_on_arrival(reject, state, "m1")  # no turn is active: it is batched as usual
    c = claim(["m1"], 20, 0)
    assert apply_event(state, c) is None
    m2 = message("m2", 30)
    assert apply_event(state, m2) is None
    assert rejects_on_arrival(reject, state, "m2")
    assert not rejects_on_arrival(DoubleTextPolicy("enqueue"), state, "m2")
    refusal = refusal_on_arrival(reject, state, m2)
    assert refusal is not None
    event = rejection_event(state, "m2", refusal, event_id="e", now_ms=40)
    assert (event.message_id, event.reason, event.active_turn_id) == ("m2", "turn_active", c.turn_id)
    assert "not taken" in event.text


def test_a_rejection_leaves_the_message_not_pending_and_recorded_as_rejected():
    state = new_state("conv-1")
    c = claim(["m1"], 20, 0)
    for event in (message("m1", 10), c, started(c, 21), message("m2", 30, "hi again")):
        assert apply_event(state, event) is None
    assert apply_event(state, rejected("m2", c.turn_id)) is None
    assert "m2" not in state.pending and state.rejected == {"m2": "turn_active"}
    # Republishing the refused message is a duplicate: it does not come back.
    assert apply_event(state, message("m2", 30, "hi again")) is not None
    assert "m2" not in state.pending
    # A rejection of what is not a pending message is ignored by every reader.
    assert apply_event(state, rejected("m2", c.turn_id)) is not None
    assert apply_event(state, rejected("m1", c.turn_id)) is not None  # claimed, not pending
    assert apply_event(state, completed(c, 60)) is None
    assert [h.content for h in state.history if h.role == "user"] == ["text of m1"]


# -- the worker ---------------------------------------------------------------------------
def policy_config(policy: DoubleTextPolicy) -> WorkerConfig:
    return dataclasses.replace(FAST, double_text=policy)


async def test_reject_refuses_a_message_sent_mid_turn_and_the_turn_ends_normally(tmp_path):
    log = FileLog(tmp_path)
    async with running(log, ScriptedProvider(delay_s=0.6), policy_config(DoubleTextPolicy("reject"))) as worker:
        await publish(log, message_event("c1", "check the dates", NOW(), "m1"))
        await until(lambda: any(isinstance(e, TurnClaimed) for e in events_of(log, "c1")))
        await publish(log, message_event("c1", "also compare the refund rules", NOW(), "m2"))
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        await until(lambda: "m2" in worker.states["c1"].rejected)
        # A message after the outcome is a normal one again.
        await publish(log, message_event("c1", "thanks", NOW(), "m3"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 2)
    events = events_of(log, "c1")
    refusals = [e for e in events if isinstance(e, MessageRejected)]
    claims = [e for e in events if isinstance(e, TurnClaimed)]
    assert [r.message_id for r in refusals] == ["m2"]
    assert refusals[0].active_turn_id == claims[0].turn_id and refusals[0].text
    assert [c.input_ids for c in claims] == [("m1",), ("m3",)]
    # The refusal is on the log before the turn it interrupted ended.
    assert events.index(refusals[0]) < next(i for i, e in enumerate(events) if isinstance(e, TurnCompleted))
    # Consumers of the outcomes topic see the refusal too.
    outcomes = [decode(r.value) for r in log.read_all(log.topics.outcomes)]
    assert [type(o).__name__ for o in outcomes] == ["MessageRejected", "TurnCompleted", "TurnCompleted"]


async def test_enqueue_is_the_default_and_the_policy_is_per_conversation(tmp_path):
    log = FileLog(tmp_path)
    policy = DoubleTextPolicy("enqueue", {"strict": "reject"})
    async with running(log, ScriptedProvider(delay_s=0.6), policy_config(policy)):
        for conversation in ("relaxed", "strict"):
            await publish(log, message_event(conversation, "first", NOW(), f"{conversation}-1"))
        both = ("relaxed", "strict")
        await until(lambda: all(any(isinstance(e, TurnClaimed) for e in events_of(log, c)) for c in both))
        for conversation in ("relaxed", "strict"):
            await publish(log, message_event(conversation, "second", NOW(), f"{conversation}-2"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "relaxed")) == 2)
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "strict")))
    relaxed, strict = events_of(log, "relaxed"), events_of(log, "strict")
    assert [c.input_ids for c in relaxed if isinstance(c, TurnClaimed)] == [("relaxed-1",), ("relaxed-2",)]
    assert not any(isinstance(e, MessageRejected) for e in relaxed)
    assert [c.input_ids for c in strict if isinstance(c, TurnClaimed)] == [("strict-1",)]
    assert [e.message_id for e in strict if isinstance(e, MessageRejected)] == ["strict-2"]


async def test_a_refusal_owed_when_the_worker_stopped_is_written_by_the_next_one(tmp_path):
    """The verdict is the log's: a new worker replays it and writes the refusal still owed
    before the conversation claims anything."""
    log = FileLog(tmp_path)
    c = claim(["m1"], NOW(), 0, run_id="dead-run", conv="c1")
    for event in (message("m1", NOW(), conv="c1"), c, started(c, NOW()), message("m2", NOW(), conv="c1")):
        await log.append(log.topics.events, "c1", event.model_dump_json().encode())
    async with running(log, ScriptedProvider(), policy_config(DoubleTextPolicy("reject"))):
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
    events = events_of(log, "c1")
    assert [e.message_id for e in events if isinstance(e, MessageRejected)] == ["m2"]
    assert [e.input_ids for e in events if isinstance(e, TurnClaimed)] == [("m1",)]


def test_the_cli_takes_a_default_and_per_conversation_policies():
    from turnstile.streams.cli import build_parser

    args = build_parser().parse_args(["run", "--double-text", "reject", "--double-text-for", "c1=enqueue"])
    assert args.double_text == "reject" and dict(args.double_text_for) == {"c1": "enqueue"}
    bad = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "run", "--double-text-for", "c1=drop"],
        capture_output=True, text=True, cwd=ROOT, timeout=30, check=False,
    )
    assert bad.returncode == 2 and "CONVERSATION=enqueue|reject" in bad.stderr


class FlakyLog(FileLog):
    """The first append of a refusal fails, as a broker hiccup would."""

    failures = 1

    async def append(
        self, topic: str, key: str, value: bytes, partition: int | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, int]:
        if topic == self.topics.events and b'"MessageRejected"' in value and self.failures:
            self.failures -= 1
            raise OSError("the log is briefly unavailable")
        return await super().append(topic, key, value, partition, headers)


async def test_a_refusal_that_failed_to_append_is_retried_and_blocks_the_next_claim_meanwhile(tmp_path):
    log = FlakyLog(tmp_path)
    async with running(log, ScriptedProvider(delay_s=0.3), policy_config(DoubleTextPolicy("reject"))) as worker:
        await publish(log, message_event("c1", "first", NOW(), "m1"))
        await until(lambda: any(isinstance(e, TurnClaimed) for e in events_of(log, "c1")))
        await publish(log, message_event("c1", "second", NOW(), "m2"))
        await until(lambda: "m2" in worker.states["c1"].rejected)
        await until(lambda: not worker.runners)
    events = events_of(log, "c1")
    assert log.failures == 0
    assert [e.message_id for e in events if isinstance(e, MessageRejected)] == ["m2"]
    assert [e.input_ids for e in events if isinstance(e, TurnClaimed)] == [("m1",)]
