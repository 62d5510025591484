#!/usr/bin/env bash
# Makes (once) a Python venv with what the Python edge client (clients/python/)
# and its tests need, nats-py, msgpack and setuptools from PyPI as pinned in its
# requirements.txt, and
# prints the venv's python path; progress goes to stderr. The venv lives in
# target/python-edge (git-ignored); a later run only checks it, in a fraction of
# a second, unless requirements.txt changed since it was installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
requirements="$root/clients/python/requirements.txt"
venv="$root/target/python-edge"
python="$venv/bin/python"
# A copy of the requirements a successful install was made from.
stamp="$venv/.ankusa-requirements"

ready() {
  [ -x "$python" ] && [ -f "$stamp" ] && cmp -s "$stamp" "$requirements" \
    && "$python" -c 'import nats, msgpack, setuptools' 2>/dev/null
}

if ready; then
  echo "$python"
  exit 0
fi

if ! command -v python3 >/dev/null 2>&1; then
  echo "ensure-python-edge: python3 not found; install Python >= 3.10 (Debian: apt-get install python3 python3-venv)" >&2
  exit 1
fi
# msgpack 1.2 needs Python 3.10.
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "ensure-python-edge: $(python3 --version 2>&1) is too old; the Python edge needs >= 3.10" >&2
  exit 1
fi
# A venv whose interpreter no longer runs (its base Python moved) is made anew.
if [ -e "$venv" ] && ! "$python" -c '' 2>/dev/null; then
  rm -rf "$venv"
fi
if [ ! -e "$venv" ]; then
  echo "ensure-python-edge: creating a venv in $venv" >&2
  if ! python3 -m venv "$venv" >&2; then
    rm -rf "$venv"
    echo "ensure-python-edge: 'python3 -m venv' failed; install the venv module (Debian: apt-get install python3-venv)" >&2
    exit 1
  fi
fi
echo "ensure-python-edge: installing $(grep -v '^#' "$requirements" | tr '\n' ' ')from PyPI into $venv" >&2
if ! "$python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2; then
  echo "ensure-python-edge: could not install $requirements from PyPI; is PyPI reachable (or a pip index configured)?" >&2
  exit 1
fi
cp "$requirements" "$stamp"
if ! ready; then
  echo "ensure-python-edge: $python still cannot import nats, msgpack and setuptools" >&2
  exit 1
fi
echo "$python"
