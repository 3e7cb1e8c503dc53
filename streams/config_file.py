"""`turnstile.toml`: the one configuration file, and the same keys from the environment
(`TURNSTILE_…`) and from flags. Precedence, per key: flags > env > file > defaults.

The file is read with tomllib into a strict pydantic model: a key the model does not know
is refused (exit code 78) with one line naming the key and the file, so a typo never
silently leaves a default in force. Every key has one path (`budget.max_cost_usd`), one
environment variable (`TURNSTILE_` + the path upper-cased, dots as `_`:
`TURNSTILE_BUDGET_MAX_COST_USD`) and, for `run`, one flag (`FLAGS`). Merging is pure: the
layers are flat mappings from key path to value; only `load` reads a file.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import date
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from turnstile.events.lifecycle import MAX_CLAIMED_INPUTS
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.claim import MAX_DEBOUNCE_MS, DebouncePolicy, DoubleText, DoubleTextPolicy
from turnstile.handlers.pricing import ModelPrice, PriceTable, parse_price
from turnstile.streams.cli_errors import CONFIG, NO_INPUT, USAGE, CliError, broker_url, http_address
from turnstile.streams.eviction import DEFAULT_IDLE_MS, EvictionPolicy
from turnstile.streams.log import Topics
from turnstile.streams.worker import WorkerConfig

KeyPath = tuple[str, ...]
DEFAULT_FILE = Path("turnstile.toml")
ENV_PREFIX = "TURNSTILE_"
# Variables read besides the settings: the API key, the HTTP token, the example agent's URL.
OTHER_VARIABLES = frozenset({"TURNSTILE_API_KEY", "TURNSTILE_HTTP_TOKEN", "TURNSTILE_BASE_URL"})
_BUDGET, _DEBOUNCE, _TOPICS, _WORKER = TurnBudget(), DebouncePolicy(), Topics(), WorkerConfig()
_EVICTION = _WORKER.eviction


# The validation context of the file's own layer (values as TOML typed them).
TOML = {"layer": "toml"}


class _Strict(BaseModel):
    # No inf or NaN anywhere: a limit or a price of either is meaningless (and NaN compares
    # false with every bound).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers_numeric_booleans_or_empty_names(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name or ""].annotation
        # pydantic takes `true` for 1 in a number key; in TOML it is a typo for a number.
        if isinstance(value, bool) and _is(annotation, int, float):
            raise ValueError(f"expected a number, not {str(value).lower()}")
        # ... and the other way round: `stream = 1` is no TOML boolean (the environment's
        # strings "1"/"true"/"on" still are).
        if isinstance(value, int | float) and not isinstance(value, bool) and _is(annotation, bool):
            raise ValueError(f"expected true or false, not {value}")
        # TOML has numbers and booleans: in the file, a string or a fraction for one is a typo
        # pydantic alone would take ("10" for 10, 1.5 cut to 1). The environment's are strings.
        if info.context == TOML and _is(annotation, int, float, bool) and not _is(annotation, str, Path):
            kind = "true or false" if _is(annotation, bool) else "a number"
            if isinstance(value, str):
                quoted = value.strip().lower() in ("true", "false") or _number(value) is not None
                hint = ": leave out the quotes" if quoted else ""
                raise ValueError(f"expected {kind}, not the string {value!r}{hint}")
            if isinstance(value, float) and _is(annotation, int) and not _is(annotation, float):
                raise ValueError(f"expected a whole number, not {value}")
        # An empty name, folder or address is no value (`data = ""` is the current folder,
        # `topics.events = ""` the data folder itself); the environment's empty is unset.
        if isinstance(value, str) and not value.strip() and _is(annotation, str, Path):
            raise ValueError("is empty: give a value or leave the key out")
        # ... so is one in a list of names (`fallbacks = [""]`) or a table's (`{"" = "reject"}`).
        names = value if isinstance(value, list | tuple) else value.keys() if isinstance(value, dict) else ()
        if any(isinstance(name, str) and not name.strip() for name in names):
            raise ValueError("holds an empty name: give each a value or leave it out")
        return value


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _is(annotation: Any, *kinds: type) -> bool:
    """One of `kinds`, or an optional one."""
    return annotation in kinds or any(_is(a, *kinds) for a in typing.get_args(annotation))


class TopicsConfig(_Strict):
    events: str = _TOPICS.events
    outcomes: str = _TOPICS.outcomes
    dead_letters: str = _TOPICS.dead_letters
    deltas: str = _TOPICS.deltas

    def topics(self) -> Topics:
        return Topics(self.events, self.outcomes, self.dead_letters, self.deltas)


class HttpConfig(_Strict):
    address: str | None = None  # HOST:PORT, or PORT for 127.0.0.1
    token_file: Path | None = None  # its first line is the bearer token (else env TURNSTILE_HTTP_TOKEN)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        return None if value is None else _checked(http_address, value)


class PriceConfig(_Strict):
    """USD per million tokens; a cache write price left out is unknown (not free), a cache
    read price left out is the input price (an upper bound)."""

    input: NonNegativeFloat
    output: NonNegativeFloat
    cached_input: NonNegativeFloat | None = None
    cache_write: NonNegativeFloat | None = None

    def price(self) -> ModelPrice:
        return ModelPrice(self.input, self.output, self.cached_input, self.cache_write)

    @classmethod
    def of(cls, price: ModelPrice) -> PriceConfig:
        return cls(input=price.input_per_mtok, output=price.output_per_mtok,
                   cached_input=price.cached_input_per_mtok, cache_write=price.cache_write_per_mtok)


class ModelConfig(_Strict):
    provider: Literal["scripted", "openai", "anthropic"] = "scripted"
    name: str = "scripted-1"
    base_url: str | None = None
    fallbacks: tuple[str, ...] = ()  # tried in order when the model fails mid-attempt (same provider)
    legacy_max_tokens: tuple[str, ...] = ()
    scripted_delay_s: NonNegativeFloat = 0.0


class BudgetConfig(_Strict):
    max_iterations: int = Field(_BUDGET.max_iterations, ge=1)
    max_tool_calls: int = Field(_BUDGET.max_tool_calls, ge=0)
    max_cost_usd: NonNegativeFloat = _BUDGET.max_cost_usd
    deadline_ms: int = Field(_BUDGET.deadline_ms, ge=1)
    soft_fraction: float = Field(_BUDGET.soft_fraction, gt=0, le=1)

    def budget(self) -> TurnBudget:
        return TurnBudget(**self.model_dump())


class DebounceConfig(_Strict):
    quiet_ms: int = Field(_DEBOUNCE.quiet_ms, ge=0, le=MAX_DEBOUNCE_MS)
    max_wait_ms: int = Field(_DEBOUNCE.max_wait_ms, ge=0, le=MAX_DEBOUNCE_MS)
    max_batch: int = Field(_DEBOUNCE.max_batch, ge=1, le=MAX_CLAIMED_INPUTS)

    def policy(self) -> DebouncePolicy:
        return DebouncePolicy(**self.model_dump())


class DoubleTextConfig(_Strict):
    default: DoubleText = "enqueue"
    per_conversation: dict[str, DoubleText] = {}

    def policy(self) -> DoubleTextPolicy:
        return DoubleTextPolicy(self.default, dict(self.per_conversation))


MAX_IDLE_S = 10 * 365 * 86_400


class EvictionConfig(_Strict):
    """When an idle conversation leaves memory for the local store (`streams/eviction.py`)."""

    # At most ten years: past that it means "never", and a larger value overflows the ms.
    idle_s: NonNegativeFloat = Field(DEFAULT_IDLE_MS / 1000, le=MAX_IDLE_S)
    max_resident: int | None = Field(_EVICTION.max_resident, ge=1)  # None: no bound but idle time

    def policy(self, state_dir: Path | None) -> EvictionPolicy:
        return EvictionPolicy(idle_ms=round(self.idle_s * 1000), max_resident=self.max_resident, state_dir=state_dir)


class Config(_Strict):
    broker: str | None = None  # kafka://HOST:PORT[,HOST:PORT]; None: the embedded log in `data`
    data: Path = Path(".turnstile")
    group: str = "turnstile-worker"
    instance_id: str | None = None
    session_timeout_s: float = 10.0
    drain_grace_s: NonNegativeFloat = _WORKER.drain_grace_s
    # The local store of snapshots (`streams/state_store.py`); None: a temporary folder, so a
    # restart reads every snapshot from the topic. A folder that outlives the process (a
    # volume of its own per worker) lets a restart read only what changed since its stop.
    state_dir: Path | None = None
    eviction: EvictionConfig = EvictionConfig()
    connect_timeout_s: NonNegativeFloat = 60.0
    stream: bool = True  # unlike WorkerConfig's default: a served worker streams unless told not to
    trace: bool = _WORKER.tracing
    schedules: Path | None = None
    log_format: Literal["text", "json"] = "text"
    topics: TopicsConfig = TopicsConfig()
    http: HttpConfig = HttpConfig()
    model: ModelConfig = ModelConfig()
    prices: dict[str, PriceConfig] = {}
    budget: BudgetConfig = BudgetConfig()
    debounce: DebounceConfig = DebounceConfig()
    double_text: DoubleTextConfig = DoubleTextConfig()

    @field_validator("broker")
    @classmethod
    def _broker(cls, value: str | None) -> str | None:
        return None if value is None else _checked(broker_url, value)

    @field_validator("prices", mode="before")
    @classmethod
    def _quoted_names(cls, value: Any) -> Any:
        # `[prices.gpt-4.1-mini]` is model `gpt-4` holding a table `1-mini`: TOML splits at dots.
        for name, entry in value.items() if isinstance(value, dict) else ():
            for inner in (k for k, v in entry.items() if isinstance(v, dict)) if isinstance(entry, dict) else ():
                raise ValueError(f'a model name with dots needs quotes: [prices."{name}.{inner}"]')
        return value

    @field_validator("session_timeout_s")
    @classmethod
    def _session_timeout(cls, value: float) -> float:
        if not 6 <= value <= 1_800:
            # (:g said 1800.0001 was 1800)
            raise ValueError(f"{value:.15g} is outside 6..1800 s (the broker's default bounds)")
        return value


def _checked(check: typing.Callable[[str], str], value: str) -> str:
    try:
        return check(value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None


# The flag of each key (`run`'s; the log's keys are flags of every command that reads the log).
FLAGS: dict[KeyPath, str] = {
    ("broker",): "--broker",
    ("data",): "--data",
    ("group",): "--group",
    ("instance_id",): "--instance-id",
    ("session_timeout_s",): "--session-timeout-s",
    ("drain_grace_s",): "--drain-grace-s",
    ("state_dir",): "--state-dir",
    ("eviction", "idle_s"): "--evict-idle-s",
    ("eviction", "max_resident"): "--max-resident",
    ("connect_timeout_s",): "--connect-timeout-s",
    ("stream",): "--stream",
    ("trace",): "--trace",
    ("schedules",): "--schedules",
    ("log_format",): "--log-format",
    ("topics", "events"): "--events-topic",
    ("topics", "outcomes"): "--outcomes-topic",
    ("topics", "dead_letters"): "--dlq-topic",
    ("topics", "deltas"): "--deltas-topic",
    ("http", "address"): "--http",
    ("http", "token_file"): "--http-token-file",
    ("model", "provider"): "--provider",
    ("model", "name"): "--model",
    ("model", "base_url"): "--base-url",
    ("model", "fallbacks"): "--fallback",
    ("model", "legacy_max_tokens"): "--legacy-max-tokens",
    ("model", "scripted_delay_s"): "--scripted-delay",
    ("prices",): "--price",
    ("budget", "max_iterations"): "--max-iterations",
    ("budget", "max_tool_calls"): "--max-tool-calls",
    ("budget", "max_cost_usd"): "--max-cost-usd",
    ("budget", "deadline_ms"): "--deadline-ms",
    ("budget", "soft_fraction"): "--soft-fraction",
    ("debounce", "quiet_ms"): "--quiet-ms",
    ("debounce", "max_wait_ms"): "--max-wait-ms",
    ("debounce", "max_batch"): "--max-batch",
    ("double_text", "default"): "--double-text",
    ("double_text", "per_conversation"): "--double-text-for",
}


def dest(flag: str) -> str:
    """The argparse attribute of a flag."""
    return flag.removeprefix("--").replace("-", "_")


def _submodel(annotation: Any) -> type[_Strict] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Strict) else None


def _is_table(annotation: Any) -> bool:
    """A key whose value is a table of entries (`prices`, `double_text.per_conversation`):
    each entry is merged on its own, so the file can price one model and a flag another."""
    return typing.get_origin(annotation) is dict


def key_paths(model: type[_Strict] = Config, prefix: KeyPath = ()) -> Iterator[KeyPath]:
    """Every key of the configuration, as its path."""
    for name, info in model.model_fields.items():
        sub = _submodel(info.annotation)
        if sub is not None:
            yield from key_paths(sub, (*prefix, name))
        else:
            yield (*prefix, name)


def env_name(path: KeyPath) -> str:
    return ENV_PREFIX + "_".join(path).upper()


def dotted(path: KeyPath) -> str:
    return ".".join(path)


def _annotation(path: KeyPath) -> Any:
    model: type[_Strict] = Config
    for part in path[:-1]:
        sub = _submodel(model.model_fields[part].annotation)
        assert sub is not None
        model = sub
    return model.model_fields[path[-1]].annotation


def flatten(nested: Mapping[str, Any], model: type[_Strict] = Config, prefix: KeyPath = ()) -> dict[KeyPath, Any]:
    """A validated file's tables as {key path: value}; a table of entries gives one path per entry."""
    flat: dict[KeyPath, Any] = {}
    for name, value in nested.items():
        annotation = model.model_fields[name].annotation
        sub = _submodel(annotation)
        if sub is not None:
            flat.update(flatten(value, sub, (*prefix, name)))
        elif _is_table(annotation):
            flat.update({(*prefix, name, entry): each for entry, each in value.items()})
        else:
            flat[(*prefix, name)] = value
    return flat


def _nest(flat: Mapping[KeyPath, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        level = nested
        for part in path[:-1]:
            level = level.setdefault(part, {})
        level[path[-1]] = value
    return nested


def _entries(text: str, separator: str) -> list[str]:
    """The entries of a list in a variable; an empty one (`a,,b`, a trailing separator) is a
    typo, refused as a flag's empty value is, not dropped."""
    items = [t.strip() for t in text.split(separator)]
    if not all(items):
        raise ValueError(f"an empty entry in {text!r}: separate entries with one {separator!r}")
    return items


def _pairs(text: str, separator: str = ",") -> dict[str, str]:
    """`a=x,b=y` -> {a: x, b: y} (the last '=' of each item separates)."""
    found = {}
    for item in _entries(text, separator):
        key, sep, value = item.rpartition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        found[key] = value
    return found


def from_env(environ: Mapping[str, str]) -> tuple[dict[KeyPath, Any], dict[KeyPath, str]]:
    """The keys set in the environment (an empty variable is unset) and, for each, its source
    ("env TURNSTILE_…").
    Lists are comma-separated; `TURNSTILE_PRICES` is `MODEL=IN,OUT[,CACHED,WRITE];MODEL=...`;
    `TURNSTILE_DOUBLE_TEXT_PER_CONVERSATION` is `CONVERSATION=POLICY,...`."""
    values: dict[KeyPath, Any] = {}
    names: dict[KeyPath, str] = {}
    for path in key_paths():
        name = env_name(path)
        text = environ.get(name, "").strip()
        source = f"env {name}"
        if not text:
            continue
        try:
            if path == ("prices",):
                entries: dict[str, Any] = {
                    m: PriceConfig.of(p).model_dump() for m, p in map(parse_price, _entries(text, ";"))
                }
            elif _is_table(_annotation(path)):
                entries = _pairs(text)
            elif typing.get_origin(_annotation(path)) is tuple:
                values[path], names[path] = tuple(_entries(text, ",")), source
                continue
            else:
                values[path], names[path] = text, source
                continue
        except ValueError as exc:
            raise CliError(CONFIG, f"{source}: {exc}") from None
        for entry, value in entries.items():
            values[(*path, entry)], names[(*path, entry)] = value, source
    return values, names


def from_flags(args: argparse.Namespace) -> tuple[dict[KeyPath, Any], dict[KeyPath, str]]:
    """The keys given as flags (a flag left out is None in `args`)."""
    values: dict[KeyPath, Any] = {}
    names: dict[KeyPath, str] = {}
    for path, flag in FLAGS.items():
        value = getattr(args, dest(flag), None)
        if value is None:
            continue
        if path == ("prices",):
            value = {model: PriceConfig.of(price).model_dump() for model, price in value}
        if isinstance(value, dict | list) and _is_table(_annotation(path)):
            for entry, each in dict(value).items():
                values[(*path, entry)], names[(*path, entry)] = each, flag
        else:
            values[path], names[path] = tuple(value) if isinstance(value, list) else value, flag
    return values, names


@dataclass(frozen=True, slots=True)
class Resolved:
    """The effective configuration and where each key that is not a default came from."""

    config: Config
    sources: Mapping[KeyPath, str] = field(default_factory=dict)

    def given(self, path: KeyPath) -> bool:
        """Set by the file, the environment or a flag (an entry of a table counts for it)."""
        return any(p[: len(path)] == path for p in self.sources)

    def source(self, path: KeyPath) -> str | None:
        return self.sources.get(path)


def _sentence(error: Mapping[str, Any]) -> str:
    loc = tuple(map(str, error["loc"]))
    where = dotted(loc)
    if error["type"] == "extra_forbidden":
        near = difflib.get_close_matches(dotted(loc), [dotted(k) for k in key_paths()], n=1, cutoff=0.75)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return f"unknown key {where!r} ({hint}the README's configuration reference lists every key)"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}"


def _sentences(errors: list[Any]) -> str:
    """Every problem of a layer at once (one said per run made a file with two typos take two)."""
    said = [_sentence(e) for e in errors[:5]]
    more = f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
    return "; ".join(said) + more


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """`TURNSTILE_…` variables that are no setting but nearly one (a typo is ignored silently
    otherwise, while the file's typos are refused): a sentence for each, naming the setting.
    Other `TURNSTILE_…` names (a deployment's own, the tests') are left alone."""
    known = [*(env_name(path) for path in key_paths()), *sorted(OTHER_VARIABLES)]
    said = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if near:
                said.append(f"{name} is no setting (did you mean {near[0]}?): it is ignored")
    return said


def resolve(
    file: Mapping[str, Any] | None = None,
    file_name: str = str(DEFAULT_FILE),
    env: tuple[Mapping[KeyPath, Any], Mapping[KeyPath, str]] = ({}, {}),
    flags: tuple[Mapping[KeyPath, Any], Mapping[KeyPath, str]] = ({}, {}),
) -> Resolved:
    """Defaults, then the file, the environment and the flags, each key from the highest
    layer that sets it. A layer that names `data` but no `broker` means the embedded log,
    whatever a lower layer's broker (the two flags exclude each other)."""
    merged: dict[KeyPath, Any] = {}
    sources: dict[KeyPath, str] = {}
    if file is not None:
        try:
            Config.model_validate(file, context=TOML)
        except ValidationError as exc:
            raise CliError(CONFIG, f"{file_name}: {_sentences(exc.errors())}") from None
        flat = flatten(file)
        merged.update(flat)
        sources.update(dict.fromkeys(flat, file_name))
    for values, names in (env, flags):
        if ("data",) in values and ("broker",) not in values:
            merged.pop(("broker",), None)
            sources.pop(("broker",), None)
        merged.update(values)
        sources.update(names)
    try:
        config = Config.model_validate(_nest(merged))
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = tuple(map(str, error["loc"]))
        source = next((sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), "configuration")
        code = USAGE if source.startswith("--") else CONFIG
        raise CliError(code, f"{source}: {_sentence(error)}") from None
    return Resolved(config, sources)


def load(path: Path | None, environ: Mapping[str, str], args: argparse.Namespace) -> Resolved:
    """The configuration of this process: `path` (None: ./turnstile.toml when there is one),
    the environment and the flags in `args`."""
    file, name = None, str(path or DEFAULT_FILE)
    if path is not None or DEFAULT_FILE.is_file():
        try:
            file = tomllib.loads((path or DEFAULT_FILE).read_text(encoding="utf-8"))
        except OSError as exc:
            raise CliError(NO_INPUT, f"cannot read the configuration file {name} ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise CliError(CONFIG, f"{name} is not TOML: not UTF-8 text (byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise CliError(CONFIG, f"{name} is not TOML: {exc}") from None
        except RecursionError:
            nested = "its arrays or tables nest too deeply"
            raise CliError(CONFIG, f"{name} is not TOML this program reads: {nested}") from None
    return resolve(file, name, from_env(environ), from_flags(args))


@dataclass(frozen=True, slots=True)
class ShippedPrices:
    taken: date  # the day the prices were read from the providers' pricing pages
    sources: tuple[str, ...]
    prices: PriceTable


class _PriceFile(_Strict):
    taken: date
    sources: tuple[str, ...]
    prices: dict[str, PriceConfig]


@cache
def shipped_prices() -> ShippedPrices:
    """The dated price table shipped with the package (`streams/prices.toml`)."""
    text = resources.files("turnstile.streams").joinpath("prices.toml").read_text()
    table = _PriceFile.model_validate(tomllib.loads(text))
    return ShippedPrices(table.taken, table.sources, {m: p.price() for m, p in table.prices.items()})
