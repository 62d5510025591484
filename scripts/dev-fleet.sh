#!/usr/bin/env bash
# A local ankusa fleet on this machine, in one command:
#
#   scripts/dev-fleet.sh            # start, send a burst, keep running until Ctrl-C
#   scripts/dev-fleet.sh --detach   # start, send a burst, leave it running
#   scripts/dev-fleet.sh status     # is it up? which node serves what?
#   scripts/dev-fleet.sh burst      # send another burst to the running fleet
#   scripts/dev-fleet.sh stop       # stop a detached fleet
#
# It finds (or installs) nats-server >= 2.11, builds ankusa-node in release, starts
# one nats-server with JetStream on 127.0.0.1 (port 4222 if free, else any free
# port) and three ankusa-node processes in fleet mode (node-1..node-3), waits until
# every node answers /readyz, then sends a burst of hits (claims, settles, replays)
# and prints what they got. Everything lives under .fleet/ in the repository
# (or DEV_FLEET_DIR):
# the JetStream store, logs and pid files. `--clean` wipes it first (state from an
# earlier run otherwise survives: claims and buckets are in JetStream).
#
# Environment: DEV_FLEET_NODES (default 3), DEV_FLEET_SHARDS (default 64),
# DEV_FLEET_INSTANCE (default `default`), DEV_FLEET_READY_S (default 60),
# DEV_FLEET_DIR (default .fleet in the repository), DEV_FLEET_PROFILE (`release`,
# the default, or `dev` for the debug build the tests use; tests/tests/dev_fleet.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
FLEET=${DEV_FLEET_DIR:-$ROOT/.fleet}
RUN="$FLEET/run"
NODES=${DEV_FLEET_NODES:-3}
SHARDS=${DEV_FLEET_SHARDS:-64}
INSTANCE=${DEV_FLEET_INSTANCE:-default}
READY_S=${DEV_FLEET_READY_S:-60}
PROFILE=${DEV_FLEET_PROFILE:-release}

say() { printf 'dev-fleet: %s\n' "$*"; }
die() { printf 'dev-fleet: %s\n' "$*" >&2; exit 1; }

case "$PROFILE" in
  release) BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release" ;;
  dev) BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug" ;;
  *) die "DEV_FLEET_PROFILE must be release or dev, not $PROFILE" ;;
esac
# Paths as printed: relative to the repository when inside it.
show() { printf '%s' "${1#"$ROOT"/}"; }
# This script as printed in hints, with the settings that find this fleet again.
SELF="scripts/dev-fleet.sh"
[ "$FLEET" != "$ROOT/.fleet" ] && SELF="DEV_FLEET_DIR=$(show "$FLEET") $SELF"
[ "$PROFILE" != release ] && SELF="DEV_FLEET_PROFILE=$PROFILE $SELF"

usage() {
  sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
}

# The pid recorded for `name`, if that process still runs the program we started.
live_pid() {
  local name=$1 prog=$2 pid
  [ -f "$RUN/$name.pid" ] || return 1
  pid=$(cat "$RUN/$name.pid")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$prog" || return 1
  echo "$pid"
}

# Port $1 if nothing on 127.0.0.1 uses it, else a free one the kernel picks.
pick_port() {
  python3 - "$1" <<'EOF'
import socket, sys
want = int(sys.argv[1])
for port in (want, 0):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        print(s.getsockname()[1])
        break
    except OSError:
        pass
    finally:
        s.close()
EOF
}

# HTTP status of a GET on 127.0.0.1 (000 when nothing answers), bounded to 2 s.
http_code() {
  curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$1$2" 2>/dev/null || true
}

fail_with_log() {
  local what=$1 log=$2
  printf 'dev-fleet: %s\n--- last 30 lines of %s ---\n' "$what" "$log" >&2
  tail -n 30 "$log" >&2 || true
  printf -- '---\n' >&2
  exit 1
}

# Stops what the pid files name: nodes first (SIGTERM: they hand their shards back
# and leave), then nats-server. Bounded: SIGKILL after 25 s, past the node's own
# bound on stopping (20 s with the default lease TTL: the round under way, one
# TTL, then the leave, three TTLs and at least 10 s).
stop_fleet() {
  local any=0 pid name waited
  for name in $(ls "$RUN" 2>/dev/null | sed -n 's/^\(node-[0-9]*\)\.pid$/\1/p'); do
    if pid=$(live_pid "$name" ankusa-node); then
      kill -TERM "$pid" 2>/dev/null || true
      any=1
    fi
  done
  for name in $(ls "$RUN" 2>/dev/null | sed -n 's/^\(node-[0-9]*\)\.pid$/\1/p'); do
    if pid=$(live_pid "$name" ankusa-node); then
      waited=0
      while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 250 ]; do
        sleep 0.1
        waited=$((waited + 1))
      done
      if kill -0 "$pid" 2>/dev/null; then
        say "$name did not exit within 25 s of SIGTERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
    rm -f "$RUN/$name.pid"
  done
  if pid=$(live_pid nats nats-server); then
    kill -TERM "$pid" 2>/dev/null || true
    any=1
    waited=0
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 150 ]; do
      sleep 0.1
      waited=$((waited + 1))
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$RUN/nats.pid" "$RUN/env"
  if [ "$any" = 1 ]; then say "fleet stopped"; else say "no fleet running"; fi
}

status_fleet() {
  [ -f "$RUN/env" ] || die "no fleet running (start one with scripts/dev-fleet.sh)"
  # shellcheck disable=SC1091
  . "$RUN/env"
  if pid=$(live_pid nats nats-server); then
    say "nats-server  pid $pid  $NATS_URL  (monitor http://127.0.0.1:$NATS_MONITOR)"
  else
    say "nats-server  NOT RUNNING (log: $FLEET/nats.log)"
  fi
  local i port body
  for i in $(seq 1 "$NODES"); do
    port=$(eval echo "\$HTTP_$i")
    if pid=$(live_pid "node-$i" ankusa-node); then
      body=$(curl -s -m 2 "http://127.0.0.1:$port/readyz" 2>/dev/null || echo "no answer")
      say "node-$i       pid $pid  http://127.0.0.1:$port  ${body%$'\n'}"
    else
      say "node-$i       NOT RUNNING (log: $FLEET/node-$i.log)"
    fi
  done
}

burst() {
  # shellcheck disable=SC1091
  . "$RUN/env"
  local cli="$BIN/ankusa"
  # The shard map, if the CLI has `status`.
  if [ -x "$cli" ] && "$cli" --help 2>/dev/null | grep -qw status; then
    "$cli" status --nats "$NATS_URL" --instance "$INSTANCE" --shards "$SHARDS" || true
    echo
  fi
  # ~1000 hits (claims), then commits, then replays: every kind of answer.
  "$BIN/examples/burst" --nats "$NATS_URL" --instance "$INSTANCE" --shards "$SHARDS" --strict
}

DETACH=0
CLEAN=0
case "${1:-}" in
  stop) stop_fleet; exit 0 ;;
  status) status_fleet; exit 0 ;;
  burst)
    [ -f "$RUN/env" ] || die "no fleet running (start one with scripts/dev-fleet.sh)"
    burst
    exit 0
    ;;
  -h | --help | help) usage; exit 0 ;;
esac
while [ $# -gt 0 ]; do
  case "$1" in
    --detach | -d) DETACH=1 ;;
    --clean) CLEAN=1 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
  shift
done

running() {
  local f
  live_pid nats nats-server >/dev/null && return 0
  for f in "$RUN"/node-*.pid; do
    [ -e "$f" ] && live_pid "$(basename "$f" .pid)" ankusa-node >/dev/null && return 0
  done
  return 1
}
if running; then
  die "a fleet is already running here ($SELF status; $SELF stop)"
fi
command -v curl >/dev/null || die "curl is needed (to probe /readyz)"
command -v python3 >/dev/null || die "python3 is needed (to find free ports and to install nats-server)"

# 1. nats-server >= 2.11
NATS_BIN=$(scripts/ensure-nats.sh) || die "no nats-server >= 2.11 (see scripts/ensure-nats.sh)"
say "using $NATS_BIN ($("$NATS_BIN" --version))"

# 2. build
say "building ankusa-node ($PROFILE) ..."
cargo build --profile "$PROFILE" --quiet -p ankusa-node --bins --example burst \
  || die "cargo build --profile $PROFILE -p ankusa-node failed (output above)"

# 3. nats-server with JetStream on loopback
[ "$CLEAN" = 1 ] && rm -rf "$FLEET"
mkdir -p "$FLEET/nats/store" "$RUN"
rm -f "$RUN"/*.pid "$RUN/env"
NATS_PORT=$(pick_port 4222)
NATS_MONITOR=$(pick_port 8222)
NATS_URL="nats://127.0.0.1:$NATS_PORT"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$DETACH" = 0 ] || [ "$rc" != 0 ]; then
    echo
    say "stopping the fleet ..."
    stop_fleet
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# setsid: Ctrl-C reaches this script only, which then stops nodes before NATS.
setsid "$NATS_BIN" -n ankusa-dev -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MONITOR" \
  -js -sd "$FLEET/nats/store" >>"$FLEET/nats.log" 2>&1 </dev/null &
echo $! >"$RUN/nats.pid"
say "nats-server on $NATS_URL (pid $!, log $(show "$FLEET")/nats.log)"
for _ in $(seq 1 150); do
  [ "$(http_code "$NATS_MONITOR" /healthz)" = 200 ] && break
  live_pid nats nats-server >/dev/null || fail_with_log "nats-server exited at start" "$FLEET/nats.log"
  sleep 0.1
done
[ "$(http_code "$NATS_MONITOR" /healthz)" = 200 ] \
  || fail_with_log "nats-server not healthy within 15 s" "$FLEET/nats.log"

# 4. the nodes
{
  echo "NATS_URL=$NATS_URL"
  echo "NATS_MONITOR=$NATS_MONITOR"
  echo "NODES=$NODES"
  echo "SHARDS=$SHARDS"
  echo "INSTANCE=$INSTANCE"
} >"$RUN/env"
# The nodes get no ANKUSA_* setting of this shell but the log filter: one meant
# for another fleet (ANKUSA_KV_REPLICAS=3, credentials) would keep them unready.
UNSET_ANKUSA=()
for name in $(compgen -e | grep '^ANKUSA_' | grep -v '^ANKUSA_LOG$'); do
  UNSET_ANKUSA+=(-u "$name")
done
for i in $(seq 1 "$NODES"); do
  port=$(pick_port $((9463 + i)))
  echo "HTTP_$i=$port" >>"$RUN/env"
  eval "HTTP_$i=$port"
  env ${UNSET_ANKUSA[@]+"${UNSET_ANKUSA[@]}"} setsid "$BIN/ankusa-node" --mode fleet --node-id "node-$i" \
    --instance "$INSTANCE" --shards "$SHARDS" --nats "$NATS_URL" \
    --http-addr "127.0.0.1:$port" >>"$FLEET/node-$i.log" 2>&1 </dev/null &
  echo $! >"$RUN/node-$i.pid"
  say "node-$i on http://127.0.0.1:$port (pid $!, log $(show "$FLEET")/node-$i.log)"
done

say "waiting (at most ${READY_S} s) until every node is ready ..."
deadline=$((SECONDS + READY_S))
while :; do
  ready=0
  for i in $(seq 1 "$NODES"); do
    live_pid "node-$i" ankusa-node >/dev/null \
      || fail_with_log "node-$i exited at start" "$FLEET/node-$i.log"
    port=$(eval echo "\$HTTP_$i")
    [ "$(http_code "$port" /readyz)" = 200 ] && ready=$((ready + 1))
  done
  [ "$ready" = "$NODES" ] && break
  if [ "$SECONDS" -ge "$deadline" ]; then
    for i in $(seq 1 "$NODES"); do
      port=$(eval echo "\$HTTP_$i")
      if [ "$(http_code "$port" /readyz)" != 200 ]; then
        fail_with_log "node-$i not ready within ${READY_S} s ($(curl -s -m 2 "http://127.0.0.1:$port/readyz" || true))" \
          "$FLEET/node-$i.log"
      fi
    done
  fi
  sleep 0.2
done
status_fleet

# 5. a burst
say "sending a burst of hits ..."
echo
burst
echo

CLI="$(show "$BIN")/ankusa --nats $NATS_URL --instance $INSTANCE --shards $SHARDS"
cat <<EOF
dev-fleet: the fleet is up.
  NATS         $NATS_URL  (instance \`$INSTANCE\`, $SHARDS shards)
  metrics      curl -s http://127.0.0.1:$HTTP_1/metrics | grep ^ankusa_
  readiness    curl -s http://127.0.0.1:$HTTP_1/readyz
  logs         $(show "$FLEET")/nats.log, $(show "$FLEET")/node-1.log ...
  again        $SELF burst
  shard map    $CLI status
  a hit        $CLI hit --tenant acme --source github --key evt-1 --hook h1
  its commit   $CLI settle --tenant acme --source github --key evt-1 --hook h1 --commit
  a duplicate  $CLI hit --tenant acme --source github --key evt-1 --hook h2
  a look       $CLI inspect --tenant acme --source github --key evt-1
  load         $CLI bench --duration-s 10
EOF
if [ "$DETACH" = 1 ]; then
  echo "  stop         $SELF stop"
  exit 0
fi
echo "  stop         Ctrl-C"
# Foreground: watch the processes until Ctrl-C (or one of them dies).
while :; do
  live_pid nats nats-server >/dev/null || fail_with_log "nats-server stopped" "$FLEET/nats.log"
  for i in $(seq 1 "$NODES"); do
    live_pid "node-$i" ankusa-node >/dev/null || fail_with_log "node-$i stopped" "$FLEET/node-$i.log"
  done
  sleep 1
done
