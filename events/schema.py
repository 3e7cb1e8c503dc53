"""The checked-in contract, generated from the models: JSON Schema of every event, of the
event union, of the outcome union and of the dead letter, plus an AsyncAPI 3 document
of the three topics.

    python -m turnstile.events.schema --write   # regenerate events/schemas/ and events/asyncapi.yaml
    python -m turnstile.events.schema --check   # exit 1 if the checked-in files differ (the default)

A test runs the check, so a model change without regenerated files fails the build.
The schemas are JSON Schema draft-07 (what pydantic emits validates under it) and
describe what producers publish today: `schema_version` is the current one. Values of
older versions are still accepted by readers through upcasters (`events.upcast`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, TypeAdapter

from turnstile.events.base import SCHEMA_VERSION
from turnstile.events.dead_letter import DeadLetter
from turnstile.events.deltas import ReplyDelta
from turnstile.events.examples import approval_example, dead_letter_example, delta_example, event_examples
from turnstile.events.rejections import MessageRejected
from turnstile.events.union import EVENT_ADAPTER, INPUT_TYPES, OUTCOME_TYPES, Event, TerminalOutcome

# What the workers copy to the outcomes topic: every terminal outcome and every refusal.
OutcomeRecord = typing.Annotated[TerminalOutcome | MessageRejected, Field(discriminator="type")]
OUTCOME_TOPIC_TYPES: tuple[type[BaseModel], ...] = (*OUTCOME_TYPES, MessageRejected)

HERE = Path(__file__).parent
SCHEMA_DIR = HERE / "schemas"
ASYNCAPI_PATH = HERE / "asyncapi.yaml"
DRAFT = "http://json-schema.org/draft-07/schema#"
SCHEMA_FORMAT = "application/schema+json;version=draft-07"
KAFKA_BINDING = "0.5.0"
JsonSchema = dict[str, Any]


def event_models() -> tuple[type[BaseModel], ...]:
    """Every member of the event union, in declaration order."""
    (union, *_) = typing.get_args(Event)  # Annotated[Union[...], Field(discriminator=...)]
    return tuple(typing.get_args(union))


def _finish(schema: JsonSchema, title: str | None = None) -> JsonSchema:
    out: JsonSchema = {"$schema": DRAFT}
    if title:
        out["title"] = title
    out.update(schema)
    _require_type(out)
    _drop_discriminators(out)
    return out


def _drop_discriminators(node: Any) -> None:
    """OpenAPI's `discriminator` is no JSON Schema keyword: validators in their strict mode
    (ajv's default) refuse it. A plain `oneOf` says the same, since every member pins
    `type` with a `const`, so exactly one member matches any valid value."""
    if isinstance(node, dict):
        if isinstance(node.get("discriminator"), dict) and "propertyName" in node["discriminator"]:
            del node["discriminator"]
        for value in node.values():
            _drop_discriminators(value)
    elif isinstance(node, list):
        for value in node:
            _drop_discriminators(value)


def _require_type(schema: JsonSchema) -> None:
    """`type` has a default in the models (so Python code need not repeat it), but on the
    wire it is the discriminator and always required."""
    for node in [schema, *schema.get("$defs", {}).values()]:
        props = node.get("properties", {})
        if "type" in props and "const" in props["type"]:
            required = node.setdefault("required", [])
            if "type" not in required:
                required.insert(0, "type")


def schema_documents() -> dict[str, JsonSchema]:
    """File name (under events/schemas/) -> schema."""
    docs: dict[str, JsonSchema] = {
        "event.schema.json": _finish(EVENT_ADAPTER.json_schema(), "Event"),
        "outcome.schema.json": _finish(TypeAdapter(OutcomeRecord).json_schema(), "OutcomeRecord"),
        "DeadLetter.schema.json": _finish(DeadLetter.model_json_schema()),
        "ReplyDelta.schema.json": _finish(ReplyDelta.model_json_schema()),
    }
    for model in event_models():
        docs[f"{model.__name__}.schema.json"] = _finish(model.model_json_schema())
    return docs


# -- the AsyncAPI document -----------------------------------------------------------------


def _summary(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or model.__name__).strip()
    return " ".join(doc.split("\n\n")[0].split())


def _message(name: str, model: type[BaseModel], examples: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    return {
        "name": name,
        "title": name,
        "summary": _summary(model),
        "contentType": "application/json",
        "payload": {"schemaFormat": SCHEMA_FORMAT, "schema": {"$ref": f"./schemas/{name}.schema.json"}},
        "bindings": {
            "kafka": {
                "key": {"type": "string", "description": "the conversation id (murmur2 partitioning)"},
                "bindingVersion": KAFKA_BINDING,
            }
        },
        **({"examples": [{"name": n, "payload": dict(p)} for n, p in examples]} if examples else {}),
    }


def asyncapi_document() -> dict[str, Any]:
    examples = {t: e.model_dump(mode="json") for t, e in event_examples().items()}
    messages: dict[str, Any] = {}
    for model in event_models():
        name = model.__name__
        shown = [(name, examples[name])] if name in examples else []  # the contract test asks for one
        if name == "InputInjected":
            shown.append(("approval", approval_example().model_dump(mode="json")))
        messages[name] = _message(name, model, shown)
    messages["DeadLetter"] = _message("DeadLetter", DeadLetter, [("DeadLetter", dead_letter_example().model_dump())])
    messages["ReplyDelta"] = _message("ReplyDelta", ReplyDelta, [("ReplyDelta", delta_example().model_dump())])

    def refs(names: list[str]) -> dict[str, Any]:
        return {n: {"$ref": f"#/components/messages/{n}"} for n in names}

    all_events = [m.__name__ for m in event_models()]
    inputs = [m.__name__ for m in INPUT_TYPES]
    outcomes = [m.__name__ for m in OUTCOME_TOPIC_TYPES]
    forever = {"retention.ms": -1}

    def on(channel: str, names: list[str]) -> list[dict[str, str]]:
        return [{"$ref": f"#/channels/{channel}/messages/{n}"} for n in names]

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "turnstile",
            "version": f"{SCHEMA_VERSION}.0.0",
            "description": (
                "A durable, event-sourced turn engine for LLM chat agents. Every value is one JSON "
                "object with a flat envelope (type, schema_version, event_id, conversation_id, "
                "occurred_at, causation_id; turn events add turn_id, run_id, attempt). Generated by "
                "`python -m turnstile.events.schema --write`; do not edit by hand."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:9092",
                "protocol": "kafka",
                "description": "the single-node broker started by infra/kafka/start.sh",
            }
        },
        "channels": {
            "events": {
                "address": "turnstile.events",
                "title": "conversation events",
                "description": (
                    "Every event of every conversation, keyed by conversation id so that one "
                    "conversation stays in one partition and in order. Inputs are published by "
                    "services; lifecycle events and outcomes by the workers. Never expires: it is "
                    "the source of truth every reader folds."
                ),
                "messages": refs(all_events),
                "bindings": {
                    "kafka": {
                        "topic": "turnstile.events",
                        "partitions": 8,
                        "replicas": 1,
                        "topicConfiguration": forever,
                        "bindingVersion": KAFKA_BINDING,
                    }
                },
            },
            "outcomes": {
                "address": "turnstile.outcomes",
                "title": "terminal outcomes",
                "description": (
                    "One record per terminal outcome (and per message refused by the double-text policy), "
                    "keyed by conversation id, the same JSON as on the events topic. "
                    "At-least-once: a worker publishes an outcome when its consumer "
                    "folds it past the committed offset, so a crash between the publish and the commit "
                    "publishes it again, byte-identical: dedupe on event_id (or conversation_id + turn_id; "
                    "a turn_id alone repeats across conversations)."
                ),
                "messages": refs(outcomes),
                "bindings": {"kafka": {"topic": "turnstile.outcomes", "bindingVersion": KAFKA_BINDING}},
            },
            "deadLetters": {
                "address": "turnstile.events.dlq",
                "title": "dead letters",
                "description": (
                    "Values of the events topic that were not accepted (not JSON, invalid, too large, "
                    "key not the conversation id, message id reused for other content), with the "
                    "original bytes, where they were read and why. Never expires."
                ),
                "messages": refs(["DeadLetter"]),
                "bindings": {
                    "kafka": {
                        "topic": "turnstile.events.dlq",
                        "partitions": 1,
                        "topicConfiguration": forever,
                        "bindingVersion": KAFKA_BINDING,
                    }
                },
            },
            "deltas": {
                "address": "turnstile.deltas",
                "title": "reply deltas",
                "description": (
                    "The text of replies while they stream in, keyed by conversation id, for live "
                    "readers (GET /conversations/{id}/stream). Not the record: the events topic has "
                    "each reply whole in ModelResponded. Kept for an hour."
                ),
                "messages": refs(["ReplyDelta"]),
                "bindings": {
                    "kafka": {
                        "topic": "turnstile.deltas",
                        "partitions": 8,
                        "topicConfiguration": {"retention.ms": 3_600_000},
                        "bindingVersion": KAFKA_BINDING,
                    }
                },
            },
        },
        "operations": {
            "receiveInputs": {
                "action": "receive",
                "channel": {"$ref": "#/channels/events"},
                "summary": "Services publish inputs; the workers consume them (and every other event).",
                "messages": on("events", inputs),
            },
            "recordTurns": {
                "action": "send",
                "channel": {"$ref": "#/channels/events"},
                "summary": "Workers append the lifecycle and the outcome of every turn.",
                "messages": on("events", [n for n in all_events if n not in inputs]),
            },
            "publishOutcomes": {
                "action": "send",
                "channel": {"$ref": "#/channels/outcomes"},
                "summary": "Workers publish each terminal outcome and refusal for consumers that only want results.",
                "messages": on("outcomes", outcomes),
            },
            "deadLetter": {
                "action": "send",
                "channel": {"$ref": "#/channels/deadLetters"},
                "summary": "Workers route values they cannot accept here and move on.",
                "messages": on("deadLetters", ["DeadLetter"]),
            },
            "streamReplies": {
                "action": "send",
                "channel": {"$ref": "#/channels/deltas"},
                "summary": "Workers that stream replies send each piece of text as it arrives.",
                "messages": on("deltas", ["ReplyDelta"]),
            },
        },
        "components": {"messages": messages},
    }


# -- rendering -------------------------------------------------------------------------------

_PLAIN_KEY = re.compile(r"^[A-Za-z_$][A-Za-z0-9_.$-]*$")
_YAML11_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def _key(key: str) -> str:
    return key if _PLAIN_KEY.match(key) and key.lower() not in _YAML11_WORDS else json.dumps(key)


def _scalar(value: Any) -> str:
    # JSON scalars are valid YAML flow scalars; strings are always double-quoted.
    return json.dumps(value, ensure_ascii=False)


def to_yaml(value: Any, indent: int = 0) -> str:
    """A small YAML emitter for JSON-like data: block mappings and sequences, quoted strings."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, dict | list) and v:
                lines.append(f"{pad}{_key(k)}:")
                lines.append(to_yaml(v, indent + 1))
            else:
                lines.append(f"{pad}{_key(k)}: {_empty_or_scalar(v)}")
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) and item:
                nested = to_yaml(item, indent + 1)
                lines.append(f"{pad}- {nested.lstrip()}")
            else:
                lines.append(f"{pad}- {_empty_or_scalar(item)}")
    else:
        lines.append(pad + _scalar(value))
    return "\n".join(lines)


def _empty_or_scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def _json(doc: JsonSchema) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def rendered_files() -> dict[Path, str]:
    """Every generated file with its exact text."""
    files = {SCHEMA_DIR / name: _json(doc) for name, doc in schema_documents().items()}
    header = "# Generated by `python -m turnstile.events.schema --write` from the models in events/. Do not edit.\n"
    files[ASYNCAPI_PATH] = header + to_yaml(asyncapi_document()) + "\n"
    return files


def drift() -> list[str]:
    """What differs between the models and the checked-in files (empty when in sync)."""
    wanted = rendered_files()
    problems = [
        f"{path.relative_to(HERE.parent)} is {'missing' if not path.exists() else 'out of date'}"
        for path, text in wanted.items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    if SCHEMA_DIR.exists():
        problems += [
            f"{p.relative_to(HERE.parent)} is not generated from any model"
            for p in sorted(SCHEMA_DIR.glob("*.json"))
            if p not in wanted
        ]
    return problems


def write() -> list[Path]:
    SCHEMA_DIR.mkdir(exist_ok=True)
    wanted = rendered_files()
    for stale in SCHEMA_DIR.glob("*.json"):
        if stale not in wanted:
            stale.unlink()
    changed = []
    for path, text in wanted.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m turnstile.events.schema", description="Generate or check the contract."
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in files")
    mode.add_argument("--check", action="store_true", help="fail if they differ from the models (default)")
    args = parser.parse_args(argv)
    if args.write:
        for path in write():
            print(f"wrote {path.relative_to(HERE.parent)}")
        return 0
    problems = drift()
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print("run `python -m turnstile.events.schema --write` and commit the result", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
