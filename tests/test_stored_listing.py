"""The packed listing of a partition's conversations that wait in the local store since its
assignment: what a page walk gets from it, and what it costs a conversation."""

from __future__ import annotations

import gc
import tracemalloc

from turnstile.projections import Status
from turnstile.streams.stored_listing import StoredListing

LISTED: list[tuple[str, Status]] = [("a", "idle"), ("b", "paused"), ("ć", "idle"), ("d", "failed"), ("e", "paused")]


def walked(listing: StoredListing, status: Status | None = None, before: int | None = None,
           moved: frozenset[str] = frozenset()) -> list[tuple[int, str, Status]]:  # fmt: skip
    return list(listing.walk(status, before, moved.__contains__))


def test_given_stored_conversations_when_walked_then_the_last_listed_comes_first_with_its_sequence() -> None:
    listing = StoredListing(partition=3, first=100, conversations=LISTED)
    assert walked(listing) == [(104, "e", "paused"), (103, "d", "failed"), (102, "ć", "idle"), (101, "b", "paused"),
                               (100, "a", "idle")]  # fmt: skip


def test_given_a_cursor_when_walked_then_only_the_entries_below_it() -> None:
    listing = StoredListing(3, 100, LISTED)
    assert [s for s, _, _ in walked(listing, before=103)] == [102, 101, 100]
    assert walked(listing, before=100) == [] and walked(listing, before=1) == []
    assert len(walked(listing, before=10_000)) == len(LISTED)  # a cursor from a later listing


def test_given_a_status_when_walked_then_exactly_its_entries_indexed_or_not() -> None:
    listing = StoredListing(3, 100, LISTED)
    assert [c for _, c, _ in walked(listing, "paused")] == ["e", "b"]
    assert [c for _, c, _ in walked(listing, "paused", before=104)] == ["b"]
    assert [c for _, c, _ in walked(listing, "idle")] == ["ć", "a"]
    assert [c for _, c, _ in walked(listing, "failed")] == ["d"]
    assert walked(listing, "active") == []


def test_given_conversations_listed_again_since_when_walked_then_their_entries_are_skipped() -> None:
    listing = StoredListing(3, 100, LISTED)
    assert [c for _, c, _ in walked(listing, moved=frozenset({"a", "d"}))] == ["e", "ć", "b"]
    assert [c for _, c, _ in walked(listing, "failed", moved=frozenset({"d"}))] == []


def test_an_empty_listing_walks_nothing() -> None:
    assert walked(StoredListing(0, 1, [])) == [] and walked(StoredListing(0, 1, []), "paused") == []


def test_a_stored_conversation_costs_its_ids_bytes_and_five_more() -> None:
    """The dict entry, sequence int and str of a listed conversation took ≈ 150 B of resident
    memory; a million of them were a third of the worker's."""
    conversations: list[tuple[str, Status]] = [(f"conv-{i:06d}", "idle") for i in range(100_000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        listing = StoredListing(0, 1, conversations)
        gc.collect()
        per_conversation = (tracemalloc.get_traced_memory()[0] - before) / len(conversations)
    finally:
        tracemalloc.stop()
    assert len(listing) == len(conversations)
    assert per_conversation < len("conv-000000") + 5 + 4, per_conversation  # (+ the arrays' spare room)
