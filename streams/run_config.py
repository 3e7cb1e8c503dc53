"""What `turnstile run` makes of its configuration (`streams/config_file.py`): the worker of
the flags-only path, the keys applied to an agent (`run MODULE:AGENT`), and the one line of
effective configuration a worker logs at start, secrets masked."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from turnstile.handlers.pricing import DEFAULT_PRICES, PriceTable
from turnstile.handlers.provider import Provider
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.agent import Agent
from turnstile.streams.config_file import (
    Config,
    KeyPath,
    ModelConfig,
    Resolved,
    dotted,
    key_paths,
    shipped_prices,
)
from turnstile.streams.serving import WorkerOptions
from turnstile.streams.turn_runner import Route, TurnSettings
from turnstile.streams.worker import WorkerConfig

log = logging.getLogger(__name__)
SECRET = "***"


def worker_options(config: Config) -> WorkerOptions:
    """The keys about the process, not the agent: they apply to an agent too."""
    return {
        "drain_grace_s": config.drain_grace_s,
        "stream_replies": config.stream,
        "tracing": config.trace,
        "eviction": config.eviction.policy(config.state_dir),
    }


def provider(model: ModelConfig, api_key: str | None) -> Provider:
    if model.provider == "scripted":
        return ScriptedProvider(delay_s=model.scripted_delay_s)
    from turnstile.streams.provider_http import http_provider

    legacy = frozenset(model.legacy_max_tokens)
    return http_provider(model.provider, model.base_url, api_key, "TURNSTILE_API_KEY", legacy)


def prices(config: Config) -> PriceTable:
    """The shipped table, then the configured prices over it."""
    return {**DEFAULT_PRICES, **shipped_prices().prices, **{m: p.price() for m, p in config.prices.items()}}


def worker_config(config: Config, provider_: Provider) -> WorkerConfig:
    """The worker of `run` without an agent: one provider serves the model and its fallbacks."""
    turn = TurnSettings(
        model=config.model.name,
        budget=config.budget.budget(),
        prices=prices(config),
        fallbacks=tuple(Route(name, provider_) for name in config.model.fallbacks),
    )
    return WorkerConfig(
        debounce=config.debounce.policy(), double_text=config.double_text.policy(), turn=turn,
        **worker_options(config),
    )


def _given(resolved: Resolved, table: str) -> dict[str, Any]:
    """The keys of `table` the file, the environment or a flag set, with their values."""
    section = getattr(resolved.config, table)
    return {name: getattr(section, name) for name in type(section).model_fields if resolved.given((table, name))}


def configure_agent(agent: Agent, resolved: Resolved) -> tuple[Agent, list[str]]:
    """`agent` with the configured keys applied, and one warning per key it ignores.

    An agent's code says what it is; the configuration says how this deployment runs it.
    So a budget, debounce, double-text or price key that was set (file, env or flag)
    overrides the agent's own value, key by key (`--quiet-ms 0` keeps the agent's
    `max_wait_ms`). The `model.*` keys do not: an agent's models carry their protocol
    family, endpoint and key variable, which a model name from a flag cannot, so those keys
    are ignored and named in a warning."""
    configured = copy.copy(agent)
    config = resolved.config
    if budget := _given(resolved, "budget"):
        configured.budget = dataclasses.replace(agent.budget, **budget)
    if debounce := _given(resolved, "debounce"):
        configured.debounce = dataclasses.replace(agent.debounce, **debounce)
    if double_text := _given(resolved, "double_text"):
        policy = agent.double_text_policy()
        merged = {**policy.per_conversation, **double_text.get("per_conversation", {})}
        configured.double_text = dataclasses.replace(
            policy, default=double_text.get("default", policy.default), per_conversation=merged
        )
    configured.model, *fallbacks = (
        dataclasses.replace(m, price=config.prices[m.name].price()) if m.name in config.prices else m
        for m in agent.models()
    )
    configured.fallbacks = tuple(fallbacks)
    ignored = [
        f"{resolved.source(path)} ({dotted(path)}) is ignored: agent {agent.name!r} names its models in code "
        "(Agent(model=..., fallbacks=...)); budget, debounce, double-text and price keys do apply to it"
        for path in key_paths()
        if path[0] == "model" and resolved.source(path) is not None
    ]
    return configured, ignored


def agent_view(agent: Agent, resolved: Resolved) -> Resolved:
    """The configuration as the agent runs it, for the effective-configuration line: its
    models, budget, debounce and double-text policy, with the agent named as their source."""
    config, first, double_text = resolved.config, agent.model, agent.double_text_policy()
    family = first.family if first.family in ("openai", "anthropic") else "scripted"
    viewed = config.model_copy(update={
        "model": ModelConfig(provider=family, name=first.name, base_url=getattr(first, "base_url", None),
                             fallbacks=tuple(m.name for m in agent.fallbacks)),
        "budget": type(config.budget)(**dataclasses.asdict(agent.budget)),
        "debounce": type(config.debounce)(**dataclasses.asdict(agent.debounce)),
        "double_text": type(config.double_text)(default=double_text.default,
                                                per_conversation=dict(double_text.per_conversation)),
    })
    sources = dict(resolved.sources)
    for path in key_paths():
        # The model keys are the agent's whatever was configured (configure_agent ignores them).
        if path[0] == "model" or (path[0] in ("budget", "debounce", "double_text") and path not in sources):
            sources[path] = f"agent {agent.name}"
    for m in agent.models():
        if m.price is not None:
            sources.setdefault(("prices", m.name), f"agent {agent.name}")
    return Resolved(viewed, sources)


def effective(resolved: Resolved, secrets: Mapping[str, str | None], table: PriceTable) -> str:
    """One line: every key's value (with its source when it is not a default), the prices
    of the models that run, and each secret as set (masked) or unset."""
    config = resolved.config
    parts = []
    for path in key_paths():
        if path == ("prices",):
            continue
        value: Any = config
        for part in path:
            value = getattr(value, part)
        parts.append(_shown(path, value, resolved.sources))
    shipped = shipped_prices()
    for model in dict.fromkeys([config.model.name, *config.model.fallbacks]):
        price = table.get(model)
        source = resolved.sources.get(("prices", model))
        if source is None and price is not None and shipped.prices.get(model) == price:
            source = f"shipped table of {shipped.taken.isoformat()}"
        text = "none (unknown cost)" if price is None else (
            f"{price.input_per_mtok:g}/{price.output_per_mtok:g}/"
            f"{_maybe(price.cached_input_per_mtok, 'input')}/{_maybe(price.cache_write_per_mtok, '?')}"
        )
        parts.append(f"prices.{model}={text}" + (f" [{source}]" if source else ""))
    parts += [f"{name}={SECRET if value else 'unset'}" for name, value in secrets.items()]
    return "effective configuration: " + "; ".join(parts)


def _maybe(value: float | None, unset: str) -> str:
    """A cache price as the line shows it: `input` for a read priced as input, `?` unknown."""
    return unset if value is None else f"{value:g}"


def _shown(path: KeyPath, value: Any, sources: Mapping[KeyPath, str]) -> str:
    if isinstance(value, tuple):
        value = ",".join(value)
    elif isinstance(value, dict):
        value = ",".join(f"{k}={v}" for k, v in value.items())
    source = sources.get(path) or next((s for p, s in sources.items() if p[: len(path)] == path), None)
    return f"{dotted(path)}={'none' if value is None else value}" + (f" [{source}]" if source else "")


def secrets_of(token: str | None, api_key_envs: Sequence[str], environ: Mapping[str, str]) -> dict[str, str | None]:
    """The secrets a worker holds, by name, for `effective` to mask."""
    return {"http.token": token, **{f"env {name}": environ.get(name) for name in dict.fromkeys(api_key_envs)}}
