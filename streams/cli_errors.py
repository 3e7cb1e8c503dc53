"""What the command line says when it cannot do its job: one line on stderr naming the
cause and the fix, and an exit code from the BSD sysexits convention, so scripts and
supervisors can tell a typo from an outage. A traceback only with `-v`."""

from __future__ import annotations

import argparse
import errno
import json
import math
from collections.abc import Callable

from pydantic import ValidationError

# Exit codes, as the README documents them.
USAGE = 2  # a flag or argument is wrong (argparse uses 2 as well)
LOG_OWNED = 3  # another worker owns the embedded log folder
NOT_FOUND = 1  # the thing asked about does not exist (inspect of an unknown conversation)
DATA_ERR = 65  # the input is not a valid message (too long, an id out of bounds)
NO_INPUT = 66  # a file named on the command line does not exist or cannot be read
UNAVAILABLE = 69  # the broker cannot be reached; the HTTP address is taken
CANT_CREATE = 73  # the embedded log folder, a file or a Kafka topic cannot be created or written
CONFIG = 78  # a configuration file (schedules) is malformed


class CliError(Exception):
    """An expected failure, already worded for the operator."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def explain(exc: BaseException, command: str) -> CliError | None:
    """The operator's sentence for an exception the CLI knows, or None (then a traceback)."""
    if isinstance(exc, CliError):
        return exc
    from turnstile.streams.kafka_log import MembershipLost, ProducerBroken  # (here: only once something failed)

    if isinstance(exc, MembershipLost):
        return CliError(LOG_OWNED, str(exc))
    if isinstance(exc, ProducerBroken):
        return CliError(UNAVAILABLE, str(exc))
    from aiokafka.errors import KafkaConnectionError

    if isinstance(exc, KafkaConnectionError):  # it answered the pre-check, then went away
        return CliError(UNAVAILABLE, f"lost the Kafka broker: {exc}")
    if isinstance(exc, ValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        return CliError(DATA_ERR, f"the message is not accepted: {problems}")
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return CliError(UNAVAILABLE, f"the address is already in use ({exc.strerror}): pick another --http port")
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, FileNotFoundError)):
        where = exc.filename or "a file"
        if command in ("run", "send"):
            return CliError(
                CANT_CREATE, f"cannot write {where} ({exc.strerror}): give --data a folder this user can write"
            )
        return CliError(NO_INPUT, f"cannot read {where} ({exc.strerror})")
    return None


def schedules_error(path: str, exc: Exception) -> CliError:
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return CliError(NO_INPUT, f"cannot read the schedules file {path} ({exc.strerror})")
    if isinstance(exc, json.JSONDecodeError):
        where = f"line {exc.lineno} column {exc.colno}"
        return CliError(CONFIG, f"the schedules file {path} is not JSON: {exc.msg} at {where}")
    return CliError(CONFIG, f"the schedules file {path} is not valid: {exc}")


def broker_url(text: str) -> str:
    """`--broker`: `kafka://HOST:PORT[,HOST:PORT]` or bare `HOST:PORT[,...]`."""
    rest = text.removeprefix("kafka://")
    if "://" in rest:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Kafka address: use kafka://HOST:PORT[,HOST:PORT]")
    for address in rest.split(","):
        host, _, port = address.rpartition(":")
        if not host or not _digits(port) or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"{address!r} in {text!r} is not HOST:PORT (e.g. kafka://127.0.0.1:9092)")
    return text


def http_address(text: str) -> str:
    """`--http`: `HOST:PORT` or `PORT` (then 127.0.0.1)."""
    _, _, port = text.rpartition(":")
    if not _digits(port):
        raise argparse.ArgumentTypeError(f"{text!r} has no port: use HOST:PORT (e.g. 127.0.0.1:8080) or PORT")
    if int(port) >= 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: port {port} is out of range (0..65535)")
    return text


def _digits(text: str) -> bool:
    """ASCII digits only: `str.isdigit` also takes "²" and other digits `int` refuses."""
    return text.isascii() and text.isdigit()


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the message is empty: give --text some content (or - to read stdin)")
    return text


def at_least(low: float, *, integer: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number (an integer if asked) of at least `low`. A negative
    stall age or a NaN limit would not be refused by float() and would check nothing."""

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if integer else 'a number'}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: give a finite number >= {low:g}")
        return value

    return parse
