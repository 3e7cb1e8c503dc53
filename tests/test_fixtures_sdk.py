"""The checked-in provider fixtures are what their generator writes, and -- where the
official SDKs (test-only dependencies of the `dev` extra) -- exactly what the SDKs' own
response models make of them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

FOLDER = Path(__file__).parent / "fixtures" / "providers"
_spec = importlib.util.spec_from_file_location("make_fixtures", FOLDER / "make_fixtures.py")
assert _spec is not None and _spec.loader is not None
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)

CASES = [("openai", name) for name in make_fixtures.OPENAI] + [("anthropic", name) for name in make_fixtures.ANTHROPIC]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_the_checked_in_fixture_is_the_generators(family: str, name: str) -> None:
    source = make_fixtures.OPENAI if family == "openai" else make_fixtures.ANTHROPIC
    assert json.loads((FOLDER / family / f"{name}.json").read_text()) == source[name]


def test_every_fixture_file_has_a_source() -> None:
    on_disk = {(p.parent.name, p.stem) for p in FOLDER.glob("*/*.json")}
    assert on_disk == set(CASES)
    streams = {(p.parent.name, p.stem) for p in FOLDER.glob("*/*.sse")}
    assert streams == set(STREAMS)


STREAMS = {
    (family, name): stream
    for family, streams in (("openai", make_fixtures.OPENAI_STREAMS), ("anthropic", make_fixtures.ANTHROPIC_STREAMS))
    for name, stream in streams.items()
}


@pytest.mark.parametrize(("family", "name"), list(STREAMS))
def test_each_stream_fixture_is_the_generators_and_every_event_the_sdks(family: str, name: str) -> None:
    stream = STREAMS[family, name]
    assert (FOLDER / family / f"{name}.sse").read_text() == make_fixtures.sse(stream)
    make_fixtures.check_stream(family, stream, f"{family}/{name}")


@pytest.mark.parametrize(("family", "name"), CASES)
def test_the_fixture_is_what_the_official_sdk_model_makes_of_it(family: str, name: str) -> None:
    from anthropic.types import Message
    from openai.types.chat import ChatCompletion

    model = ChatCompletion if family == "openai" else Message
    make_fixtures.check(model, json.loads((FOLDER / family / f"{name}.json").read_text()), f"{family}/{name}")
