"""GETs served from the worker's folded state: no log read for what it owns, a listing with
each conversation's state, 503 while a partition replays, and a bounded read (refused past
its bound) for a conversation it does not hold."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

from builders import claim, completed, message, started
from worker_harness import FAST, client_of, every_row, serving, until

from turnstile.events import Event, TurnInterrupted, encode
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections import ConversationState, Status, apply_event, conversation_status, new_state
from turnstile.projections.snapshot_head import head_of
from turnstile.projections.state import ActiveTurn, PendingInput, TurnRecord
from turnstile.streams.eviction import EvictionPolicy
from turnstile.streams.file_log import FileLog
from turnstile.streams.http_api import HttpServer, build_app
from turnstile.streams.http_reads import Tail
from turnstile.streams.log import PartitionStart, Record
from turnstile.streams.read_model import Folded, NotOwned, Replaying, WorkerReadModel
from turnstile.streams.service import conversation_reader
from turnstile.streams.state_store import Stored
from turnstile.streams.views import ConversationView
from turnstile.streams.worker import Worker, WorkerConfig


class NoLogRead:
    """`ConversationReads` that fail the test when used: the worker's state must answer."""

    async def whole(self, conversation: str) -> list[Record]:
        raise AssertionError(f"the log was read for {conversation}")

    async def tail(self, conversation: str) -> Tail:
        raise AssertionError(f"the log was read for {conversation}")


no_log_read = NoLogRead()


def test_given_folded_states_when_listed_then_each_has_the_status_an_operator_reads() -> None:
    state = new_state("c")
    assert conversation_status(state) == "idle"
    state.pending["m1"] = PendingInput("m1", "message", "hi", 1)
    assert conversation_status(state) == "debouncing"
    state.active = ActiveTurn("t1", (), 0, 1, "r1", 1)
    assert conversation_status(state) == "active"
    state.active, state.pending = None, {}
    for outcome, status in (("paused", "paused"), ("failed", "failed"), ("exhausted", "failed"), ("completed", "idle")):
        state.turns = {"t1": TurnRecord("t1", ("m1",), outcome, 1)}  # type: ignore[arg-type]
        assert conversation_status(state) == status


async def test_gets_of_owned_conversations_never_read_the_log_and_the_list_pages_by_recency(tmp_path: Path) -> None:
    log = FileLog(tmp_path)
    for i in range(5):
        await log.append(log.topics.events, f"c{i}", encode(message(f"m{i}", 1_000 + i, conv=f"c{i}")))
    worker = Worker(log, ScriptedProvider(), FAST)
    model = WorkerReadModel(worker)
    server = HttpServer(build_app(log, no_log_read, worker=worker, read_model=model), "127.0.0.1", 0)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        async with client_of(server) as client:
            await until(lambda: all((s := worker.state_of(f"c{i}")) is not None and s.turns for i in range(5)))
            state = (await client.get("/conversations/c3")).json()
            assert [h["content"] for h in state["history"]] == ["text of m3", "(scripted reply to) text of m3"]
            [turn] = state["turns"]
            timeline = (await client.get(f"/conversations/c3/turns/{turn['turn_id']}")).json()
            assert [e["type"] for e in timeline["timeline"]][-1] == "TurnCompleted"
            # its first 8 characters name it too, as the pages and export-turn show it (7 do not)
            short = (await client.get(f"/conversations/c3/turns/{turn['turn_id'][:8]}")).json()
            assert short["turn_id"] == turn["turn_id"] and short["timeline"] == timeline["timeline"]
            assert (await client.get(f"/conversations/c3/turns/{turn['turn_id'][:7]}")).status_code == 404
            assert (await client.get("/conversations/nobody")).status_code == 404  # owned partition, no event

            first = (await client.get("/conversations", params={"limit": 2})).json()
            assert len(first["conversations"]) == 2 and first["next_cursor"] is not None
            rest = (await client.get("/conversations", params={"before": first["next_cursor"]})).json()
            listed = [r["conversation_id"] for r in first["conversations"] + rest["conversations"]]
            assert sorted(listed) == [f"c{i}" for i in range(5)] and rest["next_cursor"] is None
            row = first["conversations"][0]
            assert row["status"] == "idle" and row["turns"] == 1 and row["last_event_at"] > 1_000
            assert (await client.get("/conversations", params={"status": "paused"})).json()["conversations"] == []
            only = (await client.get("/conversations", params={"q": "c4", "status": "idle"})).json()
            assert [r["conversation_id"] for r in only["conversations"]] == ["c4"]
            for bad in (
                {"status": "asleep"}, {"limit": "0"}, {"limit": "501"}, {"before": "x"},
                {"before": str(2**64)}, {"before": "9" * 400}, {"before": "²"}, {"limit": "²"}, {"before": "--1"},
                {"before": f"-{2**64}"},
            ):  # fmt: skip
                response = await client.get("/conversations", params=bad)
                assert response.status_code == 400 and "error" in response.json(), bad
            # A place at the bottom of the local store's listing is negative: so is its cursor.
            below = await client.get("/conversations", params={"before": "-5"})
            assert below.status_code == 200 and below.json()["conversations"] == []
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)


async def test_a_partition_still_replaying_is_a_503_with_retry_after(tmp_path: Path) -> None:
    log = FileLog(tmp_path)
    worker = Worker(log, ScriptedProvider(), FAST)
    model = WorkerReadModel(worker)
    # Assigned, and nothing of it folded yet: the state is not the log's present.
    await worker.on_assigned({p: PartitionStart(end_offset=10, committed=0) for p in range(log.partitions)})
    async with client_of(HttpServer(build_app(log, no_log_read, worker=worker, read_model=model), "127.0.0.1", 0)) as c:
        response = await c.get("/conversations/c1")
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert "still replaying" in response.json()["error"]


async def test_a_stopped_port_no_longer_watches_the_workers_fold(tmp_path: Path) -> None:
    """A worker outlives ports built on it (a restarted HTTP server, tests): each port's
    wait for the fold leaves the worker's observers when the port stops."""
    log = FileLog(tmp_path)
    worker = Worker(log, ScriptedProvider(), FAST)
    before = list(worker.fold_observers)
    for _ in range(3):
        async with client_of(HttpServer(build_app(log, no_log_read, worker=worker), "127.0.0.1", 0)) as c:
            assert (await c.get("/healthz")).status_code == 200
            assert len(worker.fold_observers) == len(before) + 1
    assert worker.fold_observers == before


async def test_a_conversation_not_held_is_read_boundedly_and_refused_past_the_bound(tmp_path: Path) -> None:
    log = FileLog(tmp_path)
    c = claim(["m1"], 20, 0, conv="c1")
    for event in (message("m1", 10, conv="c1"), c, completed(c, 30)):
        await log.append(log.topics.events, "c1", encode(event))
    for bound, status in ((3, 200), (2, 503)):
        app = build_app(log, conversation_reader(log, max_records=bound))  # no worker: nothing is held
        async with client_of(HttpServer(app, "127.0.0.1", 0)) as client:
            response = await client.get("/conversations/c1")
            assert response.status_code == status, response.text
            if status == 503:
                assert "exceed the bounded read (2)" in response.json()["error"]
            else:
                assert [t["outcome"] for t in response.json()["turns"]] == ["completed"]
            assert (await client.get("/conversations")).status_code == 404  # listing needs a worker


async def test_old_turns_timelines_leave_memory_and_are_read_from_the_log_on_demand(tmp_path: Path) -> None:
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    async with serving(worker) as (svc, client):
        assert svc.read_model is not None
        svc.read_model.turn_details_kept = 2
        for i in range(3):
            await client.post("/conversations/c1/messages", json={"message_id": f"m{i}", "content": f"q{i}"})

            def answered(i: int = i) -> bool:
                state = worker.state_of("c1")
                return state is not None and len(state.turns) == i + 1 and state.active is None

            await until(answered)
        turns = (await client.get("/conversations/c1")).json()["turns"]
        held = svc.read_model.lookup("c1")
        assert not isinstance(held, (NotOwned, Replaying)) and held is not None
        assert [held.turns[t["turn_id"]].entries_dropped for t in turns] == [True, False, False]
        for turn in turns:  # the first from a read of the partition, the others from memory
            timeline = (await client.get(f"/conversations/c1/turns/{turn['turn_id']}")).json()
            assert timeline["timeline"][0]["type"] == "TurnClaimed"
            assert timeline["timeline"][-1]["type"] == "TurnCompleted"


async def test_a_follower_is_told_each_folded_event_and_a_slow_one_to_re_read(tmp_path: Path) -> None:
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    model = WorkerReadModel(worker)
    queue = model.follow("c1")
    state = new_state("c1")
    record = Record(0, 7, b"c1", b"")
    event = message("m1", 1, conv="c1")
    model.folded(record, event, state, None)
    assert queue.get_nowait() == Folded(0, 7, "MessageReceived", None, "idle")
    for _ in range(300):
        model.folded(record, event, state, None)
    # It overflowed at the 257th: what it held is dropped for one "re-read", then it goes on.
    assert queue.get_nowait() is None and queue.qsize() == 300 - 257
    model.unfollow("c1", queue)


async def test_a_client_can_page_a_hundred_thousand_conversations(tmp_path: Path) -> None:
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    model = WorkerReadModel(worker)
    for i in range(100_000):
        conversation = f"conv-{i:06d}"
        model.folded(Record(0, i, conversation.encode(), b""), message("m", i, conv=conversation),
                     new_state(conversation), None)
    assert len(every_row(model, limit=500)) == 100_000
    assert [r.conversation_id for r in model.page(contains="099999").rows] == ["conv-099999"]




async def test_an_interrupted_turn_reads_as_interrupted_and_its_conversation_as_debouncing(tmp_path: Path) -> None:
    log = FileLog(tmp_path)
    worker = Worker(log, ScriptedProvider(), FAST)
    model = WorkerReadModel(worker)
    await worker.on_assigned({p: PartitionStart(end_offset=0, committed=0) for p in range(log.partition_count() or 0)})
    state = new_state("c1")
    c = claim(["m1"], 20, 0, conv="c1")
    interrupted = TurnInterrupted(event_id="e-int", conversation_id="c1", occurred_at=40, turn_id=c.turn_id,
                                  run_id=c.run_id, attempt=1, message_id="m2")
    events = [message("m1", 10, conv="c1"), c, started(c, 25), message("m2", 30, conv="c1"), interrupted]
    for offset, event in enumerate(events):
        rejection = apply_event(state, event)
        assert rejection is None, rejection
        model.folded(Record(0, offset, b"c1", encode(event)), event, state, None)
    assert state.active is None and list(state.pending) == ["m1", "m2"]
    held = model.lookup("c1")
    assert isinstance(held, ConversationView)
    [turn] = held.turns.values()
    assert (turn.outcome, turn.duration_ms) == ("interrupted", 20)
    assert [r.status for r in model.page().rows] == ["debouncing"]


def _with_store(tmp_path: Path) -> WorkerConfig:
    return dataclasses.replace(FAST, eviction=EvictionPolicy(state_dir=tmp_path / "state"))


def _stored(state: ConversationState, partition: int = 0, status: Status | None = None) -> Stored:
    """The row the snapshots would put in the local store for `state` (with another status)."""
    head = head_of(state, state.events_applied - 1, 0)
    return Stored(dataclasses.replace(head, status=status or head.status), partition, 0, b"snapshot")


class StoreOfNewStates(Worker):
    """A worker that owns partition 0, live, whose local store has a (new) state of every
    conversation asked of it."""

    def state_of(self, conversation_id: str) -> ConversationState | None:
        return self.states.get(conversation_id) or new_state(conversation_id)

    def partition_liveness(self) -> dict[int, bool]:
        return {0: True}


async def _relisted() -> None:
    """Lets the read model write the places of the evicted conversations (a slice a loop cycle)."""
    for _ in range(100):
        await asyncio.sleep(0)


async def test_an_evicted_conversation_leaves_the_read_model_and_is_listed_by_the_store(tmp_path: Path) -> None:
    """A worker that evicts idle conversations keeps nothing of them in memory: not its view,
    not the turns whose timelines it bounded, not its entry in the listing. The local store
    lists them, each at the place it had, so pages still show every one, most recent first."""
    import gc
    import tracemalloc

    worker = StoreOfNewStates(FileLog(tmp_path), ScriptedProvider(), _with_store(tmp_path))
    store = worker.stored_listing
    assert store is not None
    model = WorkerReadModel(worker)
    conversations = 3_000

    def one_turn_then_evicted(conversation: str) -> None:
        state = new_state(conversation)
        m = message("m1", 10, conv=conversation)
        c = claim(["m1"], 20, 0, conv=conversation)
        for offset, event in enumerate((m, c, started(c, 25), completed(c, 30))):
            assert apply_event(state, event) is None
            model.folded(Record(0, offset, conversation.encode(), b""), event, state, None)
        store.put([_stored(state)])  # what eviction waits for: its latest state in the store
        model.evicted(conversation, conversation_status(state))

    one_turn_then_evicted("warm-up")  # the model's first-use allocations are not per conversation
    await _relisted()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(conversations):
            one_turn_then_evicted(f"conv-{i:06d}")
            if i % 100 == 99:  # the worker evicts a few at each of its steps
                await _relisted()
        gc.collect()
        per_conversation = (tracemalloc.get_traced_memory()[0] - before) / conversations
    finally:
        tracemalloc.stop()
    # An entry of the in-memory listing was ≈ 150 B; a turn's details ≈ 700 B before that.
    assert per_conversation < 10, per_conversation

    seen = [(row.conversation_id, row.status) for row in every_row(model, limit=500)]
    assert seen == [(f"conv-{i:06d}", "idle") for i in reversed(range(conversations))] + [("warm-up", "idle")]
    one_turn_then_evicted("conv-000000")  # back, then out again: listed once, first
    await _relisted()
    assert [row.conversation_id for row in model.page(limit=2).rows] == ["conv-000000", "conv-002999"]


class Churn:
    """A read model over a worker with a local store, fed by hand: conversations take a turn
    (folded), leave memory (their row put, then evicted) and come back (restored)."""

    def __init__(self, tmp_path: Path) -> None:
        self.worker = StoreOfNewStates(FileLog(tmp_path, partitions=1), ScriptedProvider(), _with_store(tmp_path))
        store = self.worker.stored_listing
        assert store is not None
        self.store = store
        self.model = WorkerReadModel(self.worker)
        self.states: dict[str, ConversationState] = {}
        self._offsets = iter(range(10**6))

    def turn(self, conversation: str) -> None:
        state = self.states.setdefault(conversation, new_state(conversation))
        n = len(state.turns) + 1
        c = claim([f"{conversation}-m{n}"], 20, len(state.history), conv=conversation)
        for event in (message(f"{conversation}-m{n}", 10, conv=conversation), c, completed(c, 30)):
            assert apply_event(state, event) is None
            self.model.folded(Record(0, next(self._offsets), conversation.encode(), b""), event, state, None)

    def evict(self, conversation: str) -> None:
        state = self.states[conversation]
        self.store.put([_stored(state)])
        self.model.evicted(conversation, conversation_status(state))

    def back(self, conversation: str) -> None:
        self.model.restored(self.states[conversation])
        self.turn(conversation)

    def walk(self, limit: int) -> list[str]:
        return [row.conversation_id for row in every_row(self.model, limit)]


async def test_given_every_conversation_in_memory_with_its_snapshot_stored_when_a_page_is_read_then_no_stale_row_is(
    tmp_path: Path,
) -> None:
    # Given 200 conversations in memory, each with a row in the store from its last
    # snapshot (stale: the read model lists it)
    churn = Churn(tmp_path)
    for n in range(200):
        churn.turn(f"conv-{n:03d}")
        churn.store.put([_stored(churn.states[f"conv-{n:03d}"])])
    read: list[str] = []
    listing = churn.store.listing

    def counted(*args: object, **kwargs: object) -> Iterator[tuple[int, str, Status, int, int, int]]:
        for row in listing(*args, **kwargs):  # type: ignore[arg-type]
            read.append(row[1])
            yield row

    churn.store.listing = counted  # type: ignore[method-assign]
    # When the first page of 50 is read
    page = churn.model.page(limit=50)
    # Then it is the 50 most recent, and not one of the 200 stale rows was read to find it
    assert [row.conversation_id for row in page.rows] == [f"conv-{n:03d}" for n in reversed(range(150, 200))]
    assert page.next_cursor is not None and read == []
    # (and paging on still lists every one once)
    assert churn.walk(50) == [f"conv-{n:03d}" for n in reversed(range(200))]


async def test_conversations_moving_in_and_out_of_memory_are_listed_once_in_recency_order_at_every_moment(
    tmp_path: Path,
) -> None:
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: errors.append(context))
    churn = Churn(tmp_path)
    names = [f"conv-{i:03d}" for i in range(600)]
    for name in names:
        churn.turn(name)
    for name in names[:500]:
        churn.evict(name)
    newest_first = names[::-1]
    assert churn.walk(limit=51) == newest_first  # before the store has their places
    await asyncio.sleep(0)
    assert churn.walk(limit=51) == newest_first  # with some of them
    churn.back("conv-010")  # back, and out again, twice, before the store heard of the first time
    churn.evict("conv-010")
    churn.back("conv-010")
    churn.evict("conv-010")
    churn.back("conv-020")  # back, and stays
    moved = ["conv-020", "conv-010"] + [n for n in newest_first if n not in ("conv-010", "conv-020")]
    assert churn.walk(limit=51) == moved
    await _relisted()
    assert churn.walk(limit=51) == moved and churn.walk(limit=1) == moved
    assert errors == []
    # Those in memory are at the bottom of the store's listing: a page does not skip them first.
    top = [found[1] for found in itertools.islice(churn.store.listing([0], None, None, ""), 499)]
    assert top == [n for n in moved if n in names[:500] and n != "conv-020"]


async def test_a_restart_on_its_store_lists_the_conversations_of_both_runs_once_each(tmp_path: Path) -> None:
    first = Churn(tmp_path)
    for i in range(300):
        first.turn(f"old-{i:03d}")
        first.evict(f"old-{i:03d}")
    await _relisted()
    first.store.close()
    second = Churn(tmp_path)  # the same store, whose rows the read model has not been told of yet
    for i in range(300):
        second.turn(f"new-{i:03d}")
        second.evict(f"new-{i:03d}")
    await _relisted()
    second.model.stored(0, [])
    listed = second.walk(limit=51)
    assert listed == [f"new-{i:03d}" for i in reversed(range(300))] + [f"old-{i:03d}" for i in reversed(range(300))]


async def test_a_page_filtered_by_status_lists_exactly_that_status_most_recent_first(tmp_path: Path) -> None:
    log = FileLog(tmp_path, partitions=3)  # c1 and c3 on partition 2, c2 on 1
    model = WorkerReadModel(Worker(log, ScriptedProvider(), _with_store(tmp_path)))
    states = {c: new_state(c) for c in ("c1", "c2", "c3")}
    offsets = iter(range(100))

    def fold(conversation: str, *events: Event) -> None:
        for event in events:
            assert apply_event(states[conversation], event) is None
            model.folded(Record(0, next(offsets), conversation.encode(), b""), event, states[conversation], None)

    def listed(status: Status | None = None) -> list[tuple[str, str]]:
        return [(row.conversation_id, row.status) for row in model.page(status=status).rows]

    turns = {c: claim([f"{c}-m1"], 20, 0, conv=c) for c in states}
    for c in ("c1", "c2", "c3"):
        fold(c, message(f"{c}-m1", 10, conv=c))
    fold("c1", turns["c1"], completed(turns["c1"], 30))
    fold("c3", turns["c3"], completed(turns["c3"], 30))
    assert listed() == [("c3", "idle"), ("c1", "idle"), ("c2", "debouncing")]
    assert listed("idle") == [("c3", "idle"), ("c1", "idle")]
    assert listed("debouncing") == [("c2", "debouncing")]
    fold("c2", turns["c2"])
    assert listed("debouncing") == [] and listed("active") == [("c2", "active")]
    fold("c2", completed(turns["c2"], 40))
    assert listed("idle") == [("c2", "idle"), ("c3", "idle"), ("c1", "idle")] and listed("active") == []
    model.evicted("c1", "idle")
    model.forgotten(2, {"c3"})  # partition 2 handed over: c3, in memory, and c1, evicted, go
    await _relisted()
    assert listed("idle") == [("c2", "idle")]


async def test_a_partition_handed_over_and_assigned_back_lists_each_conversation_once_as_it_is_now(
    tmp_path: Path,
) -> None:
    worker = StoreOfNewStates(FileLog(tmp_path, partitions=1), ScriptedProvider(), _with_store(tmp_path))
    store = worker.stored_listing
    assert store is not None
    model = WorkerReadModel(worker)
    offsets = iter(range(100))

    def one_turn(conversation: str) -> ConversationState:
        state = new_state(conversation)
        c = claim([f"{conversation}-m1"], 20, 0, conv=conversation)
        for event in (message(f"{conversation}-m1", 10, conv=conversation), c, completed(c, 30)):
            assert apply_event(state, event) is None
            model.folded(Record(0, next(offsets), conversation.encode(), b""), event, state, None)
        return state

    store.put([_stored(one_turn("c1"))])
    model.evicted("c1", "idle")
    await _relisted()
    model.forgotten(0, set())  # handed over, with c1 out of memory; its rows leave the store
    store.drop_partitions([0])
    assert model.page().rows == []
    # Assigned back: c1 was paused by the other owner meanwhile, c2 is new; both wait in the store.
    store.put([_stored(new_state("c1"), status="paused"), _stored(new_state("c2"))])
    model.stored(0, [("c1", "paused"), ("c2", "idle")])
    one_turn("c3")  # one in memory, listed after them

    def walk(status: Status | None = None, contains: str = "") -> list[tuple[str, str]]:
        return [(row.conversation_id, row.status) for row in every_row(model, 1, status, contains)]

    assert walk() == [("c3", "idle"), ("c2", "idle"), ("c1", "paused")]
    assert walk("idle") == [("c3", "idle"), ("c2", "idle")] and walk("paused") == [("c1", "paused")]
    assert walk(contains="2") == [("c2", "idle")] and walk("paused", contains="2") == []
