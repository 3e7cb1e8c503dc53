"""The worker end to end on the embedded file log: the same code that runs on Kafka."""

from __future__ import annotations

import asyncio

import pytest
from builders import claim, message, started
from worker_harness import FAST, ReplayCalls, events_of, running, until

from turnstile.events import (
    AttemptFailed,
    AttemptStarted,
    DeadLetter,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnFailed,
    encode,
)
from turnstile.handlers.provider import ModelRequest
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections.audit import Auditor
from turnstile.streams.file_log import FileLog
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker

NOW = SystemClock().now_ms


async def test_a_message_sent_mid_turn_gets_its_own_turn_after_the_first_outcome(tmp_path):
    log = FileLog(tmp_path)
    async with running(log, ScriptedProvider(delay_s=0.5)):
        await publish(log, message_event("c1", "check the dates", NOW(), "m1"))
        await until(lambda: any(isinstance(e, TurnClaimed) for e in events_of(log)))
        await publish(log, message_event("c1", "also compare the refund rules", NOW(), "m2"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log)) == 2)
    events = events_of(log, "c1")
    claims = [e for e in events if isinstance(e, TurnClaimed)]
    assert [c.input_ids for c in claims] == [("m1",), ("m2",)]
    first_outcome = next(i for i, e in enumerate(events) if isinstance(e, TurnCompleted))
    assert events.index(claims[1]) > first_outcome
    replies = [e for e in events if isinstance(e, TurnCompleted)]
    assert [r.reply for r in replies] == [
        "(scripted reply to) check the dates",
        "(scripted reply to) also compare the refund rules",
    ]


async def test_a_slow_model_call_does_not_hold_up_other_conversations(tmp_path):
    log = FileLog(tmp_path, partitions=1)  # both conversations share the one partition

    def script(request: ModelRequest):
        from turnstile.handlers.providers.scripted import Scripted, echo_reply

        return Scripted(echo_reply(request), delay_s=30.0 if "slow" in request.messages[-1].content else 0.0)

    async with running(log, ScriptedProvider(script)) as worker:
        await publish(log, message_event("slow-conv", "slow question", NOW(), "s1"))
        await asyncio.sleep(0.2)
        await publish(log, message_event("fast-conv", "fast question", NOW(), "f1"))
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "fast-conv")), 5)
        assert worker.states["slow-conv"].active is not None  # still waiting on its model


async def test_an_attempt_left_open_by_a_dead_worker_is_retried_under_the_same_turn(tmp_path):
    log = FileLog(tmp_path)
    msg, c = message("m1", NOW(), conv="c1"), claim(["m1"], NOW(), 0, run_id="dead-run", conv="c1")
    for event in (msg, c, started(c, NOW())):
        await publish_raw(log, event)
    async with running(log, ScriptedProvider()):
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
    events = events_of(log, "c1")
    failed = [e for e in events if isinstance(e, AttemptFailed)]
    assert len(failed) == 1 and failed[0].run_id == "dead-run" and failed[0].retryable
    retry = [e for e in events if isinstance(e, AttemptStarted)][-1]
    assert (retry.turn_id, retry.attempt) == (c.turn_id, 2) and retry.run_id != "dead-run"
    assert sum(isinstance(e, TurnCompleted) for e in events) == 1


async def test_a_side_effect_left_unfinished_is_never_replayed(tmp_path):
    log = FileLog(tmp_path)
    msg, c = message("m1", NOW(), conv="c1"), claim(["m1"], NOW(), 0, run_id="dead-run", conv="c1")
    tool = ToolCallStarted(
        event_id="t1",
        conversation_id="c1",
        occurred_at=NOW(),
        turn_id=c.turn_id,
        run_id="dead-run",
        attempt=1,
        iteration=1,
        call_id="call-1",
        tool="send_email",
        arguments="{}",
        side_effect=True,
    )
    for event in (msg, c, started(c, NOW()), tool):
        await publish_raw(log, event)
    provider = ScriptedProvider()
    async with running(log, provider):
        await until(lambda: any(isinstance(e, TurnFailed) for e in events_of(log, "c1")))
    failed = next(e for e in events_of(log, "c1") if isinstance(e, TurnFailed))
    assert [(o.call_id, o.status) for o in failed.operations] == [("call-1", "unknown")]
    assert provider.requests == []  # the model was not called again
    assert not any(isinstance(e, AttemptStarted) and e.attempt == 2 for e in events_of(log, "c1"))


async def test_bad_values_go_to_the_dead_letter_topic_and_the_partition_keeps_moving(tmp_path):
    log = FileLog(tmp_path, partitions=1)
    await log.append(log.topics.events, "c1", b"{not json")
    await log.append(log.topics.events, "c1", encode(message("m1", NOW(), "hello", conv="someone-else")))
    await publish(log, message_event("c1", "hello", NOW(), "m1"))
    await publish(log, message_event("c1", "a different text", NOW(), "m1"))
    async with running(log, ScriptedProvider()) as worker:
        await until(lambda: "c1" in worker.states and len(worker.states["c1"].history) == 2)
        assert worker.states["c1"].history[0].content == "hello"
    letters = [DeadLetter.model_validate_json(r.value) for r in log.read_all(log.topics.dead_letters)]
    assert [(d.offset, d.reason) for d in letters] == [
        (0, "not_json"),
        (1, "key_mismatch"),
        (3, "conflicting_duplicate"),
    ]
    assert letters[0].original_value() == b"{not json"



async def test_a_message_outside_its_conversations_partition_is_dead_lettered_not_a_second_home(tmp_path):
    # Given a publisher whose partitioner is not murmur2 (librdkafka's default): a message of
    # c1 lands in another partition than c1's, then one lands in c1's own
    log = FileLog(tmp_path)
    home = log.partition_for("c1")
    wrong = (home + 1) % log.partition_count()
    stray = encode(message_event("c1", "sent with the wrong partitioner", NOW(), "m0"))
    await log.append(log.topics.events, "c1", stray, partition=wrong)
    await publish(log, message_event("c1", "hello", NOW(), "m1"))
    async with running(log, ScriptedProvider()) as worker:
        await until(lambda: "c1" in worker.states and len(worker.states["c1"].history) == 2)
        # then c1 has one home, and its turn claimed only what is there
        assert worker.partitions.home("c1") == home
        assert [h.content for h in worker.states["c1"].history][:1] == ["hello"]
    claims = [e for e in events_of(log, "c1") if isinstance(e, TurnClaimed)]
    assert [c.input_ids for c in claims] == [("m1",)]
    [record] = log.read_all(log.topics.dead_letters)
    letter = DeadLetter.model_validate_json(record.value)
    assert (letter.partition, letter.offset, letter.reason) == (wrong, 0, "wrong_partition")
    assert f"partition {home} of {log.partition_count()}" in letter.detail and letter.original_value() == stray
    # and the auditor, told the partition count, refuses it alike: the conversation is in
    # one partition, the stray a value the workers dead-lettered, nothing pending for ever
    auditor = Auditor(partitions=log.partition_count()).feed_all(log.read_all(log.topics.events))
    report = auditor.feed_dead_letters([letter]).report()
    assert report.ok and report.not_dead_lettered == []
    assert [(f.partition, f.detail.split(":")[0]) for f in report.undecodable] == [(wrong, "wrong_partition")]
    assert auditor.states["c1"].pending == {} and auditor.states["c1"].seen_inputs.keys() == {"m1"}


@pytest.mark.parametrize(("key_bytes", "keyed"), [(600_000, True), (1_048_200, False)])
async def test_a_bad_value_under_a_huge_key_is_still_dead_lettered(tmp_path, key_bytes, keyed):
    # Given a bad value under a key so long that key and letter together would not fit the
    # dead-letter topic (the letter carries the key too); at 1,048,200 bytes the key leaves
    # no room for any letter beside it
    log = FileLog(tmp_path, partitions=1)
    huge = "k" * key_bytes
    await log.append(log.topics.events, huge, b"not json")
    await publish(log, message_event("c1", "hello", NOW(), "m1"))
    async with running(log, ScriptedProvider()) as worker:
        await until(lambda: "c1" in worker.states and len(worker.states["c1"].history) == 2)
    # then its letter is there, with a prefix of the key (the whole stays at its offset)
    [record] = log.read_all(log.topics.dead_letters)
    letter = DeadLetter.model_validate_json(record.value)
    assert (letter.offset, letter.reason, letter.key_truncated) == (0, "not_json", True)
    assert letter.original_value() == b"not json" and not letter.value_truncated
    assert huge.startswith(letter.key or "x") and len(letter.key or "") > 1000
    assert record.key == (huge.encode() if keyed else None)  # keyed as it was where a letter fits beside it

async def test_a_restarted_worker_rebuilds_the_same_state_and_repeats_nothing(tmp_path):
    log = FileLog(tmp_path)
    async with running(log, ScriptedProvider()) as first:
        for i in range(3):
            await publish(log, message_event(f"c{i}", f"question {i}", NOW(), f"m{i}"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log)) == 3)
        await asyncio.sleep(0.2)
        before = dict(first.states)
    outcomes_before = len(log.read_all(log.topics.outcomes))
    count_before = len(events_of(log))
    async with running(FileLog(tmp_path), ScriptedProvider()) as second:
        live = second.partition_liveness
        await until(
            lambda: bool(live()) and all(live().values()) and second.states_local
            and all(second.state_of(c) for c in before)
        )
        await asyncio.sleep(0.3)
        # in memory, or (settled, from its snapshot) in the local store
        assert {c: second.state_of(c) for c in before} == before
    assert len(events_of(log)) == count_before
    assert len(log.read_all(log.topics.outcomes)) == outcomes_before == 3


async def publish_raw(log: FileLog, event) -> None:
    await log.append(log.topics.events, event.conversation_id, encode(event))


async def test_a_backlog_that_takes_several_polls_to_replay_is_answered_in_full(tmp_path):
    """Decisions wait until a partition is replayed; then every conversation of it is due,
    not only those a later event touches."""
    log = FileLog(tmp_path, partitions=1)
    for i in range(700):  # more than one poll's worth of records
        await publish(log, message_event(f"c{i}", f"question {i}", NOW(), f"m{i}"))
    async with running(log, ScriptedProvider()):
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log)) == 700, 60)


async def test_later_turns_send_the_whole_history_with_the_workers_rendered_cache(tmp_path):
    """The worker keeps each conversation's history rendered across turns: a later turn still
    sends every earlier exchange, in order, then its own input."""
    log = FileLog(tmp_path)
    provider = ScriptedProvider()
    async with running(log, provider) as worker:
        for i in range(3):
            await publish(log, message_event("c1", f"question {i}", NOW(), f"m{i}"))
            await until(lambda i=i: sum(isinstance(e, TurnCompleted) for e in events_of(log)) == i + 1)
        assert len(worker._rendered["c1"]) == 4  # the history the third turn was sent
    sent = [[(m.role, m.content) for m in request.messages[1:]] for request in provider.requests]
    assert sent[2] == [
        ("user", "question 0"),
        ("assistant", "(scripted reply to) question 0"),
        ("user", "question 1"),
        ("assistant", "(scripted reply to) question 1"),
        ("user", "question 2"),
    ]


async def test_replay_hooks_are_told_when_replay_starts_and_when_every_partition_is_live(tmp_path):
    log = FileLog(tmp_path, partitions=2)
    for i in range(20):
        await publish(log, message_event(f"c{i}", f"question {i}", NOW(), f"m{i}"))
    hooks = ReplayCalls()
    worker = Worker(log, ScriptedProvider(), FAST, replay_hooks=hooks)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log)) == 20)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert hooks.calls == ["replaying", "replayed"]


def test_worker_gc_eases_the_collector_while_replaying_then_sets_the_live_threshold_and_freezes():
    import gc

    from turnstile.streams.worker_gc import WorkerGc

    before = gc.get_threshold()
    hooks = WorkerGc(gen0_threshold=50_000, live_gen0_threshold=12_345)
    try:
        hooks.replaying()
        hooks.replaying()  # a second assignment while replaying changes nothing
        assert gc.get_threshold() == (50_000, *before[1:])
        hooks.replayed()
        assert gc.get_threshold() == (12_345, *before[1:])
        assert gc.get_freeze_count() > 0
        hooks.replaying()  # a later assignment: replaying again, then live again
        assert gc.get_threshold() == (50_000, *before[1:])
        hooks.replayed()
        assert gc.get_threshold() == (12_345, *before[1:])
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
