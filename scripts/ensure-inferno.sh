#!/usr/bin/env bash
# Finds inferno's flame graph tools (inferno-collapse-perf, inferno-flamegraph),
# for `scripts/bench.sh --profile`, or installs them from crates.io into
# target/tools. Prints the directory holding both; progress goes to stderr.
set -euo pipefail

version=0.12.8
root="$(cd "$(dirname "$0")/.." && pwd)/target/tools"

find_tools() {
  for dir in "${INFERNO_BIN_DIR:-}" "$(dirname "$(command -v inferno-flamegraph 2>/dev/null || echo /nonexistent/x)")" \
      "$root/bin"; do
    if [ -n "$dir" ] && [ -x "$dir/inferno-flamegraph" ] && [ -x "$dir/inferno-collapse-perf" ]; then
      echo "$dir"
      return 0
    fi
  done
  return 1
}

if dir=$(find_tools); then
  echo "$dir"
  exit 0
fi

echo "ensure-inferno: installing inferno $version into $root (a minute or two)" >&2
cargo install inferno --version "$version" --locked --root "$root" >&2
if dir=$(find_tools); then
  echo "$dir"
  exit 0
fi
echo "ensure-inferno: could not find or install inferno" >&2
exit 1
