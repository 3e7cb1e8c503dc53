"""A reader of `GET /conversations/{id}/stream`, as a chat UI would be: it collects the
server-sent events until the outcome closes the stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from turnstile.handlers.providers.sse import SseDecoder


@dataclass
class StreamReader:
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    connected: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self, client: httpx.AsyncClient, conversation: str) -> None:
        decoder = SseDecoder()
        async with client.stream("GET", f"/conversations/{conversation}/stream", timeout=None) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            self.connected.set()
            async for chunk in response.aiter_bytes():
                for event in decoder.feed(chunk):
                    self.events.append((event.event, json.loads(event.data)))
                    if event.event == "outcome":
                        return

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]

    def text(self, attempt: int | None = None) -> str:
        """The deltas joined, of one attempt or of all."""
        return "".join(d["text"] for k, d in self.events if k == "delta" and attempt in (None, d["attempt"]))

    def deltas(self) -> int:
        return self.kinds().count("delta")

    async def until(self, condition: Callable[[StreamReader], bool], timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not condition(self):
            assert asyncio.get_running_loop().time() < deadline, f"stream: not reached; got {self.events}"
            await asyncio.sleep(0.02)
