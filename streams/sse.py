"""Server-sent events: the one loop behind every feed the HTTP port serves (a reply as the
model writes it, a conversation's events as the worker folds them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

KEEPALIVE_S = 15.0  # proxies close connections that stay silent for long
_Item = TypeVar("_Item")


async def serve_feed(
    request: web.Request, queue: asyncio.Queue[_Item], render: Callable[[_Item], tuple[bytes, bool]]
) -> web.StreamResponse:
    """Writes each item of `queue` as `render` gives it (its bytes, and whether it is the
    last), and a comment line after each KEEPALIVE_S of silence. Ends after the last item or
    when the client goes away (which is no error of the server's)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                await response.write(b": keep-alive\n\n")
                continue
            data, last = render(item)
            await response.write(data)
            if last:
                break
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client closed the feed: nothing left to tell it
    return response
