//! Tests of the test harness itself: real nats-server processes start, serve
//! request-reply and JetStream KV, survive restart with their store, freeze under
//! pause, form a 3-node JetStream cluster that tolerates losing a member, and
//! [`ChildProcess`] signals, logs and cleans up.

use std::time::{Duration, Instant};

use ankusa_tests::{wait_until, ChildProcess, NatsCluster, NatsServer};
use async_nats::jetstream::{self, kv};
use futures::StreamExt;

/// Answers every request on `subject` with `pong:<payload>` until the client drops.
async fn spawn_echo(client: async_nats::Client, subject: &str) {
    let mut sub = client
        .subscribe(subject.to_string())
        .await
        .expect("subscribe");
    ankusa_bus::server_caught_up(&client)
        .await
        .expect("the server has the subscription");
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            if let Some(reply) = msg.reply {
                let mut body = b"pong:".to_vec();
                body.extend_from_slice(&msg.payload);
                let _ = client.publish(reply, body.into()).await;
            }
        }
    });
}

async fn request(client: &async_nats::Client, subject: &str, timeout: Duration) -> Option<String> {
    match tokio::time::timeout(timeout, client.request(subject.to_string(), "ping".into())).await {
        Ok(Ok(msg)) => Some(String::from_utf8_lossy(&msg.payload).into_owned()),
        _ => None,
    }
}

#[tokio::test]
async fn server_starts_and_serves_request_reply() {
    let mut server = NatsServer::start().await.expect("start nats-server");
    assert!(server.url().starts_with("nats://127.0.0.1:"));
    assert!(server.pid().is_some());
    assert!(server.store_dir().is_dir());

    let responder = server.connect().await.expect("connect responder");
    spawn_echo(responder, "svc.echo").await;
    let client = server.connect().await.expect("connect client");
    let answer = request(&client, "svc.echo", Duration::from_secs(2)).await;
    assert_eq!(answer.as_deref(), Some("pong:ping"));

    // The monitor is on loopback too, and JetStream is enabled.
    let (status, body) = server.monitor_get("/jsz").await.expect("jsz");
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains("\"disabled\":true"), "{body}");
    server.stop().await.expect("stop");
    assert!(server.pid().is_none());
}

#[tokio::test]
async fn restart_keeps_port_store_and_kv_value() {
    let mut server = NatsServer::start().await.expect("start nats-server");
    let (port, store) = (server.port(), server.store_dir().to_path_buf());
    {
        let js = jetstream::new(server.connect().await.unwrap());
        let kv = js
            .create_key_value(kv::Config {
                bucket: "restart".into(),
                ..Default::default()
            })
            .await
            .expect("create bucket");
        kv.put("k", "v1".into()).await.expect("put");
    }
    let old_pid = server.pid();
    server.restart().await.expect("restart");
    assert_ne!(server.pid(), old_pid, "a new process");
    assert_eq!(server.port(), port);
    assert_eq!(server.store_dir(), store);

    let js = jetstream::new(server.connect().await.unwrap());
    let kv = js.get_key_value("restart").await.expect("bucket survives");
    let value = kv.get("k").await.expect("get");
    assert_eq!(value.as_deref(), Some(&b"v1"[..]));

    // A SIGKILLed server comes back with its store too.
    server.kill().await.expect("kill");
    assert!(!server.is_running());
    server.start_again().await.expect("start after kill");
    let js = jetstream::new(server.connect().await.unwrap());
    let kv = js
        .get_key_value("restart")
        .await
        .expect("bucket after kill");
    assert_eq!(kv.get("k").await.unwrap().as_deref(), Some(&b"v1"[..]));
}

#[tokio::test]
async fn pause_times_out_requests_and_resume_recovers() {
    let mut server = NatsServer::start().await.expect("start nats-server");
    spawn_echo(server.connect().await.unwrap(), "svc.p").await;
    let client = server.connect().await.unwrap();
    assert!(request(&client, "svc.p", Duration::from_secs(2))
        .await
        .is_some());

    server.pause().expect("pause");
    let started = Instant::now();
    let answer = request(&client, "svc.p", Duration::from_millis(500)).await;
    assert!(answer.is_none(), "a frozen server cannot route a reply");
    assert!(started.elapsed() < Duration::from_secs(2));

    server.resume().expect("resume");
    // Bounded: the buffered connection drains as soon as the server runs again.
    let mut ok = false;
    for _ in 0..20 {
        if request(&client, "svc.p", Duration::from_millis(500))
            .await
            .is_some()
        {
            ok = true;
            break;
        }
    }
    assert!(ok, "requests work again after resume");
}

#[tokio::test]
async fn drop_kills_a_paused_server() {
    let mut server = NatsServer::start().await.expect("start nats-server");
    let pid = server.pid().unwrap();
    server.pause().unwrap();
    drop(server);
    assert!(!process_alive(pid), "pid {pid} survived drop");
}

#[tokio::test]
async fn cluster_of_three_replicates_kv_and_survives_a_kill() {
    let mut cluster = NatsCluster::start(3).await.expect("start 3-node cluster");
    assert_eq!(cluster.urls().len(), 3);
    let leader = cluster.meta_leader().await.expect("meta leader");
    assert!(
        cluster.index_of(&leader).is_some(),
        "leader {leader} is a member"
    );

    let client = cluster.connect().await.expect("connect");
    let js = jetstream::new(client);
    let kv = js
        .create_key_value(kv::Config {
            bucket: "replicated".into(),
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .expect("create R3 bucket");
    assert_eq!(kv.status().await.unwrap().info.config.num_replicas, 3);
    // A new replicated stream takes writes once its replicas have elected a
    // leader, a moment after it is created; until then a publish finds no
    // responder (`StreamNotFound` here).
    wait_until(Duration::from_secs(10), || async {
        kv.put("a", "1".into()).await.is_ok()
    })
    .await
    .expect("put on healthy cluster");

    // Kill the member the client is connected to (the worst case for it).
    let connected = js.client().server_info().port;
    let victim = (0..3)
        .find(|&i| cluster.member(i).port() == connected)
        .unwrap_or(0);
    cluster.kill(victim).await.expect("kill member");

    // Writes go on with 2 of 3 (quorum); allow time to reconnect and re-elect.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last_err = None;
    let mut wrote = false;
    while Instant::now() < deadline {
        match kv.put("b", "2".into()).await {
            Ok(_) => {
                wrote = true;
                break;
            }
            Err(e) => last_err = Some(e.to_string()),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(wrote, "KV write after killing one member: {last_err:?}");
    assert_eq!(kv.get("a").await.unwrap().as_deref(), Some(&b"1"[..]));

    cluster
        .restart(victim)
        .await
        .expect("restart killed member");
    cluster
        .wait_ready(Duration::from_secs(15))
        .await
        .expect("cluster healthy again");
    assert_eq!(kv.get("b").await.unwrap().as_deref(), Some(&b"2"[..]));
}

#[tokio::test]
async fn child_process_signals_logs_and_exit() {
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "echo started; echo to-stderr >&2; exec sleep 30"]);
    let mut child = ChildProcess::spawn("sleeper", cmd).expect("spawn");
    child
        .wait_for_log("to-stderr", Duration::from_secs(5))
        .await
        .expect("stderr in log");
    assert!(child.read_log().contains("started"));
    child.pause().expect("SIGSTOP");
    child.resume().expect("SIGCONT");
    assert!(child.is_running());
    let status = child.stop(Duration::from_secs(5)).await.expect("SIGTERM");
    assert!(!status.success());
    assert!(
        child.pause().is_err(),
        "signalling an exited process is an error"
    );

    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "echo bye; exit 3"]);
    let mut child = ChildProcess::spawn("exiter", cmd).expect("spawn");
    let status = child
        .wait_timeout(Duration::from_secs(5))
        .await
        .expect("exit");
    assert_eq!(status.code(), Some(3));
    assert_eq!(child.log_tail(1), "bye");

    let mut cmd = std::process::Command::new("sleep");
    cmd.arg("30");
    let child = ChildProcess::spawn("dropped", cmd).expect("spawn");
    let pid = child.pid();
    drop(child);
    assert!(!process_alive(pid), "pid {pid} survived drop");
}

fn process_alive(pid: u32) -> bool {
    // Drop reaps the child, so `kill -0` fails once it is gone.
    std::process::Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn cargo_bin_locates_and_builds_workspace_binaries() {
    // Runs `cargo build -p ankusa-node --bin ankusa` (a no-op when fresh).
    let path = ankusa_tests::cargo_bin("ankusa");
    assert!(path.is_file(), "{}", path.display());
    assert!(path.ends_with("ankusa"));
    // Second call is served by the once-per-process guard.
    let started = Instant::now();
    assert_eq!(ankusa_tests::cargo_bin("ankusa"), path);
    assert!(started.elapsed() < Duration::from_secs(1));
}
