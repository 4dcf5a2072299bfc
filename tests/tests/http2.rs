//! Hostile HTTP/2 against a real coordinator (the workers' servers share its frame,
//! `duet_serving::grpc::serve`): a stream flood and a reset flood on one connection, and more
//! connections than the server holds. After each the server still answers a normal
//! Generate within 2 s.

mod common;

use bytes::Bytes;
use common::*;
use duet_proto::v1::SpeculationMethod::None as TargetOnly;
use std::time::{Duration, Instant};

/// A raw HTTP/2 client connection to `addr` (the connection is driven in the background).
async fn h2_client(addr: std::net::SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    // The server's SETTINGS (its stream limit among them) arrive and are applied.
    tokio::time::sleep(Duration::from_millis(100)).await;
    send
}

/// The headers of a Generate call (its body never comes).
fn generate_headers(addr: std::net::SocketAddr) -> http::Request<()> {
    http::Request::post(format!("http://{addr}/duet.v1.Generation/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// A normal Generate answers within 2 s.
async fn still_serves(url: &str) {
    let start = Instant::now();
    let done = tokio::time::timeout(
        Duration::from_secs(2),
        generate(url, request("the cat", 4, TargetOnly)),
    )
    .await;
    let done = done.expect("no answer within 2 s").unwrap();
    assert_eq!(
        done.usage.completion_tokens,
        4,
        "after {:?}",
        start.elapsed()
    );
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

/// The server lets one connection hold `http2.max_concurrent_streams` (256) calls: it says
/// so in its SETTINGS (a client's HTTP/2 holds the rest back; it refuses any past the limit
/// a client sends anyway), and while one connection holds 1,000 calls that never send a body
/// it answers others.
#[tokio::test]
async fn a_stream_flood_stops_at_the_streams_limit() {
    let (_m, _target, coordinator) = target_only(|_| {}).await;
    wait_serving(&coordinator.url(), "").await;
    let mut send = h2_client(coordinator.addr).await;
    assert_eq!(send.current_max_send_streams(), 256);
    let mut held = Vec::new();
    for _ in 0..1000 {
        send = send.ready().await.unwrap();
        held.push(
            send.send_request(generate_headers(coordinator.addr), false)
                .unwrap(),
        );
    }
    still_serves(&coordinator.url()).await;
}

/// One connection opens and at once resets 10,000 calls (HTTP/2 rapid reset): the server
/// closes the connection long before, its memory grows by less than 100 MB, and it answers
/// others.
#[tokio::test]
async fn a_reset_flood_closes_the_connection() {
    let (_m, _target, coordinator) = target_only(|_| {}).await;
    wait_serving(&coordinator.url(), "").await;
    let before = rss_bytes();
    let mut send = h2_client(coordinator.addr).await;
    let mut sent = 0;
    for _ in 0..10_000 {
        send = match send.ready().await {
            Ok(send) => send,
            Err(_) => break,
        };
        match send.send_request(generate_headers(coordinator.addr), false) {
            Ok((answer, mut stream)) => {
                stream.send_reset(h2::Reason::CANCEL);
                drop(answer);
                sent += 1;
            }
            Err(_) => break,
        }
        tokio::task::yield_now().await;
    }
    assert!(sent < 10_000, "the server took all 10,000 resets");
    let grown = rss_bytes().saturating_sub(before);
    assert!(grown < 100 << 20, "RSS grew by {grown} bytes");
    still_serves(&coordinator.url()).await;
}

/// With `http2.max_connections` = 4, a fifth connection is closed as it arrives, and one
/// more is let in once one of the four closes.
#[tokio::test]
async fn connections_past_the_cap_are_closed() {
    use tokio::io::AsyncReadExt;
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    config.http2.max_connections = 4;
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "").await;
    // The readiness check's own connection has closed by now, or closes soon.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(
            tokio::net::TcpStream::connect(coordinator.addr)
                .await
                .unwrap(),
        );
    }
    let closed = |mut tcp: tokio::net::TcpStream| async move {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(2), tcp.read(&mut byte)).await;
        matches!(read, Ok(Ok(0)) | Ok(Err(_)))
    };
    let fifth = tokio::net::TcpStream::connect(coordinator.addr)
        .await
        .unwrap();
    assert!(closed(fifth).await, "a fifth connection was held");
    drop(idle.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    still_serves(&coordinator.url()).await;
}
