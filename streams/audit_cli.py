"""`turnstile audit`: replay the events topic and check the design's rules on it.

The rules are checked by the pure auditor (`projections.audit`); this module reads the
log and prints. On Kafka it reads every partition from offset 0 with its own consumer,
independent of the workers' group (the rules need the whole history), and remembers in
its own consumer group (default `turnstile-audit`) how far it has reported: a later run
reports only what is new since, unless `--from-beginning`.

Beside the rules it reports where the log stopped moving: values that do not decode and
their dead letters (a poisoned log), partitions the workers' consumer group has not committed
to their end, conversations whose inputs wait unclaimed while their partition goes on, and
outcomes the workers committed past that the outcomes topic does not hold (what its
consumers can never see). With `--strict` those, and turns still open, are violations too.

Exit status: 0 no violation, 1 at least one violation, 2 the log could not be read, 69 the
broker could not be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from turnstile.events import DeadLetter
from turnstile.projections.audit import DEFAULT_STALL_AFTER_S, AuditLimits, Auditor, AuditReport, render
from turnstile.projections.inert import printable
from turnstile.streams.cli_errors import at_least
from turnstile.streams.config_file import Config
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Record, Topics
from turnstile.streams.runtime import SystemClock

DEFAULT_GROUP = "turnstile-audit"


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], add_log_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    audit = sub.add_parser(
        "audit",
        help="replay the events topic and check the design's rules; exit 1 on a violation",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    # The log, its topics (the events audited, the dead letters reported) and the workers'
    # group as every command takes them: flags, TURNSTILE_* or turnstile.toml.
    add_log_args(audit)
    audit.add_argument(
        "--from-beginning",
        action="store_true",
        help="report everything on the log, not only what is new since this group's last audit",
    )
    audit.add_argument(
        "--group",
        dest="audit_group",  # not the configuration's `group`: that is the workers'
        default=DEFAULT_GROUP,
        help=f"the auditor's consumer group (default {DEFAULT_GROUP})",
    )
    audit.add_argument(
        "--worker-group",
        default=None,
        help="the workers' consumer group, whose committed offsets show how far they got "
        "(default: the configured group, turnstile-worker)",
    )
    audit.add_argument(
        "--stall-after-s",
        type=at_least(0),
        default=DEFAULT_STALL_AFTER_S,
        help="inputs unclaimed this long (event time) while their partition goes on are stalled "
        f"(default {DEFAULT_STALL_AFTER_S:g})",
    )
    audit.add_argument(
        "--strict",
        action="store_true",
        help="turns still open, stalled conversations and partitions not committed to the end are violations too",
    )
    audit.add_argument("--json", action="store_true", help="print the report as JSON (every finding)")
    audit.add_argument(
        "--max-iterations", type=at_least(1, integer=True), default=None, help="hold the log to this iteration limit"
    )
    audit.add_argument(
        "--max-tool-calls", type=at_least(0, integer=True), default=None, help="hold the log to this tool call limit"
    )
    audit.add_argument(
        "--max-cost-usd", type=at_least(0), default=None, help="hold the log to this cost limit (every outcome's cost)"
    )
    audit.add_argument(
        "--deadline-s",
        type=at_least(0),
        default=None,
        help="hold the log to this turn deadline: no step started past it, none recorded past it and its grace",
    )
    audit.add_argument("--timeout", type=at_least(0.1), default=60.0, help="seconds to read the topic to its end")


def audit_records(
    records: list[Record],
    args: argparse.Namespace,
    dlq: list[Record] | None = None,
    committed: dict[int, int] | None = None,
    began_ms: int | None = None,
    partitions: int | None = None,
    outcomes: tuple[list[Record], dict[int, int]] | None = None,
    starts: dict[int, int] | None = None,
) -> AuditReport:
    """`dlq`: the dead-letter topic's records, None if it could not be read; `committed`:
    the workers' group's offsets, None (or empty: not this log's group) if unknown;
    `began_ms`: when the audit began reading, the time an input's wait is counted to;
    `partitions`: the events topic's partition count; `outcomes`: the outcomes topic's
    records and where each of its partitions starts, None if it could not be read; `starts`:
    where each partition of the events topic starts (past 0: its first events are gone)."""
    limits = AuditLimits(args.max_iterations, args.max_tool_calls, args.max_cost_usd, args.deadline_s)
    auditor = Auditor(limits, partitions=partitions).feed_all(records).feed_starts(starts or {})
    if dlq is not None:
        auditor.feed_dead_letters(_letters(dlq, args.resolved.config.topics.events))
    if outcomes is not None:
        records_, starts = outcomes
        auditor.feed_outcomes(((r.partition, r.value, r.timestamp_ms) for r in records_), starts)
    if committed:
        auditor.feed_committed(committed)
    elif records and args.strict:
        # Strict cannot call a log clean without knowing the workers got through it: a group
        # that committed nothing is behind on every partition from offset 0.
        auditor.feed_committed({})
        print("turnstile audit: the workers' group has no committed offsets on this log; --strict counts "
              "every partition as not committed past (--worker-group names the group)", file=sys.stderr)  # fmt: skip
    elif records:
        print("turnstile audit: the workers' group has no committed offsets on this log; "
              "how far it got is not reported (--worker-group names it)", file=sys.stderr)  # fmt: skip
    return auditor.report(strict=args.strict, stall_after_s=args.stall_after_s, now_ms=began_ms)


def _outcomes_not_checked(why: str) -> None:
    print(f"turnstile audit: {why}: what the outcomes topic's consumers see is not checked "
          "(--outcomes-topic names it)", file=sys.stderr)  # fmt: skip


def _letters(records: list[Record], events: str) -> list[DeadLetter]:
    """The letters of this log's events topic (a worker names it in each; a letter naming
    another topic, a shared DLQ's or a forged one, was counted as this log's poison)."""
    letters: list[DeadLetter] = []
    elsewhere: list[DeadLetter] = []
    for record in records:
        try:
            letter = DeadLetter.model_validate_json(record.value or b"")
        except ValueError:  # not written by a worker: not a letter of ours to report
            print(f"turnstile audit: DLQ record {record.offset} is no dead letter; skipped", file=sys.stderr)
            continue
        (letters if letter.topic == events else elsewhere).append(letter)
    if elsewhere:
        print(f"turnstile audit: {len(elsewhere)} dead letter(s) name another topic than {events!r} "
              f"({printable(elsewhere[0].topic)!r} first): not this log's; skipped", file=sys.stderr)  # fmt: skip
    return letters


def _letters_not_checked(why: str) -> None:
    print(f"turnstile audit: {why}: dead letters are not checked (--dlq-topic names the topic)", file=sys.stderr)


async def run(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError

    # Before the read: an input still unclaimed when its partition is read had waited at least
    # this long (one claimed while the audit read other partitions is not counted against it).
    began_ms = SystemClock().now_ms()
    config: Config = args.resolved.config
    try:
        if config.broker:
            report = await _audit_kafka(args, config, began_ms)
        else:
            events, dlq = config.topics.events, config.topics.dead_letters
            if not (config.data / events).is_dir():
                raise LookupError(f"no embedded log of topic {events!r} in {config.data}")
            outcomes_topic = config.topics.outcomes
            log = FileLog(config.data, Topics(events, outcomes_topic, dlq))
            records = log.read_all(events)
            committed = log.committed_offsets()
            outcomes = None
            if (config.data / outcomes_topic).is_dir():  # (it keeps everything: no retention)
                outcomes = (log.read_all(outcomes_topic), dict.fromkeys(range(log.partition_count()), 0))
            else:
                _outcomes_not_checked(f"no embedded log of topic {outcomes_topic!r} in {config.data}")
            count = log.partition_count()
            # (its folder is made with its first letter: none yet is no letter, not "not read")
            report = audit_records(records, args, log.read_all(dlq), committed, began_ms, count, outcomes)
    except (OSError, LookupError, TimeoutError, KafkaError) as exc:
        why = f"not read to its end within --timeout {args.timeout:g} s" if isinstance(exc, TimeoutError) else exc
        print(f"turnstile audit: cannot read the log: {str(why) or type(exc).__name__}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report))
    return 0 if report.ok else 1


async def _audit_kafka(args: argparse.Namespace, config: Config, began_ms: int) -> AuditReport:
    from turnstile.streams.kafka_log import bootstrap_of
    from turnstile.streams.kafka_reader import partition_count, read_retained, read_topic

    assert config.broker is not None
    bootstrap, events = bootstrap_of(config.broker), config.topics.events
    records, starts = await read_retained(bootstrap, events, args.timeout)
    ends: dict[int, int] = {}
    for record in records:
        ends[record.partition] = max(ends.get(record.partition, 0), record.offset + 1)
    # The workers' offsets before their one-time writes: they write an outcome record or a
    # dead letter before they commit past its event, so all they committed past is there by now.
    committed = await _reported(bootstrap, args.worker_group or config.group, events, set(ends))
    try:
        dlq_topic = config.topics.dead_letters
        dlq: list[Record] | None = await read_topic(bootstrap, dlq_topic, timeout_s=min(args.timeout, 10.0))
    except LookupError as exc:  # no dead-letter topic: said, and the report says nothing of letters
        _letters_not_checked(str(exc))
        dlq = None
    outcomes: tuple[list[Record], dict[int, int]] | None
    try:
        outcomes = await read_retained(bootstrap, config.topics.outcomes, args.timeout)
    except LookupError as exc:  # no outcomes topic: what consumers see is not checked, said so
        _outcomes_not_checked(str(exc))
        outcomes = None
    partitions = await partition_count(bootstrap, events)
    report = audit_records(records, args, dlq, committed, began_ms, partitions, outcomes, starts)
    if not args.from_beginning:
        report = report.since(await _reported(bootstrap, args.audit_group, events, set(ends)))
    await _mark_reported(bootstrap, args.audit_group, events, ends)
    return report


async def _reported(bootstrap: str, group: str, topic: str, partitions: set[int]) -> dict[int, int]:
    """The group's committed offsets on `topic`, per partition: how far this auditor's
    group has reported, or how far the workers' group has got."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        out = {}
        for p in sorted(partitions):
            committed = await consumer.committed(TopicPartition(topic, p))
            if committed is not None:
                out[p] = committed
        return out
    finally:
        await consumer.stop()


async def _mark_reported(bootstrap: str, group: str, topic: str, ends: dict[int, int]) -> None:
    if not ends:
        return
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = {TopicPartition(topic, p): offset for p, offset in ends.items()}
        consumer.assign(list(tps))
        await consumer.commit(tps)
    finally:
        await consumer.stop()
