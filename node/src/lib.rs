//! ankusa-node: shard ownership, persistence, metrics; and the ankusa CLI.
