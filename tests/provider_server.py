"""A scripted loopback model provider for tests.

A real HTTP/1.1 server on 127.0.0.1 (OS-chosen port) in background threads, so it
answers while the test's asyncio loop awaits the client. It speaks both wire formats:
`POST /v1/chat/completions` (OpenAI) and `POST /v1/messages` (Anthropic), and answers
each request with the next queued step:

    with ProviderServer() as server:
        server.push(Reply(text="hi", usage=(10, 3)))
        server.push(Reply(tool_calls=[("call_1", "search", '{"q": "x"}')]))
        server.push(Raw(500, b"oops"), Delay(2.0, Reply(text="late")), Drop())
        server.push(Gated(gate, Reply(text="when the test sets gate")))
        server.push(Streamed(["Hel", "lo"], gap_s=0.1))  # server-sent events, as they go
        ... HttpProvider(OpenAIChat(), server.base_url_openai, ...) ...
        server.requests[0].body  # what the client sent

When the script runs out the server answers 500 with a body naming the problem. Every
thread it started has stopped when the `with` block exits.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"
# A safety net only: exit closes idle keep-alive connections itself.
_IDLE_CONNECTION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Reply:
    """A successful completion, rendered in the wire format of the path that was hit.

    `tool_calls` are (call_id, name, arguments JSON text). `usage` is (input, output)
    tokens, as the real APIs always report; None leaves usage out of the body (some
    compatible servers do: the reply's cost is then unknown). `model` defaults to the
    requested one, `finish_reason` to what the real API would say.
    """

    text: str | None = None
    tool_calls: Sequence[tuple[str, str, str]] = ()
    usage: tuple[int, int] | None = (10, 5)
    model: str | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Raw:
    """An exact status and body. A dict or list body is sent as JSON."""

    status: int
    body: bytes | str | dict[str, Any] | list[Any] = b""
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Delay:
    """Wait `seconds`, then answer with `then`."""

    seconds: float
    then: Step


@dataclass(frozen=True)
class Gated:
    """Wait until the test sets `gate`, then answer with `then`: a request held in flight for
    exactly as long as the test needs, with no guess at a duration."""

    gate: threading.Event
    then: Step


@dataclass(frozen=True)
class Drop:
    """Close the connection without answering."""


@dataclass(frozen=True)
class Streamed:
    """A streamed reply (the request must ask for one): `pieces` of text as server-sent
    events in the wire format of the path that was hit, `gap_s` apart, then the end of the
    reply with `usage` (input, output tokens). Written as it goes and the connection then
    closed, as a real provider's chunked stream."""

    pieces: Sequence[str]
    gap_s: float = 0.0
    usage: tuple[int, int] = (10, 5)


Step = Reply | Raw | Delay | Gated | Drop | Streamed


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any  # parsed JSON, or None when the body was not JSON
    raw: bytes


class ProviderServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[Step] = deque()
        self._requests: list[RecordedRequest] = []
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ProviderServer:
        self._httpd = _HTTPServer(self)
        self._thread = threading.Thread(
            # A short poll keeps shutdown (which waits for the next poll) fast.
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.01},
            name="provider-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._httpd is not None and self._thread is not None
        self._stopping.set()  # wakes handlers sleeping in a Delay
        self._httpd.shutdown()  # no new connections
        self._httpd.close_open_connections()  # wakes handlers idling on keep-alive
        self._httpd.server_close()  # joins every handler thread
        self._thread.join()

    @property
    def base_url_openai(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def base_url_anthropic(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        assert self._httpd is not None, "use ProviderServer as a context manager"
        return int(self._httpd.server_address[1])

    def push(self, *steps: Step) -> None:
        with self._lock:
            self._steps.extend(steps)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def pending(self) -> int:
        """Steps not consumed yet."""
        with self._lock:
            return len(self._steps)

    def _handle(self, handler: _Handler) -> None:
        recorded = _record(handler, handler.rfile.read(int(handler.headers.get("content-length", 0))))
        known_path = handler.path in (OPENAI_PATH, ANTHROPIC_PATH)
        with self._lock:
            self._requests.append(recorded)
            number = len(self._requests)
            # A request to a wrong path is the client's bug: it must not eat the step meant for it.
            step = self._steps.popleft() if self._steps and known_path else None
        if not known_path:
            _send(handler, 404, _error_body(f"provider_server: no such endpoint POST {handler.path}"))
        elif step is None:
            problem = f"provider_server: script exhausted, no step queued for request #{number}"
            _send(handler, 500, _error_body(f"{problem} (POST {handler.path})"))
        else:
            self._play(handler, step, recorded.body)

    def _play(self, handler: _Handler, step: Step, request: Any) -> None:
        if isinstance(step, Delay):
            if self._stopping.wait(step.seconds):
                handler.close_connection = True  # shutting down: the client is gone or about to be
                return
            self._play(handler, step.then, request)
        elif isinstance(step, Gated):
            while not step.gate.is_set():
                if self._stopping.wait(0.01):
                    handler.close_connection = True
                    return
            self._play(handler, step.then, request)
        elif isinstance(step, Drop):
            handler.close_connection = True
        elif isinstance(step, Raw):
            _send(handler, step.status, _raw_body(step.body), step.headers)
        elif isinstance(step, Streamed):
            self._stream(handler, step, request)
        else:
            _send(handler, 200, json.dumps(_render(handler.path, step, request)).encode())

    def _stream(self, handler: _Handler, step: Streamed, request: Any) -> None:
        model = (request or {}).get("model", "unknown-model")
        events = _openai_stream(step, model) if handler.path == OPENAI_PATH else _anthropic_stream(step, model)
        handler.close_connection = True  # the body ends when the connection does
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        handler.send_header("connection", "close")
        handler.end_headers()
        for index, event in enumerate(events):
            if index and step.gap_s and self._stopping.wait(step.gap_s):
                return
            handler.wfile.write(event)
            handler.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    # Non-daemon handler threads, so that server_close() joins them all.
    daemon_threads = False
    block_on_close = True
    # A backlog for a burst of connections at once (socketserver's default is 5: past it,
    # connections are reset before they are accepted).
    request_queue_size = 256

    def __init__(self, owner: ProviderServer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.owner = owner
        self._open_lock = threading.Lock()
        self._open: set[socket.socket] = set()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_open_connections(self) -> None:
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):  # the client may have closed it already
                sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = _IDLE_CONNECTION_TIMEOUT_S
    server: _HTTPServer

    def do_POST(self) -> None:
        try:
            self.server.owner._handle(self)
        except OSError:
            # The client hung up first (e.g. it timed out during a Delay).
            self.close_connection = True
        except Exception as exc:
            # A scripting mistake: answer with it rather than dying in a background thread.
            _send(self, 500, _error_body(f"provider_server: {type(exc).__name__}: {exc}"))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean


def _record(handler: _Handler, raw: bytes) -> RecordedRequest:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    headers = {name.lower(): value for name, value in handler.headers.items()}
    return RecordedRequest(path=handler.path, headers=headers, body=body, raw=raw)


def _send(handler: _Handler, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
    handler.send_response(status)
    extra = dict(headers or {})
    if "content-type" not in {name.lower() for name in extra}:
        handler.send_header("content-type", "application/json")
    for name, value in extra.items():
        handler.send_header(name, value)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _raw_body(body: bytes | str | dict[str, Any] | list[Any]) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body).encode()


def _error_body(message: str) -> bytes:
    return json.dumps({"error": {"type": "provider_server_error", "message": message}}).encode()


def _render(path: str, reply: Reply, request: Any) -> dict[str, Any]:
    model = reply.model or (request or {}).get("model", "unknown-model")
    if path == OPENAI_PATH:
        return _openai_completion(reply, model)
    return _anthropic_message(reply, model)


def _openai_completion(reply: Reply, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in reply.tool_calls
        ]
    default_reason = "tool_calls" if reply.tool_calls else "stop"
    body: dict[str, Any] = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason or default_reason}],
    }
    if reply.usage is not None:
        prompt, completion = reply.usage
        total = prompt + completion
        body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}
    return body


def _anthropic_message(reply: Reply, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text is not None else []
    # The Messages API sends tool input as an object, so the script's JSON text must parse.
    content += [
        {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}
        for call_id, name, arguments in reply.tool_calls
    ]
    default_reason = "tool_use" if reply.tool_calls else "end_turn"
    body: dict[str, Any] = {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reply.finish_reason or default_reason,
        "stop_sequence": None,
    }
    if reply.usage is not None:
        body["usage"] = {"input_tokens": reply.usage[0], "output_tokens": reply.usage[1]}
    return body


def _sse(name: str | None, data: Any) -> bytes:
    head = f"event: {name}\n" if name else ""
    return (head + "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n").encode()


def _openai_stream(step: Streamed, model: str) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _sse(
            None, {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": model, "choices": [choice]}
        )

    prompt, completion = step.usage
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return [
        *(chunk({"content": piece}) for piece in step.pieces),
        chunk({}, "stop"),
        _sse(
            None,
            {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": model, "choices": [], "usage": usage},
        ),
        _sse(None, "[DONE]"),
    ]


def _anthropic_stream(step: Streamed, model: str) -> list[bytes]:
    message = {"id": "msg_test", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "usage": {"input_tokens": step.usage[0], "output_tokens": 1}}  # fmt: skip
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [
        _sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}},
        )
        for p in step.pieces
    ]
    end = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": step.usage[1]}}
    return [
        _sse("message_start", {"type": "message_start", "message": message}),
        _sse("content_block_start", block),
        *deltas,
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", end),
        _sse("message_stop", {"type": "message_stop"}),
    ]
