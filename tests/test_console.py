"""The console's pages as an HTTP client gets them: readable numbers and ids, inert output,
secret fields redacted, the list's filters, the sign-in cookie, the live feed, and the
static export of a turn's page."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
from mail_agent import mail_worker
from worker_harness import serving

import turnstile
from turnstile import Agent, TestModel
from turnstile.events import Usage, decode
from turnstile.handlers.provider import ProviderError
from turnstile.streams.console.format import duration, esc_text, money, redact_json, short_id, when
from turnstile.streams.console.waterfall import waterfall
from turnstile.streams.file_log import FileLog
from turnstile.streams.views import build_view

ROOT = Path(__file__).parent.parent


def test_given_raw_figures_when_formatted_then_they_read_as_people_write_them() -> None:
    assert ">$0.018<" in money(0.018000000000000002) and 'title="$0.018000000000000002"' in money(0.018000000000000002)
    assert ">$0.000123<" in money(0.000123) and ">$1,234.50<" in money(1234.5) and ">$0<" in money(0.0)
    assert ">unknown<" in money(None)
    assert [">850 ms<" in duration(850), ">2.4 s<" in duration(2_400), ">3 min 12 s<" in duration(192_000),
            ">2 h 5 min<" in duration(7_500_000)] == [True] * 4
    assert short_id("9d6c0be9fdab845b09582a8be5") == (
        '<span class="id" title="9d6c0be9fdab845b09582a8be5" data-copy="9d6c0be9fdab845b09582a8be5">9d6c0be9fd…</span>'
    )
    moment = when(1_772_442_000_000)
    assert ">2026-03-02 09:00:00 UTC<" in moment and 'data-ms="1772442000000"' in moment


def test_given_secrets_and_markup_when_shown_then_they_are_redacted_and_inert() -> None:
    shown = redact_json('{"to": "a@b.c", "auth": {"API-Key": "k", "password": "p"}, "tokens": [1]}')
    assert '"API-Key": "[redacted]"' in shown and '"password": "[redacted]"' in shown and '"to": "a@b.c"' in shown
    assert '"tokens": "[redacted]"' in shown  # a name that says token is hidden, whatever its value
    assert redact_json("not json") == "not json"
    shown = esc_text('say {"api_key": "k-1"} <b>\x1b[31m')
    assert shown == "say {&quot;api_key&quot;: &quot;[redacted]&quot;} &lt;b&gt;\\x1b[31m"


async def paused(client: httpx.AsyncClient, conversation: str) -> None:
    for _ in range(200):
        rows = (await client.get("/conversations", params={"status": "paused"})).json()["conversations"]
        if any(r["conversation_id"] == conversation for r in rows):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{conversation} never paused")


async def test_the_pages_escape_what_clients_wrote_and_hide_secret_arguments(tmp_path: Path) -> None:
    hostile = 'evil"><script>alert(1)<\\script>'
    async with serving(mail_worker(tmp_path, [])) as (_svc, client):
        await client.post(f"/conversations/{hostile}/messages", json={"content": "<img src=x onerror=alert(2)> hi"})
        await client.post("/conversations/mail-1/messages", json={"content": "mail it"})
        await paused(client, "mail-1")
        listing = (await client.get("/ui")).text
        assert "<script>alert(1)" not in listing and "&lt;script&gt;alert(1)&lt;\\script&gt;" in listing
        assert 'href="/ui/conversations/evil%22%3E%3Cscript%3Ealert%281%29%3C%5Cscript%3E"' in listing
        only_paused = (await client.get("/ui", params={"status": "paused"})).text
        assert 'data-conversation="mail-1"' in only_paused and "evil" not in only_paused
        assert 'data-conversation="mail-1"' not in (await client.get("/ui", params={"q": "evil"})).text
        assert (await client.get("/ui", params={"status": "asleep"})).status_code == 400

        page = (await client.get("/ui/conversations/mail-1")).text
        assert 'class="approve"' in page and 'data-call="call-1"' in page
        assert "k-123" not in page and "[redacted]" in page
        for _ in range(200):  # its turn answered too
            state = (await client.get(f"/conversations/{hostile}")).json()
            if state.get("turns") and state["active"] is None:
                break
            await asyncio.sleep(0.05)
        conversation = (await client.get(f"/ui/conversations/{hostile}")).text
        assert "<img src=x" not in conversation and "&lt;img src=x onerror=alert(2)&gt; hi" in conversation
        turn = (await client.get(f"/ui/conversations/{hostile}/turns/{state['turns'][0]['turn_id']}")).text
        assert "<img src=x" not in turn and "<script>alert" not in turn and "&lt;img src=x" in turn
        fragment = (await client.get("/ui/conversations/mail-1", params={"fragment": "1"})).text
        assert fragment.startswith("<h1>") and "<html" not in fragment
        assert (await client.get("/ui/conversations/nobody")).status_code == 404
        assert (await client.get("/ui/assets/../secret")).status_code == 404
        assert (await client.get("/ui/assets/console.css")).headers["Content-Type"].startswith("text/css")


async def test_a_token_is_asked_once_and_kept_in_a_strict_cookie(tmp_path: Path) -> None:
    async with serving(mail_worker(tmp_path, []), http_token="s3cret") as (_svc, client):
        to_login = await client.get("/ui")
        assert to_login.status_code == 303 and to_login.headers["Location"] == "/ui/login"
        assert (await client.get("/ui/login")).status_code == 200
        assert (await client.get("/ui/assets/console.js")).status_code == 200  # the sign-in page is styled
        assert (await client.post("/ui/login", data={"token": "wrong"})).status_code == 401
        signed = await client.post("/ui/login", data={"token": "s3cret"})
        assert signed.status_code == 303 and "HttpOnly" in signed.headers["Set-Cookie"]
        assert "SameSite=Strict" in signed.headers["Set-Cookie"]
        assert (await client.get("/ui")).status_code == 200
        assert (await client.get("/conversations")).status_code == 200  # the cookie reads the API too
        # A POST with only the cookie needs the console's header: a cross-site form cannot send one.
        await client.post("/conversations/mail-2/messages", json={"content": "mail it"},
                          headers={"Authorization": "Bearer s3cret"})
        await paused(client, "mail-2")
        bare = await client.post("/conversations/mail-2/approve", json={"call_id": "call-1"})
        assert bare.status_code == 401 and "only with the X-Turnstile-Console header" in bare.json()["error"]
        console = await client.post("/conversations/mail-2/approve", json={"call_id": "call-1"},
                                    headers={"X-Turnstile-Console": "1"})
        assert console.status_code == 202, console.text


async def test_the_live_feed_tells_each_folded_event(tmp_path: Path) -> None:
    async with serving(mail_worker(tmp_path, [])) as (_svc, client):
        await client.post("/conversations/c1/messages", json={"message_id": "m1", "content": "hello"})
        for _ in range(200):  # its first turn over: the feed then starts with the second message
            state = await client.get("/conversations/c1")
            if state.status_code == 200 and state.json()["turns"] and state.json()["active"] is None:
                break
            await asyncio.sleep(0.05)
        seen: list[str] = []
        async with client.stream("GET", "/ui/conversations/c1/events") as feed:
            await client.post("/conversations/c1/messages", json={"message_id": "m2", "content": "again"})
            async for line in feed.aiter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                if '"type":"TurnCompleted"' in line:
                    break
        assert '"type":"MessageReceived"' in seen[0] and '"status":"debouncing"' in seen[0]
        assert '"status":"idle"' in seen[-1]


def test_a_turn_page_exports_to_one_standalone_file(tmp_path: Path) -> None:
    data = tmp_path / "log"

    async def answered() -> str:
        async with serving(mail_worker(data, [])) as (_svc, client):
            await client.post("/conversations/c1/messages", json={"content": "hello <b>"})
            for _ in range(200):
                state = await client.get("/conversations/c1")
                if state.status_code == 200 and state.json()["turns"] and state.json()["active"] is None:
                    return str(state.json()["turns"][0]["turn_id"])
                await asyncio.sleep(0.05)
        raise AssertionError("no turn")

    turn_id = asyncio.run(answered())
    out = tmp_path / "turn.html"
    command = [sys.executable, "-m", "turnstile.streams.cli", "export-turn", "--data", str(data), "c1"]
    done = subprocess.run([*command, turn_id[:10], "-o", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert "<style>" in page and "<script>" in page and 'href="/ui' not in page and "/ui/assets" not in page
    assert "hello &lt;b&gt;" in page and "table class=\"waterfall\"" in page
    assert f"exported from {data} (turnstile.events) at 20" in page and f"by turnstile {turnstile.__version__}" in page
    # The audit record: the turn's records exactly as the log holds them, with where they are.
    record = tmp_path / "turn.json"
    done = subprocess.run([*command, turn_id, "--format", "json", "-o", str(record)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    exported = orjson.loads(record.read_bytes())
    on_log = {(r.partition, r.offset): r.value for r in asyncio.run(FileLog(data).reader().conversation("c1"))}
    assert [orjson.dumps(r["event"]) for r in exported["records"]] == [
        orjson.dumps(orjson.loads(on_log[(r["partition"], r["offset"])])) for r in exported["records"]
    ]
    events = [decode(orjson.dumps(r["event"])) for r in exported["records"]]
    assert [e.type for e in events] == ["MessageReceived", "TurnClaimed", "AttemptStarted", "ModelResponded",
                                        "TurnCompleted"]  # fmt: skip
    assert events[0].content == "hello <b>" and exported["input_ids"] == [events[0].message_id]
    assert exported["turn_id"] == turn_id and exported["run_ids"] == [events[2].run_id]
    assert exported["exported"]["by"] == f"turnstile {turnstile.__version__}"
    assert (exported["exported"]["log"], exported["exported"]["topic"]) == (str(data), "turnstile.events")
    missing = subprocess.run([*command, "nope"], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    assert missing.returncode == 1 and "no turn 'nope'" in missing.stderr


async def test_the_page_of_a_conversation_not_folded_yet_follows_it_until_its_first_event(tmp_path: Path) -> None:
    async with serving(mail_worker(tmp_path, [])) as (_svc, client):
        # Given a link opened before the worker folded anything of the conversation
        page = await client.get("/ui/conversations/fresh-1")
        # then it is a 404 that follows the conversation live, not a dead end
        assert page.status_code == 404
        assert 'data-conversation="fresh-1"' in page.text and 'data-live="1"' in page.text
        assert "shows it once its first event is folded" in page.text
        assert (await client.get("/ui/conversations/fresh-1", params={"fragment": "1"})).status_code == 404
        # and when the first message is folded the feed tells it, and the page's part is there
        async with client.stream("GET", "/ui/conversations/fresh-1/events") as feed:
            await client.post("/conversations/fresh-1/messages", json={"message_id": "m1", "content": "hello"})
            async for line in feed.aiter_lines():
                if line.startswith("data: "):
                    assert '"type":"MessageReceived"' in line
                    break
        assert (await client.get("/ui/conversations/fresh-1", params={"fragment": "1"})).status_code == 200


def test_a_billed_malformed_reply_counts_on_the_turns_page_as_in_its_outcome(tmp_path: Path) -> None:
    billed = Usage(input_tokens=700, output_tokens=40)
    model = TestModel(replies=[ProviderError("malformed_response", "choices is empty", retryable=False, usage=billed)])
    answered = asyncio.run(Agent("a", model=model).answer("hi", data=tmp_path))
    assert answered.outcome.type == "TurnFailed"
    log = FileLog(tmp_path)
    view = build_view("c1", asyncio.run(log.reader().conversation("c1")))
    [turn] = view.turns.values()
    metrics = answered.outcome.metrics
    assert (turn.input_tokens, turn.output_tokens) == (metrics.input_tokens, metrics.output_tokens) == (700, 40)
    [failure] = [span for span in waterfall(turn).spans if span.kind == "protocol"]
    assert (failure.input_tokens, failure.output_tokens, failure.cost_usd) == (700, 40, 0.0)
