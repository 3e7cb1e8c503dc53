"""The console's routes on the worker's HTTP app (`build_app` adds them).

Same authentication as the API: with a token, a browser signs in once at `/ui/login` and
gets it back as an HttpOnly, SameSite=Strict cookie, which the API's middleware takes like
the bearer header (a POST authenticated by the cookie must also carry the console's
`X-Turnstile-Console` header, which no cross-site form can send). Pages read through the
same `Reads` as the API's GETs; the live feed is the read model's follow queue as
server-sent events: `folded` per event the worker folds, `reload` when a slow reader missed
some.
"""

from __future__ import annotations

import hmac

import orjson
from aiohttp import web

from turnstile.streams.console import pages
from turnstile.streams.console.format import esc
from turnstile.streams.http_reads import Reads, Unavailable
from turnstile.streams.read_model import Folded
from turnstile.streams.sse import serve_feed

COOKIE = "turnstile_token"
CONSOLE_HEADER = "X-Turnstile-Console"


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _folded_event(folded: Folded | None) -> tuple[bytes, bool]:
    """An event the worker folded, for the live page; None: some were missed, re-read it."""
    if folded is None:
        return b"event: reload\ndata: {}\n\n", False
    data = {"partition": folded.partition, "offset": folded.offset, "type": folded.type,
            "turn_id": folded.turn_id, "status": folded.status}  # fmt: skip
    return b"event: folded\ndata: " + orjson.dumps(data) + b"\n\n", False


def _problem(problem: Unavailable) -> web.Response:
    main = f'<h1>{problem.status}</h1><p class="error">{esc(problem.message)}</p>'
    response = _html(pages.layout(f"turnstile · {problem.status}", main), problem.status)
    if problem.retry_after_s is not None:
        response.headers["Retry-After"] = str(problem.retry_after_s)
    return response


def add_console(app: web.Application, reads: Reads, token: str | None) -> None:
    from turnstile.streams.http_api import id_problem, page_query

    async def conversation_list(request: web.Request) -> web.Response:
        if reads.model is None:
            return _problem(Unavailable(404, "the console lists a worker's conversations: no worker here"))
        query = page_query(request)
        if isinstance(query, str):
            return _problem(Unavailable(400, query))
        page = reads.model.page(**query)
        return _html(pages.list_page(page, query["contains"], query["status"], query["limit"]))

    async def conversation(request: web.Request) -> web.Response:
        conversation_id = request.match_info["conversation"]
        if problem := id_problem("the conversation id", conversation_id):
            return _problem(Unavailable(400, problem))
        view = await reads.conversation(conversation_id)
        if isinstance(view, Unavailable) and view.status == 404 and reads.model is not None:
            if request.query.get("fragment"):
                return _problem(view)
            # A link opened right after a publish: the page follows the conversation and
            # shows it once its first event is folded, instead of a dead end.
            return _html(pages.awaited_conversation_page(conversation_id, view.message), 404)
        if isinstance(view, Unavailable):
            return _problem(view)
        if request.query.get("fragment"):
            return _html(pages.conversation_main(view))
        return _html(pages.conversation_page(view, live=reads.model is not None))

    async def turn(request: web.Request) -> web.Response:
        conversation_id, turn_id = request.match_info["conversation"], request.match_info["turn_id"]
        if problem := id_problem("the conversation id", conversation_id) or id_problem("the turn id", turn_id):
            return _problem(Unavailable(400, problem))
        found = await reads.turn(conversation_id, turn_id)
        if isinstance(found, Unavailable):
            return _problem(found)
        view, turn_view = found
        if request.query.get("fragment"):
            return _html(pages.turn_main(view, turn_view))
        return _html(pages.turn_page(view, turn_view, live=reads.model is not None and turn_view.outcome is None))

    async def events(request: web.Request) -> web.StreamResponse:
        conversation_id = request.match_info["conversation"]
        if problem := id_problem("the conversation id", conversation_id):
            return _problem(Unavailable(400, problem))
        if reads.model is None:
            return _problem(Unavailable(404, "live updates need a worker beside this port"))
        queue = reads.model.follow(conversation_id)
        try:
            return await serve_feed(request, queue, _folded_event)
        finally:
            reads.model.unfollow(conversation_id, queue)

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            text = pages.asset(name)
        except FileNotFoundError:
            raise web.HTTPNotFound() from None
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        return web.Response(text=text, content_type=kind, charset="utf-8", headers={"Cache-Control": "max-age=300"})

    async def login_form(_request: web.Request) -> web.Response:
        return _html(pages.login_page(failed=False))

    async def login(request: web.Request) -> web.Response:
        given = str((await request.post()).get("token", ""))
        if token is None:
            raise web.HTTPSeeOther("/ui")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return _html(pages.login_page(failed=True), 401)
        response = web.HTTPSeeOther("/ui")
        response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
        raise response

    app.router.add_get("/ui", conversation_list)
    app.router.add_get("/ui/login", login_form)
    app.router.add_post("/ui/login", login)
    app.router.add_get("/ui/assets/{name}", asset)
    app.router.add_get("/ui/conversations/{conversation}", conversation)
    app.router.add_get("/ui/conversations/{conversation}/events", events)
    app.router.add_get("/ui/conversations/{conversation}/turns/{turn_id}", turn)
