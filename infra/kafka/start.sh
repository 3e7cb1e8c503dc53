#!/usr/bin/env bash
# Start a single-node Apache Kafka (KRaft, broker+controller) on 127.0.0.1 and ensure the
# turnstile topics exist. Idempotent: if the broker this script started is still running, it
# only (re)ensures the topics. See README.md in this folder for env vars, logs and timings.
set -euo pipefail

T_START=$EPOCHREALTIME
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="$HERE/.cache"              # jars + CDS archives (git-ignored, kept between runs)
# pid, generated config, data, logs (git-ignored). KAFKA_RUN_DIR gives a second broker (other
# KAFKA_PORT / KAFKA_CONTROLLER_PORT) its own folder, so it runs beside the default one.
RUN="${KAFKA_RUN_DIR:-$HERE/.run}"
LIB="$CACHE/lib"
STAMP="$CACHE/lib.stamp"          # hash of the pom.xml that lib/ was copied for
CDS_DIR="$CACHE/cds"
LOGS="$RUN/logs"
DATA="$RUN/data"
PIDFILE="$RUN/kafka.pid"
PROPS="$RUN/server.properties"

KAFKA_PORT="${KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${KAFKA_CONTROLLER_PORT:-9093}"
KAFKA_START_TIMEOUT="${KAFKA_START_TIMEOUT:-90}"
KAFKA_KEEP_DATA="${KAFKA_KEEP_DATA:-0}"
KAFKA_CDS="${KAFKA_CDS:-1}"
KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m}"
EVENTS_TOPIC="${TURNSTILE_EVENTS_TOPIC:-turnstile.events}"
OUTCOMES_TOPIC="${TURNSTILE_OUTCOMES_TOPIC:-turnstile.outcomes}"
DLQ_TOPIC="${TURNSTILE_DLQ_TOPIC:-turnstile.events.dlq}"
SNAPSHOTS_TOPIC="${TURNSTILE_SNAPSHOTS_TOPIC:-turnstile.snapshots}"
HEADS_TOPIC="${TURNSTILE_HEADS_TOPIC:-$SNAPSHOTS_TOPIC.heads}"
DELTAS_TOPIC="${TURNSTILE_DELTAS_TOPIC:-turnstile.deltas}"
PARTITIONS="${TURNSTILE_EVENT_PARTITIONS:-8}"
BOOTSTRAP="127.0.0.1:$KAFKA_PORT"
CP="$LIB/*"

log() { echo "kafka: $*" >&2; }
die() { echo "kafka: ERROR: $*" >&2; exit 1; }
elapsed() { awk -v a="$T_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

mkdir -p "$CACHE" "$LOGS"

# One start.sh at a time (e.g. parallel test runners). Every java started below gets `9>&-` so
# the long-lived broker does not inherit (and hold) the lock.
exec 9>"$RUN/start.lock"
flock -w 120 9 || die "another start.sh holds $RUN/start.lock"
rmdir "$CDS_DIR/tools.dumping" 2>/dev/null || true   # stale marker of a killed run (see topics)

# Our broker = pid from the pid file, alive, and its command line is kafka.Kafka with OUR config
# (guards against a recycled pid). No other process is ever touched.
our_broker_pid() {
  local pid
  [[ -f "$PIDFILE" ]] || return 1
  pid="$(<"$PIDFILE")"
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "kafka.Kafka $PROPS" || return 1
  echo "$pid"
}

show_log_tail() {
  echo "---- tail of $LOGS/server.log ----" >&2
  tail -n 40 "$LOGS/server.log" >&2 2>/dev/null || true
  if [[ -s "$LOGS/kafka.out" ]]; then
    echo "---- tail of $LOGS/kafka.out (broker stdout/stderr) ----" >&2
    tail -n 20 "$LOGS/kafka.out" >&2
  fi
}

# ---------------------------------------------------------------- jars (mvn only when needed)
fetch_jars() {
  local pom_hash
  pom_hash="$(sha256sum "$HERE/pom.xml" | cut -c1-16)"
  if [[ -d "$LIB" && -f "$STAMP" && "$(<"$STAMP")" == "$pom_hash" ]]; then
    return 0
  fi
  log "fetching Kafka jars with Maven (first run or pom.xml changed) ..."
  rm -rf "$LIB" "$CDS_DIR" "$STAMP"
  # outputDirectory must be absolute: a relative one resolves against pom.xml's folder.
  # shellcheck disable=SC2086  # KAFKA_MVN_ARGS: extra mvn args, e.g. -o or -Dmaven.repo.local=DIR
  mvn -B -q -Dstyle.color=never -f "$HERE/pom.xml" ${KAFKA_MVN_ARGS:-} dependency:copy-dependencies \
      -DincludeScope=runtime -DoutputDirectory="$LIB" >"$CACHE/mvn.log" 2>&1 9>&- \
    || { tail -n 30 "$CACHE/mvn.log" >&2; die "mvn dependency:copy-dependencies failed (log: $CACHE/mvn.log)"; }
  local g
  for g in 'kafka_2.13-*.jar' 'kafka-tools-[0-9]*.jar' 'log4j-core-*.jar' 'log4j-slf4j-impl-*.jar'; do
    compgen -G "$LIB/$g" >/dev/null || die "jar set incomplete after mvn (no $g), see $CACHE/mvn.log"
  done
  echo "$pom_hash" >"$STAMP"   # written last: a half-finished copy is never taken as complete
}

# ---------------------------------------------------------------- AppCDS (optional speed-up)
# A dynamic class-data-sharing archive cuts JVM start time (measured here: broker ready in 1.8 s
# instead of 2.8 s, TopicCommand 0.4 s instead of 0.7 s). Archives are keyed by the jar set and
# the java binary. A JVM started while no archive exists writes one when it exits (the broker:
# at stop.sh's SIGTERM; stop.sh keeps it only after a clean exit). -Xshare:auto: a missing or
# stale archive only means "no sharing", never a failure. KAFKA_CDS=0 turns all this off.
# -Xlog:cds=off silences the dump's harmless "Skipping ... pre JDK 6 class" warnings.
CDS_LOG=(-Xlog:cds=off -Xlog:cds+dynamic=off)
cds_key() {
  local j
  j="$(readlink -f "$(command -v java)")"
  echo "$(cat "$STAMP" 2>/dev/null)-$(echo "$j $(stat -c %Y "$j")" | sha256sum | cut -c1-12)"
}

# ---------------------------------------------------------------- CLI tool (TopicCommand)
# Short-lived tool JVMs: C1 only, serial GC, small heap: 0.4-0.7 s each on 2 cores.
TOOL_JAVA_OPTS=(-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xmx256m -Xshare:auto
                -Dlog4j2.configurationFile="$HERE/tools-log4j2.properties")
topics() {  # topics <timeout-seconds> <TopicCommand args...>
  local t="$1"; shift
  local -a cds=()
  local jsa="" dumping=0 rc=0
  if [[ "$KAFKA_CDS" == 1 ]]; then
    jsa="$CDS_DIR/tools-$(cds_key).jsa"
    mkdir -p "$CDS_DIR"
    if [[ -f "$jsa" ]]; then
      cds=(-XX:SharedArchiveFile="$jsa" "${CDS_LOG[@]}")
    elif mkdir "$CDS_DIR/tools.dumping" 2>/dev/null; then
      # no archive yet: exactly one of the parallel tool JVMs dumps it
      dumping=1
      cds=(-XX:ArchiveClassesAtExit="$jsa.$BASHPID.tmp" "${CDS_LOG[@]}")
    fi
  fi
  timeout "$t" java "${TOOL_JAVA_OPTS[@]}" "${cds[@]}" -cp "$CP" \
      org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP" "$@" 9>&- || rc=$?
  if [[ $dumping == 1 ]]; then
    if [[ $rc == 0 && -s "$jsa.$BASHPID.tmp" ]]; then mv -f "$jsa.$BASHPID.tmp" "$jsa"; fi
    rm -f "$jsa.$BASHPID.tmp"; rmdir "$CDS_DIR/tools.dumping" 2>/dev/null || true
  fi
  return $rc
}

# Create whichever of our six topics is missing.
#   $1 = fresh: empty cluster, skip the --list JVM;  check: --list first, create only missing ones
#   $2 = time budget in seconds for each tool JVM
ensure_topics() {
  local mode="$1" budget="$2" existing="" rc=0 i
  local -a names=("$EVENTS_TOPIC" "$OUTCOMES_TOPIC" "$DLQ_TOPIC" "$DELTAS_TOPIC" "$SNAPSHOTS_TOPIC" "$HEADS_TOPIC")
  local -a parts=("$PARTITIONS" "$PARTITIONS" 1 "$PARTITIONS" "$PARTITIONS" "$PARTITIONS")
  # The events topic is the source of truth (every state is rebuilt from it) and dead letters
  # hold the only copy of refused bytes: neither may expire. Outcomes keep the broker default.
  # Reply deltas only serve live readers of a reply in progress: one hour. Snapshots are
  # compacted (the latest per conversation, co-partitioned with the events), never expired;
  # so are their heads (what each covers and where it is: what a new owner reads to go live).
  local -a configs=("retention.ms=-1" "retention.ms=604800000" "retention.ms=-1" "retention.ms=3600000"
                    "cleanup.policy=compact" "cleanup.policy=compact")
  local -a pids=()
  if [[ "$mode" == check ]]; then
    existing="$(topics "$budget" --list)" || return 1
  fi
  for i in 0 1 2 3 4 5; do
    grep -qxF -- "${names[$i]}" <<<"$existing" && continue
    # TopicCommand creates one topic per run; the JVMs run in parallel (~2 s for six on
    # 2 cores, ~2.6 s one after the other). --if-not-exists: a concurrent creator is fine.
    topics "$budget" --create --if-not-exists --topic "${names[$i]}" \
        --partitions "${parts[$i]}" --replication-factor 1 --config "${configs[$i]}" >/dev/null &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  return $rc
}

finish() {
  log "topics: $EVENTS_TOPIC($PARTITIONS) $OUTCOMES_TOPIC($PARTITIONS) $DLQ_TOPIC(1) $DELTAS_TOPIC($PARTITIONS) $SNAPSHOTS_TOPIC($PARTITIONS, compacted) $HEADS_TOPIC($PARTITIONS, compacted); log: $LOGS/server.log"
  echo "kafka ready on $BOOTSTRAP ($(elapsed) s)"
  exit 0
}

# ---------------------------------------------------------------- already running?
# (jars are not re-fetched here: the running broker uses lib/ as it is)
if pid="$(our_broker_pid)"; then
  port_open "$KAFKA_PORT" \
    || die "broker pid $pid is alive but 127.0.0.1:$KAFKA_PORT does not answer (other KAFKA_PORT? still starting?); run stop.sh first"
  log "broker already running (pid $pid), ensuring topics"
  ensure_topics check 60 || { show_log_tail; die "could not ensure topics on the running broker (pid $pid)"; }
  finish
fi
rm -f "$PIDFILE"

for p in "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
  port_open "$p" && die "port $p on 127.0.0.1 is already in use by a process this script did not start"
done

fetch_jars

# ---------------------------------------------------------------- config + storage
sed -e "s|@KAFKA_PORT@|$KAFKA_PORT|g" \
    -e "s|@KAFKA_CONTROLLER_PORT@|$KAFKA_CONTROLLER_PORT|g" \
    -e "s|@DATA_DIR@|$DATA|g" \
    "$HERE/server.properties.template" >"$PROPS"

# Each start gets a fresh server.log (the previous run's is kept as previous-server.log), so the
# tail printed on failure shows only this run.
if [[ -f "$LOGS/server.log" ]]; then mv -f "$LOGS/server.log" "$LOGS/previous-server.log"; fi
rm -f "$LOGS"/server.log.[0-9]*
LOG_OPTS=(-Dlog4j2.configurationFile="$HERE/log4j2.properties" -Dkafka.logs.dir="$LOGS")
# format --standalone records the controller endpoint in the data dir, so kept data is only
# valid for the same ports.
PORTS_FILE="$DATA/.turnstile-ports"
fresh=1
if [[ "$KAFKA_KEEP_DATA" == 1 && -f "$DATA/meta.properties" ]]; then
  if [[ "$(cat "$PORTS_FILE" 2>/dev/null)" != "$KAFKA_PORT $KAFKA_CONTROLLER_PORT" ]]; then
    die "KAFKA_KEEP_DATA=1 but $DATA was formatted for other ports ($(cat "$PORTS_FILE" 2>/dev/null || echo unknown)); unset KAFKA_KEEP_DATA to start fresh"
  fi
  fresh=0
  log "keeping existing data in $DATA (KAFKA_KEEP_DATA=1)"
else
  rm -rf "$DATA"
  # Cluster id = 16 random bytes in unpadded base64url (what `StorageTool random-uuid` prints),
  # made here to save a JVM start. A leading '-' would be parsed as an option: draw again.
  cluster_id="-"
  while [[ "$cluster_id" == -* ]]; do
    cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
  done
  # StorageTool lives in the broker jar: the broker's CDS archive (if any) serves it too (1.1 -> 0.6 s).
  format_cds=()
  if [[ "$KAFKA_CDS" == 1 && -f "$CDS_DIR/broker-$(cds_key).jsa" ]]; then
    format_cds=(-XX:SharedArchiveFile="$CDS_DIR/broker-$(cds_key).jsa" "${CDS_LOG[@]}")
  fi
  java -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xshare:auto "${format_cds[@]}" "${LOG_OPTS[@]}" -cp "$CP" \
      kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$PROPS" \
      >"$LOGS/format.log" 2>&1 9>&- \
    || { cat "$LOGS/format.log" >&2; die "StorageTool format failed"; }
  echo "$KAFKA_PORT $KAFKA_CONTROLLER_PORT" >"$PORTS_FILE"
fi

# ---------------------------------------------------------------- broker
broker_cds=()
if [[ "$KAFKA_CDS" == 1 ]]; then
  mkdir -p "$CDS_DIR"
  jsa="$CDS_DIR/broker-$(cds_key).jsa"
  if [[ -f "$jsa" ]]; then
    broker_cds=(-XX:SharedArchiveFile="$jsa" "${CDS_LOG[@]}")
  else
    rm -f "$CDS_DIR"/broker-*.jsa.tmp
    broker_cds=(-XX:ArchiveClassesAtExit="$jsa.tmp" "${CDS_LOG[@]}")
  fi
fi
# GC flags as in Kafka's kafka-run-class.sh; small heap for a dev box / CI (KAFKA_HEAP_OPTS).
# shellcheck disable=SC2086  # KAFKA_HEAP_OPTS / KAFKA_OPTS are word lists
nohup java $KAFKA_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 \
    -Xshare:auto "${broker_cds[@]}" -Djava.awt.headless=true "${LOG_OPTS[@]}" ${KAFKA_OPTS:-} \
    -cp "$CP" kafka.Kafka "$PROPS" \
    </dev/null >"$LOGS/kafka.out" 2>&1 9>&- &
pid=$!
echo "$pid" >"$PIDFILE"
log "broker starting (pid $pid)"

fail_start() {  # print the reason + log tail, stop our half-started broker, exit 1
  show_log_tail
  echo "kafka: ERROR: $*" >&2
  # a CDS archive dumped by a broker that never finished starting would be incomplete: drop it
  KAFKA_CDS_DISCARD=1 "$HERE/stop.sh" >&2 || true
  exit 1
}

# Wait (bounded) for the PLAINTEXT port; fail fast if the JVM dies.
deadline=$(( $(date +%s) + KAFKA_START_TIMEOUT ))
until port_open "$KAFKA_PORT"; do
  kill -0 "$pid" 2>/dev/null || fail_start "broker process exited during startup"
  (( $(date +%s) < deadline )) || fail_start "broker did not open 127.0.0.1:$KAFKA_PORT within ${KAFKA_START_TIMEOUT}s"
  sleep 0.2
done

# The port can accept before the broker serves requests; the TopicCommand runs (admin client:
# metadata, then CreateTopics) wait for it, bounded by what is left of the start budget.
remaining=$(( deadline - $(date +%s) )); (( remaining >= 10 )) || remaining=10
mode=fresh; [[ $fresh == 1 ]] || mode=check
ensure_topics "$mode" "$remaining" \
  || fail_start "broker did not answer, or topic creation failed, within ${KAFKA_START_TIMEOUT}s"
finish
