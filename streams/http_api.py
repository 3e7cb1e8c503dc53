"""The worker's HTTP port (aiohttp):

* `POST /conversations/{id}/messages` with `{"content": ..., "message_id"?: ...}` publishes a
  `MessageReceived` and answers 202 with the message id. Idempotent by id: the same id and
  content again is 202 again and answered once (`duplicate: true` and `status` accepted or
  rejected once the worker has folded the first); the same id with other content is 409,
  decided by log order: a client's id is appended and answered once the fold has reached it
  (`first_use`), so every process gives the same answer.
* `GET /conversations/{id}`: the conversation's state as the worker folded it (history,
  pending, rejected, active turn, a summary per turn); 404 if the log has nothing of it.
* `GET /conversations/{id}/turns/{turn_id}`: the turn's timeline as JSON, or as the
  console's page of it with `Accept: text/html` or `?format=html`.
* `GET /conversations/{id}/stream`: server-sent events of the conversation's reply in
  progress (or its next one): the text so far, then `delta`s as they arrive, `restart` and
  `interrupted` when an attempt starts over, and the `outcome`, which ends the stream (see
  `reply_hub`). 404 when the service streams no replies.
* `GET /metrics`: Prometheus text.
* `GET /healthz` (liveness): 200 as long as the process serves, replay or not.
* `GET /readyz` (readiness): 200 once the group has given the worker its first assignment
  and every partition it owns is live (replayed to its end), 503 before (`assigned`, and the
  partitions still replaying).

With a token (`TURNSTILE_HTTP_TOKEN` or `--http-token-file`) every request but the two
probes needs `Authorization: Bearer <token>` (401 otherwise); a non-loopback address is
refused without one. Every error, the framework's 404/405/413 included, is a JSON
`{"error": ..., "status": ...}`. Ids in paths and bodies are 1-256 characters (as in the
events) with no control character (400 otherwise).

Reads are served from the worker's state (`streams/read_model.py`) for the conversations
it owns, without reading the log; for another worker's partition, from the conversation's
snapshot and the tail of its partition (`streams/http_reads.py`); 503 while the partition
replays. `GET /conversations`
lists the worker's conversations (`?q=`, `status=`, `limit=`, `before=`). `POST
/conversations/{id}/approve|deny|resume` are the CLI's operations. The console
(`streams/console`) is served at `/ui` with the same authentication (or its sign-in
cookie). Writes are appends to the events topic keyed by conversation id, like any other
producer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict
from urllib.parse import quote, urlsplit

import orjson
from aiohttp import web
from pydantic import ValidationError

from turnstile.events import content_fingerprint, encode
from turnstile.events.base import MAX_ID_CHARS
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.operations import VERBS, AlreadyTaken, Refused, decide_operation
from turnstile.projections import STATUSES, ConversationState, Status
from turnstile.streams.eviction import NotLocal
from turnstile.streams.fold_watch import FoldWatch
from turnstile.streams.http_reads import ConversationReads, Reads, Unavailable
from turnstile.streams.log import EventLog, RecordRefused
from turnstile.streams.publisher import message_event
from turnstile.streams.read_model import ReadModel
from turnstile.streams.runtime import Clock, SystemClock
from turnstile.streams.sse import serve_feed
from turnstile.streams.tracing import trace_headers
from turnstile.streams.views import state_json, turn_json

if TYPE_CHECKING:
    from turnstile.streams.metrics import Metrics
    from turnstile.streams.reply_hub import ReplyHub
    from turnstile.streams.worker import Worker

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
MAX_BODY_BYTES = 256 * 1024
# How long a POST with the client's message id waits for the fold to say whether this use of
# the id was its first (normally the time the worker takes to read its own append back).
VERDICT_WAIT_S = 5.0
# How long a POSTed message waits for the log's acknowledgement (a broker away held the
# request for the producer's 40 s and more, where a client expects an answer).
APPEND_WAIT_S = 5.0
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/ui/login"})  # probes carry no credentials
OPEN_PREFIXES = ("/ui/assets/",)  # the console's stylesheet and script, for the sign-in page


class InsecureBind(ValueError):
    """A non-loopback address without a token."""


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a network without authentication."""
    if token or _loopback(host):
        return
    raise InsecureBind(
        f"refusing to serve HTTP on {host} without a token: set TURNSTILE_HTTP_TOKEN or --http-token-file"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (or 0.0.0.0 / "" -- every interface) is not loopback


def id_problem(what: str, value: str) -> str | None:
    """Why `value` is not a usable id, or None. Ids end up in headers, terminals and logs."""
    if not value:
        return f"{what} is empty"
    if len(value) > MAX_ID_CHARS:
        return f"{what} is longer than {MAX_ID_CHARS} characters"
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in value):
        return f"{what} contains a control character"
    return None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message, "status": status}, status)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The framework's own errors (404, 405, 413, ...) as JSON like the API's; the headers
    they carry (Allow on a 405) are kept."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # A 413 says the limit ("Maximum request body size 262144 exceeded."); the others, their name.
        response = _error(exc.status, exc.text if exc.status == 413 and exc.text else exc.reason)
        for name in ("Allow",):
            if name in exc.headers:
                response.headers[name] = exc.headers[name]
        return response


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@web.middleware
async def _same_origin(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A browser sends `Origin` with every cross-site POST, and a text/plain one needs no
    CORS preflight: without this any web page the operator visits could post messages and
    approve side effects on a tokenless loopback worker. curl and other clients send no
    Origin; the console's own requests carry this server's. (With a token the bearer
    middleware already refuses them: a cross-site request cannot add the console's header.)"""
    # A name that resolves to 127.0.0.1 (DNS rebinding) makes a hostile page same-origin:
    # a tokenless port is only loopback, so it answers only to a loopback Host.
    if not _loopback(_hostname(f"//{request.host}")):
        return _error(403, f"a request for host {request.host[:100]!r} is refused: without a token only loopback")
    origin = request.headers.get("Origin")
    if request.method in SAFE_METHODS or origin is None or _netloc(origin) == request.host:
        return await handler(request)
    return _error(403, f"a cross-origin request from {origin[:100]!r} is refused")


def _hostname(url: str) -> str:
    """The URL's host name; "" for one that does not parse (`Host: [`): never loopback."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _netloc(url: str) -> str | None:
    try:
        return urlsplit(url).netloc
    except ValueError:
        return None  # matches no Host


def _bearer(token: str) -> Middleware:
    """The token as `Authorization: Bearer`, or as the console's sign-in cookie (with the
    console's header on a POST: a cross-site form can send the cookie's name, never the
    header). A browser asking for a console page without either is sent to sign in."""
    from turnstile.streams.console.routes import CONSOLE_HEADER, COOKIE

    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        # Headers are decoded with surrogateescape: encoded back so, any bytes compare (and fail).
        if hmac.compare_digest(request.headers.get("Authorization", "").encode("utf-8", "surrogateescape"), expected):
            return await handler(request)
        cookie = request.cookies.get(COOKIE, "").encode("utf-8", "surrogateescape")
        from_console = request.method == "GET" or CONSOLE_HEADER in request.headers
        if from_console and hmac.compare_digest(cookie, token.encode()):
            return await handler(request)
        if path == "/ui" or path.startswith("/ui/"):
            raise web.HTTPSeeOther("/ui/login")
        said = "a bearer token is required"
        if cookie and not from_console:  # the console's cookie alone does not write: cross-site requests carry it
            said += f" (the console's cookie is taken for a write only with the {CONSOLE_HEADER} header)"
        response = _error(401, said)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return auth


MAX_PAGE = 500
# Cursors are places in the read model's order (negative at the bottom of the local store's
# listing): integers JSON carries exactly.
MAX_CURSOR = 2**53


class PageQuery(TypedDict):
    contains: str
    status: Status | None
    before: int | None
    limit: int


def page_query(request: web.Request) -> PageQuery | str:
    """`?q=` (part of the id), `status=`, `before=` (a page's `next_cursor`), `limit=`
    (1..500, default 50), or what is wrong with them."""
    status, before, limit = request.query.get("status") or None, request.query.get("before"), request.query.get("limit")
    if status is not None and status not in STATUSES:
        return f"status must be one of {', '.join(STATUSES)}"
    if before is not None and not (_decimal(before.removeprefix("-")) and abs(int(before)) <= MAX_CURSOR):
        return "before must be a cursor a page gave (a number)"
    if limit is not None and not (_decimal(limit) and 1 <= int(limit) <= MAX_PAGE):
        return f"limit must be 1..{MAX_PAGE}"
    return {
        "contains": request.query.get("q", ""),
        "status": status,  # checked against STATUSES above
        "before": None if before is None else int(before),
        "limit": 50 if limit is None else int(limit),
    }


def _decimal(text: str) -> bool:
    """ASCII digits only (`str.isdigit` also takes "²", which `int` refuses), and short."""
    return text.isascii() and text.isdigit() and len(text) <= 20


def _wants_html(request: web.Request) -> bool:
    fmt = request.query.get("format")
    if fmt is not None:
        return fmt == "html"
    accept = request.headers.get("Accept", "")
    return "text/html" in accept and "application/json" not in accept


def build_app(
    log_: EventLog,
    log_reads: ConversationReads,
    *,
    worker: Worker | None = None,
    metrics: Metrics | None = None,
    clock: Clock | None = None,
    hub: ReplyHub | None = None,
    token: str | None = None,
    read_model: ReadModel | None = None,
) -> web.Application:
    """`token`: when given, every request but the probes must carry it as a bearer token.
    `read_model`: the worker's, to serve the conversations it owns from its state (and to
    list them); without one every read is a bounded read of the conversation's partition."""
    clock = clock or SystemClock()
    reads = Reads(read_model, log_reads)
    middlewares: list[Middleware] = [_json_errors, _bearer(token) if token else _same_origin]
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)  # type: ignore[arg-type]
    watch = FoldWatch(worker) if worker is not None else None
    if watch is not None:  # the app's watch leaves the worker's observers with the app

        async def detach_watch(_app: web.Application) -> None:
            watch.detach()

        app.on_cleanup.append(detach_watch)

    def folded_use(conversation: str, message_id: str) -> tuple[str, ConversationState] | None:
        """The fingerprint of the id's first use on the log, if this worker has folded it."""
        try:
            state = worker.state_of(conversation) if worker is not None else None
        except NotLocal:  # being fetched: not known yet (the caller answers 503, to retry)
            return None
        if state is None or (seen := state.seen_inputs.get(message_id)) is None:
            return None
        return seen, state

    async def first_use(
        conversation: str, message_id: str, partition: int, offset: int, unknown: str
    ) -> str | Unavailable:
        """The fingerprint the id's first use on the log carries, once the record just appended
        at `partition`@`offset` is folded: by this worker when the partition is live here,
        else from the conversation's snapshot and the tail of its partition. The log's order
        decides, so every process gives the same answer. `unknown`: what the client does when
        that cannot be known yet (a 503)."""
        if watch is not None and worker is not None and worker.live_here(conversation):
            folded = await watch.until_folded(partition, offset, VERDICT_WAIT_S)
            found = folded_use(conversation, message_id) if folded else None
            if found is not None:
                return found[0]
        if worker is None or not worker.live_here(conversation):  # not this worker's (any more)
            view = await reads.logged(conversation)
            if isinstance(view, Unavailable):
                return view
            if (seen := view.state.seen_inputs.get(message_id)) is not None:
                return seen
        where = f"{message_id!r} is on the log at {partition}@{offset}"
        return Unavailable(503, f"{where}, but whether it came first is not known yet; {unknown}", 1)

    def conflict(message_id: str) -> web.Response:
        return _error(409, f"message id {message_id!r} was already used for other content")

    async def append(
        request: web.Request, conversation: str, value: bytes, again: str
    ) -> tuple[int, int] | web.Response:
        """Where the record landed, or the answer saying why it did not: 413 for a record the
        log refuses, 503 when the log did not acknowledge it within APPEND_WAIT_S (it may land
        yet: `again` says how to retry without a second copy counting)."""
        try:
            trace = trace_headers(request.headers)  # the caller's trace goes on to the turn's spans
            async with asyncio.timeout(APPEND_WAIT_S):
                return await log_.append(log_.topics.events, conversation, value, headers=trace)
        except RecordRefused as exc:  # within the body's limit, its JSON escaped past the log's
            return _error(413, f"the log does not take this record: {exc}")
        except Exception as exc:  # a broker away, an append failed: unavailable, not a server bug
            why = "did not acknowledge it in time" if isinstance(exc, TimeoutError) else f"failed ({exc!r})"
            log.warning("a POST to %s: the log %s", conversation, why)
            said = f"the log {why}: it may be on the log or not; {again}"
            return unavailable(Unavailable(503, said, 1))

    async def post_message(request: web.Request) -> web.Response:
        conversation = request.match_info["conversation"]
        if problem := id_problem("the conversation id", conversation):
            return _error(400, problem)
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}")
        if not isinstance(body, dict) or set(body) - {"content", "message_id"}:
            return _error(400, 'expected {"content": "...", "message_id"?: "..."}')
        content, message_id = body.get("content"), body.get("message_id")
        if not isinstance(content, str) or not (message_id is None or isinstance(message_id, str)):
            return _error(400, "content must be a string, and message_id a string when given")
        if not content.strip():  # as `turnstile send` refuses it: there is nothing to answer
            return _error(400, "the content is empty or only whitespace: give the message some text")
        if message_id is not None and (problem := id_problem("message_id", message_id)):
            return _error(400, problem)
        try:
            event = message_event(conversation, content, clock.now_ms(), message_id)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            return _error(400, problems)
        reply = {"conversation_id": conversation, "message_id": event.message_id}
        fingerprint = content_fingerprint(content)
        # An id this worker has folded is answered from its state, not published again.
        if message_id is not None and (found := folded_use(conversation, message_id)) is not None:
            seen, state = found
            if seen != fingerprint:
                return conflict(message_id)
            status = "rejected" if message_id in state.rejected else "accepted"
            return _json({**reply, "duplicate": True, "status": status}, 202)
        again = f"send it again with message_id {event.message_id!r} and the same content (answered once)"
        landed = await append(request, conversation, encode(event), again)
        if isinstance(landed, web.Response):
            return landed
        partition, offset = landed
        if message_id is not None:  # the client's id may have been used before, by anyone
            again = "send it again with the same id and content (it is answered once)"
            first = await first_use(conversation, message_id, partition, offset, again)
            if isinstance(first, Unavailable):
                return unavailable(first)
            if first != fingerprint:
                return conflict(message_id)  # this record is a conflicting duplicate: dead-lettered
        headers = {"Location": f"/conversations/{quote(conversation, safe='')}"}
        return web.Response(
            body=orjson.dumps({**reply, "partition": partition, "offset": offset}),
            status=202,
            content_type="application/json",
            headers=headers,
        )

    def unavailable(problem: Unavailable) -> web.Response:
        response = _error(problem.status, problem.message)
        if problem.retry_after_s is not None:
            response.headers["Retry-After"] = str(problem.retry_after_s)
        return response

    async def get_conversation(request: web.Request) -> web.Response:
        conversation = request.match_info["conversation"]
        if problem := id_problem("the conversation id", conversation):
            return _error(400, problem)
        view = await reads.conversation(conversation)
        if isinstance(view, Unavailable):
            return unavailable(view)
        return _json(state_json(view))

    async def get_turn(request: web.Request) -> web.Response:
        conversation, turn_id = request.match_info["conversation"], request.match_info["turn_id"]
        if problem := id_problem("the conversation id", conversation) or id_problem("the turn id", turn_id):
            return _error(400, problem)
        found = await reads.turn(conversation, turn_id)
        if isinstance(found, Unavailable):
            return unavailable(found)
        view, turn = found
        if _wants_html(request):  # the console's page of the turn
            from turnstile.streams.console.pages import turn_page

            return web.Response(text=turn_page(view, turn), content_type="text/html")
        return _json(turn_json(conversation, turn))

    async def list_conversations(request: web.Request) -> web.Response:
        if reads.model is None:
            return _error(404, "listing conversations needs a worker beside this port")
        query = page_query(request)
        if isinstance(query, str):
            return _error(400, query)
        page = reads.model.page(**query)
        rows = [dataclasses.asdict(row) for row in page.rows]
        return _json({"conversations": rows, "next_cursor": page.next_cursor})

    async def operate(request: web.Request) -> web.Response:
        conversation, verb = request.match_info["conversation"], request.match_info["verb"]
        if problem := id_problem("the conversation id", conversation):
            return _error(400, problem)
        if verb not in VERBS:
            return _error(404, f"no operation {verb!r}: approve, deny or resume")
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}")
        allowed = {"note"} if verb == "resume" else {"call_id", "note", "turn_id"}
        if not isinstance(body, dict) or set(body) - allowed:
            shape = '{"note"?: "..."}' if verb == "resume" else '{"call_id": "...", "note"?: "...", "turn_id"?: "..."}'
            return _error(400, f"expected {shape}")
        call_id, note, turn_id = body.get("call_id"), body.get("note"), body.get("turn_id")
        if any(not (v is None or isinstance(v, str)) for v in (call_id, note, turn_id)):
            return _error(400, "call_id, note and turn_id must be strings")
        # A call id is the model's (any 1..256 characters a tool call may carry): whatever the
        # turn paused on can be decided here, as with `turnstile approve`.
        if call_id is not None and not 1 <= len(call_id) <= MAX_ID_CHARS:
            return _error(400, f"call_id must be 1..{MAX_ID_CHARS} characters")
        if verb != "resume" and call_id is None:  # a malformed request, not a refused decision
            return _error(400, f'{verb} needs {{"call_id": "..."}}: the call the turn paused on')
        view = await reads.conversation(conversation)
        if isinstance(view, Unavailable):
            return unavailable(view)
        policy = worker.config.debounce if worker is not None else DebouncePolicy()
        decided = decide_operation(
            view.state, verb, call_id, note, event_id=uuid.uuid4().hex, now_ms=clock.now_ms(), policy=policy,
            turn_id=turn_id,
        )  # fmt: skip
        if isinstance(decided, Refused):
            return _error(409, decided.reason)
        if isinstance(decided, AlreadyTaken):  # the same decision again: answered as a duplicate message is
            taken = {"conversation_id": conversation, "input_id": decided.input_id, "turn_id": decided.turn_id}
            return _json({**taken, "duplicate": True}, 202)
        event = decided.event
        again = "send the same decision again (its input id is the paused turn's: it is written once)"
        landed = await append(request, conversation, encode(event), again)
        if isinstance(landed, web.Response):
            return landed
        partition, offset = landed
        input_id = decided.input_id
        # Decided from a state that may not hold a decision just written by another request
        # (approve, then deny at once): the log's order says which came first, as for a message.
        # (Not "send it again": once its turn is claimed, the same decision is refused as late.)
        see = f"GET /conversations/{conversation} shows whether a turn claimed it (awaiting_approval drops it)"
        first = await first_use(conversation, input_id, partition, offset, see)
        if isinstance(first, Unavailable):
            return unavailable(first)
        if first != content_fingerprint(event.content):
            return _error(409, f"another decision ({input_id}) was written first; the first one stands")
        reply = {"conversation_id": conversation, "input_id": input_id, "turn_id": decided.turn_id}
        return _json({**reply, "partition": partition, "offset": offset}, 202)

    async def stream_reply(request: web.Request) -> web.StreamResponse:
        if hub is None:
            return _error(404, "this service does not stream replies")
        conversation = request.match_info["conversation"]
        if problem := id_problem("the conversation id", conversation):
            return _error(400, problem)
        queue = hub.subscribe(conversation)
        try:
            return await serve_feed(request, queue, lambda event: (event.sse(), event.kind == "outcome"))
        finally:
            hub.unsubscribe(conversation, queue)

    async def get_metrics(_request: web.Request) -> web.Response:
        if metrics is None:
            return _error(404, "metrics are not enabled")
        from turnstile.streams.metrics import CONTENT_TYPE

        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def health(_request: web.Request) -> web.Response:
        return _json({"ok": True})

    async def ready(_request: web.Request) -> web.Response:
        owned = worker.partition_liveness() if worker is not None else {}
        replaying = sorted(p for p, live in owned.items() if not live)
        # Not before its first assignment: it owned nothing yet, which read as "all replayed"
        # (200 for the first 0.3-0.6 s of every start: a rollout gated on it moved on at once).
        assigned = worker is None or worker.assignment_received
        ready = assigned and not replaying
        body = {"ready": ready, "assigned": assigned, "partitions": sorted(owned), "replaying": replaying}
        return _json(body, 200 if ready else 503)

    app.router.add_post("/conversations/{conversation}/messages", post_message)
    app.router.add_get("/conversations", list_conversations)
    app.router.add_get("/conversations/{conversation}", get_conversation)
    app.router.add_post("/conversations/{conversation}/{verb}", operate)
    app.router.add_get("/conversations/{conversation}/turns/{turn_id}", get_turn)
    app.router.add_get("/conversations/{conversation}/stream", stream_reply)
    from turnstile.streams.console.routes import add_console

    add_console(app, reads, token)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", health)
    app.router.add_get("/readyz", ready)
    return app


class HttpServer:
    """The app on a host and port (port 0: any free one; `url` says which). `token`: the
    app's bearer token; without one only a loopback address is served (`InsecureBind`)."""

    def __init__(self, app: web.Application, host: str, port: int, token: str | None = None) -> None:
        check_bind(host, token)
        self.app, self.host, self.port = app, host, port
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # IPv6 in brackets
        log.info("HTTP on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def read_token(env: Mapping[str, str], token_file: Path | None) -> str | None:
    """The bearer token: from the file when one is named (its first line), else from
    TURNSTILE_HTTP_TOKEN; None when neither says one."""
    if token_file is None:
        return env.get("TURNSTILE_HTTP_TOKEN", "").strip() or None
    try:
        lines = token_file.read_text(encoding="utf-8-sig").splitlines()  # (an editor's BOM is no part of it)
    except UnicodeDecodeError:
        raise ValueError(f"the token file {token_file} is not UTF-8 text") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"the token file {token_file} has no token on its first line")
    return token


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, or `PORT` alone for 127.0.0.1; an IPv6 host in brackets (`[::1]:8080`)."""
    host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)
