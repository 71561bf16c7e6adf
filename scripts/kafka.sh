#!/usr/bin/env bash
# Runs the project's single-node Apache Kafka broker (KRaft: broker and controller in one JVM) on 127.0.0.1.
#
#   scripts/kafka.sh install   copy the pinned Kafka jars from Maven Central into .kafka/libs (skipped if there)
#   scripts/kafka.sh start     format .kafka/data once, start the broker in the background, wait until it serves
#   scripts/kafka.sh stop      SIGTERM, then SIGKILL after TXS_KAFKA_STOP_TIMEOUT_S (20 s); leaves no JVM behind
#   scripts/kafka.sh status    exit 0 and print the bootstrap address if the broker is up, 1 otherwise
#   scripts/kafka.sh reset     stop and delete .kafka/data (topics, offsets); the jars stay
#   scripts/kafka.sh logs [N]  last N (default 100) lines of .kafka/logs/server.log
#
# Environment: TXS_KAFKA_PORT (39092), TXS_KAFKA_CONTROLLER_PORT (39093), TXS_KAFKA_START_TIMEOUT_S (60),
# TXS_KAFKA_STOP_TIMEOUT_S (20), TXS_KAFKA_HEAP_OPTS ("-Xms256m -Xmx512m"), TXS_KAFKA_GC_OPTS
# ("-XX:+UseSerialGC"; e.g. add "-Xlog:gc:file=.kafka/logs/gc.log" to see every collection's pause).
# The ports are not Kafka's defaults so that another Kafka on this machine does not collide with ours.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INFRA="$REPO_ROOT/infra/kafka"
POM="$INFRA/pom.xml"
HOME_DIR="$REPO_ROOT/.kafka"
LIBS="$HOME_DIR/libs"
DATA="$HOME_DIR/data"
LOGS="$HOME_DIR/logs"
PID_FILE="$HOME_DIR/kafka.pid"
CONFIG="$HOME_DIR/server.properties"
PYTHON="$REPO_ROOT/.venv/bin/python"

PORT="${TXS_KAFKA_PORT:-39092}"
CONTROLLER_PORT="${TXS_KAFKA_CONTROLLER_PORT:-39093}"
START_TIMEOUT_S="${TXS_KAFKA_START_TIMEOUT_S:-60}"
STOP_TIMEOUT_S="${TXS_KAFKA_STOP_TIMEOUT_S:-20}"
HEAP_OPTS="${TXS_KAFKA_HEAP_OPTS:--Xms256m -Xmx512m}"
GC_OPTS="${TXS_KAFKA_GC_OPTS:--XX:+UseSerialGC}"
BOOTSTRAP="127.0.0.1:$PORT"

say() { echo "kafka.sh: $*"; }
die() {
  echo "kafka.sh: error: $*" >&2
  exit 1
}

require() {
  command -v "$1" >/dev/null 2>&1 || die "'$1' is not on PATH; $2"
}

pom_property() { sed -n "s:.*<$1>\\(.*\\)</$1>.*:\\1:p" "$POM"; }
kafka_version() { pom_property kafka.version; }

# Serial GC and a small heap: the broker shares 2 cores with the tests, and a dev broker holds little data.
# shellcheck disable=SC2206  # HEAP_OPTS and GC_OPTS are lists of JVM flags, split on purpose
JVM_OPTS=($HEAP_OPTS $GC_OPTS -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
  "-Dkafka.logs.dir=$LOGS" "-Dlog4j2.configurationFile=$INFRA/log4j2.properties")

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A zombie (state Z) has exited already; its parent just has not reaped it.
alive() {
  local state
  state="$(ps -p "$1" -o stat= 2>/dev/null)" && [[ "${state// /}" != Z* ]]
}

# The broker's pid, if it is alive. The pid file is checked against the command line so that a reused pid
# is never mistaken for the broker; without a pid file, a JVM running our own config file still counts.
broker_pid() {
  local pid
  for pid in "$(cat "$PID_FILE" 2>/dev/null)" "$(pgrep -f "kafka\.Kafka $CONFIG\$" | head -n 1)"; do
    [[ -n "$pid" ]] || continue
    # -ww: otherwise ps may cut the command line to the terminal width or $COLUMNS (it did under pytest).
    if [[ "$(ps -ww -p "$pid" -o args= 2>/dev/null)" == *kafka.Kafka* ]] && alive "$pid"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

cmd_install() {
  require java "install a Java 17+ runtime"
  require mvn "install Maven 3.8+ (it resolves the Kafka jars)"
  local version stamp
  version="$(kafka_version)"
  [[ -n "$version" ]] || die "no <kafka.version> in $POM"
  # The stamp is the pom's hash, so any change to the pinned versions re-resolves the jars.
  stamp="$(sha256sum "$POM" | cut -d' ' -f1)"
  if [[ -f "$LIBS/.pom.sha256" && "$(cat "$LIBS/.pom.sha256")" == "$stamp" ]]; then
    say "Kafka $version jars already in .kafka/libs"
    return 0
  fi
  rm -rf "$LIBS"
  mkdir -p "$LIBS" "$HOME_DIR"
  local goal
  goal="org.apache.maven.plugins:maven-dependency-plugin:$(pom_property dependency.plugin.version):copy-dependencies"
  local args=(-q -B -Dstyle.color=never -f "$POM" "$goal"
    "-DoutputDirectory=$LIBS" -DincludeScope=runtime)
  local log="$HOME_DIR/mvn-install.log"
  # Offline first: with a warm ~/.m2 this needs no network at all.
  if ! mvn -o "${args[@]}" >"$log" 2>&1; then
    say "downloading Kafka $version jars from Maven Central ..."
    # Short timeouts and a single retry, so an unreachable repository fails in seconds, not minutes.
    # Maven 3.8's wagon transport ignores aether.connector.requestTimeout for reads (measured: a silent
    # server hung it for minutes); maven.wagon.rto is the read timeout it does honour.
    if ! mvn "${args[@]}" -Daether.connector.connectTimeout=10000 -Daether.connector.requestTimeout=30000 \
      -Dmaven.wagon.rto=30000 -Dmaven.wagon.http.retryHandler.count=1 >"$log" 2>&1; then
      rm -rf "$LIBS"
      sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^\[ERROR\] [^ ]' | head -n 1 >&2 || true
      if grep -q "Could not find artifact" "$log"; then
        die "the repository answered but lacks an artifact (see the Maven error above): check the versions" \
          "pinned in $POM, or the mirror in ~/.m2/settings.xml. Full output: $log"
      fi
      if grep -qiE 'could not transfer|connect|unknownhost|unreachable|timed out|no route' "$log"; then
        die "could not download Kafka $version: Maven Central is unreachable." \
          "Check network access or the mirror in ~/.m2/settings.xml. Full output: $log"
      fi
      die "Maven failed to copy the Kafka jars; full output: $log"
    fi
  fi
  echo "$stamp" >"$LIBS/.pom.sha256"
  say "installed Kafka $version ($(find "$LIBS" -name '*.jar' | wc -l) jars) into .kafka/libs"
}

write_config() {
  mkdir -p "$DATA" "$LOGS"
  sed -e "s|@PORT@|$PORT|g" -e "s|@CONTROLLER_PORT@|$CONTROLLER_PORT|g" -e "s|@DATA_DIR@|$DATA|g" \
    "$INFRA/server.properties" >"$CONFIG"
}

# KRaft refuses to start on an unformatted log dir; formatting writes meta.properties with a cluster id.
format_storage() {
  [[ -f "$DATA/meta.properties" ]] && return 0
  local cluster_id
  # A cluster id is 16 random bytes in URL-safe base64 without padding; one starting with '-' would be
  # read as an option, so draw again.
  while
    cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
    [[ "$cluster_id" == -* ]]
  do :; done
  say "formatting .kafka/data (cluster id $cluster_id)"
  java "${JVM_OPTS[@]}" -cp "$LIBS/*" kafka.tools.StorageTool format \
    --config "$CONFIG" --cluster-id "$cluster_id" >>"$LOGS/format.log" 2>&1 ||
    die "formatting .kafka/data failed; see $LOGS/format.log"
}

# Kafka is ready when a client gets metadata naming this broker; an open port alone is not enough,
# since the listener accepts connections before the broker has caught up with the metadata log.
probe_ready() {
  local seconds="$1"
  "$PYTHON" - "$BOOTSTRAP" "$seconds" <<'EOF'
import sys, time, logging
from kafka import KafkaAdminClient
logging.disable(logging.CRITICAL)  # connection refusals while starting are expected
bootstrap, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            if admin.describe_cluster()["brokers"]:
                sys.exit(0)
        finally:
            admin.close()
    except Exception:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
}

wait_ready() {
  local pid="$1" log_offset="$2" started=$SECONDS
  local deadline=$((SECONDS + START_TIMEOUT_S))
  # First wait for the broker's own "started" line (no client needed), then confirm with a real client.
  # Only the part of server.log written since this start counts; if log4j rolled the file meanwhile,
  # the new file is all ours.
  until
    (($(stat -c %s "$LOGS/server.log" 2>/dev/null || echo 0) < log_offset)) && log_offset=0
    tail -c "+$((log_offset + 1))" "$LOGS/server.log" 2>/dev/null | grep -q "Kafka Server started"
  do
    # Not broker_pid: right after the fork the child may not have exec'd java yet.
    if ! alive "$pid"; then
      {
        tail -c "+$((log_offset + 1))" "$LOGS/server.log" 2>/dev/null | tail -n 20
        tail -n 20 "$LOGS/stdout.log"
      } >&2 || true
      rm -f "$PID_FILE"
      die "the broker exited while starting; see the log lines above, $LOGS/server.log and $LOGS/stdout.log"
    fi
    if ((SECONDS >= deadline)); then
      cmd_stop >&2
      die "the broker did not start within ${START_TIMEOUT_S} s, so it was stopped; see $LOGS/server.log"
    fi
    sleep 0.5
  done
  if [[ -x "$PYTHON" ]] && ! probe_ready $((deadline - SECONDS + 1)); then
    cmd_stop >&2
    die "the broker logged that it started, but no client could reach it at $BOOTSTRAP, so it was" \
      "stopped; see $LOGS/server.log"
  fi
  say "ready in $((SECONDS - started)) s at $BOOTSTRAP (pid $pid)"
}

cmd_start() {
  local pid
  if pid="$(broker_pid)"; then
    say "already running (pid $pid) at $BOOTSTRAP"
    return 0
  fi
  rm -f "$PID_FILE"
  for port in "$PORT" "$CONTROLLER_PORT"; do
    if port_open "$port"; then
      die "127.0.0.1:$port is already in use by another process;" \
        "stop it or choose other ports with TXS_KAFKA_PORT / TXS_KAFKA_CONTROLLER_PORT"
    fi
  done
  cmd_install
  write_config
  format_storage
  local log_offset=0
  [[ -f "$LOGS/server.log" ]] && log_offset="$(stat -c %s "$LOGS/server.log")"
  say "starting Kafka $(kafka_version) on $BOOTSTRAP (controller 127.0.0.1:$CONTROLLER_PORT, data in .kafka/data)"
  nohup java "${JVM_OPTS[@]}" -cp "$LIBS/*" kafka.Kafka "$CONFIG" </dev/null >"$LOGS/stdout.log" 2>&1 &
  pid=$!
  echo "$pid" >"$PID_FILE"
  wait_ready "$pid" "$log_offset"
}

cmd_stop() {
  local pid
  if ! pid="$(broker_pid)"; then
    rm -f "$PID_FILE"
    say "not running"
    return 0
  fi
  say "stopping the broker (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + STOP_TIMEOUT_S))
  while broker_pid >/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
  if broker_pid >/dev/null; then
    say "no clean exit after ${STOP_TIMEOUT_S} s; sending SIGKILL" \
      "(the next start recovers the logs and waits ~10 s for the old broker registration to expire)"
    kill -KILL "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while broker_pid >/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    broker_pid >/dev/null && die "pid $pid survived SIGKILL; check it with: ps -p $pid -o pid,stat,args"
  fi
  rm -f "$PID_FILE"
  say "stopped"
}

cmd_status() {
  local pid
  if ! pid="$(broker_pid)"; then
    say "not running"
    return 1
  fi
  if ! port_open "$PORT"; then
    say "the broker process (pid $pid) is up but $BOOTSTRAP does not accept connections; see $LOGS/server.log"
    return 1
  fi
  say "running (pid $pid) at $BOOTSTRAP"
}

cmd_reset() {
  cmd_stop
  rm -rf "$DATA" "$CONFIG"
  say "deleted .kafka/data; the jars in .kafka/libs are kept"
}

cmd_logs() {
  [[ -f "$LOGS/server.log" ]] || die "no broker log yet ($LOGS/server.log); start the broker first"
  tail -n "${1:-100}" "$LOGS/server.log"
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  reset) cmd_reset ;;
  logs) cmd_logs "${2:-}" ;;
  *)
    echo "usage: scripts/kafka.sh install|start|stop|status|reset|logs [N]" >&2
    exit 2
    ;;
esac
