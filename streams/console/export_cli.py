"""`turnstile export-turn CONVERSATION TURN_ID [-o FILE] [--format html|json]`: one turn, for
an incident or an audit. The conversation is folded from the log by an independent reader
(no worker needed, `--broker` or `--data` as for `inspect`).

`html` (the default) is the turn's console page as one standalone file: its stylesheet and
script inline, no link to anything. `json` is the audit record: the turn's records exactly
as the log holds them (the inputs it claimed, then its own events, each with its partition
and offset and, when the fold ignored it, why), with where and when they were read and by
which version. Both say where they came from."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from turnstile.events import INPUT_TYPES, decode_record, input_id
from turnstile.streams.cli_errors import CANT_CREATE, NOT_FOUND, CliError
from turnstile.streams.console.format import iso_utc
from turnstile.streams.console.pages import turn_page
from turnstile.streams.log import Record
from turnstile.streams.runtime import SystemClock
from turnstile.streams.serving import LogPlace
from turnstile.streams.views import MIN_TURN_PREFIX, TurnView, build_view, turn_named


async def export_turn(args: argparse.Namespace, place: LogPlace) -> int:
    from turnstile import __version__

    log = place.open()
    records = await log.reader().conversation(args.conversation)
    view = build_view(args.conversation, records)
    turn = view.turns.get(turn_named(view, args.turn_id))
    if turn is None:
        short = " (a turn id, or 8 or more of its first characters)" if len(args.turn_id) < MIN_TURN_PREFIX else ""
        raise CliError(NOT_FOUND, f"no turn {args.turn_id!r} in conversation {args.conversation!r} on {place}{short}")
    now_ms = SystemClock().now_ms()
    at = iso_utc(now_ms)
    by = f"turnstile {__version__}"
    if args.format == "json":
        exported = {"by": by, "at": at, "at_ms": now_ms, "log": str(place), "topic": log.topics.events}
        text = orjson.dumps(audit_record(args.conversation, turn, records, exported), option=orjson.OPT_INDENT_2)
        content = text.decode() + "\n"
    else:
        said = f"exported from {place} ({log.topics.events}) at {at} by {by}"
        content = turn_page(view, turn, standalone=True, provenance=said)
    out = args.output or Path(f"turn-{turn.turn_id[:12]}.{args.format}")
    try:
        out.write_text(content, encoding="utf-8")
    except OSError as exc:
        raise CliError(CANT_CREATE, f"cannot write {out} ({exc.strerror})") from None
    print(f"turn {turn.turn_id} of {args.conversation} written to {out}")
    return 0


def audit_record(conversation: str, turn: TurnView, records: list[Record], exported: dict[str, Any]) -> dict[str, Any]:
    """The turn as the log holds it: the records of the inputs it claimed (first delivery of
    each id: the one its pending set took), then the turn's own, in log order."""
    claimed, inputs = set(turn.input_ids), []
    for record in records:
        event = decode_record(record.key, record.value)
        if isinstance(event, INPUT_TYPES) and event.conversation_id == conversation and input_id(event) in claimed:
            claimed.discard(input_id(event))
            inputs.append(_entry(record.partition, record.offset, record.value or b"", None))
    steps = [_entry(e.partition, e.offset, e.value, e.ignored) for e in turn.entries]
    return {
        "exported": exported,
        "conversation_id": conversation,
        "turn_id": turn.turn_id,
        "outcome": turn.outcome,
        "input_ids": list(turn.input_ids),
        "run_ids": [attempt.run_id for attempt in turn.attempts],
        "records": inputs + steps,
    }


def _entry(partition: int, offset: int, value: bytes, ignored: str | None) -> dict[str, Any]:
    # The value's own bytes, not a re-encoding: what an auditor checks against the log.
    return {"partition": partition, "offset": offset, "ignored": ignored, "event": orjson.Fragment(value)}


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], add_log_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    parser = sub.add_parser("export-turn", help="write one turn as a standalone HTML page or a JSON audit record")
    add_log_args(parser)
    parser.add_argument("conversation", help="the conversation id")
    parser.add_argument("turn_id", help="the turn's id, or its first 8+ characters (inspect and the console show it)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="the file (default: turn-<id>.<format> here)")
    parser.add_argument(
        "--format", choices=("html", "json"), default="html",
        help="html: the console's page of the turn; json: its records as the log holds them, for an audit",
    )  # fmt: skip
