//! Test support: real nats-server and ankusa-node processes on loopback.
