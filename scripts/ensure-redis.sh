#!/usr/bin/env bash
# Finds a redis-server (for the Redis + Lua baseline of `ankusa bench` and its test)
# or installs Debian's package. Prints the binary's path; progress goes to stderr.
set -euo pipefail

find_server() {
  for candidate in "${REDIS_SERVER_BIN:-}" "$(command -v redis-server 2>/dev/null || true)" \
      /usr/bin/redis-server /usr/local/bin/redis-server; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if path=$(find_server); then
  echo "$path"
  exit 0
fi

echo "ensure-redis: no redis-server found; installing Debian's redis-server" >&2
export DEBIAN_FRONTEND=noninteractive
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo -n)
fi
# The package lists may be missing or stale on a fresh machine: update first.
"${sudo_cmd[@]}" apt-get update -qq >&2 || echo "ensure-redis: apt-get update failed; trying the install anyway" >&2
# The package's own service is not needed (tests start their own servers on free
# loopback ports); where no init system runs, its start is refused and that is fine.
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends redis-server >&2
hash -r
if path=$(find_server); then
  echo "$path"
  exit 0
fi
echo "ensure-redis: could not find or install redis-server" >&2
exit 1
