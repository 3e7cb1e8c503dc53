"""`turnstile approve|deny CONVERSATION CALL_ID [--note]` and `turnstile resume CONVERSATION`:
the conversation is folded from the log (no worker needed), `handlers.operations` decides
the input event, and it is published like a user's message; the running worker claims it
as a new logical turn, whose id is printed."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable

from turnstile.events import InputEvent
from turnstile.events.identity import content_fingerprint
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.operations import AlreadyTaken, Operation, Refused, Verb, decide_operation
from turnstile.projections import new_state
from turnstile.streams.cli_errors import DATA_ERR, NOT_FOUND, UNAVAILABLE, CliError
from turnstile.streams.http_reads import PartitionReads, Reads, Unavailable
from turnstile.streams.log import RecordRefused
from turnstile.streams.publisher import publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.serving import LogPlace
from turnstile.streams.views import ConversationView


async def publish_input(place: LogPlace, event: InputEvent) -> tuple[int, int]:
    """(partition, offset) of `event` once the log has it, through a producer-only open of
    the log (no consumer, no group)."""
    log = place.open()
    await log.start_producer()
    try:
        return await publish(log, event)
    except RecordRefused as exc:  # its bytes: 200,000 characters escape to up to 1.2 MB of JSON
        raise CliError(DATA_ERR, f"the log does not take this input: {exc}") from None
    finally:
        await log.stop()


async def first_use(place: LogPlace, conversation: str, input_id: str) -> str | Unavailable | None:
    """The content fingerprint of the input id's first use on the log (read after an append:
    if it is not the appended content's, the append was a conflicting duplicate, which every
    reader ignores and the worker dead-letters). Read as the HTTP port reads a conversation
    it does not hold: its snapshot and the rest of its partition, bounded; `Unavailable` when
    that read fails (the append stands)."""
    view = await logged(place, conversation)
    return view if isinstance(view, Unavailable) else view.state.seen_inputs.get(input_id)


async def logged(place: LogPlace, conversation: str) -> ConversationView | Unavailable:
    """The conversation as its snapshot and the rest of its partition have it (bounded), as
    the HTTP port reads one it does not hold: a decision needs the state, not every turn's
    timeline, and a long partition is not read whole."""
    return await Reads(None, PartitionReads(place.open().reader(), place.topics)).logged(conversation)


def unchecked(what: str, why: Unavailable) -> None:
    """The append stands; whether it came first could not be read."""
    print(f"turnstile: {what} is on the log, but whether it came first could not be checked: {why.message}",
          file=sys.stderr)  # fmt: skip


async def decided_on_log(
    place: LogPlace,
    conversation: str,
    verb: Verb,
    call_id: str | None,
    note: str | None,
    turn_id: str | None = None,
    policy: DebouncePolicy = DebouncePolicy(),
) -> Operation | Refused | AlreadyTaken | Unavailable:
    """An operator's decision on `conversation` as its log has it now (`Unavailable` when the
    log could not be read; a conversation with no event is one with nothing to decide);
    `policy`: the workers' debounce, whose claims say which turn will take the decision."""
    view = await logged(place, conversation)
    if isinstance(view, Unavailable) and view.status != 404:
        return view
    state = new_state(conversation) if isinstance(view, Unavailable) else view.state
    event_id, now_ms = uuid.uuid4().hex, SystemClock().now_ms()
    return decide_operation(
        state, verb, call_id, note, event_id=event_id, now_ms=now_ms, policy=policy, turn_id=turn_id
    )


async def operate(args: argparse.Namespace, place: LogPlace, policy: DebouncePolicy) -> int:
    call_id, turn_id = (None, None) if args.command == "resume" else (args.call_id, args.turn)
    decided = await decided_on_log(place, args.conversation, args.command, call_id, args.note, turn_id, policy)
    if isinstance(decided, Unavailable):
        raise CliError(UNAVAILABLE, decided.message)
    if isinstance(decided, Refused):
        raise CliError(NOT_FOUND, decided.reason)  # nothing to act on, as an unknown conversation
    if isinstance(decided, AlreadyTaken):  # run twice: harmless, and said so
        print(f"turnstile {args.command}: {decided.said}")
        return 0
    event = decided.event
    partition, offset = await publish_input(place, event)
    what = {"approve": "approval", "deny": "denial", "resume": "resume request"}[args.command]
    # Decided from the log as it was read: another decision may have been written since.
    input_id = decided.input_id
    first = await first_use(place, args.conversation, input_id)
    if isinstance(first, Unavailable):
        unchecked(f"the {what}", first)
    elif first != content_fingerprint(event.content):
        raise CliError(NOT_FOUND, f"another decision ({input_id}) was written first; the first one stands")
    print(f"{what} written to {place.topics.events}[{partition}]@{offset}; new logical turn {decided.turn_id}")
    return 0


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], add_log_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    """`approve`, `deny` and `resume`; `add_log_args` adds the shared --broker/--data flags."""
    for verb, says in (("approve", "let the paused tool call run"), ("deny", "refuse the paused tool call")):
        parser = sub.add_parser(verb, help=f"{says}: its turn continues in a new logical turn")
        add_log_args(parser)
        parser.add_argument("conversation", help="the conversation whose turn is paused")
        parser.add_argument("call_id", help="the call the turn paused on (turnstile inspect shows it)")
        parser.add_argument("--note", default=None, help="a sentence for the model, e.g. why it was denied")
        parser.add_argument(
            "--turn", default=None, metavar="TURN_ID",
            help="the paused turn (its id or first characters), when calls of this id wait in more than one",
        )  # fmt: skip
    what = "continue a turn paused on its budget, failed (not refused by the model) or exhausted, in a new turn"
    resume = sub.add_parser("resume", help=what)
    add_log_args(resume)
    resume.add_argument("conversation", help="the conversation whose last turn paused, failed or was exhausted")
    resume.add_argument("--note", default=None, help="what the model reads instead of 'Continue.'")
