"""The worker's HTTP port (aiohttp):

* `POST /conversations/{id}/messages` with `{"content": ..., "message_id"?: ...}` publishes a
  `MessageReceived` and answers 202 with the message id. Idempotent by id: the same id and
  content again is 202 again and answered once (`duplicate: true` and `status` accepted or
  rejected once the worker has folded the first); the same id with other content is 409.
* `GET /conversations/{id}`: the conversation's state, folded from the log (history,
  pending, rejected, active turn, a summary per turn); 404 if the log has nothing of it.
* `GET /conversations/{id}/turns/{turn_id}`: the turn's timeline as JSON, or as a small
  HTML page with `Accept: text/html` or `?format=html`.
* `GET /conversations/{id}/stream`: server-sent events of the conversation's reply in
  progress (or its next one): the text so far, then `delta`s as they arrive, `restart` and
  `interrupted` when an attempt starts over, and the `outcome`, which ends the stream (see
  `reply_hub`). 404 when the service streams no replies.
* `GET /metrics`: Prometheus text.

Reads come from the log itself (the conversation's partition, read by an independent
reader), not from the worker's memory: they are right whichever worker of the group owns
the conversation. Writes are appends to the events topic keyed by conversation id, like
any other producer's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from pydantic import ValidationError
from turnstile.events import content_fingerprint, encode
from turnstile.streams.log import EventLog, Record
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import Clock, SystemClock
from turnstile.streams.views import build_view, state_json, turn_html, turn_json

if TYPE_CHECKING:
    from turnstile.streams.metrics import Metrics
    from turnstile.streams.reply_hub import ReplyHub
    from turnstile.streams.worker import Worker

log = logging.getLogger(__name__)

ReadConversation = Callable[[str], Awaitable[list[Record]]]
MAX_BODY_BYTES = 256 * 1024
KEEPALIVE_S = 15.0


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


def _wants_html(request: web.Request) -> bool:
    fmt = request.query.get("format")
    if fmt is not None:
        return fmt == "html"
    accept = request.headers.get("Accept", "")
    return "text/html" in accept and "application/json" not in accept


def build_app(
    log_: EventLog,
    read_conversation: ReadConversation,
    *,
    worker: Worker | None = None,
    metrics: Metrics | None = None,
    clock: Clock | None = None,
    hub: ReplyHub | None = None,
) -> web.Application:
    clock = clock or SystemClock()
    app = web.Application(client_max_size=MAX_BODY_BYTES)

    async def post_message(request: web.Request) -> web.Response:
        conversation = request.match_info["conversation"]
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or set(body) - {"content", "message_id"}:
            return _error(400, 'expected {"content": "...", "message_id"?: "..."}')
        content, message_id = body.get("content"), body.get("message_id")
        if not isinstance(content, str) or not (message_id is None or isinstance(message_id, str)):
            return _error(400, "content must be a string, and message_id a string when given")
        try:
            event = message_event(conversation, content, clock.now_ms(), message_id)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            return _error(400, problems)
        reply = {"conversation_id": conversation, "message_id": event.message_id}
        # What the worker already folded: a known id is not published again.
        state = worker.states.get(conversation) if worker is not None else None
        seen = state.seen_inputs.get(event.message_id) if state is not None else None
        if state is not None and seen is not None:
            if seen != content_fingerprint(content):
                return _error(409, f"message id {event.message_id!r} was already used for other content")
            status = "rejected" if event.message_id in state.rejected else "accepted"
            return _json({**reply, "duplicate": True, "status": status}, 202)
        partition, offset = await log_.append(log_.topics.events, conversation, encode(event))
        headers = {"Location": f"/conversations/{conversation}"}
        return web.Response(
            body=orjson.dumps({**reply, "partition": partition, "offset": offset}),
            status=202,
            content_type="application/json",
            headers=headers,
        )

    async def get_conversation(request: web.Request) -> web.Response:
        conversation = request.match_info["conversation"]
        view = build_view(conversation, await read_conversation(conversation))
        if view.state.events_applied == 0:
            return _error(404, f"no events of conversation {conversation!r}")
        return _json(state_json(view))

    async def get_turn(request: web.Request) -> web.Response:
        conversation, turn_id = request.match_info["conversation"], request.match_info["turn_id"]
        view = build_view(conversation, await read_conversation(conversation))
        turn = view.turns.get(turn_id)
        if turn is None:
            return _error(404, f"no turn {turn_id!r} in conversation {conversation!r}")
        if _wants_html(request):
            return web.Response(text=turn_html(conversation, turn), content_type="text/html")
        return _json(turn_json(conversation, turn))

    async def stream_reply(request: web.Request) -> web.StreamResponse:
        if hub is None:
            return _error(404, "this service does not stream replies")
        conversation = request.match_info["conversation"]
        queue = hub.subscribe(conversation)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")  # proxies close silent connections
                    continue
                await response.write(event.sse())
                if event.kind == "outcome":
                    break
        finally:
            hub.unsubscribe(conversation, queue)
        await response.write_eof()
        return response

    async def get_metrics(_request: web.Request) -> web.Response:
        if metrics is None:
            return _error(404, "metrics are not enabled")
        from turnstile.streams.metrics import CONTENT_TYPE

        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def health(_request: web.Request) -> web.Response:
        return _json({"ok": True})

    app.router.add_post("/conversations/{conversation}/messages", post_message)
    app.router.add_get("/conversations/{conversation}", get_conversation)
    app.router.add_get("/conversations/{conversation}/turns/{turn_id}", get_turn)
    app.router.add_get("/conversations/{conversation}/stream", stream_reply)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", health)
    return app


class HttpServer:
    """The app on a host and port (port 0: any free one; `url` says which)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("HTTP on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT`, or `PORT` alone for 127.0.0.1."""
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)
