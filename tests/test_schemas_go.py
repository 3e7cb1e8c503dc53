"""The checked-in JSON Schemas as a Go consumer loads them: santhosh-tekuri/jsonschema (v6),
with its default options, compiles every one and validates each golden event against the
event union, its own type's schema and, for outcomes, the outcomes topic's union
(tests/go_validate). The module comes from the Go proxy into build/go; go is required
in CI (TURNSTILE_REQUIRE_KAFKA=1 or CI set), skipped elsewhere when missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_schemas_ajv import broken_value

ROOT = Path(__file__).parent.parent
PROGRAM = ROOT / "tests" / "go_validate"
GOLDEN = sorted((ROOT / "tests" / "golden" / "v1").glob("*.json"))


def go() -> str:
    found = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")  # the official tarball's place
    if found is None:
        if os.environ.get("CI") or os.environ.get("TURNSTILE_REQUIRE_KAFKA"):
            pytest.fail("go is needed to test the schemas with a Go validator (https://go.dev/dl/)")
        pytest.skip("go is not installed")
    return found


@pytest.fixture(scope="module")
def validator() -> Path:
    build = ROOT / "build" / "go"
    env = {**os.environ, "GOMODCACHE": str(build / "mod"), "GOCACHE": str(build / "cache"),
           "GOFLAGS": "-mod=readonly", "GOTOOLCHAIN": "local"}  # go.sum pins the module; no toolchain download
    binary = build / "go_validate"
    subprocess.run([go(), "build", "-o", str(binary), "."], cwd=PROGRAM, env=env, check=True,
                   capture_output=True, timeout=600)
    return binary


def validate(binary: Path, *values: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary), str(ROOT / "events" / "schemas"), *map(str, values)],
                          capture_output=True, text=True, timeout=60)


def test_a_go_validator_loads_every_schema_and_accepts_every_golden_event(validator: Path) -> None:
    result = validate(validator, *GOLDEN)
    assert result.returncode == 0, result.stdout + result.stderr
    schemas = len(list((ROOT / "events" / "schemas").glob("*.schema.json")))
    assert result.stdout.strip().endswith(f"{schemas} schemas compiled, {len(GOLDEN)} values checked, 0 failures")


def test_the_go_validator_refuses_a_value_that_breaks_its_schema(validator: Path, tmp_path: Path) -> None:
    result = validate(validator, broken_value(tmp_path))
    assert result.returncode == 1
    assert "against TurnPaused.schema.json: " in result.stdout and "against outcome.schema.json: " in result.stdout
    assert "value must be one of 'tool_calls', 'cost', 'deadline', 'approval'" in result.stdout
    assert result.stdout.strip().endswith("1 values checked, 3 failures")
