"""The tool registry and the validation of tool calls, before anything runs.

A tool is a name, a description, a pydantic model of its arguments (whose JSON Schema is
what the provider shows the model), a kind (`read_only` or `side_effect`), whether it may
run in isolated (scheduled) turns, whether it needs a person's approval, and an async
callable the runner awaits with the validated arguments. Validation here is pure; the
runner is the only place a tool actually runs.

A side-effecting tool can say how a call interrupted mid-run is settled by the next owner
(see `handlers/resume.py`): `idempotent=True` means `run(arguments, idempotency_key)` is
always called with a key stable over every run of the call, so running it again has one
effect; a `reconcile(call)` returns the result of a call that did run, `NOT_RUN` when it
had no effect, or None when it cannot tell. A tool with neither makes such a turn fail visibly.

Secret arguments: a field of the argument model typed `SecretStr` or `SecretBytes` (also
inside an optional, a list or a nested model) is a secret. The log keeps the call with
those values replaced by `[redacted]` (`ToolRegistry.recorded`) -- in the `ModelResponded`
that requested it, its `ToolCallStarted`, a pause and its signature -- while the tool is
given the validated arguments parsed from what the model sent.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, SecretBytes, SecretStr, ValidationError

from turnstile.events import ToolCall
from turnstile.handlers.provider import ToolSpec
from turnstile.handlers.resume import Recovery

ToolKind = Literal["read_only", "side_effect"]
# run(arguments), or run(arguments, idempotency_key) for an idempotent tool.
ToolFunction = Callable[..., Awaitable[str]]
class NotRun(enum.Enum):
    """What a reconciler returns when it knows the call had no effect (the system it acts on
    holds nothing under the call's id, say): the call is recorded as not run, and the model,
    told so, may make it again -- a new call, run as any."""

    NOT_RUN = "not_run"


NOT_RUN = NotRun.NOT_RUN
# The result of a call that ran before an interruption, `NOT_RUN` when it had no effect, or
# None when it cannot be known (the turn fails: running it again might act twice).
Reconciler = Callable[[ToolCall], Awaitable[str | NotRun | None]]
REDACTED = "[redacted]"

# Tool names as OpenAI's and Anthropic's APIs take them (a request with another is refused).
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# Where a model's secrets are: field name -> True (the value is secret) or the secrets of
# the nested model (or models) the field holds.
Secrets = dict[str, "bool | Secrets"]


def secret_fields(model: type[BaseModel]) -> Secrets:
    out: Secrets = {}
    for name, info in model.model_fields.items():
        found = _secrets_in(info.annotation)
        if found:
            out[info.alias or name] = found
    return out


def _secrets_in(annotation: Any) -> bool | Secrets:
    if annotation in (SecretStr, SecretBytes):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return secret_fields(annotation)
    # Optional[...], list[...], dict[str, ...], Annotated[...]: secret if what they hold is.
    merged: Secrets = {}
    for arg in typing.get_args(annotation):
        found = _secrets_in(arg)
        if found is True:
            return True
        if isinstance(found, dict):
            merged.update(found)
    return merged


def redacted_arguments(secrets: Secrets, arguments: str) -> str:
    """The arguments JSON with the secret values replaced. Text that does not parse cannot
    be searched for them: it is redacted whole."""
    if not secrets:
        return arguments
    try:
        parsed = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return f"{REDACTED} ({len(arguments)} characters that are not JSON)"
    return orjson.dumps(_redact(parsed, secrets)).decode()


def _redact(value: Any, secrets: bool | Secrets) -> Any:
    if secrets is True:
        return None if value is None else REDACTED
    if isinstance(value, list):
        return [_redact(v, secrets) for v in value]
    if isinstance(value, dict) and isinstance(secrets, dict):
        return {k: _redact(v, secrets[k]) if k in secrets else v for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    arguments: type[BaseModel]
    run: ToolFunction
    kind: ToolKind = "read_only"
    isolated_ok: bool = False
    needs_approval: bool = False
    idempotent: bool = False
    reconcile: Reconciler | None = None
    # How long a call may run, in seconds; None: the worker's `tool_timeout_s` (60). Never
    # past the turn's deadline either way.
    timeout_s: float | None = None

    @property
    def side_effect(self) -> bool:
        return self.kind == "side_effect"

    @property
    def has_secrets(self) -> bool:
        """Some of its arguments are secret: the log keeps its calls redacted, so a call cannot
        be made again from there (after the worker that had the values stopped)."""
        return bool(secret_fields(self.arguments))

    @property
    def recovery(self) -> Recovery:
        """How a call of this tool left started and not finished is settled."""
        if not self.side_effect:
            return "rerun"
        if self.idempotent and not self.has_secrets:
            return "idempotent"
        return "reconcile" if self.reconcile is not None else "none"

    def spec(self) -> ToolSpec:
        schema = self.arguments.model_json_schema()
        schema.pop("title", None)  # the tool's name already says it
        return ToolSpec(self.name, self.description, schema)


def _seconds(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


class ToolRegistry:
    """The tools a turn may call, by name. Names are unique."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"tool {tool.name!r} is registered twice")
            if not TOOL_NAME.fullmatch(tool.name):
                raise ValueError(f"tool {tool.name!r}: a name is 1-64 letters, digits, _ or - (as the model APIs take)")
            if tool.timeout_s is not None and not _seconds(tool.timeout_s):
                raise ValueError(f"tool {tool.name!r}: timeout_s is a number of seconds over 0, not {tool.timeout_s!r}")
            if tool.needs_approval and tool.has_secrets:
                raise ValueError(
                    f"tool {tool.name!r}: an approval names its call by the arguments as the log keeps them, and "
                    "secret ones are kept redacted, so an approval could let a call with another secret run; "
                    "let the tool take the secret from its own configuration instead"
                )
            self._tools[tool.name] = tool

    def __len__(self) -> int:
        return len(self._tools)

    def available(self, isolated: bool) -> tuple[Tool, ...]:
        """Isolated (scheduled) turns have nobody watching: only tools marked for them."""
        return tuple(t for t in self._tools.values() if t.isolated_ok or not isolated)

    def specs(self, isolated: bool) -> tuple[ToolSpec, ...]:
        return tuple(t.spec() for t in self.available(isolated))

    def get(self, name: str, isolated: bool) -> Tool | None:
        tool = self._tools.get(name)
        return tool if tool is not None and (tool.isolated_ok or not isolated) else None

    def recorded(self, call: ToolCall) -> ToolCall:
        """The call as the log keeps it: its tool's secret arguments redacted."""
        tool = self._tools.get(call.name)
        if tool is None:
            return call
        arguments = redacted_arguments(secret_fields(tool.arguments), call.arguments)
        return call if arguments == call.arguments else call.model_copy(update={"arguments": arguments})


@dataclass(frozen=True, slots=True)
class ValidCall:
    call: ToolCall  # as the log keeps it (secrets redacted)
    tool: Tool
    arguments: BaseModel  # what the tool is given: parsed from the call the model sent
    signature: str


InvalidKind = Literal["unknown_tool", "malformed_arguments"]


@dataclass(frozen=True, slots=True)
class InvalidCall:
    """A call that must not run; `detail` is recorded and sent back to the model."""

    call: ToolCall  # as the log keeps it (secrets redacted)
    kind: InvalidKind
    detail: str
    signature: str


def canonical_arguments(arguments: str) -> str:
    """Normalized JSON (sorted keys, no whitespace) when it parses; otherwise the text with
    surrounding whitespace stripped, so the same broken text is still the same call."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments.strip()
    return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS).decode()


def call_signature(name: str, arguments: str) -> str:
    """Tool name plus a digest of the normalized arguments: equal for the same call
    however the model spaced or ordered its JSON."""
    digest = hashlib.sha256(canonical_arguments(arguments).encode()).hexdigest()[:16]
    return f"{name}:{digest}"


def validate_call(registry: ToolRegistry, sent: ToolCall, isolated: bool) -> ValidCall | InvalidCall:
    """`sent`: the call as the model sent it. The signature is the recorded call's, so that
    an approval read back from the log matches it."""
    call = registry.recorded(sent)
    signature = call_signature(call.name, call.arguments)
    tool = registry.get(call.name, isolated)
    if tool is None:
        where = " in a scheduled turn" if isolated and registry.get(call.name, False) is not None else ""
        return InvalidCall(call, "unknown_tool", f"tool {call.name!r} is not available{where}", signature)
    try:
        parsed = orjson.loads(sent.arguments) if sent.arguments.strip() else {}
    except orjson.JSONDecodeError as exc:
        return InvalidCall(call, "malformed_arguments", f"arguments are not valid JSON ({exc})", signature)
    try:
        arguments = tool.arguments.model_validate(parsed)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<arguments>'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)[:5]
        )
        return InvalidCall(call, "malformed_arguments", f"arguments do not match the schema: {problems}", signature)
    return ValidCall(call, tool, arguments, signature)
