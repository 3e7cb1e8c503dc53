"""A turn whose owner closed its attempt (`AttemptFailed`) and stopped before its next event,
taken over by the next owner of the partition: it carries out what the first owner decided.

Staged exactly on the embedded log with the loopback provider server (requests counted
there): the test holds the first owner's model request in flight, starts a revoke (the
runner finishes that step and rests at the next boundary, right after its AttemptFailed),
then hands the partition to another member, so the first owner stops before writing the
outcome or the retry. A second worker then takes the turn over:

* failed for good (a provider error after a side effect had run): exactly one TurnFailed,
  with the attempt's reason, and zero model requests -- the turn is not run on (rule 9);
* failed retryably (no side effect): attempt 2, fresh from the inputs, after the backoff.
"""

# ruff: noqa: F811  (the loop tests' fixtures are imported by name, then requested as parameters)
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from loop_harness import World, config, say, settings
from provider_server import Gated, ProviderServer, Raw, Reply
from test_audit_turn_loop import openai, server  # noqa: F401  (fixtures)
from worker_harness import events_of, running, until

from turnstile.events import AttemptFailed, AttemptStarted, ModelResponded, TurnCompleted, TurnFailed
from turnstile.projections.audit import audit, render
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Topics
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.worker import WorkerConfig

TRANSFER = ("call_1", "transfer", '{"to": "bob", "amount": 5}')
SEARCH = ("call_1", "search", '{"q": "fees"}')
# Holds the first owner's failing request in flight until its revoke has begun.
gate = threading.Event()


def worker_config(world: World) -> WorkerConfig:
    # A backoff long enough that the first owner is still in it when it stops.
    return config(settings(world, backoff_base_ms=300, backoff_max_ms=300))


async def first_owner_stops_after_its_attempt_failed(
    tmp_path: Path, server: ProviderServer, provider: HttpProvider, world: World, failing_request: int
) -> None:
    """Runs the first owner until request number `failing_request` (answered 500) is in
    flight, revokes, lets the request fail, and gives the partition away."""
    log = FileLog(tmp_path, partitions=1)
    async with running(log, provider, worker_config(world)) as worker:
        await say(log, "pay bob 5", "m1")
        await until(lambda: len(server.requests) == failing_request, 20)
        revoking = asyncio.create_task(worker.on_revoked({0}))
        await asyncio.sleep(0)  # the revoke has begun: it holds the turn at its next boundary
        gate.set()
        await asyncio.wait_for(revoking, 20)
        await worker.on_assigned({})  # the group gave the partition to another member
        assert worker.state_of("c1") is None
    # The first owner stopped right after its AttemptFailed: no outcome, no next attempt.
    assert events_of(log, "c1")[-1].type == "AttemptFailed"


@pytest.fixture(autouse=True)
def _closed_gate() -> Iterator[None]:
    gate.clear()
    yield
    gate.set()  # never leave a server thread waiting


async def test_a_turn_whose_owner_failed_it_for_good_is_failed_by_the_next_owner_with_no_model_call(
    tmp_path: Path, server: ProviderServer, openai: HttpProvider
) -> None:
    world = World()
    server.push(Reply(tool_calls=[TRANSFER]), Gated(gate, Raw(500, {"error": {"message": "boom"}})))
    await first_owner_stops_after_its_attempt_failed(tmp_path, server, openai, world, failing_request=2)
    log = FileLog(tmp_path, partitions=1)
    [closing] = [e for e in events_of(log, "c1") if isinstance(e, AttemptFailed)]
    assert not closing.retryable and "500" in closing.reason  # the transfer had run
    asked = len(server.requests)

    async with running(log, openai, worker_config(world)):
        await until(lambda: any(isinstance(e, TurnFailed) for e in events_of(log, "c1")), 20)
    events = events_of(log, "c1")
    assert events[-1].type == "TurnFailed"
    [failed] = [e for e in events if isinstance(e, TurnFailed)]
    assert failed.run_id == closing.run_id and closing.reason in failed.error
    assert [o.status for o in failed.operations] == ["succeeded"]
    assert len(server.requests) == asked == 2  # the next owner asked the model nothing
    assert len(world.transfers) == 1  # and ran no tool
    assert sum(isinstance(e, AttemptStarted) for e in events) == 1
    report = audit(log.read_all(Topics().events), strict=True)
    assert report.ok, render(report)


async def test_a_turn_whose_owner_stopped_backing_off_is_retried_fresh_by_the_next_owner(
    tmp_path: Path, server: ProviderServer, openai: HttpProvider
) -> None:
    world = World()
    server.push(Reply(tool_calls=[SEARCH]), Gated(gate, Raw(500, {"error": {"message": "boom"}})))
    server.push(Reply(text="Fees are 1%."))
    await first_owner_stops_after_its_attempt_failed(tmp_path, server, openai, world, failing_request=2)
    log = FileLog(tmp_path, partitions=1)
    [closing] = [e for e in events_of(log, "c1") if isinstance(e, AttemptFailed)]
    assert closing.retryable

    async with running(log, openai, worker_config(world)):
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")), 20)
    events = events_of(log, "c1")
    starts = [e for e in events if isinstance(e, AttemptStarted)]
    assert [(s.attempt, s.resumes_run_id) for s in starts] == [(1, None), (2, None)]  # fresh, not resumed
    assert starts[1].occurred_at >= closing.occurred_at + 300  # after the backoff, by event time
    [completed] = [e for e in events if isinstance(e, TurnCompleted)]
    assert completed.reply == "Fees are 1%." and completed.run_id == starts[1].run_id
    # Attempt 2 started from the inputs: its one request held no tool exchange of attempt 1.
    assert [m.iteration for m in events if isinstance(m, ModelResponded)] == [1, 1]
    retry_messages = server.requests[-1].body["messages"]
    assert all(m["role"] != "tool" for m in retry_messages) and len(server.requests) == 3
    assert not any(isinstance(e, AttemptFailed) for e in events if e.occurred_at > closing.occurred_at)
    report = audit(log.read_all(Topics().events), strict=True)
    assert report.ok, render(report)
