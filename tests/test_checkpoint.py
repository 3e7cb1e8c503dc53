"""The checkpoint on its own, over the embedded log: positions, one-time effects and the
commit protocol (`streams/checkpoint.py`, steps 1-5)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from turnstile.events import DeadLetter
from turnstile.streams.checkpoint import Checkpoint
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import PartitionStart, Record, RecordRefused


class HeldLog(FileLog):
    """Appends to the outcomes topic wait until released, or are refused for good."""

    refuse = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = asyncio.Event()

    async def append(
        self, topic: str, key: str | None, value: bytes, partition: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, int]:
        if topic == self.topics.outcomes:
            if self.refuse:
                raise RecordRefused("too large for the topic")
            await self.release.wait()
        return await super().append(topic, key, value, partition, headers)


def record(offset: int) -> Record:
    return Record(0, offset, b"c1", b"{}")


def checkpoint(log: FileLog, skipped: list[str] | None = None) -> Checkpoint:
    return Checkpoint(log, commit_interval_s=0.0, on_skipped=(skipped if skipped is not None else []).append)


async def test_a_record_is_new_to_the_group_from_the_committed_offset_on(tmp_path):
    cp = checkpoint(FileLog(tmp_path))
    at = cp.assign(0, PartitionStart(end_offset=4, committed=2))
    assert [cp.advance(record(i)) for i in range(4)] == [False, False, True, True]
    assert at.position == 4 and at.live


def with_an_effect_in_flight(log: HeldLog, at: int) -> Checkpoint:
    """Records 0-2 of partition 0 folded; the one at `at` has its outcome record held."""
    cp = checkpoint(log)
    cp.assign(0, PartitionStart(end_offset=3, committed=0))
    for i in range(3):
        cp.advance(record(i))
    cp.effect(log.topics.outcomes, record(at), b"outcome")
    return cp


async def test_no_offset_is_committed_past_an_effect_not_yet_written(tmp_path):
    log = HeldLog(tmp_path)
    cp = with_an_effect_in_flight(log, at=1)
    await cp.commit([0])
    assert log.committed_offsets() == {0: 1}  # held below the record whose effect is in flight
    log.release.set()
    await cp.close(True, lambda: [0])
    assert log.committed_offsets() == {0: 3}
    assert [r.value for r in log.read_all(log.topics.outcomes)] == [b"outcome"]


async def test_a_partition_still_replaying_is_not_committed(tmp_path):
    log = FileLog(tmp_path)
    cp = checkpoint(log)
    cp.assign(0, PartitionStart(end_offset=5, committed=0))
    cp.advance(record(0))
    await cp.commit([0])
    assert log.committed_offsets() == {}


async def test_a_stop_after_an_error_commits_nothing_and_drops_the_writes(tmp_path):
    log = HeldLog(tmp_path)
    cp = checkpoint(log)
    cp.assign(0, PartitionStart(end_offset=1, committed=0))
    cp.advance(record(0))
    cp.effect(log.topics.outcomes, record(0), b"outcome")
    await cp.close(False, lambda: [0])
    log.release.set()
    await asyncio.sleep(0)
    assert log.committed_offsets() == {} and log.read_all(log.topics.outcomes) == []


async def test_an_effect_the_log_refuses_for_good_is_skipped_with_a_marker(tmp_path):
    log, skipped = HeldLog(tmp_path), []
    log.refuse = True
    cp = checkpoint(log, skipped)
    cp.assign(0, PartitionStart(end_offset=1, committed=0))
    cp.advance(record(0))
    cp.effect(log.topics.outcomes, record(0), b"x" * 10)
    await cp.close(True, lambda: [0])
    assert skipped == [log.topics.outcomes] and log.committed_offsets() == {0: 1}
    [marker] = [DeadLetter.model_validate_json(r.value) for r in log.read_all(log.topics.dead_letters)]
    assert marker.reason == "effect_skipped" and (marker.partition, marker.offset) == (0, 0)


async def test_a_kept_partition_keeps_its_position_and_takes_the_new_end(tmp_path):
    cp = checkpoint(FileLog(tmp_path))
    cp.assign(0, PartitionStart(end_offset=2, committed=0))
    cp.advance(record(0))
    cp.advance(record(1))
    at = cp.assign(0, PartitionStart(end_offset=5, committed=2), keep=True)
    assert (at.position, at.end_offset, at.committed, at.live) == (2, 5, 2, False)
    assert cp.assign(0, PartitionStart(end_offset=5, committed=2)).position == 0  # given anew: replayed


async def test_the_first_commit_is_due_at_once_and_the_next_one_an_interval_later(tmp_path):
    """Whatever the loop's clock reads (time since boot: on a machine up for less than the
    interval, the first commit used to wait for it)."""
    log = FileLog(tmp_path)
    cp = Checkpoint(log, commit_interval_s=10**9, on_skipped=[].append)
    cp.assign(0, PartitionStart(end_offset=2, committed=0))
    for i in range(2):
        cp.advance(record(i))
    assert await cp.commit_due([0]) == {0: 2}
    cp.advance(record(2))
    assert await cp.commit_due([0]) is None
    assert log.committed_offsets() == {0: 2}


async def test_the_stop_asks_which_partitions_to_commit_only_once_its_effects_have_landed(tmp_path):
    # A revoke may land while the stop waits for its effects: a partition revoked meanwhile
    # must not be committed, so the stop asks which partitions are still its own after the wait.
    log = HeldLog(tmp_path)
    cp = with_an_effect_in_flight(log, at=2)
    asked_once_landed: list[bool] = []

    def still_ours() -> list[int]:
        asked_once_landed.append(bool(log.read_all(log.topics.outcomes)))
        return []  # the group revoked partition 0 meanwhile

    closing = asyncio.create_task(cp.close(True, still_ours))
    log.release.set()
    assert await closing == {}
    assert asked_once_landed == [True] and log.committed_offsets() == {}
