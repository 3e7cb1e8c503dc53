"""`turnstile inspect CONVERSATION`: the conversation as the log says it is.

It reads the log with its own reader (no consumer group, nothing committed), so it shows
the same state whether zero, one or many workers run: the history, the pending set, the
active turn and a timeline per turn (attempts, iterations, tool calls, outcome, cost,
duration), rendered with rich. What comes from the log (ids, content) is printed as plain
`Text` with its control characters escaped (`inert.printable`): never read as markup.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from turnstile.projections.inert import inert_json, printable
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Record, Topics
from turnstile.streams.views import ConversationView, TurnView, build_view, state_json, turn_json


# -- reading -----------------------------------------------------------------------------
def file_records(directory: Path, topics: Topics, conversation_id: str) -> list[Record]:
    """The records of the conversation's partition of the embedded log."""
    return FileLog(directory, topics).conversation_records(conversation_id)


async def conversation_records(conversation_id: str, *, broker: str | None, data: Path, topics: Topics) -> list[Record]:
    """The records of the conversation's partition, on Kafka or in the embedded log."""
    from turnstile.streams.serving import LogPlace

    return await LogPlace(broker, data, topics).open().reader().conversation(conversation_id)


# -- rendering ---------------------------------------------------------------------------
def _time(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _short(text: str, limit: int = 100) -> Text:
    text = printable(text.replace("\n", " "))
    return Text(text if len(text) <= limit else text[: limit - 1] + "…")


def _plain(text: str) -> Text:
    """Log text as rich shows it: literally (a `[/]` in an id is not markup), no control characters."""
    return Text(printable(text))


def _cost(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.6f}"


def render(view: ConversationView, console: Console) -> None:
    state = view.state
    head = Text.assemble((printable(state.conversation_id), "bold"),
                         f"  ·  {state.events_applied} events folded  ·  {len(view.turns)} turns")
    console.print(Panel(head, title="conversation"))

    history = Table(title="history", expand=True)
    for column in ("time", "role", "turn", "content"):
        history.add_column(column)
    for h in state.history:
        role = h.role if h.outcome is None else f"{h.role} ({h.outcome})"
        role += " (withheld: refused)" if h.withheld else ""
        history.add_row(_time(h.occurred_at), _plain(role), _plain(h.turn_id[:8]), _short(h.content))
    console.print(history if state.history else Text("history: empty"))

    if state.pending:
        pending = Table(title="pending", expand=True)
        for column in ("time", "input", "kind", "content"):
            pending.add_column(column)
        for p in state.pending.values():
            kind = p.kind if p.source is None else f"{p.kind} ({p.source})"
            pending.add_row(_time(p.occurred_at), _plain(p.input_id), _plain(kind), _short(p.content))
        console.print(pending)
    else:
        console.print(Text("pending: none"))

    if state.rejected:
        console.print(_plain(f"rejected (double text): {', '.join(state.rejected)}"))

    active = state.active
    if active is None:
        console.print(Text("active turn: none"))
    else:
        console.print(
            Panel(
                Text("\n").join([
                    _plain(f"turn {active.turn_id[:12]}  inputs {list(active.input_ids)}"),
                    _plain(f"claimed {_time(active.claimed_at)}  attempt {active.attempt} ({active.attempt_state})  "
                           f"run {active.run_id[:8]}  model {active.model}"),
                    _plain(f"iterations {active.iterations}  tool calls {active.tool_calls}  "
                           f"cost {_cost(active.cost_usd)}"),
                ]),
                title="active turn",
                border_style="yellow",
            )
        )

    for turn in view.turns.values():
        console.print(_turn_panel(turn))
    if view.undecodable:
        console.print(Text(f"{view.undecodable} value(s) of the partition did not decode (see the DLQ)"))


def _turn_panel(turn: TurnView) -> Panel:
    outcome = turn.outcome or "active"
    colour = {"completed": "green", "failed": "red", "paused": "yellow", "exhausted": "magenta"}.get(outcome, "cyan")
    duration = "—" if turn.duration_ms is None else f"{turn.duration_ms / 1000:.2f}s"
    head = Text.assemble(
        printable(
            f"inputs {list(turn.input_ids)}  ·  attempts {len(turn.attempts)}  ·  iterations {turn.iterations}"
            f"  ·  tool calls {len(turn.tool_calls)}  ·  outcome "
        ),
        (outcome, f"bold {colour}"),
        f"  ·  cost {_cost(turn.cost_usd)}  ·  duration {duration}",
    )
    parts: list[Text | Table] = [head]
    if turn.outcome_detail:
        parts.append(_short(turn.outcome_detail, 200))
    steps = Table(show_header=True, box=None, expand=True)
    for column in ("at", "+s", "event", "detail"):
        steps.add_column(column)
    for e in turn.entries:
        detail = e.text if e.ignored is None else f"{e.text}  [ignored: {e.ignored}]"
        style = "dim" if e.ignored else None
        steps.add_row(f"{e.partition}@{e.offset}", f"{(e.occurred_at - turn.claimed_at) / 1000:+.3f}", _plain(e.type),
                      _short(detail, 120), style=style)
    parts.append(steps)
    return Panel(Group(*parts), title=_plain(f"turn {turn.turn_id[:12]}"), border_style=colour)


def as_json(view: ConversationView) -> str:
    """`inspect --json`: the conversation as `GET /conversations/{id}` answers it, each of its
    turns as `GET .../turns/{turn_id}` does (timeline included), and how many values of its
    partition did not decode. Every control character is a JSON escape (`inert_json`), so
    printing it restyles no terminal."""
    whole = {
        **state_json(view),
        "turns": [turn_json(view.state.conversation_id, turn) for turn in view.turns.values()],
        "undecodable": view.undecodable,
    }
    return inert_json(orjson.dumps(whole, option=orjson.OPT_INDENT_2).decode())


async def inspect(
    conversation_id: str,
    *,
    broker: str | None,
    data: Path,
    topics: Topics,
    console: Console | None = None,
    print_json: bool = False,
) -> ConversationView:
    records = await conversation_records(conversation_id, broker=broker, data=data, topics=topics)
    view = build_view(conversation_id, records)
    if view.state.events_applied or view.undecodable:  # else nothing to show: the caller says not found
        out = console or Console()
        if print_json:
            out.out(as_json(view), highlight=False)
        else:
            render(view, out)
    return view
