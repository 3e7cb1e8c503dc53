"""The wheel is how users and images install turnstile: one `turnstile` namespace with every
subpackage, the command working from a new venv outside the repository, nothing generic at
the top of site-packages."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from provider_server import ProviderServer, Reply

REPO = Path(__file__).resolve().parent.parent
NOT_SHIPPED = {"tests", "bench", "build", "examples"}
CARD_FOLDERS = ("events", "projections", "handlers", "streams")


def package_folders() -> set[str]:
    """Every folder of the repository that is a Python package and is meant to ship, by the
    name it has once installed (the card's folders live under `turnstile`)."""
    found = set()
    for init in REPO.rglob("__init__.py"):  # does not descend into turnstile/'s links
        parts = init.relative_to(REPO).parent.parts
        if parts[0] in NOT_SHIPPED or any(p.startswith(".") for p in parts):
            continue
        found.add(".".join(parts if parts[0] == "turnstile" else ("turnstile", *parts)))
    return found


def test_the_namespace_links_each_card_folder() -> None:
    for folder in CARD_FOLDERS:
        link = REPO / "turnstile" / folder
        assert link.is_symlink() and link.resolve() == REPO / folder, folder


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel, and what the build said."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return next(out.glob("turnstile_engine-*.whl")), built.stdout + built.stderr


@pytest.fixture(scope="module")
def wheel(wheel_build: tuple[Path, str]) -> Path:
    return wheel_build[0]


# Folders of data only, listed as packages so that setuptools ships them without warning.
DATA_FOLDERS = {"turnstile.events.schemas", "turnstile.streams.console.assets"}


def test_pyproject_lists_every_package_folder() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed - DATA_FOLDERS == package_folders()
    assert listed >= DATA_FOLDERS


def test_the_wheel_builds_without_a_setuptools_warning(wheel_build: tuple[Path, str]) -> None:
    assert "would be ignored" not in wheel_build[1]


def test_the_wheel_has_one_namespace_with_every_subpackage_and_the_contract_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"turnstile"}
    shipped = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("__init__.py")}
    assert shipped == package_folders()
    assert "turnstile/py.typed" in names
    assert "turnstile/events/asyncapi.yaml" in names
    assert "turnstile/streams/prices.toml" in names  # the shipped price table
    assert any(n.startswith("turnstile/events/schemas/") and n.endswith(".json") for n in names)
    # The console's stylesheet and script ship inside the package (no CDN, no build step).
    assert {"turnstile/streams/console/assets/console.css", "turnstile/streams/console/assets/console.js"} <= set(names)
    assert not any(n.startswith("turnstile/tests/") or n.startswith("turnstile/bench/") for n in names)


def test_the_wheel_installed_outside_the_repository_runs_the_command(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python, command = env_dir / "bin" / "python", env_dir / "bin" / "turnstile"
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True, capture_output=True, timeout=600)

    def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
        # cwd outside the repository, so nothing can be imported from the source tree
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    version = run(command, "--version")
    assert version.returncode == 0 and version.stdout.startswith("turnstile "), version
    demo = run(command, "demo", "--data", tmp_path / "demo-log")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    for generic in ("events", "streams", "handlers", "projections"):
        assert run(python, "-c", f"import {generic}").returncode != 0, generic
    imported = run(python, "-c", "import turnstile.handlers.providers.openai_chat, turnstile.streams.cli")
    assert imported.returncode == 0, imported.stderr
    priced = run(python, "-c", "from turnstile.streams.config_file import shipped_prices as s; print(s().taken)")
    assert priced.returncode == 0 and priced.stdout.strip() == "2026-12-03", priced.stderr  # read from the wheel
    assets = (
        "from turnstile.streams.console.pages import asset;"
        " print(len(asset('console.css')), 'EventSource' in asset('console.js'))"
    )
    served = run(python, "-c", assets)
    assert served.returncode == 0 and served.stdout.split()[1] == "True", served.stderr


def test_the_wheel_runs_the_example_agent_from_a_folder_outside_the_repository(wheel: Path, tmp_path: Path) -> None:
    """`turnstile run examples.support_agent:agent`, as a user runs their own module: found
    in the current directory, its model a loopback OpenAI-compatible server."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    subprocess.run([env_dir / "bin" / "python", "-m", "pip", "install", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    command = env_dir / "bin" / "turnstile"
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "support_agent.py", tmp_path / "examples" / "support_agent.py")
    where = ["--data", str(tmp_path / "log")]
    with ProviderServer() as server:
        server.push(Reply(text="Order A-1001 has shipped.", usage=(40, 6)))
        env = {**os.environ, "TURNSTILE_BASE_URL": server.base_url_openai, "TURNSTILE_API_KEY": "sk-test"}

        def run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
            return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)

        assert run(command, "send", *where, "--conversation", "c1", "--text", "Where is A-1001?").returncode == 0
        worker = subprocess.Popen([command, "run", "examples.support_agent:agent", *where, "--no-stream"],
                                  cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while "TurnCompleted" not in (out := run(command, "tail", *where).stdout) and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=30) == 0, worker.stderr.read() if worker.stderr else ""
    assert "COMPLETED" in out and "Order A-1001 has shipped." in out
