"""Each expected operational error is one line on stderr naming the cause and the fix, with
the exit code the README documents, and no traceback (unless -v)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka_fixtures import kafka_bootstrap  # noqa: F401  (fixture)

CLI = [sys.executable, "-m", "turnstile.streams.cli"]


def turnstile(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, cwd=cwd, input=stdin, check=False)


def free_port_in_use() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["run", "--broker", "http://127.0.0.1:9092"], 2, "is not a Kafka address: use kafka://HOST:PORT"),
        (["run", "--broker", "kafka://127.0.0.1"], 2, "is not HOST:PORT"),
        (["run", "--http", "localhost"], 2, "has no port: use HOST:PORT"),
        (["run", "--http", "127.0.0.1:99999"], 2, "port 99999 is out of range (0..65535)"),
        (["run", "--http-token-file", "missing-token"], 66, "cannot read the token file missing-token (No such file"),
        (["send", "--conversation", "c1", "--text", "  "], 2, "the message is empty"),
        (["run", "--session-timeout-s", "1"], 2, "outside 6..1800 s"),
        (["run", "--schedules", "missing.json"], 66, "cannot read the schedules file missing.json"),
        (["run", "--schedules", "bad.json"], 78, "is not JSON"),
        (["run", "--schedules", "bad-cron.json"], 78, "is not valid"),
        (["run", "--data", "a-file/log"], 73, "give --data a folder this user can write"),
        (["inspect", "nobody"], 66, "no embedded log in .turnstile (no turnstile.events folder): is --data right?"),
        (["tail", "--data", "mistyped"], 66, "no embedded log in mistyped"),  # printed nothing, exit 0
        (["resume", "c1", "--data", "mistyped"], 66, "no embedded log in mistyped"),
        (["run", "--evict-idle-s", "1e306"], 2, "eviction.idle_s: Input should be less than or equal to 315360000"),
        (["--config", "latin1.toml", "tail"], 78, "latin1.toml is not TOML: not UTF-8 text (byte 5)"),
        (["--config", "deep.toml", "tail"], 78, "deep.toml is not TOML this program reads: its arrays or tables nest"),
        (["run", "nosuch:agent"], 2, "turnstile run: nosuch:agent: no module named 'nosuch' in"),  # was a traceback
        # The agent's own code failing at import: where, in one line (a traceback with -v)
        (["run", "broken:agent"], 2, "turnstile run: broken:agent: importing broken failed: SyntaxError: "),
        (["run", "raises:agent"], 2, "importing raises failed: RuntimeError: no DATABASE_URL ("),
        # ids HTTP and the console refuse were sent, and could then never be read or approved there
        (["send", "--conversation", "a\x1bb", "--text", "hi"], 65, "the conversation id contains a control character"),
        (["send", "--conversation", "c" * 257, "--text", "hi"], 65, "the conversation id is longer than 256"),
        (["send", "--conversation", "c1", "--message-id", "m\n", "--text", "hi"], 65, "the message id contains a"),
        # The auditor's bounds: a negative stall age made every waiting input stalled, a NaN
        # limit checked nothing; both were taken.
        (["audit", "--stall-after-s", "-1"], 2, "'-1' is out of range: give a finite number >= 0"),
        (["audit", "--max-cost-usd", "nan"], 2, "'nan' is out of range"),
        (["audit", "--max-iterations", "0"], 2, "'0' is out of range: give a finite number >= 1"),
        (["audit", "--timeout", "0"], 2, "'0' is out of range: give a finite number >= 0.1"),  # (said nothing of why)
    ],
)
def test_an_operational_error_is_one_sentence_and_a_documented_exit_code(tmp_path, args, code, says):
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "bad-cron.json").write_text('[{"id": "d", "conversation": "c1", "content": "x", "cron": "99 * * * *"}]')
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "latin1.toml").write_bytes(b"x = '\xe9t\xe9'\n")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 5_000 + "]" * 5_000 + "\n")
    (tmp_path / "broken.py").write_text("from turnstile import Agent\nagent = Agent(\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('no DATABASE_URL')\n")
    result = turnstile(*args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr


def test_an_unreachable_broker_is_retried_then_named_with_the_fix(tmp_path):
    port = closed_port()
    result = turnstile("run", "--broker", f"kafka://127.0.0.1:{port}", "--connect-timeout-s", "1", cwd=tmp_path)
    assert result.returncode == 69
    assert "not reachable, retrying in" in result.stderr  # it said it was waiting
    assert result.stderr.strip().splitlines()[-1] == (
        f"turnstile run: cannot reach the Kafka broker at 127.0.0.1:{port} after 1 s:"
        " is it running and is the address right? (turnstile speaks PLAINTEXT, not TLS; without --broker, the"
        " embedded log needs none)"
    )
    assert "worker running" not in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_while_run_waits_for_the_broker_is_one_line_not_a_traceback(tmp_path):
    argv = [*CLI, "run", "--broker", f"kafka://127.0.0.1:{closed_port()}", "--connect-timeout-s", "60"]
    with subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True) as process:
        assert process.stderr is not None
        assert "not reachable, retrying" in process.stderr.readline()  # it is waiting now
        process.send_signal(signal.SIGINT)
        rest = process.stderr.read()
        assert process.wait(timeout=30) == 130
    assert rest.strip() == "turnstile run: interrupted"


@contextlib.contextmanager
def closing_listener() -> Iterator[int]:
    """A loopback port that accepts each connection and closes it at once, as a load
    balancer with nothing behind it or a half-started broker does."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(
    "command",
    [["run", "--connect-timeout-s", "1"], ["send", "--conversation", "c", "--text", "hi"], ["inspect", "c"], ["audit"]],
)
def test_an_address_that_accepts_and_closes_is_no_broker_and_is_said_so(tmp_path, command):
    with closing_listener() as port:
        result = turnstile(command[0], "--broker", f"kafka://127.0.0.1:{port}", *command[1:], cwd=tmp_path)
    assert result.returncode == 69, result.stderr
    assert f"cannot reach the Kafka broker at 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_send_to_an_unreachable_broker_fails_at_once(tmp_path):
    result = turnstile(
        "send", "--broker", f"127.0.0.1:{closed_port()}", "--conversation", "c", "--text", "hi", cwd=tmp_path
    )
    assert result.returncode == 69 and "cannot reach the Kafka broker" in result.stderr


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("command", "missing"),
    [
        (["send", "--conversation", "c", "--text", "hi"], "topic 'nope-e' does"),
        (["tail", "--conversation", "c"], "topic 'nope-e' does"),
        (["inspect", "c"], "topic 'nope-e' does"),
        (["export-turn", "c", "0123456789ab"], "topic 'nope-e' does"),
        (["approve", "c", "call_1"], "topic 'nope-e' does"),
        (["run"], "topics 'nope-e', 'nope-o', 'nope-d', 'nope-x' do"),
        (["run", "--no-stream"], "topics 'nope-e', 'nope-o', 'nope-d' do"),  # no deltas written
    ],
)
def test_a_topic_not_on_the_broker_is_named_at_once_with_the_fix(
    tmp_path, kafka_bootstrap: str, command: list[str], missing: str  # noqa: F811
):
    topics = ["--events-topic", "nope-e", "--outcomes-topic", "nope-o", "--dlq-topic", "nope-d"]
    result = turnstile(*command, "--broker", kafka_bootstrap, *topics, "--deltas-topic", "nope-x", cwd=tmp_path)
    [line] = result.stderr.splitlines()  # no traceback, no client's error per metadata refresh
    assert result.returncode == 2 and line.startswith(f"turnstile {command[0]}: {missing} not exist on")
    assert "with `turnstile topics --broker ...` (the same topic flags)" in line


def test_trace_without_opentelemetry_installed_names_the_extra(tmp_path):
    without = "import sys; sys.modules['opentelemetry'] = None; from turnstile.streams.cli import main; "
    argv = ["run", "--trace", "--data", str(tmp_path)]
    result = subprocess.run([sys.executable, "-c", f"{without}sys.exit(main({argv!r}))"], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path, check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    said = "turnstile run: --trace makes OpenTelemetry spans: pip install 'turnstile-engine[otel]'"
    assert result.stderr.strip() == said


def test_an_http_port_in_use_is_named(tmp_path):
    held = free_port_in_use()
    try:
        port = held.getsockname()[1]
        result = turnstile("run", "--http", f"127.0.0.1:{port}", cwd=tmp_path)
    finally:
        held.close()
    assert result.returncode == 69, result.stderr
    assert "address is already in use" in result.stderr and "Traceback" not in result.stderr


def test_send_reads_a_message_larger_than_argv_allows_from_stdin(tmp_path):
    text = "word " * 30_000  # 150 KB: more than one argv string may hold (128 KiB)
    result = turnstile("send", "--conversation", "c1", "--text", "-", cwd=tmp_path, stdin=text)
    assert result.returncode == 0, result.stderr
    shown = turnstile("inspect", "c1", cwd=tmp_path)
    assert shown.returncode == 0 and "word word" in shown.stdout


@pytest.mark.parametrize("stdin", ["", "  \n"])
def test_an_empty_message_on_stdin_is_a_usage_error_not_a_traceback(tmp_path, stdin):
    result = turnstile("send", "--conversation", "c1", "--text", "-", cwd=tmp_path, stdin=stdin)
    assert result.returncode == 2 and "--text -: the message is empty" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_message_id_reused_for_other_content_is_refused_as_http_refuses_it(tmp_path):
    send = ("send", "--conversation", "c1", "--message-id", "m1", "--text")
    assert turnstile(*send, "hello", cwd=tmp_path).returncode == 0
    again = turnstile(*send, "hello", cwd=tmp_path)  # the same message again: a harmless duplicate
    assert again.returncode == 0, again.stderr
    other = turnstile(*send, "something else", cwd=tmp_path)  # reported "sent" and was dead-lettered
    assert other.returncode == 65 and "message id 'm1' was already used for other content" in other.stderr


def test_on_a_log_that_is_there_an_unknown_conversation_is_not_found(tmp_path):
    assert turnstile("send", "--conversation", "c1", "--text", "hi", cwd=tmp_path).returncode == 0
    unknown = turnstile("inspect", "nobody", cwd=tmp_path)
    assert unknown.returncode == 1 and "no event of conversation 'nobody'" in unknown.stderr
    assert unknown.stdout == ""  # not an empty panel first


def test_a_message_over_the_size_limit_is_refused_with_the_limit_named(tmp_path):
    result = turnstile("send", "--conversation", "c1", "--text", "-", cwd=tmp_path, stdin="x" * 200_001)
    assert result.returncode == 65
    assert "content: String should have at most 200000 characters" in result.stderr
    assert "Traceback" not in result.stderr


def test_global_flags_work_after_the_subcommand_and_logs_carry_utc_timestamps(tmp_path):
    result = turnstile("inspect", "nobody", "-v", cwd=tmp_path)  # -v after the subcommand
    assert result.returncode == 66
    assert "Traceback" in result.stderr  # -v shows it; the last line is still the sentence
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ERROR ", result.stderr)
    assert result.stderr.strip().splitlines()[-1].startswith("turnstile inspect: no embedded log in .turnstile")


def test_json_logs_are_one_object_per_line(tmp_path):
    result = turnstile("inspect", "nobody", "--log-format", "json", "-v", cwd=tmp_path)
    [logged, sentence] = result.stderr.strip().splitlines()
    line = json.loads(logged)
    assert (line["level"], line["logger"]) == ("ERROR", "root") and line["ts"].endswith("Z")
    assert "CliError" in line["exception"] and sentence.startswith("turnstile inspect:")


def test_json_logs_of_a_running_worker_are_json_every_line(tmp_path):
    # (the replay progress, "worker running on", the broker retries were printed as text)
    argv = [*CLI, "run", "--data", str(tmp_path / "log"), "--log-format", "json", "--drain-grace-s", "0"]
    with subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True) as process:
        assert process.stderr is not None
        lines = []
        while not any("worker running on" in line for line in lines):
            line = process.stderr.readline()
            assert line, "the worker stopped before it ran: " + "".join(lines)
            lines.append(line)
        process.send_signal(signal.SIGTERM)
        lines += process.stderr.readlines()
        assert process.wait(timeout=30) == 0
    records = [json.loads(line) for line in lines]  # every line one JSON object
    assert any(r["message"].startswith("worker running on") for r in records)
    waiting = turnstile("run", "--broker", f"kafka://127.0.0.1:{closed_port()}", "--connect-timeout-s", "1",
                        "--log-format", "json", cwd=tmp_path)  # fmt: skip
    *logged, sentence = waiting.stderr.strip().splitlines()
    assert logged and all("not reachable, retrying" in json.loads(line)["message"] for line in logged)
    assert sentence.startswith("turnstile run: cannot reach the Kafka broker")


def test_a_worker_whose_producer_broke_exits_69_with_its_one_line():
    from turnstile.streams.cli_errors import UNAVAILABLE, explain
    from turnstile.streams.kafka_log import ProducerBroken

    said = "appends to the log fail out of order"
    explained = explain(ProducerBroken(said), "run")
    assert explained is not None and (explained.code, str(explained)) == (UNAVAILABLE, said)


def test_a_read_that_cannot_reach_the_broker_leaves_no_client_unclosed(caplog: pytest.LogCaptureFixture) -> None:
    # (a broker-restart hunt: each retry of a snapshot fill left an AIOKafkaConsumer unclosed)
    import asyncio
    import gc
    import logging

    from aiokafka.errors import KafkaConnectionError

    from turnstile.streams.kafka_reader import read_span, read_topic

    address = f"127.0.0.1:{closed_port()}"

    async def both() -> None:
        for read in (read_topic(address, "x", timeout_s=2), read_span(address, "x", 0, 0, None, timeout_s=2)):
            with pytest.raises(KafkaConnectionError):
                await read

    with caplog.at_level(logging.ERROR):
        asyncio.run(both())
        gc.collect()
    assert not [r for r in caplog.records if "Unclosed" in r.getMessage()]


def test_sighup_drains_as_sigterm_does(tmp_path):
    # (by default it ended the worker at once: exit 129, no drain, nothing said)
    with subprocess.Popen([*CLI, "-v", "run", "--data", str(tmp_path / "log")], cwd=tmp_path,
                          stderr=subprocess.PIPE, text=True) as worker:  # fmt: skip
        assert worker.stderr is not None
        for line in worker.stderr:
            if "worker running" in line:
                break
        worker.send_signal(signal.SIGHUP)
        rest = worker.stderr.read()
        assert worker.wait(30) == 0, rest
        assert "SIGHUP: stopping; no new turn is claimed" in rest and rest.rstrip().endswith("stopped"), rest


def test_a_worker_started_with_sighup_ignored_outlives_its_terminal(tmp_path):
    # (nohup: the handler that drains on SIGHUP must not replace the SIG_IGN it was given)
    def ignore_hangup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    with subprocess.Popen([*CLI, "-v", "run", "--data", str(tmp_path / "log")], cwd=tmp_path,
                          stderr=subprocess.PIPE, text=True, preexec_fn=ignore_hangup) as worker:  # fmt: skip
        assert worker.stderr is not None
        for line in worker.stderr:
            if "worker running" in line:
                break
        worker.send_signal(signal.SIGHUP)
        worker.send_signal(signal.SIGTERM)  # what stops it is the TERM: had the HUP drained it, the
        rest = worker.stderr.read()        # TERM would have come second and stopped it at once (130)
        assert worker.wait(30) == 0, rest
