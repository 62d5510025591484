#!/usr/bin/env bash
# The one command that runs every check and test: format, lints, API docs, unit, property,
# integration and fault tests (against real nats-server processes the tests start).
set -euo pipefail
cd "$(dirname "$0")/.."

NATS_SERVER_BIN=$(scripts/ensure-nats.sh)
export NATS_SERVER_BIN
echo "test: using $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"
# The Redis + Lua baseline of the benchmarks has its own tests.
REDIS_SERVER_BIN=$(scripts/ensure-redis.sh)
export REDIS_SERVER_BIN
echo "test: using $REDIS_SERVER_BIN ($("$REDIS_SERVER_BIN" --version | head -1))"
# The Python edge client's tests (tests/tests/python_edge.rs) run it with this.
ANKUSA_PYTHON=$(scripts/ensure-python-edge.sh)
export ANKUSA_PYTHON
echo "test: using $ANKUSA_PYTHON ($("$ANKUSA_PYTHON" --version))"

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The API docs build without a broken link or a stray tag.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet
# The binaries the integration tests start, built up front (the tests would
# otherwise build them inside the first test that needs one, on its clock).
cargo build --locked -p ankusa-node --bins
# Benches are not run here: clippy above compiles them, and a debug run of
# theirs measures nothing and took minutes of the suite (`cargo bench`,
# scripts/bench.sh).
cargo test --workspace --locked --lib --bins --tests --examples --no-fail-fast
cargo test --workspace --locked --doc
