#!/usr/bin/env bash
# Stop the broker that start.sh started (pid from .run/kafka.pid, or $KAFKA_RUN_DIR/kafka.pid): SIGTERM, wait up to
# KAFKA_STOP_TIMEOUT (30) seconds, then SIGKILL. Exit 0 if nothing was running.
# Only that pid is ever signalled, and only if its command line is kafka.Kafka with our config.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN="${KAFKA_RUN_DIR:-$HERE/.run}"  # the folder start.sh used (KAFKA_RUN_DIR for a second broker)
PIDFILE="$RUN/kafka.pid"
PROPS="$RUN/server.properties"
CDS_DIR="$HERE/.cache/cds"
TIMEOUT="${KAFKA_STOP_TIMEOUT:-30}"

log() { echo "kafka: $*" >&2; }

if [[ ! -f "$PIDFILE" ]]; then
  log "not running (no $PIDFILE)"
  exit 0
fi
pid="$(<"$PIDFILE")"
if ! [[ "$pid" =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null \
   || ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "kafka.Kafka $PROPS"; then
  log "not running (stale pid file removed)"
  rm -f "$PIDFILE"
  exit 0
fi

# The broker is not our child, so `wait` cannot be used: poll until the pid is gone. A zombie
# (exited, not yet reaped by its parent, e.g. start.sh stopping a failed start) counts as gone.
gone() {
  kill -0 "$pid" 2>/dev/null || return 0
  [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]]
}
kill -TERM "$pid" 2>/dev/null || true
clean=0
for _ in $(seq 1 $(( TIMEOUT * 5 ))); do
  if gone; then clean=1; break; fi
  sleep 0.2
done
if [[ $clean == 0 ]]; then
  log "pid $pid still alive after ${TIMEOUT}s, sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do gone && break; sleep 0.1; done
fi
rm -f "$PIDFILE"

# A broker started without a CDS archive writes one at exit (see start.sh). Keep it only if
# the JVM finished cleanly; a SIGKILLed dump may be truncated. (start.sh sets KAFKA_CDS_DISCARD=1
# when it stops a broker that failed to start.)
for tmp in "$CDS_DIR"/broker-*.jsa.tmp; do
  [[ -e "$tmp" ]] || continue
  if [[ $clean == 1 && -s "$tmp" && "${KAFKA_CDS_DISCARD:-0}" != 1 ]]; then mv -f "$tmp" "${tmp%.tmp}"; else rm -f "$tmp"; fi
done

log "stopped (pid $pid)"
