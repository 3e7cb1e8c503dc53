"""The HTTP port facing a network: bearer tokens, refusal of a non-loopback address without
one, JSON for every error (the framework's too), id validation, a conflicting re-use of a
message id answered 409 before the worker folded the first as after, and the probes:
/healthz answered and /readyz 503 while a long replay runs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator

import httpx
import pytest
from loop_probe import LoopProbe
from worker_harness import FAST, client_of, events_of, serving, until

from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.cli_errors import broker_url, http_address
from turnstile.streams.file_log import FileLog
from turnstile.streams.http_api import HttpServer, InsecureBind, build_app, check_bind, parse_address, read_token
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.service import Service, conversation_reader
from turnstile.streams.worker import Worker

TOKEN = "s3cret-token"


@contextlib.asynccontextmanager
async def port(worker: Worker, token: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The app of a worker that is not running (nothing is folded) on a loopback port."""
    app = build_app(worker.log, conversation_reader(worker.log), worker=worker, token=token)
    async with client_of(HttpServer(app, "127.0.0.1", 0, token=token)) as client:
        yield client


async def test_with_a_token_every_request_but_the_probes_needs_it(tmp_path):
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    async with port(worker, TOKEN) as client:
        body = {"content": "hi", "message_id": "m1"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = await client.post("/conversations/c1/messages", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"] == "a bearer token is required"
            assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert (await client.get("/conversations/c1")).status_code == 401
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/healthz")).status_code == 200
        # Not yet assigned (the worker does not run): not ready, and no token asked
        not_yet = await client.get("/readyz")
        assert not_yet.status_code == 503 and not_yet.json()["assigned"] is False
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert (await client.post("/conversations/c1/messages", json=body, headers=auth)).status_code == 202
    async with port(worker) as open_client:  # no token: loopback only, and open
        assert (await open_client.post("/conversations/c2/messages", json=body)).status_code == 202


async def test_without_a_token_a_cross_site_or_rebound_browser_request_is_refused_and_nothing_appended(tmp_path):
    # Given a tokenless loopback port: a page on another site can POST to it from the
    # operator's browser (text/plain needs no CORS preflight), and could approve side effects
    log = FileLog(tmp_path)
    worker = Worker(log, ScriptedProvider(), FAST)
    async with port(worker) as client:
        evil = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
        for path in ("/conversations/c1/messages", "/conversations/c1/approve", "/conversations/c1/resume"):
            refused = await client.post(path, content=b'{"content": "hi", "call_id": "call-1"}', headers=evil)
            assert refused.status_code == 403, path
            assert refused.json()["error"] == "a cross-origin request from 'https://evil.example' is refused"
        # a browser's request from the console of this very server, and curl (no Origin), are served
        own = {"Origin": f"http://{client.base_url.netloc.decode()}"}
        assert (await client.post("/conversations/c1/messages", json={"content": "hi"}, headers=own)).status_code == 202
        assert (await client.post("/conversations/c2/messages", json={"content": "hi"})).status_code == 202
        assert (await client.get("/conversations/c1", headers=evil)).status_code != 403  # reads stay open
        # DNS rebinding: a hostile name resolved to 127.0.0.1 is same-origin to the browser
        rebound = {"Host": "evil.example:80", "Origin": "http://evil.example:80"}
        for request in (client.get("/conversations/c1", headers=rebound),
                        client.post("/conversations/c3/messages", json={"content": "hi"}, headers=rebound)):
            refused = await request
            assert refused.status_code == 403 and "without a token only loopback" in refused.json()["error"]
    assert sorted(e.conversation_id for e in events_of(log)) == ["c1", "c2"]  # the refused ones appended nothing


def test_a_non_loopback_address_needs_a_token(tmp_path):
    for host in ("0.0.0.0", "192.0.2.7", "example.com", "::"):
        with pytest.raises(InsecureBind, match="without a token"):
            check_bind(host, None)
        check_bind(host, TOKEN)
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(host, None)
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    with pytest.raises(InsecureBind):
        Service(worker, http=("0.0.0.0", 0))


def test_the_token_comes_from_a_file_or_the_environment(tmp_path):
    assert read_token({}, None) is None
    assert read_token({"TURNSTILE_HTTP_TOKEN": " t1 \n"}, None) == "t1"
    (tmp_path / "token").write_text("t2\n")
    assert read_token({"TURNSTILE_HTTP_TOKEN": "t1"}, tmp_path / "token") == "t2"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="has no token on its first line"):
        read_token({}, tmp_path / "empty")
    (tmp_path / "two-lines").write_text("t3\n# rotated 2026-12-06\n")
    assert read_token({}, tmp_path / "two-lines") == "t3"  # its first line, as documented
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbft4\n")
    assert read_token({}, tmp_path / "bom") == "t4"
    (tmp_path / "binary").write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match=r"token file .*binary is not UTF-8 text"):
        read_token({}, tmp_path / "binary")


def test_an_address_is_host_and_port_an_ipv6_host_in_brackets():
    assert parse_address("8080") == ("127.0.0.1", 8080)
    assert parse_address("[::1]:8080") == ("::1", 8080)
    check_bind(parse_address("[::1]:8080")[0], None)  # loopback: served without a token
    for text in ("127.0.0.1:²", "h:\uff18\uff10"):  # digits to str.isdigit (² and fullwidth 80), not to int
        with pytest.raises(argparse.ArgumentTypeError, match="has no port"):
            http_address(text)
        with pytest.raises(argparse.ArgumentTypeError, match="is not HOST:PORT"):
            broker_url(text)


async def test_header_bytes_that_are_not_utf8_or_hosts_that_do_not_parse_are_refused_not_crashed(tmp_path):
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    async with port(worker, TOKEN) as client:
        for headers in ({"Authorization": b"Bearer \xff\xfe"}, {"Cookie": b"turnstile_token=\xff"}):
            refused = await client.get("/conversations/c1", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"] == "a bearer token is required"
    async with port(worker) as client:
        refused = await client.get("/conversations/c1", headers={"Host": "["})
        assert refused.status_code == 403 and "without a token only loopback" in refused.json()["error"]
        refused = await client.post("/conversations/c1/messages", json={"content": "hi"}, headers={"Origin": "http://["})
        assert refused.status_code == 403 and "cross-origin" in refused.json()["error"]


async def test_every_error_is_json_the_frameworks_too(tmp_path):
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    async with port(worker) as client:
        cases = [
            (await client.get("/no/such/path"), 404),
            (await client.delete("/conversations/c1/messages"), 405),
            (await client.post("/conversations/c1/messages", content=b"x" * 300_000), 413),
            (await client.post("/conversations/c1/messages", content=b'{"content": "\\ud800"}'), 400),
            (await client.get("/conversations/nobody"), 404),
        ]
        for response, status in cases:
            assert response.status_code == status
            assert response.headers["Content-Type"].startswith("application/json")
            assert response.json()["status"] == status and response.json()["error"]
        assert "POST" in cases[1][0].headers["Allow"]
        assert cases[2][0].json()["error"] == "Maximum request body size 262144 exceeded."  # the limit, in bytes
        assert cases[3][0].json()["error"].startswith("the body is not JSON: ")  # and why not (orjson's words)
        assert "surrogate" in cases[3][0].json()["error"]


async def test_ids_are_validated(tmp_path):
    log = FileLog(tmp_path)
    worker = Worker(log, ScriptedProvider(), FAST)
    async with port(worker) as client:
        bad_conversations = ["a%0Ab", "a%1B%5B31mred", "x" * 257, "tab%09"]
        for conversation in bad_conversations:
            response = await client.post(f"/conversations/{conversation}/messages", json={"content": "hi"})
            assert response.status_code == 400, conversation
            assert "conversation id" in response.json()["error"]
            assert (await client.get(f"/conversations/{conversation}")).status_code == 400
        for message_id, reason in (("", "empty"), ("m\n1", "control character"), ("m" * 257, "longer than")):
            response = await client.post("/conversations/c1/messages", json={"content": "hi", "message_id": message_id})
            assert response.status_code == 400 and reason in response.json()["error"]
        assert (await client.get("/conversations/c1/turns/t%7F1")).status_code == 400
        for content in ("", "   ", "\n\t "):
            response = await client.post("/conversations/c1/messages", json={"content": content})
            assert response.status_code == 400 and "empty or only whitespace" in response.json()["error"]
        # at the events' own limit (256): every conversation id a publisher may use is reachable
        longest = "x" * 256
        body = {"content": "hi", "message_id": "m" * 256}
        at_limit = await client.post(f"/conversations/{longest}/messages", json=body)
        assert at_limit.status_code == 202 and (await client.get(f"/conversations/{longest}")).status_code != 400
        ok = await client.post("/conversations/caf%C3%A9%20%5B%2F%5D%3F%23/messages", json={"content": "hi"})
        assert ok.status_code == 202 and ok.json()["conversation_id"] == "café [/]?#"
        # the Location names this conversation, not a path with a query or a fragment
        assert ok.headers["Location"] == "/conversations/caf%C3%A9%20%5B%2F%5D%3F%23"
    assert [e.conversation_id for e in events_of(log)] == [longest, "café [/]?#"]  # nothing invalid was appended


async def test_a_conflicting_reuse_is_409_before_the_fold_as_after(tmp_path):
    log = FileLog(tmp_path)
    worker = Worker(log, ScriptedProvider(), FAST)
    async with port(worker) as client:
        first = {"message_id": "m1", "content": "hello"}
        clash = {"message_id": "m1", "content": "other"}
        # The worker is not running: nothing is folded yet, the log itself decides.
        assert (await client.post("/conversations/c1/messages", json=first)).status_code == 202
        early = await client.post("/conversations/c1/messages", json=clash)
        assert early.status_code == 409 and "already used" in early.json()["error"]
        same = await client.post("/conversations/c1/messages", json=first)
        assert same.status_code == 202 and same.json()["message_id"] == "m1"
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: "c1" in worker.states and bool(worker.states["c1"].turns))
            late = await client.post("/conversations/c1/messages", json=clash)
            assert late.status_code == 409 and late.json()["error"] == early.json()["error"]
            again = (await client.post("/conversations/c1/messages", json=first)).json()
            assert again["duplicate"] and again["status"] == "accepted"
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    # The early clash is on the log (a 409 is decided by log order) and dead-lettered there;
    # the ones answered from the worker's state never reached it. m1 was answered once.
    contents = [e.content for e in events_of(log) if e.type == "MessageReceived"]
    assert contents == ["hello", "other", "hello"]
    assert worker.dead_letters == 1
    [turn] = worker.states["c1"].turns.values()
    assert turn.input_ids == ("m1",)


REPLAYED = 150_000  # a replay of this many records holds the loop for many slices (~1 s here)


class Replay:
    """Replay hooks that say when the replay runs."""

    def __init__(self) -> None:
        self.running = False

    def replaying(self) -> None:
        self.running = True

    def replay_slice(self) -> None:
        pass

    def replayed(self) -> None:
        self.running = False


async def test_the_probes_are_answered_during_a_long_replay(tmp_path):
    log = FileLog(tmp_path, partitions=1)
    await publish(log, message_event("c1", "hello", 1, "m1"))
    # The same record many times over (re-deliveries the fold ignores): a long replay that
    # starts no turn of its own. Written as one file, not as that many fsynced appends.
    [segment] = (tmp_path / log.topics.events).glob("0.log")
    segment.write_bytes(segment.read_bytes() * REPLAYED)
    replay = Replay()
    worker = Worker(FileLog(tmp_path, partitions=1), ScriptedProvider(), FAST, replay_hooks=replay)
    lag = LoopProbe()
    answered: list[tuple[int, int]] = []
    try:
        async with serving(worker) as (_svc, client):
            lag.start()  # from here: the service and its client are set up
            while not worker.partition_liveness() or replay.running:
                # Both at once: a request takes several loop cycles, each behind a slice of
                # the replay, and the pair must be answered while the replay still runs.
                health, ready = await asyncio.gather(client.get("/healthz"), client.get("/readyz"))
                if replay.running:
                    answered.append((health.status_code, ready.status_code))
            final = await client.get("/readyz")
    finally:
        lag.stop()
    assert answered and set(answered) == {(200, 503)}, answered
    assert final.status_code == 200
    assert final.json() == {"ready": True, "assigned": True, "partitions": [0], "replaying": []}
    # Liveness requirement (a probe's timeout is typically 1 s): the loop is never held that long.
    assert lag.longest_s < 1.0, lag.longest_s


def test_turnstile_run_refuses_a_non_loopback_address_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TURNSTILE_HTTP_TOKEN"}
    data = tmp_path / "log"
    refused = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "run", "--data", str(data), "--http", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        "turnstile run: refusing to serve HTTP on 0.0.0.0 without a token: set TURNSTILE_HTTP_TOKEN or"
        " --http-token-file"
    ]
    assert not data.exists()  # refused before anything was opened


async def test_a_worker_assigned_nothing_is_ready_once_the_group_has_answered(tmp_path):
    # (an empty first assignment: more workers than partitions) -- owning nothing was "ready"
    # before any assignment too, for the first 0.3-0.6 s of every start
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), FAST)
    async with port(worker) as client:
        assert (await client.get("/readyz")).status_code == 503
        assert await worker.on_assigned({}) == {}
        answered = await client.get("/readyz")
    assert answered.status_code == 200 and answered.json() == {
        "ready": True, "assigned": True, "partitions": [], "replaying": []
    }  # fmt: skip


class Unacknowledged(FileLog):
    """A log whose appends are never acknowledged: a broker away."""

    async def append(self, topic, key, value, partition=None, headers=None):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_post_the_log_does_not_acknowledge_in_time_is_a_503_that_says_how_to_retry(tmp_path, monkeypatch):
    # (a broker away held the request for the producer's 40 s and more, with no answer)
    import turnstile.streams.http_api as http_api

    monkeypatch.setattr(http_api, "APPEND_WAIT_S", 0.05)
    worker = Worker(Unacknowledged(tmp_path), ScriptedProvider(), FAST)
    async with port(worker) as client:
        answer = await client.post("/conversations/c1/messages", json={"content": "hi"})
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
    said = answer.json()["error"]
    assert said.startswith("the log did not acknowledge it in time: it may be on the log or not; send it again")
    # a message the client gave no id: the one it was given is named, so a retry is answered once
    assert "with message_id '" in said and "and the same content (answered once)" in said
