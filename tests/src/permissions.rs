//! The locked-down NATS setup of `deploy/nats/permissions.conf`, as the tests
//! run it: the deploy file itself (so the documented example and what is
//! tested cannot drift apart) with its passwords defined and test users added,
//! the node's credentials, and what the server logs when it refuses a client.

use crate::{read_repo_file, NatsServer};

/// The password of the file's `ankusa-node` user in the tests.
pub const NODE_PASSWORD: &str = "node-secret-0008";
/// The password of the file's edge user in the tests.
pub const EDGE_PASSWORD: &str = "edge-secret-0008";

/// The deploy file, with its password variables defined and `extra_users` added
/// to its user list.
pub fn permissions_conf(extra_users: &str) -> String {
    let text = read_repo_file("deploy/nats/permissions.conf");
    let users = "  users = [\n";
    assert!(text.contains(users), "the file has a user list");
    format!(
        "ANKUSA_NODE_PASSWORD: \"{NODE_PASSWORD}\"\nANKUSA_EDGE_PASSWORD: \"{EDGE_PASSWORD}\"\n{}",
        text.replacen(users, &format!("{users}{extra_users}\n"), 1)
    )
}

/// The inbox prefix the file lets the node user subscribe to.
pub const NODE_INBOX_PREFIX: &str = "_INBOX_ankusa_node";

/// The `ankusa-node` arguments that connect a node as the file's node user,
/// with the inbox prefix the file requires of it.
pub const NODE_USER_ARGS: [&str; 6] = [
    "--nats-user",
    "ankusa-node",
    "--nats-password",
    NODE_PASSWORD,
    "--nats-inbox-prefix",
    NODE_INBOX_PREFIX,
];

/// Lines of the server's log reporting a permissions violation.
pub fn violations(nats: &NatsServer) -> Vec<String> {
    std::fs::read_to_string(nats.log_path())
        .unwrap_or_default()
        .lines()
        // nats-server 2.11+: `... - "$G/user:<name>" - Publish Violation - Subject "<s>"`.
        .filter(|l| l.contains(" Violation - "))
        .map(str::to_string)
        .collect()
}
