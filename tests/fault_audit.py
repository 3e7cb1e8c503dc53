"""The verdict of a fault scenario, from the log alone.

`audit_log` reads the whole events topic with an independent consumer (no group) and
folds it the way every reader does: decode, check the key, `apply_event` per
conversation. What it accepted is the truth; what it refused is counted. `Counts` is the
line of the reliability table (docs/reliability.md); `check_invariants` is what must hold
after any fault:

* every accepted input was claimed by exactly one accepted claim, and every accepted
  claim has exactly one accepted outcome (nothing lost, nothing answered twice);
* per conversation the accepted claims and outcomes alternate claim, outcome, claim, ...
  -- no conversation ever has two active turns.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from turnstile.events import (
    OUTCOME_TYPES,
    DeadLetter,
    DecodeError,
    Event,
    ToolCallStarted,
    TurnClaimed,
    decode,
)
from turnstile.projections import ConversationState, Rejection, apply_event, new_state
from turnstile.streams.kafka_reader import partition_count, read_topic
from turnstile.streams.log import Record, Topics, partition_for


@dataclass
class LogAudit:
    records: list[Record] = field(default_factory=list)
    accepted: list[tuple[Record, Event]] = field(default_factory=list)
    ignored: list[tuple[Record, Event, Rejection]] = field(default_factory=list)
    refused: list[tuple[Record, str]] = field(default_factory=list)  # what the worker dead-letters
    states: dict[str, ConversationState] = field(default_factory=dict)

    def raw(self) -> list[Event]:
        return [e for _, e in self.accepted] + [e for _, e, _ in self.ignored]

    def of_type(self, kind: type | tuple[type, ...], accepted: bool = True) -> list[Event]:
        events = [e for _, e in self.accepted] if accepted else self.raw()
        return [e for e in events if isinstance(e, kind)]

    def input_ids(self) -> set[str]:
        """Every input id the log accepted (messages, injected inputs, resume requests)."""
        return {i for state in self.states.values() for i in state.seen_inputs}


def fold_records(records: Iterable[Record], max_bytes: int = 1_000_000, partitions: int | None = None) -> LogAudit:
    """`partitions`: the topic's partition count, to refuse what lies outside its key's."""
    audit = LogAudit()
    for record in records:
        audit.records.append(record)
        event = decode(record.value, max_bytes)
        if isinstance(event, DecodeError):
            audit.refused.append((record, event.reason))
            continue
        key = record.key.decode("utf-8", "replace") if record.key is not None else None
        if key != event.conversation_id:
            audit.refused.append((record, "key_mismatch"))
            continue
        if partitions is not None and partition_for(key, partitions) != record.partition:
            audit.refused.append((record, "wrong_partition"))
            continue
        state = audit.states.setdefault(event.conversation_id, new_state(event.conversation_id))
        rejection = apply_event(state, event)
        if rejection is None:
            audit.accepted.append((record, event))
        elif rejection.conflict:
            audit.refused.append((record, "conflicting_duplicate"))
        else:
            audit.ignored.append((record, event, rejection))
    return audit


async def audit_log(bootstrap: str, topics: Topics, max_bytes: int = 1_000_000) -> LogAudit:
    records = await read_topic(bootstrap, topics.events, timeout_s=60)
    return fold_records(records, max_bytes, await partition_count(bootstrap, topics.events))


async def dead_letters(bootstrap: str, topics: Topics) -> list[DeadLetter]:
    return [DeadLetter.model_validate_json(r.value or b"") for r in await read_topic(bootstrap, topics.dead_letters)]


def settled(audit: LogAudit, expected_inputs: Iterable[str]) -> bool:
    """Every expected input is on the log, claimed, and every claim has its outcome."""
    claims = audit.of_type(TurnClaimed)
    claimed = {i for c in claims for i in c.input_ids}  # type: ignore[attr-defined]
    outcomes = {o.turn_id for o in audit.of_type(OUTCOME_TYPES)}  # type: ignore[attr-defined]
    return set(expected_inputs) <= claimed and {c.turn_id for c in claims} <= outcomes  # type: ignore[attr-defined]


async def until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def until_settled(
    bootstrap: str,
    topics: Topics,
    expected_inputs: Iterable[str],
    timeout_s: float,
    alive: Callable[[], None] | None = None,
    max_bytes: int = 1_000_000,
) -> LogAudit:
    """Read and fold the topic until `settled`, or fail after `timeout_s` with what is missing.
    `alive` may raise to fail fast (e.g. a worker process that died)."""
    expected = set(expected_inputs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        audit = await audit_log(bootstrap, topics, max_bytes)
        if settled(audit, expected):
            return audit
        if alive is not None:
            alive()
        if loop.time() > deadline:
            claims = audit.of_type(TurnClaimed)
            claimed = {i for c in claims for i in c.input_ids}  # type: ignore[attr-defined]
            done = {o.turn_id for o in audit.of_type(OUTCOME_TYPES)}  # type: ignore[attr-defined]
            open_turns = [c.turn_id[:8] for c in claims if c.turn_id not in done]  # type: ignore[attr-defined]
            raise AssertionError(
                f"not settled after {timeout_s}s: {len(expected - claimed)} inputs unclaimed, open turns {open_turns}"
            )
        await asyncio.sleep(1.0)


@dataclass
class Counts:
    scenario: str
    published: int  # distinct inputs accepted on the log
    claimed: int  # distinct inputs in accepted claims
    answered: int  # distinct inputs whose turn reached an accepted outcome
    answered_twice: int  # inputs in two accepted claims, or whose turn has two accepted outcomes
    lost: int  # inputs on the log that never reached an outcome
    side_effects_replayed: int  # extra runs of a side-effecting tool call
    dlq: int  # dead letters on the DLQ topic
    turns: int = 0  # accepted claims
    outcomes: str = ""  # accepted outcomes by kind
    ignored_events: int = 0  # decoded events the fold ignored (stale runs, duplicates, refused claims)
    refused_claims: int = 0  # raw claims the fold refused (e.g. a second claim while one was active)
    ignored_by: str = ""  # the ignored events by type and reason


def counts(
    scenario: str, audit: LogAudit, dlq: int, published: Iterable[str] | None = None, tool_runs: int | None = None
) -> Counts:
    """`published`: the input ids the test sent (default: those the log accepted).
    `tool_runs`: how often side-effecting tool bodies really ran, from outside the worker;
    compared with the distinct side-effecting calls the log started."""
    inputs = set(published) if published is not None else audit.input_ids()
    claims = audit.of_type(TurnClaimed)
    claim_count = Counter(i for c in claims for i in c.input_ids)  # type: ignore[attr-defined]
    outcome_count = Counter(o.turn_id for o in audit.of_type(OUTCOME_TYPES))  # type: ignore[attr-defined]
    turn_of = {i: c.turn_id for c in claims for i in c.input_ids}  # type: ignore[attr-defined]
    answered = {i for i in inputs if outcome_count.get(turn_of.get(i, ""), 0) >= 1}
    twice = {i for i in inputs if claim_count[i] > 1 or outcome_count.get(turn_of.get(i, ""), 0) > 1}
    # Side-effecting calls started on the log: one run per call is the most there may be (a
    # resumed attempt continues the turn in a new run, and may make new calls), except that
    # an idempotent call runs again with its idempotency key.
    side_calls = [e for e in audit.raw() if isinstance(e, ToolCallStarted) and e.side_effect]
    runs_per_call: dict[tuple[str, str], set[str]] = {}
    for e in side_calls:
        if e.idempotency_key is None:
            runs_per_call.setdefault((e.turn_id, e.call_id), set()).add(e.run_id)
    replayed = sum(len(runs) - 1 for runs in runs_per_call.values())
    if tool_runs is not None:
        replayed = max(replayed, tool_runs - len({(e.turn_id, e.call_id) for e in side_calls}))
    kinds = Counter(type(o).__name__.removeprefix("Turn").lower() for o in audit.of_type(OUTCOME_TYPES))
    refused_claims = sum(isinstance(e, TurnClaimed) for _, e, _ in audit.ignored)
    ignored_by = Counter(f"{e.type}: {_reason_class(r.reason)}" for _, e, r in audit.ignored)
    return Counts(
        scenario=scenario,
        published=len(inputs),
        claimed=len(set(claim_count) & inputs),
        answered=len(answered),
        answered_twice=len(twice),
        lost=len(inputs - answered),
        side_effects_replayed=replayed,
        dlq=dlq,
        turns=len(claims),
        outcomes=" ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        ignored_events=len(audit.ignored),
        refused_claims=refused_claims,
        ignored_by="; ".join(f"{n} {what}" for what, n in sorted(ignored_by.items())),
    )


def _reason_class(reason: str) -> str:
    """A rejection reason without its ids, so that equal reasons count together."""
    for marker in (" run ", " input ", " event ", " turn ", " of tool call "):
        if marker in reason:
            return reason.split(marker)[0] + marker.rstrip() + " ..."
    return reason


def check_invariants(audit: LogAudit) -> None:
    """No conversation ever had two active turns; every accepted claim has one outcome."""
    for conversation in audit.states:
        sequence = [
            "C" if isinstance(e, TurnClaimed) else "O"
            for _, e in audit.accepted
            if e.conversation_id == conversation and isinstance(e, (TurnClaimed, *OUTCOME_TYPES))
        ]
        assert "CC" not in "".join(sequence), f"{conversation}: a claim was accepted while a turn was active"
        assert "OO" not in "".join(sequence) and not "".join(sequence).startswith("O"), conversation
    claims = audit.of_type(TurnClaimed)
    claim_count = Counter(i for c in claims for i in c.input_ids)  # type: ignore[attr-defined]
    assert all(n == 1 for n in claim_count.values()), [i for i, n in claim_count.items() if n > 1]
    outcome_count = Counter(o.turn_id for o in audit.of_type(OUTCOME_TYPES))  # type: ignore[attr-defined]
    assert all(n == 1 for n in outcome_count.values())
    assert {c.turn_id for c in claims} == set(outcome_count)  # type: ignore[attr-defined]


def record(result: Counts) -> Counts:
    """Print the line (visible with `pytest -s`) and, when TURNSTILE_FAULT_COUNTS names a
    file, append it there as JSON: docs/reliability.md's table is made from that file."""
    print(f"\nCOUNTS {json.dumps(asdict(result))}")
    path = os.environ.get("TURNSTILE_FAULT_COUNTS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(asdict(result)) + "\n")
    return result


async def all_topic_bytes(bootstrap: str, topics: Topics) -> bytes:
    """Every key and value of the three topics, for grepping."""
    out = bytearray()
    for topic in (topics.events, topics.outcomes, topics.dead_letters):
        for r in await read_topic(bootstrap, topic):
            out += (r.key or b"") + b"\n" + (r.value or b"") + b"\n"
            # Dead letters hold the refused bytes in base64: look inside them too.
            if topic == topics.dead_letters:
                out += DeadLetter.model_validate_json(r.value or b"").original_value() + b"\n"
    return bytes(out)


def markdown_table(lines: Iterable[str]) -> str:
    """The reliability table from the JSON lines `record` appended, in scenario order."""
    rows = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["scenario"])
    head = ["scenario", "published", "claimed", "answered", "answered twice", "lost",
            "side effects replayed", "DLQ", "turns", "outcomes", "ignored by the fold"]  # fmt: skip
    keys = ["scenario", "published", "claimed", "answered", "answered_twice", "lost",
            "side_effects_replayed", "dlq", "turns", "outcomes", "ignored_by"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(row.get(k, "")) or "0" for k in keys) + " |" for row in rows]
    return "\n".join(out)


if __name__ == "__main__":  # python tests/fault_audit.py counts.jsonl
    import sys

    with open(sys.argv[1]) as fh:
        print(markdown_table(fh))
