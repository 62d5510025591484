#!/usr/bin/env bash
# Starts the 3-server JetStream cluster of deploy/nats/cluster/n{1,2,3}.conf on
# loopback, for trying a replicated fleet out on one machine:
#
#   deploy/nats/cluster/start-local.sh          # start, wait until healthy
#   deploy/nats/cluster/start-local.sh status   # which servers answer
#   deploy/nats/cluster/start-local.sh stop     # stop them (store kept)
#   deploy/nats/cluster/start-local.sh clean    # stop and delete the store
#
# Clients on nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224;
# monitoring on http://127.0.0.1:8222..8224. Stores, logs and pid files live in
# .fleet/cluster/ of the repository.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
DIR="$ROOT/.fleet/cluster"
SERVERS="n1 n2 n3"

say() { printf 'nats-cluster: %s\n' "$*"; }
die() { printf 'nats-cluster: %s\n' "$*" >&2; exit 1; }

monitor_port() { sed -n 's/^http: 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$HERE/$1.conf"; }
client_port() { sed -n 's/^listen: 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$HERE/$1.conf"; }

live_pid() {
  local pid
  [ -f "$DIR/$1.pid" ] || return 1
  pid=$(cat "$DIR/$1.pid")
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q nats-server || return 1
  echo "$pid"
}

healthy() {
  [ "$(curl -s -o /dev/null -m 2 -w '%{http_code}' "http://127.0.0.1:$(monitor_port "$1")/healthz" 2>/dev/null)" = 200 ]
}

stop() {
  local s pid waited
  for s in $SERVERS; do
    if pid=$(live_pid "$s"); then
      kill -TERM "$pid" 2>/dev/null || true
      waited=0
      while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 100 ]; do
        sleep 0.1
        waited=$((waited + 1))
      done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
      say "$s stopped"
    fi
    rm -f "$DIR/$s.pid"
  done
}

status() {
  local s pid
  for s in $SERVERS; do
    if pid=$(live_pid "$s"); then
      if healthy "$s"; then h=healthy; else h="not healthy"; fi
      say "$s pid $pid nats://127.0.0.1:$(client_port "$s") ($h)"
    else
      say "$s not running"
    fi
  done
}

case "${1:-start}" in
  stop) stop; exit 0 ;;
  clean) stop; rm -rf "$DIR"; say "removed $DIR"; exit 0 ;;
  status) status; exit 0 ;;
  start) ;;
  *) die "usage: $0 [start|status|stop|clean]" ;;
esac

NATS_BIN=$("$ROOT/scripts/ensure-nats.sh") || die "no nats-server >= 2.11 (scripts/ensure-nats.sh)"
command -v curl >/dev/null || die "curl is needed"
mkdir -p "$DIR"
for s in $SERVERS; do
  live_pid "$s" >/dev/null && die "$s already runs (deploy/nats/cluster/start-local.sh stop)"
  "$NATS_BIN" -t -c "$HERE/$s.conf" >/dev/null 2>&1 || die "$HERE/$s.conf does not parse: $("$NATS_BIN" -t -c "$HERE/$s.conf" 2>&1 | tail -1)"
done
for s in $SERVERS; do
  # Its store_dir is relative: run it from $DIR. setsid: Ctrl-C in this shell
  # does not reach the servers.
  (cd "$DIR" && exec setsid "$NATS_BIN" -c "$HERE/$s.conf" >>"$DIR/$s.log" 2>&1 </dev/null) &
  echo $! >"$DIR/$s.pid"
done
# Healthy = JetStream has a meta leader and has recovered its streams; no member
# is until a majority is up, so all start before any is waited for.
deadline=$((SECONDS + 30))
for s in $SERVERS; do
  until healthy "$s"; do
    if ! live_pid "$s" >/dev/null; then
      tail -n 20 "$DIR/$s.log" >&2
      stop
      die "$s exited at start (log above, $DIR/$s.log)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 20 "$DIR/$s.log" >&2
      stop
      die "$s not healthy within 30 s (log above, $DIR/$s.log)"
    fi
    sleep 0.2
  done
done
status
cat <<EOF
nats-cluster: up. Run nodes against it with replicated KV, e.g.
  target/release/ankusa-node --node-id node-1 --http-addr 127.0.0.1:9464 \\
    --nats nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224 --kv-replicas 3
nats-cluster: stop with deploy/nats/cluster/start-local.sh stop
EOF
