"""Operator output is inert: what clients wrote (ids, content) reaches `inspect`, `tail`
and the HTML turn page as literal text -- rich markup is not interpreted, HTML is escaped,
and no control character (an ANSI escape, a hyperlink sequence) is passed through."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from worker_harness import events_of, running, until

from turnstile.events import TurnCompleted
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections.inert import printable
from turnstile.streams.console.pages import turn_page
from turnstile.streams.file_log import FileLog
from turnstile.streams.inspect_cli import file_records, inspect
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.views import build_view

ROOT = Path(__file__).parent.parent
CONVERSATION = "[/]\x1b[31mred"  # a closing tag rich choked on, then an ANSI colour
CONTENT = "[bold red]loud[/] [link=https://evil.example]click[/link] \x1b]8;;https://evil.example\x07x <script>"


async def answered_turn(tmp_path: Path) -> FileLog:
    log = FileLog(tmp_path)
    async with running(log, ScriptedProvider()):
        await publish(log, message_event(CONVERSATION, CONTENT, 1, "m\x1b[2J1"))
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, CONVERSATION)))
    return log


def test_printable_writes_control_characters_out():
    assert printable("a\x1b[31mb\nc\x7f\x9bd") == "a\\x1b[31mb\\nc\\x7f\\x9bd"
    assert printable("café [/] ünïcode") == "café [/] ünïcode"


async def test_inspect_prints_ids_and_content_literally(tmp_path):
    await answered_turn(tmp_path)
    out = io.StringIO()
    view = await inspect(CONVERSATION, broker=None, data=tmp_path, topics=Topics(),
                         console=Console(file=out, width=300, color_system=None))
    text = out.getvalue()
    assert view.turns and "\x1b" not in text and "\x07" not in text
    assert "[/]\\x1b[31mred" in text  # the id, escaped and not read as markup
    assert "[bold red]loud[/] [link=https://evil.example]click[/link]" in text
    assert "m\\x1b[2J1" in text


def test_tail_prints_no_escape_sequence(tmp_path):
    asyncio.run(answered_turn(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "tail", "--data", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "[/]\\x1b[31mred" in result.stdout and "TurnCompleted" in result.stdout


async def test_the_html_turn_page_escapes_ids_and_content(tmp_path):
    log = await answered_turn(tmp_path)
    view = build_view(CONVERSATION, file_records(tmp_path, log.topics, CONVERSATION))
    [turn] = view.turns.values()
    page = turn_page(view, turn)
    assert "\x1b" not in page and "\x07" not in page and "<script>" not in page
    assert "[/]\\x1b[31mred" in page and "&lt;script&gt;" in page
