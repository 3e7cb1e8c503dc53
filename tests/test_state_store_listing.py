"""The local store's listing of the conversations out of memory: the order a page walk gets
from it, and the places the store and the read model give its rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from turnstile.projections import Status
from turnstile.projections.snapshot_head import Head
from turnstile.streams.state_store import LISTED_BY_THE_STORE, StateStore, Stored


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    opened = StateStore(tmp_path, "events")
    yield opened
    opened.close()


def row(conversation: str, status: Status = "idle", partition: int = 0) -> Stored:
    return Stored(Head(conversation, 3, status, 11, 4, 1, 0), partition, source=7, value=b"state")


def walked(store: StateStore, status: Status | None = None, before: int | None = None, contains: str = "") -> list[str]:
    return [found[1] for found in store.listing([0], status, before, contains)]


def test_given_rows_put_in_turn_when_walked_then_the_last_put_comes_first_below_the_read_models_places(
    store: StateStore,
) -> None:
    store.put([row("a"), row("b")])
    store.put([row("c", "paused")])
    listed = list(store.listing([0], None, None, ""))
    assert [found[1] for found in listed] == ["c", "b", "a"]
    assert [found[2] for found in listed] == ["paused", "idle", "idle"]
    assert all(0 < found[0] < LISTED_BY_THE_STORE for found in listed)
    # with what a listing shows of each, from its head
    assert {found[3:] for found in listed} == {(4, 1, 0)}


def test_given_a_row_put_again_when_walked_then_it_keeps_its_place_with_its_new_status(store: StateStore) -> None:
    store.put([row("a"), row("b")])
    store.put([row("a", "failed")])  # a new snapshot of a: its place in the listing is not its recency
    assert [found[:3] for found in store.listing([0], None, None, "")] == [(2, "b", "idle"), (1, "a", "failed")]


def test_given_a_cursor_a_status_or_a_part_of_the_id_when_walked_then_exactly_the_rows_that_match(
    store: StateStore,
) -> None:
    store.put([row("alpha"), row("beta", "paused"), row("ćelo"), row("delta", "failed"), row("epsilon", "paused")])
    assert walked(store, before=4) == ["ćelo", "beta", "alpha"]
    assert walked(store, "paused") == ["epsilon", "beta"] and walked(store, "paused", before=5) == ["beta"]
    assert walked(store, "active") == []
    assert walked(store, contains="lt") == ["delta"] and walked(store, contains="ć") == ["ćelo"]
    assert walked(store, "idle", contains="a") == ["alpha"]


def test_given_evicted_conversations_relisted_when_walked_then_each_is_once_at_the_place_it_was_given(
    store: StateStore,
) -> None:
    store.put([row("a"), row("b"), row("c")])
    first = LISTED_BY_THE_STORE + 10
    store.relist([("a", first + 1), ("c", first)])
    store.relist([("gone", first + 2)])  # a row no longer in the store: nothing to list
    assert walked(store) == ["a", "c", "b"] and store.last_listed() == first + 1
    assert walked(store, before=first + 1) == ["c", "b"]


def test_a_walk_over_more_rows_than_one_read_of_the_index_lists_every_row_once(store: StateStore) -> None:
    conversations = [f"conv-{i:05d}" for i in range(1_000)]
    store.put(row(c, "paused" if i % 3 == 0 else "idle") for i, c in enumerate(conversations))
    assert walked(store) == conversations[::-1]
    assert walked(store, "paused") == [c for i, c in enumerate(conversations) if i % 3 == 0][::-1]
    assert walked(store, before=LISTED_BY_THE_STORE) == conversations[::-1]


def test_only_the_rows_of_the_partitions_asked_for_are_listed(store: StateStore) -> None:
    store.put([row("a", partition=0), row("b", partition=1), row("c", partition=2)])
    assert [found[1] for found in store.listing([0, 2], None, None, "")] == ["c", "a"]
    assert [found[1] for found in store.listing([1], "idle", None, "b")] == ["b"]
    assert list(store.listing([], None, None, "")) == []


def test_an_empty_store_lists_nothing_and_has_no_place_given(store: StateStore) -> None:
    assert walked(store) == [] and walked(store, "paused") == [] and store.last_listed() == 0


def test_given_a_partitions_rows_when_read_a_slice_at_a_time_then_each_comes_once_in_conversation_order(
    store: StateStore,
) -> None:
    # Given 30 rows of partition 0 put one at a time in reverse order, some with unusual ids
    # (one unsettled: it comes with its bytes), and 5 of partition 1
    names = sorted([f"conv-{n:02d}" for n in range(26)] + ["a\x00", "é", "😀", "conv-1"])
    for name in reversed(names):
        store.put([row(name, "paused" if name == "conv-13" else "idle")])
    store.put([row(f"other-{n}", partition=1) for n in range(5)])
    # When partition 0 is read 10 rows at a time, each slice starting past the last one read
    slices, after = [], None
    while taken := store.rows(0, without_value=frozenset({"idle"}), after=after, limit=10):
        slices.append(taken)
        after = taken[-1].conversation
    # Then every row of it came once, in order (the last slice full, the next one empty),
    # none of partition 1
    assert [len(s) for s in slices] == [10, 10, 10]
    assert [r.conversation for s in slices for r in s] == names
    assert [r.conversation for s in slices for r in s if r.value is not None] == ["conv-13"]
