#!/usr/bin/env bash
# The benchmark, side by side on this machine: brings up nats-server (JetStream)
# and redis-server on free 127.0.0.1 ports, N ankusa-node processes (fleet mode,
# release build), then runs
#   ankusa bench --compare   (bare NATS echo, Redis + Lua, fleet without and with
#                             edge batching, the batching edge against a node
#                             that does nothing, p99 at half the fleet's peak), in R
#                             rounds where the stores take turns, each round
#                             starting with the next store (each ratio the
#                             median of its rounds'), K times; every run after
#                             a 2 s warm-up of the same tenants
#   ankusa bench durable     (KV group commit vs sequential puts)
#   ankusa bench recovery    (load 100,000 claims of one shard)
#   ankusa bench memory      (with --memory: node RSS per committed claim, per
#                             idle tenant and its control, each on a fresh
#                             standalone node; adds about 6 minutes)
# and prints everything. Every process it starts is stopped on exit. The default
# run takes about 5 minutes once built.
#
#   scripts/bench.sh [--duration S] [--nodes N] [--shards S] [--runs K] [--rounds R]
#                    [--memory | --memory-only] [--memory-count N]
#                    [--memory-what 'claims tenants control parked'] [--out DIR]
#   scripts/bench.sh --scale [--duration S]   # 1, 2, 4 nodes x 16, 64, 256 shards
#   scripts/bench.sh --profile [--batching on|off] [--nodes N] [--shards S] [--duration S]
#       the fleet at peak (batched unless --batching off): CPU per hit + settle
#       of each process, the nodes' latency split, perf profiles of one node
#       and of the load generator, and their flame graphs (node-flame.svg,
#       loadgen-flame.svg; inferno, installed by scripts/ensure-inferno.sh).
#       Needs perf; about 2 minutes once built
set -euo pipefail

duration=5 nodes=2 shards=64 runs=1 rounds=3 scale=0 profile=0 batching=on memory=0 main=1 memory_what="claims tenants control parked" memory_count=1000000 out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --scale) scale=1; shift ;;
    --profile) profile=1 main=0; shift ;;
    --batching) batching=$2; shift 2 ;;
    --memory) memory=1; shift ;;
    --no-memory) memory=0; shift ;;
    --memory-only) memory=1 main=0; shift ;;
    --memory-count) memory_count=$2; shift 2 ;;
    --memory-what) memory_what=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
root=$(pwd)
nats_bin=$(scripts/ensure-nats.sh)
redis_bin=$(scripts/ensure-redis.sh)

echo "== building (release) ==" >&2
cargo build --release -q -p ankusa-node --bins
node_bin="$root/target/release/ankusa-node"
cli_bin="$root/target/release/ankusa"

work=$(mktemp -d -t ankusa-bench.XXXXXX)
out=${out:-$work/results}
mkdir -p "$out"
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    # Bounded: a process that ignores SIGTERM for 5 s is killed.
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -rf "$work/nats" "$work/redis"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1]);s.close()'
}

wait_port() { # port, what
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "bench.sh: $2 did not listen on 127.0.0.1:$1 within 10 s" >&2
  return 1
}

nats_port=$(free_port)
mkdir -p "$work/nats"
"$nats_bin" -a 127.0.0.1 -p "$nats_port" -js -sd "$work/nats" >"$work/nats.log" 2>&1 &
nats_pid=$!
pids+=($nats_pid)
wait_port "$nats_port" nats-server
nats_url="nats://127.0.0.1:$nats_port"

redis_port=$(free_port)
mkdir -p "$work/redis"
"$redis_bin" --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no \
  --dir "$work/redis" >"$work/redis.log" 2>&1 &
redis_pid=$!
pids+=($redis_pid)
wait_port "$redis_port" redis-server
redis_url="redis://127.0.0.1:$redis_port/"

# Starts `count` fleet nodes of `instance` with `nshards` shards; sets node_pids
# and node_https.
node_pids=() node_https=()
start_fleet() { # instance, count, nshards
  node_pids=() node_https=()
  local i port
  for i in $(seq "$2"); do
    port=$(free_port)
    "$node_bin" --mode fleet --nats "$nats_url" --instance "$1" --shards "$3" \
      --node-id "$1-n$i" --http-addr "127.0.0.1:$port" --log-level warn \
      >"$work/$1-n$i.log" 2>&1 &
    pids+=($!)
    node_pids+=($!)
    node_https+=("127.0.0.1:$port")
  done
  wait_fleet "$1" "$3"
}

# Every node answers /readyz and no shard is unowned, at once (60 s at most).
wait_fleet() { # instance, nshards
  local t addr ok
  for t in $(seq 600); do
    ok=1
    for addr in "${node_https[@]}"; do
      curl -fsS -o /dev/null --max-time 1 "http://$addr/readyz" 2>/dev/null || { ok=0; break; }
    done
    if [ "$ok" = 1 ] && "$cli_bin" --nats "$nats_url" --instance "$1" --shards "$2" \
        status --json 2>/dev/null | python3 -c 'import json,sys; sys.exit(0 if not json.load(sys.stdin)["unowned"] else 1)'; then
      echo "fleet $1: ${#node_https[@]} node(s) ready, $2 shards owned (after $((t / 10)) s)" >&2
      return 0
    fi
    sleep 0.1
  done
  echo "bench.sh: fleet $1 not ready within 60 s; node logs:" >&2
  tail -n 20 "$work/$1"-n*.log >&2
  return 1
}

stop_fleet() {
  local pid
  for pid in "${node_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${node_pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  node_pids=() node_https=()
}

cli() { "$cli_bin" --nats "$nats_url" "$@"; }

echo "== machine ==" 
echo "nproc: $(nproc)"; lscpu | sed -n '1,15p'; uptime
echo "nats-server: $("$nats_bin" --version)  redis-server: $("$redis_bin" --version | cut -d' ' -f1-3)"

if [ "$scale" = 1 ]; then
  echo "== scale: fleet bench, ${duration}s per run, 256 in flight =="
  printf '%-6s %-7s %12s %9s %9s %14s %9s %9s\n' nodes shards "hits/s" "p50 µs" "p99 µs" "batch hits/s" "p50 µs" "p99 µs" >"$out/scale.txt"
  for n in 1 2 4; do
    for s in 16 64 256; do
      inst="scale_n${n}_s${s}"
      start_fleet "$inst" "$n" "$s"
      cli --instance "$inst" --shards "$s" bench --duration-s "$duration" --batching off \
        --json "$out/$inst-off.json" >"$out/$inst-off.txt"
      cli --instance "$inst" --shards "$s" bench --duration-s "$duration" --batching on \
        --json "$out/$inst-on.json" >"$out/$inst-on.txt"
      stop_fleet
      python3 - "$out/$inst-off.json" "$out/$inst-on.json" "$n" "$s" >>"$out/scale.txt" <<'EOF'
import json, sys
off, on = (json.load(open(p)) for p in sys.argv[1:3])
row = lambda r: (r["hits_per_sec"], r["hit_latency"]["p50_us"], r["hit_latency"]["p99_us"])
a, b = row(off), row(on)
print(f"{sys.argv[3]:<6} {sys.argv[4]:<7} {a[0]:>12.0f} {a[1]:>9} {a[2]:>9} {b[0]:>14.0f} {b[1]:>9} {b[2]:>9}")
EOF
      tail -n 1 "$out/scale.txt"
    done
  done
  echo; cat "$out/scale.txt"
  echo "results in $out"
  exit 0
fi

if [ "$profile" = 1 ]; then
  command -v perf >/dev/null || { echo "bench.sh --profile needs perf (linux-tools) on PATH" >&2; exit 1; }
  case "$batching" in on|off) ;; *) echo "bench.sh: --batching is on or off, not $batching" >&2; exit 2 ;; esac
  # Flame graphs are a bonus: without inferno (and no way to install it) the
  # profiles are still printed.
  inferno=$(scripts/ensure-inferno.sh) || { inferno=""; echo "bench.sh: no inferno, so no flame graphs" >&2; }
  start_fleet prof "$nodes" "$shards"
  # The bench's own warm-up (the same tenants: actors spawned, tables grown,
  # routes learned), then the measured run; the processes' CPU is read over
  # the measured run alone (--cpu-of, into the JSON report).
  warmup=3
  cpu_of=(--cpu-of "nats-server=$nats_pid")
  for pid in "${node_pids[@]}"; do cpu_of+=(--cpu-of "node=$pid"); done
  # Not through cli(): $! must be the load generator itself, not a subshell.
  "$cli_bin" --nats "$nats_url" --instance prof --shards "$shards" bench --batching "$batching" \
    --warmup-s "$warmup" --duration-s "$duration" "${cpu_of[@]}" \
    --json "$out/profile-bench.json" >"$out/profile-bench.txt" &
  loadgen=$!
  sleep $((warmup + 1))
  # Both recordings at once, over the middle of the run.
  record_s=$((duration > 4 ? duration - 3 : 1))
  perf record -q -e cpu-clock -F 499 --call-graph dwarf,16384 -p "${node_pids[0]}" \
    -o "$out/node.perf" -- sleep "$record_s" >/dev/null 2>&1 &
  node_recorder=$!
  perf record -q -e cpu-clock -F 499 --call-graph dwarf,16384 -p "$loadgen" \
    -o "$out/loadgen.perf" -- sleep "$record_s" >/dev/null 2>&1 || true
  wait "$node_recorder" || true
  wait "$loadgen"
  cat "$out/profile-bench.txt"
  for addr in "${node_https[@]}"; do curl -fsS --max-time 2 "http://$addr/metrics"; done >"$out/profile-metrics.txt"
  python3 - "$out/profile-bench.json" "$out/profile-metrics.txt" "$batching" \
    <<'EOF' | tee "$out/profile-cpu.txt"
import json, sys
report = json.load(open(sys.argv[1]))
cpu = report.get("process_cpu_s", {})
nodes, nats = (cpu.get(name, float("nan")) for name in ("node", "nats-server"))
loadgen = report.get("loadgen_cpu_s") or float("nan")
pairs = report["hits"]
metrics = {}
for line in open(sys.argv[2]):
    if line.strip() and not line.startswith("#"):
        name, _, value = line.rpartition(" ")
        metrics[name] = metrics.get(name, 0.0) + float(value)
def mean_ms(name, labels=""):
    count = metrics.get(f"{name}_count{labels}", 0.0)
    return 1000 * metrics.get(f"{name}_sum{labels}", 0.0) / count if count else float("nan")
# Batched, the edge sends node batches; unbatched, lone hits.
what, op = ("a batch", "node_batch") if sys.argv[3] == "on" else ("a hit", "hit")
answered = mean_ms("ankusa_request_duration_seconds", f'{{op="{op}"}}')
ack = mean_ms("ankusa_kv_write_seconds")
changes = metrics.get("ankusa_claim_log_batch_sum", 0) / max(metrics.get("ankusa_claim_log_batch_count", 0), 1)
print(f"CPU per hit + settle: nodes {1e6 * nodes / pairs:.1f} µs, nats-server {1e6 * nats / pairs:.1f} µs, "
      f"load generator {1e6 * loadgen / pairs:.1f} µs")
print(f"nodes, over their life: {what} {answered:.2f} ms from receipt to answer; a claim-log message "
      f"{ack:.2f} ms from publish to ack, {changes:.1f} changes each")
EOF
  top() { # perf data, what
    perf report -i "$1" --no-children --sort symbol --stdio -g none 2>/dev/null >"$1.self.txt" || true
    perf report -i "$1" --children --sort symbol --stdio -g none 2>/dev/null >"$1.children.txt" || true
    echo; echo "== profile: $2, top symbols by own time =="
    grep -E '^ +[0-9]' "$1.self.txt" | sed -n '1,25p' | cut -c1-140 || true
    echo; echo "== profile: $2, ankusa functions by time with callees =="
    grep -E '^ +[0-9]' "$1.children.txt" | grep -E 'ankusa_|ConnectionHandler::process|Timeout<T>' \
      | grep -v inlined | sed -n '1,30p' | cut -c1-140 || true
  }
  top "$out/node.perf" "one node" | tee "$out/profile-node.txt"
  top "$out/loadgen.perf" "load generator" | tee "$out/profile-loadgen.txt"
  flame() { # perf data, svg, title
    perf script -i "$1" 2>/dev/null | "$inferno/inferno-collapse-perf" \
      | "$inferno/inferno-flamegraph" --minwidth 0.5 --title "$3" >"$2"
  }
  if [ -n "$inferno" ]; then
    title="$nodes nodes x $shards shards, batching $batching, at peak"
    flame "$out/node.perf" "$out/node-flame.svg" "ankusa-node: $title"
    flame "$out/loadgen.perf" "$out/loadgen-flame.svg" "load generator: $title"
    echo; echo "flame graphs: $out/node-flame.svg, $out/loadgen-flame.svg"
  fi
  stop_fleet
fi

if [ "$main" = 1 ]; then
echo "== fleet: $nodes node(s), $shards shards =="
start_fleet bench "$nodes" "$shards"
cli --instance bench --shards "$shards" status
for r in $(seq "$runs"); do
  echo; echo "== comparison, run $r of $runs ($rounds rounds, ${duration}s per store) =="
  # Each run reports the CPU of every process on the host that serves it.
  cpu_of=(--cpu-of "nats-server=$nats_pid" --cpu-of "redis-server=$redis_pid")
  for pid in "${node_pids[@]}"; do cpu_of+=(--cpu-of "node=$pid"); done
  cli --instance bench --shards "$shards" bench --compare --rounds "$rounds" --duration-s "$duration" \
    --redis-url "$redis_url" "${cpu_of[@]}" --json "$out/compare-$r.json" | tee "$out/compare-$r.txt"
done
echo; echo "== durable claims =="
cli bench durable --json "$out/durable.json" | tee "$out/durable.txt"
echo; echo "== recovery =="
cli bench recovery --json "$out/recovery.json" | tee "$out/recovery.txt"
stop_fleet
fi

if [ "$memory" = 1 ]; then
  # Fresh standalone nodes, so nothing but the measured state lives in them;
  # a short idle time so tenants retire (park) within the run.
  printf 'idle_after_ms = 2000\nsweep_every_ms = 60000\n' >"$work/memory.toml"
  for what in $memory_what; do
    case $what in claims|tenants|control) ;; *) continue ;; esac
    echo; echo "== memory: $what =="
    port=$(free_port)
    "$node_bin" --config "$work/memory.toml" --mode standalone --nats "$nats_url" \
      --instance "mem_$what" --shards 64 --node-id "mem-$what" \
      --http-addr "127.0.0.1:$port" --log-level warn >"$work/mem-$what.log" 2>&1 &
    pid=$!
    pids+=($pid)
    node_pids=($pid) node_https=("127.0.0.1:$port")
    for _ in $(seq 100); do curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$port/readyz" 2>/dev/null && break; sleep 0.1; done
    cli --instance "mem_$what" --shards 64 bench memory --pid "$pid" --http "127.0.0.1:$port" \
      --what "$what" --count "$memory_count" --settle-wait-s 150 --json "$out/memory-$what.json" | tee "$out/memory-$what.txt"
    stop_fleet
  done
  if [[ " $memory_what " == *" parked "* ]]; then
    # Idle tenants with no actor ever started: written to KV, then loaded by a
    # fleet node straight into its parked map. Compared with a node of an empty
    # instance, started the same way.
    rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
    start_mem_node() { # instance
      port=$(free_port)
      "$node_bin" --mode fleet --nats "$nats_url" --instance "$1" --shards 64 --node-id "$1" \
        --http-addr "127.0.0.1:$port" --log-level warn >"$work/$1.log" 2>&1 &
      pid=$!
      pids+=($pid)
      node_pids=($pid) node_https=("127.0.0.1:$port")
      for _ in $(seq 1200); do curl -fsS -o /dev/null --max-time 1 "http://127.0.0.1:$port/readyz" 2>/dev/null && break; sleep 0.1; done
      sleep 3
    }
    echo; echo "== memory: parked tenants loaded from KV =="
    start_mem_node mem_empty
    empty_kb=$(rss_kb "$pid")
    stop_fleet
    cli --instance mem_parked --shards 64 bench seed-parked --count "$memory_count"
    start_mem_node mem_parked
    parked=0
    for _ in $(seq 60); do
      parked=$(curl -fsS --max-time 2 "http://127.0.0.1:$port/metrics" 2>/dev/null | awk '/^ankusa_tenants_parked / {print $2}')
      [ "${parked:-0}" -ge "$memory_count" ] 2>/dev/null && break
      sleep 1
    done
    parked_kb=$(rss_kb "$pid")
    stop_fleet
    python3 -c "import sys; e,p,n=map(float,sys.argv[1:]); b=(p-e)*1024/max(n,1); print(f'memory (parked, from KV): empty-instance node {e/1024:.1f} MiB, with {n:.0f} parked tenants {p/1024:.1f} MiB: {b:.0f} bytes per idle tenant (target < 150: {\"met\" if b < 150 else \"MISSED\"})')" \
      "$empty_kb" "$parked_kb" "${parked:-0}" | tee "$out/memory-parked.txt"
  fi
fi
echo; echo "results in $out"
