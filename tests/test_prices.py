"""Prices from the command line, and the warning a worker gives at start for a model
that has none (its turns would pause on cost after their first reply)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from turnstile.handlers.pricing import ModelPrice, parse_price, unpriced


def test_a_price_flag_names_the_model_and_its_prices_per_million_tokens():
    assert parse_price("gpt-4.1=2,8") == ("gpt-4.1", ModelPrice(2.0, 8.0))
    assert parse_price("claude=3,15,0.3,3.75") == ("claude", ModelPrice(3.0, 15.0, 0.3, 3.75))
    assert parse_price("org/model=a=1,2")[0] == "org/model=a"  # the last '=' separates


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("gpt=1", "expected MODEL=INPUT,OUTPUT"),
        ("=1,2", "expected"),
        ("gpt=1,x", "are not numbers"),
        ("gpt=1,2,3,4,5", "expected"),
        ("gpt=-1,2", "prices must be finite numbers >= 0"),
        ("gpt=inf,2", "prices must be finite numbers >= 0"),
        ("gpt=1,nan", "prices must be finite numbers >= 0"),
    ],
)
def test_a_malformed_price_is_refused_with_the_shape_expected(text, says):
    with pytest.raises(ValueError, match=says):
        parse_price(text)


def test_the_models_without_a_price_are_named_once_each():
    prices = {"a": ModelPrice(1, 1)}
    assert unpriced(prices, ["a", "b", "c", "b"]) == ("b", "c")
    assert unpriced(prices, ["a"]) == ()


def start_worker(tmp_path, *flags: str) -> tuple[str, int]:
    """The worker's stderr up to its 'worker running' line, then its exit code after SIGTERM."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "turnstile.streams.cli", "run", "--data", str(tmp_path / "log"), *flags],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TURNSTILE_API_KEY": "sk-test"},
    )
    assert worker.stderr is not None
    seen = []
    for line in worker.stderr:
        seen.append(line)
        if "worker running" in line:
            break
    worker.send_signal(signal.SIGTERM)
    return "".join(seen), worker.wait(30)


def test_a_worker_warns_at_start_for_a_model_without_a_price(tmp_path):
    said, code = start_worker(tmp_path, "--model", "acme-7b")
    assert "model acme-7b has no price" in said and "--price acme-7b=INPUT,OUTPUT" in said
    assert '[prices."acme-7b"] in turnstile.toml' in said
    assert code == 0


def test_a_priced_model_starts_without_the_warning(tmp_path):
    said, code = start_worker(tmp_path, "--model", "acme-7b", "--price", "acme-7b=2,8")
    assert "worker running" in said and "has no price" not in said  # the warning comes before this line
    assert code == 0


def test_a_model_of_the_shipped_table_is_priced_without_a_flag(tmp_path):
    said, code = start_worker(tmp_path, "--model", "gpt-4.1", "--fallback", "claude-haiku-4-5")
    assert "has no price" not in said and "prices.gpt-4.1=2/8/0.5/0 [shipped table of" in said
    # (no agent and the default provider: said, as real messages get echoes)
    assert "model.provider is scripted, the default: replies are echoes" in said
    assert code == 0


def test_an_agent_with_an_unpriced_fallback_is_warned_about_once(tmp_path):
    (tmp_path / "shop.py").write_text(
        "from turnstile import Agent, Model, ModelPrice\n"
        "agent = Agent('shop', model=Model('acme-7b', price=ModelPrice(2, 8)), fallbacks=[Model('acme-3b')])\n"
    )
    said, code = start_worker(tmp_path, "shop:agent")
    assert said.count("has no price") == 1 and "model acme-3b has no price" in said
    assert "replies are echoes" not in said
    assert code == 0


def test_the_models_of_a_config_file_are_warned_about_once_each(tmp_path):
    (tmp_path / "turnstile.toml").write_text(
        '[model]\nname = "acme-7b"\nfallbacks = ["acme-3b", "gpt-4.1-mini"]\n'
        '[prices."acme-3b"]\ninput = 1\noutput = 2\n'
    )
    said, code = start_worker(tmp_path)
    assert said.count("has no price") == 1 and "model acme-7b has no price" in said
    assert "prices.acme-3b=1/2/input/? [turnstile.toml]" in said  # reads at the input price, writes unknown
    assert code == 0
