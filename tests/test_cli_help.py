"""Every flag and argument of every command says what it is for: `turnstile CMD --help` is
the reference an operator reads first."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from turnstile.streams.cli import build_parser


def parsers(parser: argparse.ArgumentParser, name: str = "turnstile") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The parser and each subcommand's, by command name. argparse has no public listing of
    a parser's actions, so this reads `_actions`, as argparse's own help formatter does."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from parsers(sub, f"{name} {command}")


def actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            yield action


def test_every_flag_and_argument_of_every_command_has_help_text():
    missing = [
        f"{command}: {'/'.join(action.option_strings) or action.dest}"
        for command, parser in parsers(build_parser())
        for action in actions(parser)
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS
    ]
    assert missing == []


def test_the_walk_sees_every_command():
    commands = {name for name, _ in parsers(build_parser())}
    assert {"turnstile run", "turnstile send", "turnstile audit", "turnstile approve", "turnstile resume"} <= commands
