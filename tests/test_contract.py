"""The checked-in contract: JSON Schemas and the AsyncAPI document match the models, the
golden values of every version still decode, and upcasters bring old versions forward."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import orjson
import pytest
import yaml

from turnstile.events import SCHEMA_VERSION, DecodeError, MessageReceived, TurnClaimed, decode, encode, logical_turn_id
from turnstile.events.deltas import decode_delta
from turnstile.events.schema import ASYNCAPI_PATH, SCHEMA_DIR, drift, event_models, main
from turnstile.events.upcast import UPCASTERS, Upcasters

GOLDEN = Path(__file__).parent / "golden"
EVENT_TYPES = {m.__name__ for m in event_models()}


def golden_files(version: int) -> list[Path]:
    return sorted((GOLDEN / f"v{version}").glob("*.json"))


def schema(name: str) -> dict[str, object]:
    return json.loads((SCHEMA_DIR / name).read_text())


# -- drift --------------------------------------------------------------------------------


def test_checked_in_schemas_and_asyncapi_match_the_models() -> None:
    assert drift() == [], "run `python -m turnstile.events.schema --write` and commit the result"


def test_the_generator_check_command_exits_zero_in_sync(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check"]) == 0


def test_drift_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model change that nobody regenerated shows up as an out-of-date file."""
    import turnstile.events.schema as generator

    real = generator.schema_documents

    def changed() -> dict[str, dict[str, object]]:
        docs = real()
        docs["MessageReceived.schema.json"]["description"] = "someone changed the model"
        return docs

    monkeypatch.setattr(generator, "schema_documents", changed)
    assert drift() == ["events/schemas/MessageReceived.schema.json is out of date"]
    assert main(["--check"]) == 1


def test_every_event_type_has_a_schema_file_and_is_in_the_union_schema() -> None:
    union = schema("event.schema.json")
    members = {ref["$ref"].rsplit("/", 1)[1] for ref in union["oneOf"]}  # type: ignore[index, union-attr]
    assert members == EVENT_TYPES
    assert "discriminator" not in union  # not JSON Schema: strict validators (ajv) refuse it
    for name in EVENT_TYPES:
        doc = schema(f"{name}.schema.json")
        assert doc["required"][0] == "type", name  # type: ignore[index]
        jsonschema.Draft7Validator.check_schema(doc)


# -- golden values ------------------------------------------------------------------------


def test_there_is_a_golden_value_of_every_event_type() -> None:
    covered = {json.loads(p.read_text())["type"] for p in golden_files(SCHEMA_VERSION)}
    assert covered == EVENT_TYPES


@pytest.mark.parametrize("path", golden_files(1), ids=lambda p: p.name)
def test_golden_v1_values_still_decode(path: Path) -> None:
    raw = path.read_bytes()
    event = decode(raw)
    assert not isinstance(event, DecodeError), event
    assert event.type == json.loads(raw)["type"]


@pytest.mark.parametrize("path", golden_files(SCHEMA_VERSION), ids=lambda p: p.name)
def test_golden_values_of_the_current_version_round_trip_exactly(path: Path) -> None:
    raw = json.loads(path.read_text())
    event = decode(path.read_bytes())
    assert not isinstance(event, DecodeError)
    assert _as_written(orjson.loads(encode(event)), raw) == raw


def _as_written(value: object, written: object) -> object:
    """`value` with only the keys `written` has, at every depth: optional fields added to
    the schema later (additive changes) come back with their defaults, which the golden
    value predates; every field it does have must come back unchanged."""
    if isinstance(value, dict) and isinstance(written, dict):
        return {k: _as_written(v, written[k]) for k, v in value.items() if k in written}
    if isinstance(value, list) and isinstance(written, list) and len(value) == len(written):
        return [_as_written(v, w) for v, w in zip(value, written, strict=True)]
    return value


@pytest.mark.parametrize("path", golden_files(SCHEMA_VERSION), ids=lambda p: p.name)
def test_golden_values_validate_against_the_checked_in_json_schemas(path: Path) -> None:
    """What a non-Python consumer does: validate with the published schema, not pydantic."""
    value = json.loads(path.read_text())
    jsonschema.validate(value, schema("event.schema.json"), cls=jsonschema.Draft7Validator)
    jsonschema.validate(value, schema(f"{value['type']}.schema.json"), cls=jsonschema.Draft7Validator)


def test_the_json_schema_rejects_what_the_codec_rejects() -> None:
    value = json.loads((GOLDEN / "v1" / "MessageReceived.json").read_text())
    for broken in ({**value, "surprise": 1}, {k: v for k, v in value.items() if k != "type"}, {**value, "content": ""}):
        assert isinstance(decode(orjson.dumps(broken)), DecodeError)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema("MessageReceived.schema.json"), cls=jsonschema.Draft7Validator)


# -- AsyncAPI -----------------------------------------------------------------------------


def asyncapi() -> dict[str, object]:
    doc = yaml.safe_load(ASYNCAPI_PATH.read_text())
    assert isinstance(doc, dict)
    return doc


def test_asyncapi_describes_the_four_topics() -> None:
    doc = asyncapi()
    assert doc["asyncapi"] == "3.0.0"
    channels = doc["channels"]
    assert isinstance(channels, dict)
    addresses = {c["address"] for c in channels.values()}
    assert addresses == {"turnstile.events", "turnstile.outcomes", "turnstile.events.dlq", "turnstile.deltas"}
    refs = {name: {m["$ref"].rsplit("/", 1)[1] for m in c["messages"].values()} for name, c in channels.items()}
    assert refs["events"] == EVENT_TYPES
    assert refs["outcomes"] == {"TurnCompleted", "TurnFailed", "TurnPaused", "TurnExhausted", "MessageRejected"}
    assert refs["deadLetters"] == {"DeadLetter"}
    assert refs["deltas"] == {"ReplyDelta"}
    for operation in doc["operations"].values():  # type: ignore[attr-defined]
        channel = operation["channel"]["$ref"].rsplit("/", 1)[1]
        for ref in operation["messages"]:
            assert ref["$ref"].startswith(f"#/channels/{channel}/messages/")


def test_asyncapi_messages_point_at_schema_files_and_their_examples_are_valid() -> None:
    messages = asyncapi()["components"]["messages"]  # type: ignore[index]
    assert set(messages) == EVENT_TYPES | {"DeadLetter", "ReplyDelta"}
    for name, message in messages.items():
        assert message["bindings"]["kafka"]["key"]["type"] == "string"
        target = ASYNCAPI_PATH.parent / message["payload"]["schema"]["$ref"]
        assert target.exists(), target
        payload_schema = json.loads(target.read_text())
        assert message.get("examples"), f"add an example of {name} to events/examples.py"
        for example in message["examples"]:
            jsonschema.validate(example["payload"], payload_schema, cls=jsonschema.Draft7Validator)
            if name == "ReplyDelta":
                assert decode_delta(orjson.dumps(example["payload"])) is not None
            elif name != "DeadLetter":
                decoded = decode(orjson.dumps(example["payload"]))
                assert not isinstance(decoded, DecodeError) and decoded.type == name


# -- upcasting ----------------------------------------------------------------------------

# A made-up version 0 of MessageReceived, as a test-local history: the message was `text`
# and its id `id`. The codec must bring such a value forward before it validates.
V0_MESSAGE = {
    "type": "MessageReceived",
    "schema_version": 0,
    "event_id": "e-old",
    "conversation_id": "c-1",
    "occurred_at": 1_700_000_000_000,
    "id": "m-old",
    "text": "written before the rename",
}


def v0_to_v1(raw: dict[str, object]) -> dict[str, object]:
    raw = dict(raw)
    raw["message_id"] = raw.pop("id")
    raw["content"] = raw.pop("text")
    return raw


def v0_claim_to_v1(raw: dict[str, object]) -> dict[str, object]:
    """v0 claims had no history boundary and a single message id."""
    raw = dict(raw)
    raw["input_ids"] = [raw.pop("message_id")]
    raw.setdefault("history_boundary", 0)
    return raw


HISTORY = Upcasters().with_step(0, v0_to_v1, "MessageReceived").with_step(0, v0_claim_to_v1, "TurnClaimed")


def test_the_default_registry_is_empty_while_every_event_is_version_1() -> None:
    assert SCHEMA_VERSION == 1 and not UPCASTERS


def test_an_old_version_is_upcast_before_validation() -> None:
    event = decode(orjson.dumps(V0_MESSAGE), upcasters=HISTORY)
    assert isinstance(event, MessageReceived)
    assert (event.message_id, event.content, event.schema_version) == ("m-old", "written before the rename", 1)


def test_upcasters_are_chosen_by_type() -> None:
    old_claim = {
        "type": "TurnClaimed", "schema_version": 0, "event_id": "e-2", "conversation_id": "c-1",
        "occurred_at": 1, "turn_id": logical_turn_id(["m-old"]), "run_id": "r", "attempt": 1, "message_id": "m-old",
    }  # fmt: skip
    event = decode(orjson.dumps(old_claim), upcasters=HISTORY)
    assert isinstance(event, TurnClaimed) and event.input_ids == ("m-old",)


def test_without_an_upcaster_an_old_version_is_refused_not_raised() -> None:
    refused = decode(orjson.dumps(V0_MESSAGE))
    assert isinstance(refused, DecodeError) and refused.reason == "invalid_event"
    only_messages = Upcasters().with_step(0, v0_to_v1, "MessageReceived")
    refused = decode(orjson.dumps({**V0_MESSAGE, "type": "ResumeRequested"}), upcasters=only_messages)
    assert isinstance(refused, DecodeError) and "no upcaster" in refused.detail


def test_a_broken_old_value_is_refused_not_raised() -> None:
    broken = {k: v for k, v in V0_MESSAGE.items() if k != "text"}
    refused = decode(orjson.dumps(broken), upcasters=HISTORY)
    assert isinstance(refused, DecodeError) and refused.reason == "invalid_event"


def test_a_newer_version_than_the_reader_knows_is_refused() -> None:
    value = json.loads((GOLDEN / "v1" / "MessageReceived.json").read_text())
    refused = decode(orjson.dumps({**value, "schema_version": SCHEMA_VERSION + 1}), upcasters=HISTORY)
    assert isinstance(refused, DecodeError) and refused.reason == "invalid_event"


def test_current_values_are_not_touched_by_upcasters() -> None:
    calls: list[object] = []

    def spy(raw: dict[str, object]) -> dict[str, object]:
        calls.append(raw)
        return raw

    value = (GOLDEN / "v1" / "MessageReceived.json").read_bytes()
    event = decode(value, upcasters=Upcasters().with_step(0, spy))
    assert isinstance(event, MessageReceived) and calls == []
    # and an invalid current value keeps the fast path's precise error
    refused = decode(orjson.dumps({**json.loads(value), "content": ""}), upcasters=Upcasters().with_step(0, spy))
    assert isinstance(refused, DecodeError) and "content" in refused.detail and calls == []


def test_the_readme_publisher_example_is_a_valid_event() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("echo 'c1|{"))
    key, _, value = line.removeprefix("echo '").rsplit("'", 1)[0].partition("|")
    event = decode(value.encode())
    assert isinstance(event, MessageReceived) and event.conversation_id == key


def test_asyncapi_document_is_valid_asyncapi_3() -> None:
    """Against the official AsyncAPI 3.0.0 JSON Schema (tests/asyncapi/README.md)."""
    official = json.loads((Path(__file__).parent / "asyncapi" / "asyncapi-3.0.0.schema.json").read_text())
    validator = jsonschema.Draft7Validator(official)
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(asyncapi())]
    assert errors == []
    broken = asyncapi()
    broken["operations"]["receiveInputs"]["action"] = "publish"  # type: ignore[index]  # AsyncAPI 2's word
    assert list(validator.iter_errors(broken))
