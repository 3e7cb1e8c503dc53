"""How the command line writes its logs: text for people (UTC timestamps), or one JSON
object per line for log pipelines (`--log-format json`)."""

from __future__ import annotations

import logging
import time

import orjson


class UtcFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
        self.converter = time.gmtime  # an instance attribute: typeshed types the class one as taking secs


class JsonFormatter(UtcFormatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": f"{self.formatTime(record, self.datefmt)}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(verbose: bool, form: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else UtcFormatter())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
