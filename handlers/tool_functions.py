"""Tools declared from typed Python functions, as Pydantic AI and FastAPI users write them.

The function's parameters become the pydantic model of the tool's arguments (their
annotations the types, their defaults the defaults, `Args:` lines of the docstring the
field descriptions) and the rest of the docstring's first paragraph its description, so
what the model is shown is what the function accepts. Building the tool is pure; the
function runs only when the runner awaits `Tool.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import re
import threading
from collections.abc import Callable
from typing import Any, TypedDict, Unpack, get_type_hints, overload

import orjson
from pydantic import BaseModel, ConfigDict, Field, PydanticSchemaGenerationError, create_model

from turnstile.handlers.tools import Reconciler, Tool, ToolKind

ToolCallable = Callable[..., Any]

_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def _docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """The first paragraph (the description) and the `Args:` lines (name -> text)."""
    text = inspect.cleandoc(doc or "")
    description = text.split("\n\n", 1)[0].strip()
    if description.startswith(("Args:", "Arguments:")):
        description = ""
    arguments: dict[str, str] = {}
    section = re.split(r"^(?:Args|Arguments):\s*$", text, maxsplit=1, flags=re.MULTILINE)
    if len(section) == 2:
        lines = [line for line in section[1].split("\n\n", 1)[0].splitlines() if line.strip()]
        # A name is at the section's first indentation; deeper lines continue its text
        # ("    Example: A-1234" under an argument is no argument).
        indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
        for line in lines:
            if len(line) - len(line.lstrip()) == indent and (match := _ARG_LINE.match(line)):
                arguments[match.group(1)] = match.group(2).strip()
    return " ".join(description.split()), arguments


def arguments_model(function: ToolCallable, name: str, passed_by_engine: tuple[str, ...] = ()) -> type[BaseModel]:
    """The pydantic model of `function`'s parameters (but those the engine passes itself).
    Every parameter needs an annotation: the model is told the type, and an unannotated
    argument would accept anything."""
    signature = inspect.signature(function)
    hints = get_type_hints(function)
    _, described = _docstring_parts(function.__doc__)
    fields: dict[str, Any] = {}
    for parameter in signature.parameters.values():
        if parameter.name in passed_by_engine:
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.POSITIONAL_ONLY):
            raise TypeError(f"tool {name!r}: parameter {parameter.name!r} must be a plain or keyword argument")
        if parameter.name not in hints:
            raise TypeError(f"tool {name!r}: parameter {parameter.name!r} has no type annotation")
        default = ... if parameter.default is parameter.empty else parameter.default
        fields[parameter.name] = (hints[parameter.name], Field(default, description=described.get(parameter.name)))
    unknown = sorted(set(described) - set(fields) - set(passed_by_engine))
    if unknown:  # (a typo there left the parameter undescribed to the model, silently)
        raise TypeError(f"tool {name!r}: its docstring's Args name {unknown}, which are not its parameters")
    # Unknown arguments are the model's mistake: refused, so it is told and can correct them.
    config = ConfigDict(extra="forbid")
    try:
        model: type[BaseModel] = create_model(f"{name}_arguments", __config__=config, **fields)
    except PydanticSchemaGenerationError as exc:  # a type pydantic cannot validate from JSON
        kinds = ", ".join(f"{p}: {getattr(t, '__name__', t)}" for p, (t, _) in fields.items())
        raise TypeError(
            f"tool {name!r}: a parameter's type cannot be read from the model's JSON ({kinds}); use str, numbers,"
            " bool, lists, dicts, enums, dates or a pydantic model"
        ) from exc
    return model


def _result_text(value: object) -> str:
    """What the model reads back: strings as they are, what JSON can say as JSON (objects
    inside it as their `str()`), any other object as its `str()`."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        if isinstance(value, dict | list | tuple):
            return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        return orjson.dumps(value).decode()
    except TypeError:  # (an integer past 64 bits, say): the call succeeded all the same
        return str(value)


class ToolFlags(TypedDict, total=False):
    """What `@tool(...)` and `@agent.tool(...)` take besides the function."""

    name: str | None
    description: str | None
    side_effect: bool
    isolated_ok: bool
    needs_approval: bool
    idempotent: bool
    reconcile: Reconciler | None
    timeout_s: float | None


# The parameter an idempotent tool's function takes the call's idempotency key in: passed by
# the engine, not shown to the model as an argument.
IDEMPOTENCY_KEY = "idempotency_key"


async def _in_tool_thread(function: Callable[..., object], values: dict[str, object]) -> object:
    """A plain (sync) tool's call, on a daemon thread of its own. Not a pool's: a call still
    running past its timeout keeps its thread (Python cannot stop one), and hung calls held
    a pool's every thread, leaving none for any other tool (32 hung calls, and every plain
    tool of every conversation timed out); a pool's threads also held up the process's exit.
    Not the loop's default executor either, which DNS lookups and the embedded log share."""
    global _running
    if _running >= MAX_TOOL_THREADS:
        # Hung calls hold their threads for good: past this many, a new one fails at once
        # rather than take the process to its thread limit (which the loop's own executor,
        # DNS lookups included, shares).
        raise RuntimeError(f"{_running} plain tool calls are still running (hung past their timeouts?)")
    loop = asyncio.get_running_loop()
    done: asyncio.Future[object] = loop.create_future()
    context = contextvars.copy_context()

    def call() -> None:
        global _running
        try:
            outcome: tuple[object, Exception | None] = (context.run(function, **values), None)
        except Exception as exc:
            outcome = (None, exc)
        except BaseException as exc:  # SystemExit from a wrapped CLI, say: an error of the call's
            outcome = (None, RuntimeError(f"the tool raised {type(exc).__name__}: {exc}"))
        finally:
            with _count:
                _running -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(_settle, done, *outcome)

    with _count:
        _running += 1
    threading.Thread(target=call, name="turnstile-tool", daemon=True).start()
    return await done


# Plain tool calls running on their threads now, and how many may (see `_in_tool_thread`).
MAX_TOOL_THREADS = 512
_running = 0
_count = threading.Lock()


def _settle(done: asyncio.Future[object], result: object, error: Exception | None) -> None:
    if done.cancelled():  # timed out, or the turn stopped: the result has no taker
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def tool_from_function(
    function: ToolCallable,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: bool = False,
    isolated_ok: bool = False,
    needs_approval: bool = False,
    idempotent: bool = False,
    reconcile: Reconciler | None = None,
    timeout_s: float | None = None,
) -> Tool:
    """`idempotent` and `reconcile` say how a call left started and unfinished (its worker
    stopped) is settled, so they are for side effects only: `idempotent` runs it again with
    the same key (the function takes `idempotency_key: str`); `reconcile(call)` asks
    whether it acted (its result; `NOT_RUN`: it had no effect, the model may make it again;
    None: it cannot tell, and the turn fails)."""
    tool_name = name or function.__name__
    if (idempotent or reconcile is not None) and not side_effect:
        raise TypeError(f"tool {tool_name!r}: idempotent= and reconcile= settle a side effect: add side_effect=True")
    if reconcile is not None and not inspect.iscoroutinefunction(reconcile):
        raise TypeError(f"tool {tool_name!r}: reconcile= is an async function (call) -> result, NOT_RUN or None")
    key = inspect.signature(function).parameters.get(IDEMPOTENCY_KEY)
    if idempotent != (key is not None) or (key is not None and key.kind == key.POSITIONAL_ONLY):
        problem = "an idempotent tool's function needs" if idempotent else "only an idempotent=True tool takes"
        raise TypeError(f"tool {tool_name!r}: {problem} a (keyword) parameter {IDEMPOTENCY_KEY}: str")
    model = arguments_model(function, tool_name, passed_by_engine=(IDEMPOTENCY_KEY,))
    summary, _ = _docstring_parts(function.__doc__)
    if not (description or summary):
        raise TypeError(f"tool {tool_name!r} needs a description: give it a docstring or description=")
    fields = tuple(model.model_fields)
    is_async = inspect.iscoroutinefunction(function)

    async def run(arguments: BaseModel, *key: str) -> str:
        values = {field: getattr(arguments, field) for field in fields}
        if key:  # an idempotent tool's call: run(arguments, idempotency_key)
            values[IDEMPOTENCY_KEY] = key[0]
        # A plain function runs in a thread: it would hold every conversation's turns (and
        # the deadline's cancellation) for as long as it runs on the event loop.
        result = await function(**values) if is_async else await _in_tool_thread(function, values)
        return _result_text(result)

    kind: ToolKind = "side_effect" if side_effect else "read_only"
    flags = (isolated_ok, needs_approval, idempotent, reconcile, timeout_s)
    return Tool(tool_name, description or summary, model, run, kind, *flags)


@overload
def tool(function: ToolCallable, /) -> Tool: ...


@overload
def tool(**flags: Unpack[ToolFlags]) -> Callable[[ToolCallable], Tool]: ...


def tool(function: ToolCallable | None = None, /, **flags: Unpack[ToolFlags]) -> Tool | Callable[[ToolCallable], Tool]:
    """`@tool` or `@tool(side_effect=True, needs_approval=True)` over a typed function
    (sync or async) turns it into a `Tool`. `side_effect`: the call changes the world, so a
    turn that started it is never retried automatically; `isolated_ok`: scheduled turns,
    with nobody watching, may call it; `needs_approval`: the turn pauses until a person
    approves the exact call (`turnstile approve`); `timeout_s`: how long a call may run
    (default: the worker's 60 s; never past the turn's deadline)."""

    def decorate(f: ToolCallable) -> Tool:
        return tool_from_function(f, **flags)

    return decorate(function) if function is not None else decorate
