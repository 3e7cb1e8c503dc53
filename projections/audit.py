"""The auditor: replays a log of raw records and checks the rules of DESIGN.md on it.

It folds every conversation with the same `apply_event` the workers use (so it sees the
same state they decided on) and, before each event is folded, asks whether the event is
one a correct engine could have written in that state. What the fold resolves silently
(a stale run's events, a duplicate input) is reported as a notice; what no correct
engine writes is a violation of a named rule, located by partition@offset.

Pure: records in, a report out. No I/O, no clock. `streams/audit_cli.py` reads the log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnstile.events import (
    NOT_STARTED,
    STOPPED_MID_ATTEMPT,
    AttemptFailed,
    AttemptStarted,
    DeadLetter,
    DecodeError,
    Event,
    MessageReceived,
    MessageRejected,
    ModelResponded,
    TerminalOutcome,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnEnvelope,
    TurnExhausted,
    TurnFailed,
    TurnInterrupted,
    TurnPaused,
    decode_record,
    misplaced,
    names_its_inputs,
)
from turnstile.events.upcast import UPCASTERS, Upcasters
from turnstile.projections.conversation import apply_event, closed_run_cannot_end_so, new_state
from turnstile.projections.inert import printable
from turnstile.projections.published import OutcomeLedger
from turnstile.projections.state import ActiveTurn, ConversationState

# Rule id -> what it checks. The order is the order of the report.
RULES: dict[str, str] = {
    "one_partition": "a conversation's events are all in one partition (the log keys by conversation id)",
    "claim_once": "rule 1: a message is claimed by at most one logical turn (an interrupted turn releases its own)",
    "claim_exact": (
        "rules 1, 2, 6: a claim names received, pending inputs once each; its turn id is sha256 of the "
        "sorted ids and its history boundary the history length (the claimed messages are the final input)"
    ),
    "one_active_turn": "rules 3, 5: no claim while another turn of the conversation is active",
    "attempts": (
        "rules 6, 9: attempts share the turn id, each has a new run id, attempt numbers go up by one "
        "and a new attempt starts only after the previous one failed -- never, fresh or resuming, after "
        "a failure its owner said no attempt may follow (not retryable, other than a takeover's closing); "
        "no outcome of an attempt that never started"
    ),
    "no_replay_after_side_effect": (
        "rule 9: no automatic attempt after a side-effecting tool started, and no failure that says one may follow"
    ),
    "resume": (
        "rule 9 across owners: an attempt that resumes an interrupted run follows that run; it asks no "
        "recorded model step again, runs no finished tool call again, runs an unfinished "
        "side-effecting call again only with its idempotency key, and never records as not started a "
        "call an earlier run started"
    ),
    "one_outcome": "rule 11: one terminal outcome per claimed turn, with a status for exactly its claimed inputs",
    "double_text": (
        "double-text refusals: a MessageRejected names a received, unclaimed message that arrived "
        "while the turn it names was active"
    ),
    "interrupt": (
        "double-text interrupts: a TurnInterrupted withdraws its open turn only for a message that arrived "
        "during it, and never after a side-effecting tool of the turn started"
    ),
    "budgets": (
        "rule 7: each outcome's metrics and operation record match the events of its turn; with limits "
        "given, no iteration, tool call or model request beyond them, no outcome costing more than the "
        "cost limit, and no step started past the deadline or finished past it and its grace (a "
        "side-effecting call runs to its end, its turn's outcome within the grace after it)"
    ),
}

_KIND: dict[type, str] = {
    TurnCompleted: "completed",
    TurnFailed: "failed",
    TurnPaused: "paused",
    TurnExhausted: "exhausted",
}
_OUTCOMES = (TurnCompleted, TurnFailed, TurnPaused, TurnExhausted)


class LogRecord(Protocol):
    """One record of the events topic as read (streams.log.Record fits)."""

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...

    @property
    def unreadable(self) -> str | None:
        """Why the log's client could not read the record at all (it stands in for it)."""
        ...


# Inputs that wait longer than this (by event time) while their partition goes on are
# stalled: a debounce or a queue behind an active turn is far shorter.
DEFAULT_STALL_AFTER_S = 60.0

# A step the deadline cancels is recorded (its ToolCallFinished, the pause) a moment after
# the deadline: the auditor allows this much for those records (see docs/budgets.md).
DEADLINE_GRACE_MS = 1000
# Float sums of per-reply costs are compared with this relative tolerance.
_COST_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class AuditLimits:
    """Budget limits to hold the log to. They are configuration, not on the log, so the
    auditor knows them only when told; without them it checks the metrics' consistency."""

    max_iterations: int | None = None
    max_tool_calls: int | None = None
    max_cost_usd: float | None = None
    deadline_s: float | None = None

    @property
    def any(self) -> bool:
        return (self.max_iterations, self.max_tool_calls, self.max_cost_usd, self.deadline_s) != (None,) * 4


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the auditor found, where it is on the log, and what it is."""

    partition: int
    offset: int
    conversation_id: str | None
    turn_id: str | None
    detail: str

    @property
    def where(self) -> str:
        return f"{self.partition}@{self.offset}"

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.where,
            "partition": self.partition,
            "offset": self.offset,
            "conversation_id": self.conversation_id,
            "turn_id": self.turn_id,
            "detail": self.detail,
        }


@dataclass(slots=True)
class RuleResult:
    rule: str
    description: str
    checked: int = 0
    violations: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "description": self.description,
            "checked": self.checked,
            "violations": [v.to_json() for v in self.violations],
        }


@dataclass(slots=True)
class AuditReport:
    records: int
    events: int
    conversations: int
    turns: int
    outcomes: dict[str, int]
    rules: list[RuleResult]
    # Not violations (unless strict, for open turns): what every reader resolves alike.
    open_turns: list[Finding]
    stale: list[Finding]
    ignored: list[Finding]
    undecodable: list[Finding]
    # The dead-letter topic, when it was read: its letters (at the partition@offset of the
    # record they stand for) and the undecodable values with no letter -- values no worker
    # got past yet (a lagging or stuck group), or whose letter was lost.
    dead_letters: list[Finding] = field(default_factory=list)
    not_dead_lettered: list[Finding] = field(default_factory=list)
    letters_read: bool = True  # False: the dead-letter topic was not read (the two above say nothing)
    # Where the log stopped moving: partitions the workers' group has not committed to their
    # end (when its offsets were given), and conversations whose inputs wait unclaimed while
    # their partition went on.
    not_committed_past: list[Finding] = field(default_factory=list)
    stalled: list[Finding] = field(default_factory=list)
    # When the outcomes topic was read: outcomes (and refusals) the workers committed past
    # that a consumer of that topic can never see, no dead letter saying why; how many it
    # should hold (None: not checked); whether it held none of them (not this log's topic?).
    unpublished: list[Finding] = field(default_factory=list)
    outcomes_due: int | None = None
    outcomes_topic_foreign: bool = False
    outcomes_topic_empty: bool = False
    strict: bool = False
    # Only what is new since an earlier audit was kept (`since`): no verdict on the whole log.
    incremental: bool = False
    # Partitions whose first events are gone (retention, deleted records) -> where each starts
    # now, and what was found on them: not judged, since what came before is unknown (a claim
    # of inputs whose messages expired read as "never received").
    truncated: dict[int, int] = field(default_factory=dict)
    not_judged: list[Finding] = field(default_factory=list)

    @property
    def violations(self) -> int:
        strict = len(self.stuck) + len(self.unpublished) if self.strict else 0
        return sum(len(r.violations) for r in self.rules) + strict

    @property
    def stuck(self) -> list[Finding]:
        """What did not progress: open turns, stalled conversations, values not committed past
        (violations with --strict)."""
        return self.open_turns + self.stalled + self.not_committed_past

    @property
    def poisoned(self) -> bool:
        """Values the workers could not fold are on the log (or on the dead-letter topic)."""
        return bool(self.undecodable or self.dead_letters)

    @property
    def ok(self) -> bool:
        return self.violations == 0

    def since(self, offsets: dict[int, int]) -> AuditReport:
        """Only what was found at or past `offsets` (partition -> first offset not yet
        reported): what an incremental audit reports. Counts and open turns stay whole."""

        def new(findings: list[Finding]) -> list[Finding]:
            return [f for f in findings if f.offset >= offsets.get(f.partition, 0)]

        rules = [RuleResult(r.rule, r.description, r.checked, new(r.violations)) for r in self.rules]
        return dataclasses.replace(
            self,
            incremental=True,
            rules=rules,
            stale=new(self.stale),
            ignored=new(self.ignored),
            undecodable=new(self.undecodable),
            dead_letters=new(self.dead_letters),
            not_dead_lettered=new(self.not_dead_lettered),
            not_judged=new(self.not_judged),
        )  # stalled, not committed past and unpublished describe the log's end: reported whole

    def rule(self, rule: str) -> RuleResult:
        return next(r for r in self.rules if r.rule == rule)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violations": self.violations,
            "strict": self.strict,
            "records": self.records,
            "events": self.events,
            "conversations": self.conversations,
            "turns": self.turns,
            "outcomes": self.outcomes,
            "rules": [r.to_json() for r in self.rules],
            "open_turns": [f.to_json() for f in self.open_turns],
            "stale": [f.to_json() for f in self.stale],
            "ignored": [f.to_json() for f in self.ignored],
            "undecodable": [f.to_json() for f in self.undecodable],
            "dead_letters": [f.to_json() for f in self.dead_letters],
            "not_dead_lettered": [f.to_json() for f in self.not_dead_lettered],
            "not_committed_past": [f.to_json() for f in self.not_committed_past],
            "stalled": [f.to_json() for f in self.stalled],
            "unpublished": [f.to_json() for f in self.unpublished],
            "outcomes_due": self.outcomes_due,
            "outcomes_topic_foreign": self.outcomes_topic_foreign,
            "outcomes_topic_empty": self.outcomes_topic_empty,
            "poisoned": self.poisoned,
            "letters_read": self.letters_read,
            "truncated_partitions": {str(p): start for p, start in sorted(self.truncated.items())},
            "not_judged": [f.to_json() for f in self.not_judged],
        }


@dataclass(slots=True)
class _Turn:
    """What the auditor remembers of a logical turn, beside the fold's state."""

    claimed_at: tuple[int, int]
    runs: dict[str, int]  # run id -> attempt number
    outcome_at: tuple[int, int] | None = None
    outcome_event_id: str | None = None
    outcome_type: str | None = None
    outcome_run_id: str | None = None
    zombie_runs: set[str] = field(default_factory=set)  # runs the fold never let start
    # When its last side-effecting call finished past the deadline, ms after the claim: such a
    # call runs to its own timeout (the engine does not cut it off), the outcome after it.
    late_effect_ms: int | None = None


class Auditor:
    """Feed it the records of the events topic in partition order; ask for the report."""

    def __init__(
        self,
        limits: AuditLimits = AuditLimits(),
        max_value_bytes: int | None = None,
        upcasters: Upcasters = UPCASTERS,
        partitions: int | None = None,
    ) -> None:
        """`partitions`: the events topic's partition count, so that a record outside its
        conversation's partition is refused as the workers refuse it (None: not checked)."""
        self.limits = limits
        self.partitions = partitions
        self.max_value_bytes = max_value_bytes
        self.upcasters = upcasters
        self.states: dict[str, ConversationState] = {}
        self._partition_of: dict[str, int] = {}
        self._turns: dict[tuple[str, str], _Turn] = {}
        # (conversation, message id) -> the turn active when the message was folded (or None).
        self._arrived_during: dict[tuple[str, str], str | None] = {}
        self._rules = {rule: RuleResult(rule, text) for rule, text in RULES.items()}
        self._stale: list[Finding] = []
        self._ignored: list[Finding] = []
        self._undecodable: list[Finding] = []
        self._dead_letters: list[Finding] | None = None  # None: the dead-letter topic was not read
        self._committed: dict[int, int] | None = None  # the workers' group, when given
        self._starts: dict[int, int] = {}  # events partition -> its first offset now (`feed_starts`)
        self._refused_effects: set[tuple[int, int]] = set()  # dead letters of refused outcome records
        self._ledger = OutcomeLedger()
        self._ends: dict[int, int] = {}  # partition -> offset after its last record
        self._last_time: dict[int, int] = {}  # partition -> latest event time on it
        self._input_at: dict[tuple[str, str], tuple[int, int]] = {}  # pending input -> where it arrived
        self._records = 0
        self._events = 0
        self._at: tuple[int, int] = (0, 0)

    # -- feeding -------------------------------------------------------------------------

    def feed_all(self, records: Iterable[LogRecord]) -> Auditor:
        for record in records:
            self.feed(record)
        return self

    def feed_dead_letters(self, letters: Iterable[DeadLetter]) -> Auditor:
        """The letters of the dead-letter topic, each found at the record it stands for."""
        found = self._dead_letters if self._dead_letters is not None else []
        for letter in letters:
            detail = f"dead letter, {letter.reason}: {letter.detail}"
            if letter.value_truncated:
                detail += f" (a prefix of {letter.value_bytes} bytes, sha256 {letter.value_sha256})"
            found.append(Finding(letter.partition, letter.offset, letter.key, None, detail))
            if letter.reason == "effect_skipped":
                self._refused_effects.add((letter.partition, letter.offset))
        self._dead_letters = found
        return self

    def feed_outcomes(
        self, records: Iterable[tuple[int, bytes | None, int | None]], starts: Mapping[int, int]
    ) -> Auditor:
        """The outcomes topic's records (partition, value, when it was written if known) and
        where each of its partitions starts (past 0: retention deleted its oldest records)."""
        for partition, value, written_ms in records:
            self._ledger.published(partition, value, written_ms)
        self._ledger.started(starts)
        return self

    def feed_starts(self, starts: Mapping[int, int]) -> Auditor:
        """Where each partition of the events topic starts now: past 0, its oldest records are
        gone, and what the rules find on it is reported as not judged."""
        self._starts = dict(starts)
        return self

    def feed_committed(self, committed: Mapping[int, int]) -> Auditor:
        """The workers' consumer group's committed offsets (partition -> next offset to read)."""
        self._committed = dict(committed)
        return self

    def feed(self, record: LogRecord) -> None:
        self._records += 1
        self._at = (record.partition, record.offset)
        self._ends[record.partition] = record.offset + 1
        # What the workers dead-letter without folding it, the auditor does not fold either.
        if record.unreadable is not None:  # (no value: not a tombstone, a record no client here reads)
            self._undecodable.append(self._finding(None, None, f"unreadable: {record.unreadable}"))
            return
        event = decode_record(record.key, record.value, self.max_value_bytes, self.upcasters)
        if not isinstance(event, DecodeError):
            event = misplaced(event, record.partition, self.partitions) or event
        if isinstance(event, DecodeError):
            self._undecodable.append(self._finding(None, None, f"{event.reason}: {event.detail}"))
            return
        self._events += 1
        self._check_partition(event.conversation_id, record.partition)
        state = self.states.get(event.conversation_id)
        if state is None:
            state = self.states[event.conversation_id] = new_state(event.conversation_id)
        explained = self._before(state, event)
        rejection = apply_event(state, event)
        self._last_time[record.partition] = max(self._last_time.get(record.partition, 0), event.occurred_at)
        if rejection is None:
            self._after(event)
            self._ledger.note(record.partition, record.offset, event)
            for input_id in state.pending:
                self._input_at.setdefault((event.conversation_id, input_id), self._at)
        elif not explained:
            self._notice(state, event, rejection.reason, rejection.conflict)

    # -- the checks, each before the event is folded ---------------------------------------

    def _before(self, state: ConversationState, event: Event) -> bool:
        """Run the checks that apply to `event` in `state`. True when the event was fully
        accounted for (a violation or notice already names it)."""
        match event:
            case TurnClaimed():
                return self._check_claim(state, event)
            case AttemptStarted():
                return self._check_attempt(state, event)
            case TurnCompleted() | TurnFailed() | TurnPaused() | TurnExhausted():
                return self._check_outcome(state, event)
            case AttemptFailed():
                self._check_failure(state, event)
            case ModelResponded():
                return self._check_model_request(state, event)
            case ToolCallStarted():
                if self._check_tool_call(state, event):
                    return True
                self._check_deadline(state, event, started=True)
            case ToolCallFinished():
                if self._check_not_started(state, event):
                    return True
                self._check_deadline(state, event, started=False)
            case MessageRejected():
                return self._check_refusal(state, event)
            case TurnInterrupted():
                return self._check_interrupt(state, event)
            case _:
                pass
        return False

    def _check_partition(self, conversation: str, partition: int) -> None:
        first = self._partition_of.get(conversation)
        if first is None:
            self._partition_of[conversation] = partition
            self._rules["one_partition"].checked += 1
        elif first != partition:
            detail = f"event in partition {partition}; the conversation's first was in {first}"
            self._violate("one_partition", conversation, None, detail)

    def _check_claim(self, state: ConversationState, claim: TurnClaimed) -> bool:
        conv, turn_id = claim.conversation_id, claim.turn_id
        known = self._turns.get((conv, turn_id))
        if known is not None and (turn_id in state.turns or _active_id(state) == turn_id):
            where = _at(known.claimed_at)
            self._stale.append(self._finding(conv, turn_id, f"another claim of turn {_short(turn_id)} (first {where})"))
            return True
        found = False
        ids = claim.input_ids
        once = self._rules["claim_once"]
        once.checked += len(ids)
        for input_id in ids:
            owner = state.claimed_by.get(input_id)
            if owner is not None and owner != turn_id:
                first = self._turns[(conv, owner)].claimed_at
                detail = f"message {input_id!r} already claimed by turn {_short(owner)} ({_at(first)})"
                found = self._violate("claim_once", conv, turn_id, detail)

        problems = []
        if len(set(ids)) != len(ids):
            problems.append("names an input more than once")
        never = [i for i in ids if i not in state.seen_inputs]
        if never:
            problems.append(f"claims inputs never received: {never[:5]}")
        gone = [i for i in ids if i in state.seen_inputs and i not in state.pending and i not in state.claimed_by]
        if gone:
            problems.append(f"claims inputs that are no longer pending: {gone[:5]}")
        if not names_its_inputs(turn_id, ids):
            problems.append("turn id is not sha256 of the sorted claimed ids")
        if claim.history_boundary != len(state.history):
            problems.append(f"history boundary {claim.history_boundary} != history length {len(state.history)}")
        if claim.attempt != 1:
            problems.append(f"a claim opens attempt 1, not {claim.attempt}")
        self._rules["claim_exact"].checked += 1
        if problems:
            found = self._violate("claim_exact", conv, turn_id, "; ".join(problems))

        self._rules["one_active_turn"].checked += 1
        active = state.active
        if active is not None and active.turn_id != turn_id:
            first = self._turns[(conv, active.turn_id)].claimed_at
            detail = f"claimed while turn {_short(active.turn_id)} (claimed {_at(first)}) is active"
            found = self._violate("one_active_turn", conv, turn_id, detail)
        return found

    def _check_attempt(self, state: ConversationState, start: AttemptStarted) -> bool:
        conv, turn_id = start.conversation_id, start.turn_id
        rule = self._rules["attempts"]
        rule.checked += 1
        known = self._turns.get((conv, turn_id))
        if known is None:
            return self._violate("attempts", conv, turn_id, f"attempt {start.attempt} of a turn that was never claimed")
        if known.outcome_at is not None:
            if start.run_id in known.runs:
                return self._stale_event(conv, turn_id, f"start of run {start.run_id} after the turn's outcome")
            detail = f"attempt {start.attempt} started after the turn's outcome ({_at(known.outcome_at)})"
            return self._violate("attempts", conv, turn_id, detail)
        turn = state.active
        assert turn is not None and turn.turn_id == turn_id  # a claimed turn without outcome is the active one
        if start.run_id == turn.run_id and start.attempt == turn.attempt:
            if turn.attempt_state == "claimed":
                return False  # the first start of the claimed attempt
            return self._stale_event(conv, turn_id, f"run {start.run_id} started again")
        if start.run_id in known.runs:
            detail = f"attempt {start.attempt} reuses run id {start.run_id} of attempt {known.runs[start.run_id]}"
            return self._violate("attempts", conv, turn_id, detail)
        if start.attempt <= turn.attempt:
            # A worker that lost the turn (a zombie) starting its own next attempt: the fold
            # ignores the run, and so does every reader; its later events are stale too.
            known.zombie_runs.add(start.run_id)
            detail = (
                f"attempt {start.attempt} (run {start.run_id}) started while attempt {turn.attempt} "
                f"({turn.run_id}) owns the turn: a worker that lost it?"
            )
            return self._stale_event(conv, turn_id, detail)
        if start.attempt != turn.attempt + 1:
            detail = f"attempt {start.attempt} follows attempt {turn.attempt}"
            return self._violate("attempts", conv, turn_id, detail)
        if turn.attempt_state != "closed":
            detail = f"attempt {start.attempt} started while attempt {turn.attempt} ({turn.run_id}) had not failed"
            return self._violate("attempts", conv, turn_id, detail)
        verdict = turn.verdict
        if verdict is not None and not verdict.retryable and verdict.reason != STOPPED_MID_ATTEMPT:
            # Its owner decided the turn fails: whoever owns it next writes that TurnFailed.
            detail = (
                f"attempt {start.attempt} started after attempt {turn.attempt} ({turn.run_id}) "
                f"failed for good: {verdict.reason}"
            )
            return self._violate("attempts", conv, turn_id, detail)
        if start.resumes_run_id is not None:
            self._rules["resume"].checked += 1
            if start.resumes_run_id != turn.run_id:
                detail = f"attempt {start.attempt} resumes run {start.resumes_run_id}, not the run it follows"
                return self._violate("resume", conv, turn_id, detail)
            return False  # continuing the journal is not a replay
        self._rules["no_replay_after_side_effect"].checked += 1
        if turn.side_effect_started:
            started = ", ".join(op.tool for op in turn.operations.values() if op.side_effect)
            detail = f"attempt {start.attempt} started after side-effecting tools started: {started}"
            return self._violate("no_replay_after_side_effect", conv, turn_id, detail)
        return False

    def _check_failure(self, state: ConversationState, failure: AttemptFailed) -> None:
        turn = _open_run(state, failure)
        if turn is None:
            return
        self._rules["no_replay_after_side_effect"].checked += 1
        if failure.retryable and turn.side_effect_started:
            detail = "attempt failure marked retryable after a side-effecting tool started"
            self._violate("no_replay_after_side_effect", failure.conversation_id, failure.turn_id, detail)

    def _check_refusal(self, state: ConversationState, refusal: MessageRejected) -> bool:
        conv, message_id = refusal.conversation_id, refusal.message_id
        self._rules["double_text"].checked += 1
        if refusal.active_turn_id is None:  # a refused resume: it must still be pending
            item = state.pending.get(message_id)
            if item is not None and item.kind == "resume":
                return False
            return self._violate("double_text", conv, None, f"refuses resume {message_id!r}, which is not pending")
        problem = None
        if (conv, message_id) not in self._arrived_during:
            problem = f"refuses message {message_id!r}, which was never received"
        elif message_id in state.claimed_by:
            problem = f"refuses message {message_id!r}, which turn {_short(state.claimed_by[message_id])} claimed"
        elif message_id not in state.pending:
            return self._stale_event(conv, refusal.active_turn_id, f"message {message_id!r} refused again")
        else:
            during = self._arrived_during[(conv, message_id)]
            if during is None:
                problem = f"refuses message {message_id!r}, which arrived while no turn was active"
            elif during != refusal.active_turn_id:
                problem = f"names turn {_short(refusal.active_turn_id)}; {message_id!r} arrived during {_short(during)}"
        if problem is None:
            return False
        return self._violate("double_text", conv, refusal.active_turn_id, problem)

    def _check_interrupt(self, state: ConversationState, event: TurnInterrupted) -> bool:
        conv, turn_id = event.conversation_id, event.turn_id
        self._rules["interrupt"].checked += 1
        turn = _open_run(state, event)
        if turn is None:
            return False  # a stale run's: the fold ignores it and the notice says so
        if turn.side_effect_started:
            return self._violate("interrupt", conv, turn_id, "interrupted after a side-effecting tool started")
        if self._arrived_during.get((conv, event.message_id)) != turn_id:
            detail = f"interrupted by message {event.message_id!r}, which did not arrive during this turn"
            return self._violate("interrupt", conv, turn_id, detail)
        return False

    def _check_model_request(self, state: ConversationState, response: ModelResponded) -> bool:
        turn = _open_run(state, response)
        if turn is None or response.event_id in turn.step_ids:
            return False
        if response.iteration <= turn.iterations:
            self._rules["resume"].checked += 1
            detail = f"model step {response.iteration} asked again; the journal already holds it"
            return self._violate("resume", response.conversation_id, response.turn_id, detail)
        if not self.limits.any:
            return False
        rule = self._rules["budgets"]
        rule.checked += 1
        conv, turn_id = response.conversation_id, response.turn_id
        limit = self.limits.max_iterations
        if limit is not None and response.iteration > limit:
            self._violate("budgets", conv, turn_id, f"iteration {response.iteration} beyond the limit of {limit}")
        cost = self.limits.max_cost_usd
        if cost is not None and (turn.cost_usd is None or turn.cost_usd >= cost):
            spent = "an unknown cost" if turn.cost_usd is None else f"${turn.cost_usd:.6f}"
            detail = f"a model request after {spent} was spent (limit ${cost:.6f})"
            self._violate("budgets", conv, turn_id, detail)
        self._check_deadline(state, response, started=False)
        return False

    def _check_deadline(
        self,
        state: ConversationState,
        event: ToolCallStarted | ToolCallFinished | ModelResponded | TerminalOutcome,
        started: bool,
    ) -> None:
        """No step starts past the deadline; none is recorded as finished past it and its
        grace (a cancelled step is recorded just after the deadline) -- but a side-effecting
        call, which runs to its own end, and what is recorded within the grace after it."""
        turn = _open_run(state, event)
        deadline_s = self.limits.deadline_s
        if turn is None or deadline_s is None:
            return
        self._rules["budgets"].checked += 1
        at_ms = event.occurred_at - turn.claimed_at
        allowed_ms = deadline_s * 1000 + (0 if started else DEADLINE_GRACE_MS)
        known = self._turns.get((event.conversation_id, event.turn_id))
        if isinstance(event, ToolCallFinished) and (op := turn.operations.get(event.call_id)) and op.side_effect:
            # Started before the deadline (checked at its start), it may end after it.
            if known is not None and at_ms > deadline_s * 1000:
                known.late_effect_ms = at_ms
            return
        if not started and known is not None and known.late_effect_ms is not None:
            allowed_ms = max(allowed_ms, known.late_effect_ms + DEADLINE_GRACE_MS)
        if at_ms > allowed_ms:
            what = "started" if started else "recorded"
            detail = f"{event.type} {what} at {at_ms} ms, past the deadline of {deadline_s:g} s"
            if not started:
                detail += f" and its grace of {DEADLINE_GRACE_MS} ms"
            self._violate("budgets", event.conversation_id, event.turn_id, detail)

    def _check_tool_call(self, state: ConversationState, call: ToolCallStarted) -> bool:
        turn = _open_run(state, call)
        if turn is None or call.event_id in turn.step_ids:
            return False
        earlier = turn.operations.get(call.call_id)
        if earlier is not None:
            self._rules["resume"].checked += 1
            problem = None
            if earlier.status != "started":
                problem = f"tool call {call.call_id} ({call.tool}) ran again after it {earlier.status}"
            elif earlier.side_effect and call.idempotency_key is None:
                problem = f"side-effecting call {call.call_id} ({call.tool}) ran again without an idempotency key"
            if problem is not None:
                return self._violate("resume", call.conversation_id, call.turn_id, problem)
        limit = self.limits.max_tool_calls
        if limit is None:
            return False
        self._rules["budgets"].checked += 1
        if turn.tool_calls >= limit:
            detail = f"tool call {turn.tool_calls + 1} ({call.tool}) beyond the limit of {limit}"
            self._violate("budgets", call.conversation_id, call.turn_id, detail)
        return False

    def _check_not_started(self, state: ConversationState, finished: ToolCallFinished) -> bool:
        """A call recorded as never begun (NOT_STARTED) must not have been started by an
        earlier run of its turn: that run may have acted, and the model, told it had no
        effect, may make it anew."""
        turn = _open_run(state, finished)
        if turn is None or finished.result != NOT_STARTED:
            return False
        if turn.attempt_state != "open" or finished.event_id in turn.step_ids:
            return False  # a closed run's or a repeated record: every reader ignores it (a notice)
        self._rules["resume"].checked += 1
        earlier = [
            e for e in turn.journal
            if isinstance(e, ToolCallStarted) and e.call_id == finished.call_id and e.run_id != finished.run_id
        ]  # fmt: skip
        if not earlier:
            return False
        detail = (f"call {finished.call_id} ({earlier[0].tool}) recorded as never started, though run "
                  f"{earlier[0].run_id} started it before: it may have acted")  # fmt: skip
        return self._violate("resume", finished.conversation_id, finished.turn_id, detail)

    def _check_outcome(self, state: ConversationState, outcome: TerminalOutcome) -> bool:
        conv, turn_id = outcome.conversation_id, outcome.turn_id
        self._rules["one_outcome"].checked += 1
        known = self._turns.get((conv, turn_id))
        if known is None:
            return self._violate("one_outcome", conv, turn_id, f"{outcome.type} of a turn that was never claimed")
        if known.outcome_at is not None:
            if outcome.event_id == known.outcome_event_id:
                self._ignored.append(self._finding(conv, turn_id, f"{outcome.type} republished (same event id)"))
                return True
            earlier = outcome.run_id in known.runs or outcome.run_id in known.zombie_runs
            if earlier and outcome.run_id != known.outcome_run_id:
                detail = f"{outcome.type} from run {outcome.run_id}, not the run that ended the turn"
                return self._stale_event(conv, turn_id, detail)
            detail = f"second outcome {outcome.type}; the first was {known.outcome_type} at {_at(known.outcome_at)}"
            return self._violate("one_outcome", conv, turn_id, detail)
        turn = state.active
        assert turn is not None and turn.turn_id == turn_id
        if outcome.run_id != turn.run_id:
            return self._stale_event(conv, turn_id, f"{outcome.type} from run {outcome.run_id}, not the active run")
        if closed_run_cannot_end_so(turn, outcome):
            detail = f"{outcome.type} from run {outcome.run_id} after its AttemptFailed"
            return self._stale_event(conv, turn_id, detail)
        found = False
        if turn.attempt_state == "claimed":  # the engine writes the claim and its first attempt together
            detail = f"{outcome.type} of attempt {turn.attempt}, which never started (no AttemptStarted)"
            found = self._violate("attempts", conv, turn_id, detail)
        statuses, claimed = set(outcome.statuses), set(turn.input_ids)
        if statuses != claimed:
            detail = f"statuses for {sorted(statuses)[:5]} but the turn claimed {sorted(claimed)[:5]}"
            found = self._violate("one_outcome", conv, turn_id, detail)
        self._rules["budgets"].checked += 1
        mismatches = _metric_mismatches(turn, outcome)
        if mismatches:
            detail = f"{outcome.type} metrics disagree with the log: {mismatches}"
            found = self._violate("budgets", conv, turn_id, detail)
        limit, cost = self.limits.max_cost_usd, outcome.metrics.cost_usd
        if limit is not None and cost is not None and cost > limit * (1 + _COST_TOLERANCE):
            detail = f"{outcome.type} cost ${cost:.6f}, beyond the cost limit of ${limit:.6f}"
            found = self._violate("budgets", conv, turn_id, detail)
        self._check_deadline(state, outcome, started=False)
        return found

    # -- after an accepted event -----------------------------------------------------------

    def _after(self, event: Event) -> None:
        conv = event.conversation_id
        match event:
            case MessageReceived():
                self._arrived_during[(conv, event.message_id)] = self._active_of(conv)
            case TurnClaimed():
                self._turns[(conv, event.turn_id)] = _Turn(self._at, {event.run_id: 1})
            case AttemptStarted():
                self._turns[(conv, event.turn_id)].runs[event.run_id] = event.attempt
            case TurnCompleted() | TurnFailed() | TurnPaused() | TurnExhausted():
                known = self._turns[(conv, event.turn_id)]
                known.outcome_at, known.outcome_event_id, known.outcome_type = self._at, event.event_id, event.type
                known.outcome_run_id = event.run_id
            case _:
                pass

    def _active_of(self, conversation: str) -> str | None:
        state = self.states.get(conversation)
        return _active_id(state) if state is not None else None

    def _notice(self, state: ConversationState, event: Event, reason: str, conflict: bool) -> None:
        """An event the fold ignored that no check explained: a stale run, or a duplicate."""
        if isinstance(event, TurnEnvelope) and (event.conversation_id, event.turn_id) in self._turns:
            what = f"{event.type} ignored: {reason}"
            if isinstance(event, ToolCallStarted) and event.side_effect:
                what += f" (a side-effecting tool, {event.tool}, started in a stale run)"
            self._stale.append(self._finding(event.conversation_id, event.turn_id, what))
            return
        turn_id = event.turn_id if isinstance(event, TurnEnvelope) else None
        label = "conflict" if conflict else "ignored"
        self._ignored.append(self._finding(event.conversation_id, turn_id, f"{event.type} {label}: {reason}"))

    # -- reporting ------------------------------------------------------------------------

    def _finding(self, conversation: str | None, turn_id: str | None, detail: str) -> Finding:
        return Finding(self._at[0], self._at[1], conversation, turn_id, detail)

    def _violate(self, rule: str, conversation: str, turn_id: str | None, detail: str) -> bool:
        self._rules[rule].violations.append(self._finding(conversation, turn_id, detail))
        return True

    def _stale_event(self, conversation: str, turn_id: str, detail: str) -> bool:
        self._stale.append(self._finding(conversation, turn_id, detail))
        return True

    def report(
        self, strict: bool = False, stall_after_s: float = DEFAULT_STALL_AFTER_S, now_ms: int | None = None
    ) -> AuditReport:
        """`stall_after_s`: how long, by event time, inputs may wait unclaimed while their
        partition goes on before the conversation is reported as stalled. `now_ms` (the audit's
        clock, when it began reading): an input the workers' group has committed past waits
        until then, whether or not its partition went on (its workers read it; a claim
        within the debounce is far shorter)."""
        open_turns = []
        for conv, state in sorted(self.states.items()):
            turn = state.active
            if turn is not None:
                p, o = self._turns[(conv, turn.turn_id)].claimed_at
                detail = f"claimed, no outcome yet: attempt {turn.attempt} ({turn.run_id}) is {turn.attempt_state}"
                open_turns.append(Finding(p, o, conv, turn.turn_id, detail))
        outcomes = dict.fromkeys(_KIND.values(), 0)
        for known in self._turns.values():
            if known.outcome_type is not None:
                outcomes[_KIND[_TYPE_OF[known.outcome_type]]] += 1
        outcomes["open"] = len(open_turns)
        truncated = {p: start for p, start in sorted(self._starts.items()) if start > 0}
        cut: list[Finding] = []

        def judged(findings: list[Finding]) -> list[Finding]:
            """Those on whole partitions; the others go to `cut`, not judged."""
            cut.extend(f for f in findings if f.partition in truncated)
            return [f for f in findings if f.partition not in truncated]

        rules = [RuleResult(r.rule, r.description, r.checked, judged(r.violations)) for r in self._rules.values()]
        still_open, stalled = judged(open_turns), judged(self._stalled(stall_after_s, now_ms))
        return AuditReport(
            records=self._records,
            events=self._events,
            conversations=len(self.states),
            turns=len(self._turns),
            outcomes=outcomes,
            rules=rules,
            open_turns=still_open,
            stale=list(self._stale),
            ignored=list(self._ignored),
            undecodable=list(self._undecodable),
            dead_letters=list(self._dead_letters or ()),
            letters_read=self._dead_letters is not None,
            not_dead_lettered=self._not_dead_lettered(),
            not_committed_past=self._not_committed_past(),
            stalled=stalled,
            **self._unpublished(),
            strict=strict,
            truncated=truncated,
            not_judged=sorted(cut, key=lambda f: (f.partition, f.offset)),
        )

    def _not_committed_past(self) -> list[Finding]:
        """One finding per partition whose records the workers' group has not all committed."""
        if self._committed is None:
            return []
        found = []
        for p, end in sorted(self._ends.items()):
            at = self._committed.get(p, 0)
            if at >= end:
                continue
            detail = f"the workers' group has not committed past offset {at}: {end - at} record(s) behind the end"
            poison = next((f for f in self._undecodable if f.partition == p and f.offset == at), None)
            if poison is not None:
                detail += f"; the record there does not decode ({poison.detail})"
            found.append(Finding(p, at, poison.conversation_id if poison else None, None, detail))
        return found

    def _stalled(self, stall_after_s: float, now_ms: int | None) -> list[Finding]:
        """Conversations with no active turn whose oldest pending input waited longer than
        `stall_after_s` while events went on being written to its partition, or (`now_ms`)
        since the workers' group committed past it."""
        found = []
        for conv, state in sorted(self.states.items()):
            if state.active is not None or not state.pending:
                continue
            oldest = min(state.pending.values(), key=lambda p: p.occurred_at)
            p, o = self._input_at.get((conv, oldest.input_id), (self._partition_of.get(conv, 0), 0))
            passed = now_ms is not None and self._committed is not None and self._committed.get(p, 0) > o
            until = now_ms if passed and now_ms is not None else self._last_time.get(p, oldest.occurred_at)
            waited_ms = until - oldest.occurred_at
            if waited_ms > stall_after_s * 1000:
                why = "though the workers' group committed past it" if passed else "while the partition went on"
                detail = f"{len(state.pending)} input(s) pending with no claim for {waited_ms / 1000:.0f} s {why}"
                found.append(Finding(p, o, conv, None, detail))
        return found

    def _unpublished(self) -> dict[str, Any]:
        if not self._ledger.read or self._committed is None:
            return {}  # without both, what is due on the outcomes topic is not known
        verdict = self._ledger.unpublished(self._committed, self._refused_effects)
        detail = "{} the workers' group committed past is not on the outcomes topic, and no dead letter says why"
        missing = [
            Finding(d.partition, d.offset, d.conversation_id, d.turn_id, detail.format(d.event_type))
            for d in verdict.missing
        ]
        return {"unpublished": missing, "outcomes_due": verdict.due, "outcomes_topic_foreign": verdict.foreign,
                "outcomes_topic_empty": verdict.empty}  # fmt: skip

    def _not_dead_lettered(self) -> list[Finding]:
        if self._dead_letters is None:
            return []
        lettered = {(f.partition, f.offset) for f in self._dead_letters}
        committed = self._committed

        def why(f: Finding) -> str:
            if not committed:  # how far the workers got is not known
                return f"never dead-lettered (no worker got past it yet?): {f.detail}"
            if committed.get(f.partition, 0) > f.offset:  # its letter was refused or lost
                return f"never dead-lettered, though the workers' group committed past it: {f.detail}"
            return f"never dead-lettered (no worker got past it yet): {f.detail}"

        unlettered = (f for f in self._undecodable if (f.partition, f.offset) not in lettered)
        return [dataclasses.replace(f, detail=why(f)) for f in unlettered]


_TYPE_OF: dict[str, type] = {t.__name__: t for t in _OUTCOMES}


def audit(records: Iterable[LogRecord], limits: AuditLimits = AuditLimits(), strict: bool = False) -> AuditReport:
    """Audit a whole log: records of the events topic, in order within each partition."""
    return Auditor(limits).feed_all(records).report(strict)


def _active_id(state: ConversationState) -> str | None:
    return state.active.turn_id if state.active is not None else None


def _open_run(state: ConversationState, event: TurnEnvelope) -> ActiveTurn | None:
    """The active turn if `event` belongs to its open attempt (what the fold will accept)."""
    turn = state.active
    if turn is None or turn.turn_id != event.turn_id or turn.run_id != event.run_id:
        return None
    return turn


def _metric_mismatches(turn: ActiveTurn, outcome: TerminalOutcome) -> str:
    m = outcome.metrics
    expected: dict[str, object] = {
        "attempt": turn.attempt,
        "iterations": turn.iterations,
        "tool_calls": turn.tool_calls,
        "input_tokens": turn.input_tokens,
        "output_tokens": turn.output_tokens,
        "cached_input_tokens": turn.cached_input_tokens,
        "cache_write_tokens": turn.cache_write_tokens,
        "reasoning_tokens": turn.reasoning_tokens,
        "fallbacks": turn.fallbacks,
    }
    if turn.model is not None:
        expected["model"] = turn.model
    wrong = [f"{k} {getattr(m, k)} (log: {v})" for k, v in expected.items() if getattr(m, k) != v]
    if (m.cost_usd is None) != (turn.cost_usd is None) or (
        m.cost_usd is not None and turn.cost_usd is not None and abs(m.cost_usd - turn.cost_usd) > 1e-9
    ):
        wrong.append(f"cost_usd {m.cost_usd} (log: {turn.cost_usd})")
    logged = {
        (op.call_id, op.tool, op.side_effect, "unknown" if op.status == "started" else op.status)
        for op in turn.operations.values()
    }
    recorded = {(op.call_id, op.tool, op.side_effect, op.status) for op in outcome.operations}
    if logged != recorded:
        wrong.append(f"operations {sorted(recorded)} (log: {sorted(logged)})")
    return "; ".join(wrong)


def _at(where: tuple[int, int]) -> str:
    return f"{where[0]}@{where[1]}"


def _short(turn_id: str) -> str:
    return turn_id[:12]


LINE_CHARS = 400


def _inert(line: str) -> str:
    """A finding's line as a terminal may print it: ids and details are whatever a publisher
    sent (an escape sequence restyled the auditor's terminal; a 1 MB key made a 1 MB line)."""
    line = printable(line)
    if len(line) <= LINE_CHARS:
        return line
    return f"{line[:LINE_CHARS]}... ({len(line):,} characters; --json has it whole)"


def render(report: AuditReport, limit: int = 20) -> str:
    """The report for people: one line per rule, then each violation and notice with its place."""
    o = report.outcomes
    lines = [
        f"audited {report.records} records: {report.events} events, {report.conversations} conversations, "
        f"{report.turns} turns ({o['completed']} completed, {o['failed']} failed, {o['paused']} paused, "
        f"{o['exhausted']} exhausted, {o['open']} open)",
        "",
    ]
    for rule in report.rules:
        status = "FAIL" if rule.violations else "ok"
        lines.append(f"{status:<5}{rule.rule:<29}checked {rule.checked:<7}violations {len(rule.violations)}")
        lines.append(f"     {rule.description}")
        lines += _listed(rule.violations, limit)
    strict_note = " (violations: --strict)" if report.strict else " (not violations without --strict)"
    unread = "" if report.letters_read else " -- NOT CHECKED: the dead-letter topic was not read"
    notices = [
        ("open turns" + strict_note, report.open_turns),
        ("events of stale runs and repeated claims, ignored by every reader", report.stale),
        ("other events the fold ignores (duplicates, conflicts)", report.ignored),
        ("values that do not decode or are keyed wrongly (the workers dead-letter them)", report.undecodable),
        ("letters on the dead-letter topic (refused values, one-time writes skipped)" + unread, report.dead_letters),
        ("undecodable values with no dead letter" + unread, report.not_dead_lettered),
        ("partitions the workers' group has not committed to their end" + strict_note, report.not_committed_past),
        ("conversations whose inputs wait unclaimed while their partition goes on" + strict_note, report.stalled),
        ("outcomes the workers committed past that are not on the outcomes topic" + strict_note, report.unpublished),
    ]  # fmt: skip
    lines.append("")
    for title, findings in notices:
        lines.append(f"{len(findings):>5} {title}")
        lines += _listed(findings, limit)
    if report.truncated:
        starts = ", ".join(f"{p} at offset {start:,}" for p, start in report.truncated.items())
        lines.append(f"{len(report.not_judged):>5} findings not judged: their partitions' first events are gone "
                     f"(retention or deleted records; starts: {starts}): what came before is unknown")  # fmt: skip
        lines += _listed(report.not_judged, limit)
    if report.outcomes_topic_foreign:
        lines.append(f"      the outcomes topic holds none of the {report.outcomes_due} outcomes the workers committed "
                     "past: taken for another log's topic, not judged (--outcomes-topic names this log's)")  # fmt: skip
    elif report.outcomes_topic_empty and report.unpublished:
        lines.append("      the outcomes topic holds no outcome at all: none was published, or it is not this log's "
                     "topic (--outcomes-topic names it)")  # fmt: skip
    lines.append("")
    lines.append(_verdict(report))
    return "\n".join(lines)


def _verdict(report: AuditReport) -> str:
    """The last line: violations, and whether the log is clean, poisoned or stuck."""
    if report.incremental:
        head = "no new violation" if report.ok else f"{report.violations} new violation(s)"
    else:
        head = "no violation" if report.ok else f"{report.violations} violation(s)"
    marks = []
    if report.poisoned:
        marks.append(f"poisoned: {len(report.undecodable)} value(s) that do not decode, "
                     f"{len(report.dead_letters)} dead letter(s)")  # fmt: skip
    if report.stalled or report.not_committed_past:
        marks.append(f"not progressing: {len(report.stalled)} stalled conversation(s), "
                     f"{len(report.not_committed_past)} partition(s) not committed to the end")  # fmt: skip
    if report.unpublished:
        marks.append(f"{len(report.unpublished)} outcome(s) missing from the outcomes topic")
    if marks:
        return f"{head}; " + "; ".join(marks)
    if report.incremental:  # the findings of earlier runs are not repeated, nor judged again
        return f"{head} since this auditor group's last run (--from-beginning judges the whole log)"
    return f"{head}; the log is clean" if report.ok else head



def _listed(findings: list[Finding], limit: int) -> list[str]:
    out = []
    for f in findings[:limit]:
        turn = f" turn {_short(f.turn_id)}" if f.turn_id else ""
        out.append(_inert(f"       {f.where:<12} {f.conversation_id or '-'}{turn}: {f.detail}"))
    if len(findings) > limit:
        out.append(f"       ... and {len(findings) - limit} more (--json lists all)")
    return out
