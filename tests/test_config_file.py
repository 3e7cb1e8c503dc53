"""turnstile.toml, the environment and flags: one strict configuration, each key from the
highest layer that sets it (flags > env > file > defaults), bad input refused in one line
naming the key and where it came from."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import date

import pytest
from test_cli_help import actions, parsers

from turnstile import Agent, DebouncePolicy, Model, ModelPrice, TestModel, TurnBudget
from turnstile.handlers.claim import DoubleTextPolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams import config_file, run_config
from turnstile.streams.cli import build_parser
from turnstile.streams.cli_errors import CliError
from turnstile.streams.config_file import from_env, from_flags, resolve, shipped_prices
from turnstile.streams.eviction import EvictionPolicy

CLI = [sys.executable, "-m", "turnstile.streams.cli"]


def flags(*argv: str) -> tuple[dict, dict]:
    return from_flags(build_parser().parse_args(["run", *argv]))


def test_each_key_comes_from_the_highest_layer_that_sets_it():
    file = {"group": "from-file", "drain_grace_s": 5, "budget": {"max_cost_usd": 1.0, "max_iterations": 3}}
    env = from_env({"TURNSTILE_GROUP": "from-env", "TURNSTILE_BUDGET_MAX_COST_USD": "2"})
    resolved = resolve(file, "turnstile.toml", env, flags("--max-cost-usd", "3"))
    config = resolved.config
    assert (config.group, config.drain_grace_s) == ("from-env", 5)  # env over file; file over default
    assert (config.budget.max_cost_usd, config.budget.max_iterations) == (3.0, 3)  # flag over env over file
    assert config.connect_timeout_s == 60.0  # nobody set it: the default
    assert resolved.source(("group",)) == "env TURNSTILE_GROUP"
    assert resolved.source(("budget", "max_cost_usd")) == "--max-cost-usd"
    assert resolved.source(("drain_grace_s",)) == "turnstile.toml"


def test_an_unknown_key_is_refused_naming_it_and_the_file():
    with pytest.raises(CliError) as caught:
        resolve({"budget": {"max_cost": 1}}, "conf/turnstile.toml")
    assert caught.value.code == 78
    assert str(caught.value).startswith("conf/turnstile.toml: unknown key 'budget.max_cost'")


def test_every_unknown_key_of_a_file_is_said_at_once_with_the_key_it_is_near():
    # (one typo a run: a file with two took two runs to mend, and nothing said what was meant)
    with pytest.raises(CliError) as caught:
        resolve({"grup": "g", "budget": {"max_cost": 1}, "zzz": 1}, "turnstile.toml")
    said = str(caught.value)
    assert "unknown key 'grup' (did you mean 'group'?" in said
    assert "unknown key 'budget.max_cost' (did you mean 'budget.max_cost_usd'?" in said
    assert "unknown key 'zzz' (the README's configuration reference" in said


def test_a_variable_that_is_nearly_a_setting_is_named_with_it():
    from turnstile.streams.config_file import unknown_variables

    typos = {"TURNSTILE_GRUP": "g", "TURNSTILE_BUDGET_MAXCOST_USD": "1", "TURNSTILE_HTTP_TOKN": "t"}
    others = {"TURNSTILE_GROUP": "g2", "TURNSTILE_API_KEY": "k", "TURNSTILE_KAFKA": "h:1", "TURNSTILE_MINE": "x"}
    environ = {**typos, **others, "PATH": "/bin"}
    assert unknown_variables(environ) == [
        "TURNSTILE_BUDGET_MAXCOST_USD is no setting (did you mean TURNSTILE_BUDGET_MAX_COST_USD?): it is ignored",
        "TURNSTILE_GRUP is no setting (did you mean TURNSTILE_GROUP?): it is ignored",
        "TURNSTILE_HTTP_TOKN is no setting (did you mean TURNSTILE_HTTP_TOKEN?): it is ignored",
    ]


@pytest.mark.parametrize(
    ("layers", "code", "says"),
    [
        ({"file": {"debounce": {"quiet_ms": "soon"}}}, 78,
         "turnstile.toml: debounce.quiet_ms: expected a number, not the string 'soon'"),
        ({"env": {"TURNSTILE_SESSION_TIMEOUT_S": "2"}}, 78, "env TURNSTILE_SESSION_TIMEOUT_S: session_timeout_s: 2 is"),
        ({"flags": ["--session-timeout-s", "1"]}, 2, "--session-timeout-s: session_timeout_s: 1 is outside 6..1800 s"),
        ({"env": {"TURNSTILE_BROKER": "http://x:1"}}, 78, "env TURNSTILE_BROKER: broker: 'http://x:1' is not a Kafka"),
        ({"env": {"TURNSTILE_PRICES": "gpt=1"}}, 78, "env TURNSTILE_PRICES: expected MODEL=INPUT,OUTPUT"),
        ({"env": {"TURNSTILE_MODEL_FALLBACKS": "a,,b"}}, 78, "env TURNSTILE_MODEL_FALLBACKS: an empty entry in 'a,,b'"),
        ({"env": {"TURNSTILE_PRICES": "a=1,2;;b=1,2"}}, 78, "env TURNSTILE_PRICES: an empty entry in 'a=1,2;;b=1,2'"),
        ({"env": {"TURNSTILE_DOUBLE_TEXT_PER_CONVERSATION": "c1=enqueue,"}}, 78,
         "env TURNSTILE_DOUBLE_TEXT_PER_CONVERSATION: an empty entry in 'c1=enqueue,'"),
        ({"file": {"prices": {"m": {"input": -1, "output": 1}}}}, 78, "turnstile.toml: prices.m.input: Input should"),
        # A limit or price of inf or NaN bounds nothing (an infinite cost limit crashed every turn).
        ({"file": {"budget": {"max_cost_usd": float("inf")}}}, 78,
         "turnstile.toml: budget.max_cost_usd: Input should be a finite"),
        ({"env": {"TURNSTILE_DRAIN_GRACE_S": "nan"}}, 78,
         "env TURNSTILE_DRAIN_GRACE_S: drain_grace_s: Input should be a finite"),
        ({"env": {"TURNSTILE_PRICES": "m=nan,1"}}, 78, "env TURNSTILE_PRICES: prices must be finite numbers >= 0"),
        ({"file": {"prices": {"m": {"input": float("inf"), "output": 1}}}}, 78,
         "turnstile.toml: prices.m.input: Input should be a finite"),
        ({"flags": ["--max-cost-usd", "inf"]}, 2, "--max-cost-usd: budget.max_cost_usd: Input should be a finite"),
        # TOML's true is no number: pydantic alone would read it as 1.
        ({"file": {"budget": {"max_iterations": True}}}, 78,
         "turnstile.toml: budget.max_iterations: expected a number, not true"),
        ({"file": {"prices": {"m": {"input": 1, "output": 1, "cached_input": False}}}}, 78,
         "turnstile.toml: prices.m.cached_input: expected a number, not false"),
        # ... and TOML's 1 is no boolean: pydantic alone would read `stream = 1` as true.
        ({"file": {"stream": 1}}, 78, "turnstile.toml: stream: expected true or false, not 1"),
        ({"file": {"trace": 0.0}}, 78, "turnstile.toml: trace: expected true or false, not 0.0"),
        # ... and TOML's strings and fractions are no numbers: pydantic alone took "10" and 1.0.
        ({"file": {"session_timeout_s": "10"}}, 78,
         "turnstile.toml: session_timeout_s: expected a number, not the string '10': leave out the quotes"),
        ({"file": {"budget": {"max_iterations": 1.0}}}, 78,
         "turnstile.toml: budget.max_iterations: expected a whole number, not 1.0"),
        ({"file": {"stream": "yes"}}, 78, "turnstile.toml: stream: expected true or false, not the string 'yes'"),
        # An empty name: `topics.events = ""` wrote the log into the data folder itself.
        ({"file": {"topics": {"events": ""}}}, 78, "turnstile.toml: topics.events: is empty: give a value or leave"),
        ({"flags": ["--group", " "]}, 2, "--group: group: is empty"),
        ({"file": {"double_text": {"per_conversation": {"": "reject"}}}}, 78,
         "turnstile.toml: double_text.per_conversation: holds an empty name"),
        ({"file": {"model": {"fallbacks": ["gpt-x", " "]}}}, 78,
         "turnstile.toml: model.fallbacks: holds an empty name"),
        # TOML splits an unquoted model name at its dots: it said `prices.gpt-4.input: Field required`.
        ({"file": {"prices": {"gpt-4": {"1-mini": {"input": 1, "output": 2}}}}}, 78,
         'turnstile.toml: prices: a model name with dots needs quotes: [prices."gpt-4.1-mini"]'),
    ],
)
def test_a_bad_value_names_its_key_and_source(layers, code, says):
    with pytest.raises(CliError) as caught:
        resolve(layers.get("file"), "turnstile.toml", from_env(layers.get("env", {})), flags(*layers.get("flags", [])))
    assert caught.value.code == code
    assert str(caught.value).startswith(says)
    assert "\n" not in str(caught.value)  # one line


def test_tables_merge_entry_by_entry_and_lists_come_from_the_environment_comma_separated():
    file = {"prices": {"a": {"input": 1, "output": 2}, "b": {"input": 1, "output": 2}},
            "double_text": {"per_conversation": {"c1": "reject"}}}
    env = from_env({"TURNSTILE_PRICES": "b=3,4;c=5,6,0.5,7", "TURNSTILE_MODEL_FALLBACKS": "x, y",
                    "TURNSTILE_DOUBLE_TEXT_PER_CONVERSATION": "c2=reject"})
    config = resolve(file, "turnstile.toml", env, flags("--price", "c=8,9", "--double-text-for", "c1=enqueue")).config
    assert {m: (p.input, p.output) for m, p in config.prices.items()} == {"a": (1, 2), "b": (3, 4), "c": (8, 9)}
    assert config.model.fallbacks == ("x", "y")
    assert config.double_text.per_conversation == {"c1": "enqueue", "c2": "reject"}


def test_an_empty_variable_is_unset_and_unknown_turnstile_variables_are_not_keys():
    assert from_env({"TURNSTILE_GROUP": "", "TURNSTILE_API_KEY": "sk-1", "TURNSTILE_KAFKA": "x"}) == ({}, {})


def test_the_embedded_log_named_by_a_higher_layer_wins_over_a_broker_below():
    config = resolve({"broker": "kafka://h:9092"}, "turnstile.toml", flags=flags("--data", "here")).config
    assert config.broker is None and str(config.data) == "here"
    both = resolve({"broker": "kafka://h:9092", "data": "d"}).config  # one layer naming both keeps both
    assert both.broker == "kafka://h:9092"


def test_a_file_configures_the_worker_of_run():
    file = {"model": {"name": "gpt-4.1", "fallbacks": ["gpt-4.1-mini"]}, "budget": {"max_tool_calls": 2},
            "debounce": {"quiet_ms": 0}, "double_text": {"default": "reject"}, "stream": False,
            "prices": {"gpt-4.1": {"input": 1, "output": 1}}}
    provider = ScriptedProvider()
    worker = run_config.worker_config(resolve(file).config, provider)
    assert worker.turn.model == "gpt-4.1" and [r.model for r in worker.turn.fallbacks] == ["gpt-4.1-mini"]
    assert worker.turn.budget == TurnBudget(max_tool_calls=2)
    assert worker.debounce == DebouncePolicy(quiet_ms=0) and worker.double_text.default == "reject"
    assert worker.stream_replies is False
    assert worker.turn.prices["gpt-4.1"] == ModelPrice(1, 1)  # the file over the shipped table
    assert worker.turn.prices["gpt-4.1-mini"] == shipped_prices().prices["gpt-4.1-mini"]


def test_the_state_dir_flag_gives_the_worker_a_local_store_that_outlives_it(tmp_path):
    default = run_config.worker_config(resolve({}).config, ScriptedProvider())
    assert default.eviction.state_dir is None  # a temporary folder: a restart reads the snapshot topic
    flagged = resolve({}, "turnstile.toml", flags=flags("--state-dir", str(tmp_path / "state"))).config
    worker = run_config.worker_config(flagged, ScriptedProvider())
    assert worker.eviction.state_dir == tmp_path / "state"
    assert worker.eviction.idle_ms == EvictionPolicy().idle_ms  # the rest of the policy as before


def test_the_eviction_keys_reach_the_worker_from_the_file_the_environment_and_the_flags(tmp_path):
    file = {"eviction": {"idle_s": 30, "max_resident": 5000}}
    worker = run_config.worker_config(resolve(file).config, ScriptedProvider())
    assert (worker.eviction.idle_ms, worker.eviction.max_resident) == (30_000, 5000)
    env = from_env({"TURNSTILE_EVICTION_IDLE_S": "0.5"})
    flagged = resolve(file, "turnstile.toml", env=env, flags=flags("--max-resident", "10")).config
    worker = run_config.worker_config(flagged, ScriptedProvider())
    assert (worker.eviction.idle_ms, worker.eviction.max_resident) == (500, 10)
    default = run_config.worker_config(resolve({}).config, ScriptedProvider())
    assert default.eviction == EvictionPolicy()  # what a worker made in code has
    for bad in ({"max_resident": 0}, {"idle_s": -1}, {"idle": 5}):
        with pytest.raises(CliError):
            resolve({"eviction": bad})


def shop() -> Agent:
    return Agent("shop", model=Model("acme-7b", price=ModelPrice(1, 2)), fallbacks=[Model("acme-3b")],
                 budget=TurnBudget(max_iterations=4, max_cost_usd=0.02), debounce=DebouncePolicy(800, 5000))


def test_configured_budget_debounce_double_text_and_prices_override_the_agents_key_by_key():
    resolved = resolve({"prices": {"acme-3b": {"input": 3, "output": 4}}}, "turnstile.toml",
                       flags=flags("--quiet-ms", "0", "--max-cost-usd", "0.1", "--double-text-for", "c9=reject"))
    agent, ignored = run_config.configure_agent(shop(), resolved)
    assert ignored == []
    assert agent.debounce == DebouncePolicy(0, 5000)  # the agent's max_wait_ms stays
    assert agent.budget == TurnBudget(max_iterations=4, max_cost_usd=0.1)
    assert agent.double_text_policy() == DoubleTextPolicy("enqueue", {"c9": "reject"})
    assert agent.prices()["acme-3b"] == ModelPrice(3, 4) and agent.prices()["acme-7b"] == ModelPrice(1, 2)
    assert shop().debounce == DebouncePolicy(800, 5000)  # the agent itself is not changed


def test_model_keys_are_ignored_for_an_agent_with_one_warning_each_naming_the_flag():
    env = from_env({"TURNSTILE_MODEL_BASE_URL": "http://127.0.0.1:1"})
    agent, ignored = run_config.configure_agent(shop(), resolve(env=env, flags=flags("--model", "gpt-4.1")))
    assert agent.model.name == "acme-7b"
    assert len(ignored) == 2
    assert ignored[0].startswith("--model (model.name) is ignored: agent 'shop' names its models in code")
    assert ignored[1].startswith("env TURNSTILE_MODEL_BASE_URL (model.base_url) is ignored")


def test_the_effective_configuration_masks_secrets_and_names_sources():
    resolved = resolve({"group": "g"}, "turnstile.toml", flags=flags("--model", "gpt-4.1"))
    secrets = run_config.secrets_of("tok-123", ["TURNSTILE_API_KEY"], {"TURNSTILE_API_KEY": "sk-live-1"})
    line = run_config.effective(resolved, secrets, run_config.prices(resolved.config))
    assert "tok-123" not in line and "sk-live-1" not in line
    assert "http.token=***" in line and "env TURNSTILE_API_KEY=***" in line
    assert "group=g [turnstile.toml]" in line and "model.name=gpt-4.1 [--model]" in line
    assert "prices.gpt-4.1=2/8/0.5/0 [shipped table of" in line
    agent_line = run_config.effective(run_config.agent_view(shop(), resolved), {}, shop().prices())
    assert "model.name=acme-7b [agent shop]" in agent_line and "prices.acme-3b=none (unknown cost)" in agent_line


def test_the_shipped_price_table_is_dated_and_prices_openai_and_anthropic_models():
    table = shipped_prices()
    assert table.taken == date(2026, 12, 3)
    assert any("openai.com" in s for s in table.sources) and any("claude.com" in s for s in table.sources)
    assert table.prices["gpt-4.1"] == ModelPrice(2.0, 8.0, 0.5, 0.0)
    assert table.prices["claude-haiku-4-5"] == ModelPrice(1.0, 5.0, 0.10, 1.25)
    assert TestModel().price == ModelPrice(0, 0, 0, 0)


def test_every_key_has_an_env_name_and_a_run_flag():
    run = dict(parsers(build_parser()))["turnstile run"]
    run_flags = {flag for action in actions(run) for flag in action.option_strings}
    for path in config_file.key_paths():
        assert config_file.env_name(path).startswith("TURNSTILE_")
        assert config_file.FLAGS[path] in run_flags, path


def turnstile(*argv: str, cwd, env=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, **(env or {})}, check=False)


@pytest.mark.parametrize(
    ("text", "argv", "code", "says"),
    [
        ('brokr = "kafka://h:1"\n', [], 78, "turnstile run: turnstile.toml: unknown key 'brokr'"),
        ("[budget\n", [], 78, "turnstile run: turnstile.toml is not TOML: "),
        ("", ["--config", "missing.toml"], 66, "turnstile run: cannot read the configuration file missing.toml"),
    ],
)
def test_a_bad_configuration_file_is_one_line_and_exit_code(tmp_path, text, argv, code, says):
    (tmp_path / "turnstile.toml").write_text(text)
    result = turnstile("run", *argv, cwd=tmp_path)
    assert result.returncode == code
    assert result.stderr.startswith(says) and len(result.stderr.strip().splitlines()) == 1


def test_run_of_an_agent_names_the_model_flag_it_ignores_and_applies_the_rest(tmp_path):
    from test_prices import start_worker

    (tmp_path / "shop.py").write_text(
        "from turnstile import Agent, Model, ModelPrice\n"
        "agent = Agent('shop', model=Model('acme-7b', price=ModelPrice(2, 8)))\n"
    )
    said, code = start_worker(tmp_path, "shop:agent", "--model", "gpt-4.1", "--quiet-ms", "5")
    assert "--model (model.name) is ignored: agent 'shop' names its models in code" in said
    assert "model.name=acme-7b [agent shop]" in said and "debounce.quiet_ms=5 [--quiet-ms]" in said
    assert code == 0


def test_a_command_warns_of_a_variable_that_is_nearly_a_setting(tmp_path):
    result = turnstile("tail", "--data", "missing", cwd=tmp_path, env={"TURNSTILE_GRUP": "g"})
    assert "TURNSTILE_GRUP is no setting (did you mean TURNSTILE_GROUP?): it is ignored" in result.stderr
