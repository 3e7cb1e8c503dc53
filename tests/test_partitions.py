"""The worker's table of owned partitions (`streams/partitions.py`) and a replay's pace
(`streams/replay_pace.py`), each on its own: no log, no worker."""

from __future__ import annotations

from turnstile.streams.checkpoint import Position
from turnstile.streams.partitions import Partitions, ReplayProgress
from turnstile.streams.replay_pace import ReplayPace


def table() -> Partitions:
    """Partition 0 replayed to its end (4 of 4), partition 1 half way (3 of 6)."""
    parts = Partitions()
    parts.add(0, Position(end_offset=4, committed=0, position=4))
    parts.add(1, Position(end_offset=6, committed=0, position=3))
    return parts


def test_a_conversation_placed_on_a_partition_is_found_there_until_it_leaves_memory() -> None:
    parts = table()
    parts.place("c1", 1)
    assert parts.home("c1") == 1 and parts.of("c1") is parts[1]
    assert parts[1].conversations == {"c1"}
    parts.remove("c1")
    assert parts.home("c1") is None and parts.of("c1") is None and parts[1].conversations == set()


def test_a_dropped_partition_takes_its_conversations_with_it() -> None:
    parts = table()
    parts.place("c1", 0)
    parts.place("c2", 1)
    dropped = parts.drop(0)
    assert dropped.conversations == {"c1"}
    assert 0 not in parts and list(parts) == [1]
    assert parts.home("c1") is None and parts.home("c2") == 1


def test_a_suspended_partition_is_neither_decided_for_nor_committed() -> None:
    parts = table()
    parts[0].suspended = True
    assert parts.suspended() == [0] and parts.committable() == [1]
    assert not parts[0].deciding  # live but being revoked
    assert not parts[1].deciding  # ours but still replaying
    parts[1].at.position = 6
    assert parts[1].deciding


def test_liveness_lag_and_replay_progress_are_read_from_the_positions() -> None:
    parts = table()
    assert parts.liveness() == {0: True, 1: False} and parts.replaying()
    ends = {0: 10, 1: 6}
    assert parts.lag(ends.get) == {0: 6, 1: 3}
    assert parts.lag({1: 6}.get) == {1: 3}  # an end the log does not know yet: no lag said
    assert parts.progress() == ReplayProgress(partitions=2, replaying=1, events_done=7, events_total=10)


class Hooks:
    def __init__(self) -> None:
        self.said: list[str] = []

    def replaying(self) -> None:
        self.said.append("replaying")

    def replay_slice(self) -> None:
        self.said.append("slice")

    def replayed(self) -> None:
        self.said.append("replayed")


def test_the_replay_hooks_hear_of_each_change_once() -> None:
    hooks = Hooks()
    pace = ReplayPace(hooks)
    for replaying in (False, True, True, False, False):
        pace.note(replaying)
    assert hooks.said == ["replaying", "replayed"]
