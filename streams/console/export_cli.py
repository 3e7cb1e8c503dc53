"""`turnstile export-turn CONVERSATION TURN_ID [-o FILE]`: one turn's console page as a
standalone HTML file, for an incident or an audit. The conversation is folded from the log
by an independent reader (no worker needed, `--broker` or `--data` as for `inspect`); the
page carries its stylesheet and script inline and links to nothing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from turnstile.streams.cli_errors import CANT_CREATE, NOT_FOUND, CliError
from turnstile.streams.console.pages import turn_page
from turnstile.streams.serving import LogPlace
from turnstile.streams.views import build_view, turn_named


async def export_turn(args: argparse.Namespace, place: LogPlace) -> int:
    records = await place.open().reader().conversation(args.conversation)
    view = build_view(args.conversation, records)
    turn = view.turns.get(turn_named(view, args.turn_id))
    if turn is None:
        raise CliError(NOT_FOUND, f"no turn {args.turn_id!r} in conversation {args.conversation!r} on {place}")
    out = args.output or Path(f"turn-{turn.turn_id[:12]}.html")
    try:
        out.write_text(turn_page(view, turn, standalone=True), encoding="utf-8")
    except OSError as exc:
        raise CliError(CANT_CREATE, f"cannot write {out} ({exc.strerror})") from None
    print(f"turn {turn.turn_id} of {args.conversation} written to {out}")
    return 0


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], add_log_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    parser = sub.add_parser("export-turn", help="write one turn's console page as a standalone HTML file")
    add_log_args(parser)
    parser.add_argument("conversation", help="the conversation id")
    parser.add_argument("turn_id", help="the turn's id, or its first 8+ characters (inspect and the console show it)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="the file (default: turn-<id>.html here)")
