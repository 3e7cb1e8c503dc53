"""The checked-in JSON Schemas as a JavaScript consumer loads them: ajv in its default
strict mode compiles every one and validates each golden event against the event union,
its own type's schema and, for outcomes, the outcomes topic's union (tests/ajv_validate.cjs).
ajv comes from the npm registry into a temporary folder; node and npm are required."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
AJV = "ajv@8.20.0"  # the current major; strict mode is its default


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    npm = shutil.which("npm")
    assert npm is not None and shutil.which("node") is not None, "node and npm are needed to test the schemas"
    folder = tmp_path_factory.mktemp("ajv")
    subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(folder), AJV],
                   check=True, capture_output=True, timeout=300)
    return folder / "node_modules"


def validate(node_modules: Path, schemas: Path, *values: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", str(ROOT / "tests" / "ajv_validate.cjs"), str(schemas), *map(str, values)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "NODE_PATH": str(node_modules)},
    )


def test_ajv_in_strict_mode_loads_every_schema_and_accepts_every_golden_event(node_modules: Path) -> None:
    golden = sorted((ROOT / "tests" / "golden" / "v1").glob("*.json"))
    result = validate(node_modules, ROOT / "events" / "schemas", *golden)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(f"{len(golden)} values checked, 0 failures")


def broken_value(folder: Path) -> Path:
    """The golden TurnPaused with a reason its schema does not allow (for every validator's test)."""
    broken = folder / "TurnPaused.json"
    text = (ROOT / "tests" / "golden" / "v1" / "TurnPaused.json").read_text()
    broken.write_text(text.replace('"reason": "approval"', '"reason": "bored"'))
    assert '"reason": "bored"' in broken.read_text()
    return broken


def test_ajv_refuses_a_value_that_breaks_its_schema(node_modules: Path, tmp_path: Path) -> None:
    result = validate(node_modules, ROOT / "events" / "schemas", broken_value(tmp_path))
    assert result.returncode == 1
    assert "against TurnPaused.schema.json" in result.stdout and "against outcome.schema.json" in result.stdout
