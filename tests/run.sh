#!/usr/bin/env bash
# The whole test suite from a fresh clone: venv, project install, a real single-node Kafka
# started from infra/, lint and types, then pytest. Kafka tests fail (never skip) here.
set -euo pipefail
cd "$(dirname "$0")/.."

[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
# kcat (Debian package) is the non-Python producer and consumer of tests/test_kcat.py.
command -v kcat >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat)
# Headless Chromium and its driver (Debian packages) for the console's browser tests, which
# fail rather than skip here (TURNSTILE_REQUIRE_KAFKA=1 below).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
fi

# Leave a broker that was already running (a developer's) as it was; stop only our own.
was_running=0
if [[ -f infra/kafka/.run/kafka.pid ]] && kill -0 "$(cat infra/kafka/.run/kafka.pid)" 2>/dev/null; then
  was_running=1
fi
bash infra/kafka/start.sh
# The tests find the broker start.sh started, on KAFKA_PORT when that is set.
export TURNSTILE_KAFKA="${TURNSTILE_KAFKA:-127.0.0.1:${KAFKA_PORT:-9092}}"
if [[ $was_running == 0 ]]; then
  trap 'bash infra/kafka/stop.sh' EXIT
fi

.venv/bin/ruff check .
.venv/bin/mypy
TURNSTILE_REQUIRE_KAFKA=1 .venv/bin/pytest -q -p no:cacheprovider "$@"
