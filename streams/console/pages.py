"""The console's three pages as HTML strings, rendered on the server from the read model's
views. Every value from the log goes through `format.esc*`; the script only adds local
times, copies ids, follows live updates and calls the operations."""

from __future__ import annotations

from importlib import resources
from urllib.parse import urlencode

from turnstile.handlers.context import render_pending
from turnstile.handlers.operations import awaiting_approval
from turnstile.projections import STATUSES, PendingInput, conversation_status
from turnstile.streams.console.format import (
    count,
    duration,
    esc,
    esc_text,
    money,
    path_part,
    redact_json,
    short_id,
    status_badge,
    when,
)
from turnstile.streams.console.waterfall import waterfall
from turnstile.streams.read_model import ConversationPage
from turnstile.streams.views import ConversationView, TurnView, turn_count, turn_summaries

ASSETS = ("console.css", "console.js")


def asset(name: str) -> str:
    """A file of the console's assets, as shipped in the package."""
    if name not in ASSETS:
        raise FileNotFoundError(name)
    return resources.files("turnstile.streams.console").joinpath("assets", name).read_text(encoding="utf-8")


def layout(title: str, main: str, *, body_data: dict[str, str] | None = None, standalone: bool = False,
           aside: str = "", provenance: str = "") -> str:
    """The page around `main`. `standalone`: the assets inlined and no links back to a
    server (an exported page opens from a file), saying where it came from (`provenance`)."""
    data = "".join(f' data-{k}="{esc(v)}"' for k, v in (body_data or {}).items())
    if standalone:
        head = f"<style>{asset('console.css')}</style>"
        script = f"<script>{asset('console.js')}</script>"
        nav = f'<nav><span class="brand">turnstile</span> <span class="muted">{esc(provenance)}</span></nav>'
    else:
        head = '<link rel="stylesheet" href="/ui/assets/console.css">'
        script = '<script src="/ui/assets/console.js" defer></script>'
        nav = '<nav><a class="brand" href="/ui">turnstile</a> <a href="/ui">conversations</a></nav>'
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>{head}'
        f"</head><body{data}>{nav}{aside}<main>{main}</main>{script}</body></html>\n"
    )


def login_page(failed: bool) -> str:
    problem = '<p class="error">That token is not the one this worker was given.</p>' if failed else ""
    form = (
        '<h1>Sign in</h1><p>This console needs the worker\'s HTTP token (<code>TURNSTILE_HTTP_TOKEN</code>).</p>'
        f'{problem}<form method="post" action="/ui/login" class="login"><label>Token '
        '<input type="password" name="token" autocomplete="current-password" autofocus required></label>'
        ' <button type="submit">Sign in</button></form>'
    )
    return layout("turnstile · sign in", form)


# -- the list ----------------------------------------------------------------------------
def list_page(page: ConversationPage, contains: str, status: str | None, limit: int) -> str:
    options = "".join(
        f'<option value="{s}"{" selected" if s == status else ""}>{esc(s)}</option>' for s in STATUSES
    )
    form = (
        '<form class="filters" method="get" action="/ui">'
        f'<label>id contains <input name="q" value="{esc(contains)}" placeholder="part of an id"></label> '
        f'<label>status <select name="status"><option value="">any</option>{options}</select></label> '
        '<button type="submit">Filter</button></form>'
    )
    rows = "".join(
        f'<tr data-conversation="{esc(r.conversation_id)}">'
        f'<td><a href="/ui/conversations/{path_part(r.conversation_id)}">{short_id(r.conversation_id, 24)}</a></td>'
        f"<td>{status_badge(r.status)}</td><td>{when(r.last_event_at)}</td>"
        f"<td>{count(r.events)}</td><td>{count(r.turns)}</td><td>{count(r.pending)}</td></tr>"
        for r in page.rows
    )
    empty = '<tr><td colspan="6" class="muted">no conversation matches</td></tr>' if not page.rows else ""
    more = ""
    if page.next_cursor is not None:
        query = {"q": contains, "status": status or "", "limit": str(limit), "before": str(page.next_cursor)}
        more = f'<p><a class="next" href="/ui?{esc(urlencode(query))}">older conversations →</a></p>'
    table = (
        '<table class="list"><thead><tr><th>conversation</th><th>status</th><th>last event</th><th>events</th>'
        f"<th>turns</th><th>pending</th></tr></thead><tbody>{rows}{empty}</tbody></table>"
    )
    main = f'<h1>Conversations</h1><p class="muted">this worker\'s, most recently active first</p>{form}{table}{more}'
    return layout("turnstile · conversations", main)


# -- a conversation ----------------------------------------------------------------------
def conversation_main(view: ConversationView) -> str:
    """The part of the conversation page that live updates replace."""
    state = view.state
    status = conversation_status(state)
    head = (
        f'<h1>Conversation {short_id(state.conversation_id, 40)}</h1>'
        f'<p class="facts">{status_badge(status)} · {count(state.events_applied)} events · '
        f"{count(turn_count(view))} turns · last event {when(view.last_event_at)}</p>"
    )
    parts = [head, _active(view), _operations(view), _pending(view), _history(view), _turns(view)]
    return "".join(parts)


def conversation_page(view: ConversationView, live: bool) -> str:
    conversation = view.state.conversation_id
    aside = (
        '<section id="live" class="live" hidden><h2>Reply being written</h2>'
        '<p class="muted" id="live-note"></p><pre id="live-text"></pre></section>'
    )
    data = {"conversation": conversation, "live": "1" if live else ""}
    return layout(f"turnstile · {conversation}", conversation_main(view), body_data=data, aside=aside)


def awaited_conversation_page(conversation: str, why: str) -> str:
    """A conversation with no event folded yet, on a worker that would fold it: the page
    follows it live and turns into its page at its first event."""
    main = (
        f"<h1>Conversation {short_id(conversation, 40)}</h1><p class=\"muted\">{esc(why)}. This page follows it "
        "and shows it once its first event is folded.</p>"
    )
    data = {"conversation": conversation, "live": "1"}
    return layout(f"turnstile · {conversation}", main, body_data=data)


def _turn_link(conversation: str, turn_id: str) -> str:
    href = f"/ui/conversations/{path_part(conversation)}/turns/{path_part(turn_id)}"
    return f'<a href="{href}">{short_id(turn_id)}</a>'


def _active(view: ConversationView) -> str:
    active = view.state.active
    if active is None:
        return ""
    conversation = view.state.conversation_id
    return (
        '<section class="active"><h2>Active turn</h2><table class="kv">'
        f"<tr><th>turn</th><td>{_turn_link(conversation, active.turn_id)}</td></tr>"
        f"<tr><th>claimed</th><td>{when(active.claimed_at)}</td></tr>"
        f"<tr><th>attempt</th><td>{active.attempt} ({esc(active.attempt_state)})"
        f" on {esc(active.model or '—')}</td></tr>"
        f"<tr><th>iterations · tool calls</th><td>{count(active.iterations)} · {count(active.tool_calls)}</td></tr>"
        f"<tr><th>tokens in / out</th><td>{count(active.input_tokens)} / {count(active.output_tokens)}</td></tr>"
        f"<tr><th>cost so far</th><td>{money(active.cost_usd)}</td></tr></table></section>"
    )


def _operations(view: ConversationView) -> str:
    state = view.state
    if state.active is not None or not state.turns:
        return ""
    last = next(reversed(state.turns.values()))
    # The newest call waiting for a decision, whichever turn paused on it (the user may have
    # written again since); its turn goes with the decision, in case a call id repeats.
    waiting = awaiting_approval(state)
    if waiting is not None and (call := waiting.pending_call) is not None:
        turn = esc(waiting.turn_id)
        return (
            '<section class="paused"><h2>Waiting for approval</h2>'
            f"<p>Turn {_turn_link(state.conversation_id, waiting.turn_id)} wants to call "
            f"<strong>{esc(call.name)}</strong> (call {short_id(call.call_id)}) with</p>"
            f'<pre class="args">{esc_text(redact_json(call.arguments))}</pre>'
            f'<form class="op" data-op="decide" data-call="{esc(call.call_id)}" data-turn="{turn}">'
            '<label>note <input name="note" placeholder="a sentence for the model (optional)"></label> '
            '<button type="submit" name="verb" value="approve" class="approve">Approve</button> '
            '<button type="submit" name="verb" value="deny" class="deny">Deny</button>'
            '<output class="op-result"></output></form></section>'
        )
    if last.outcome in ("paused", "failed", "exhausted"):
        return (
            f'<section class="paused"><h2>Turn {esc(last.outcome)}</h2>'
            f"<p>Turn {_turn_link(state.conversation_id, last.turn_id)} {esc(last.outcome)}; "
            "a resume continues it in a new turn.</p>"
            '<form class="op" data-op="resume"><label>note <input name="note" placeholder="Continue."></label> '
            '<button type="submit" name="verb" value="resume" class="resume">Resume</button>'
            '<output class="op-result"></output></form></section>'
        )
    return ""


def _pending(view: ConversationView) -> str:
    pending = view.state.pending
    if not pending:
        return ""
    rows = "".join(
        f"<tr><td>{short_id(p.input_id)}</td><td>{esc(p.kind)}{' · ' + esc(p.source) if p.source else ''}</td>"
        f'<td>{when(p.occurred_at)}</td><td class="text">{esc_text(p.content)}</td></tr>'
        for p in pending.values()
    )
    return (
        '<section><h2>Pending inputs</h2><table><thead><tr><th>input</th><th>kind</th><th>at</th><th>content</th>'
        f"</tr></thead><tbody>{rows}</tbody></table></section>"
    )


# Beside an input the model refused: later turns do not send it (`HistoryEntry.withheld`).
_WITHHELD = ' <span class="muted" title="the model refused it; later turns do not send it">(withheld)</span>'


def _history(view: ConversationView) -> str:
    conversation = view.state.conversation_id
    rows = "".join(
        f'<tr class="{h.role}"><td>{esc(h.role)}{_WITHHELD if h.withheld else ""}</td><td>{when(h.occurred_at)}</td>'
        f"<td>{_turn_link(conversation, h.turn_id)}</td><td class=\"text\">{esc_text(h.content)}</td></tr>"
        for h in view.state.history
    )
    if not rows:
        rows = '<tr><td colspan="4" class="muted">no turn has ended yet</td></tr>'
    return (
        '<section><h2>History</h2><table class="history"><thead><tr><th>role</th><th>at</th><th>turn</th>'
        f"<th>content</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _turns(view: ConversationView) -> str:
    conversation = view.state.conversation_id
    rows = "".join(
        f'<tr><td>{_turn_link(conversation, t.turn_id)}</td><td>{when(t.claimed_at)}</td>'
        f'<td><span class="outcome o-{esc(t.outcome or "active")}">{esc(t.outcome or "active")}</span></td>'
        f"<td>{count(t.attempts)}</td><td>{_known(t.iterations)}</td><td>{_known(t.tool_calls)}</td>"
        # A turn only the state knows has no cost on record (not: a model without a price).
        f"<td>{money(t.cost_usd) if t.detailed or t.cost_usd is not None else '—'}</td>"
        f"<td>{duration(t.duration_ms)}</td></tr>"
        for t in reversed(turn_summaries(view))
    )
    return (
        '<section><h2>Turns</h2><table class="turns"><thead><tr><th>turn</th><th>claimed</th><th>outcome</th>'
        "<th>attempts</th><th>iterations</th><th>tool calls</th><th>cost</th><th>duration</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


def _known(value: int | None) -> str:
    return "—" if value is None else count(value)


# -- a turn ------------------------------------------------------------------------------
def rendered_inputs(view: ConversationView, turn: TurnView) -> str:
    """The turn's claimed inputs as the model was sent them (`handlers.context`)."""
    state = view.state
    if state.active is not None and state.active.turn_id == turn.turn_id:
        rows = list(state.active.inputs)
    else:
        rows = [PendingInput("", "message", h.content, h.occurred_at)
                for h in state.history if h.role == "user" and h.turn_id == turn.turn_id]
    return render_pending(rows) if rows else ""


def turn_main(view: ConversationView, turn: TurnView, *, standalone: bool = False) -> str:
    conversation = view.state.conversation_id
    outcome = turn.outcome or "active"
    back = "" if standalone else f'<a href="/ui/conversations/{path_part(conversation)}">← conversation</a>'
    head = (
        f'<p class="crumbs">{back}</p><h1>Turn {short_id(turn.turn_id)} of {short_id(conversation, 40)}</h1>'
        f'<p class="facts"><span class="outcome o-{esc(outcome)}">{esc(outcome)}</span> · claimed '
        f"{when(turn.claimed_at)} · {duration(turn.duration_ms)} · {money(turn.cost_usd)} · "
        f"{count(turn.input_tokens)} tokens in / {count(turn.output_tokens)} out</p>"
    )
    inputs = rendered_inputs(view, turn)
    inputs_html = (
        f'<section><h2>Inputs, as rendered to the model</h2><p class="muted">claimed: '
        f'{", ".join(short_id(i) for i in turn.input_ids)}</p><pre class="text">{esc_text(inputs)}</pre></section>'
    )
    outcome_html = (
        '<section><h2>Outcome</h2><table class="kv">'
        f'<tr><th>outcome</th><td>{esc(outcome)}</td></tr>'
        f'<tr><th>detail</th><td class="text">{esc_text(turn.outcome_detail or "—")}</td></tr>'
        f"<tr><th>attempts · iterations · tool calls</th><td>{count(len(turn.attempts))} · {count(turn.iterations)}"
        f" · {count(len(turn.tool_calls))}</td></tr>"
        f"<tr><th>tokens in / out</th><td>{count(turn.input_tokens)} / {count(turn.output_tokens)}</td></tr>"
        f"<tr><th>cost</th><td>{money(turn.cost_usd)}</td></tr>"
        f"<tr><th>duration</th><td>{duration(turn.duration_ms)}</td></tr>"
        f"<tr><th>protocol failures · fallbacks</th><td>{count(turn.protocol_failures)} · {count(turn.fallbacks)}"
        "</td></tr></table></section>"
    )
    return head + _waterfall(turn) + inputs_html + outcome_html + _events(turn)


def turn_page(
    view: ConversationView, turn: TurnView, *, live: bool = False, standalone: bool = False, provenance: str = ""
) -> str:
    """`standalone` (an export): `provenance` says where, when and by what it was read."""
    conversation = view.state.conversation_id
    data = {"conversation": conversation, "live": "1" if live and not standalone else "", "turn": turn.turn_id}
    title = f"turnstile · turn {turn.turn_id[:12]} of {conversation}"
    main = turn_main(view, turn, standalone=standalone)
    return layout(title, main, body_data=data, standalone=standalone, provenance=provenance)


def _waterfall(turn: TurnView) -> str:
    fall = waterfall(turn)
    rows = []
    for span in fall.spans:
        left, width = fall.position(span)
        end = span.end if span.end is not None else fall.end
        tokens = (
            f"{count(span.input_tokens)} / {count(span.output_tokens or 0)}" if span.input_tokens is not None else ""
        )
        cost = money(span.cost_usd) if span.input_tokens is not None else ""
        details = "".join(
            f'<div class="detail"><span class="muted">{esc(name)}</span><pre>{esc_text(redact_json(text))}</pre></div>'
            for name, text in span.details
        )
        opened = f"<details><summary>{esc(span.label)}</summary>{details}</details>" if details else esc(span.label)
        rows.append(
            f'<tr class="span k-{span.kind} st-{esc(span.status)}"><td class="label">{opened}</td>'
            f'<td class="track"><div class="bar" style="left:{left}%;width:{width}%"></div></td>'
            f"<td>+{duration(span.start - fall.start)}</td><td>{duration(end - span.start)}</td>"
            f"<td>{tokens}</td><td>{cost}</td><td>{esc(span.status)}</td></tr>"
        )
    body = "".join(rows) or '<tr><td colspan="7" class="muted">nothing ran yet</td></tr>'
    return (
        '<section><h2>Waterfall</h2><table class="waterfall"><thead><tr><th>step</th><th class="track">'
        f"timeline ({duration(fall.end - fall.start)})</th><th>start</th><th>duration</th><th>tokens in / out</th>"
        f"<th>cost</th><th>status</th></tr></thead><tbody>{body}</tbody></table></section>"
    )


def _events(turn: TurnView) -> str:
    rows = "".join(
        f'<tr{" class=ignored" if e.ignored else ""}><td>{e.partition}@{e.offset}</td>'
        f"<td>+{duration(e.occurred_at - turn.claimed_at)}</td><td>{esc(e.type)}</td>"
        f'<td class="text">{esc(e.text)}{" — ignored: " + esc(e.ignored) if e.ignored else ""}</td></tr>'
        for e in turn.entries
    )
    return (
        '<section><h2>Events</h2><table class="events"><thead><tr><th>at</th><th>+time</th><th>event</th>'
        f"<th>detail</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )
