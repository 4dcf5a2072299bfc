//! Hostile HTTP/2 against a real coordinator (the workers' servers share its frame,
//! `duet_serving::grpc::serve`): a stream flood, a reset flood and a flood of streams the
//! server must reset on one connection, more connections than the server holds, and a body
//! that stalls. After each the server still answers a normal Generate within 2 s. Then the same bounds on the OpenAI-compatible HTTP
//! API's server (`duet_serving::https::serve`).

use bytes::Bytes;
use duet_e2e::common::*;
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

/// One HTTP/2 frame: its 9-byte header and `payload`.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A Generate call's request headers in HPACK, every field a literal or a static-table
/// entry (no dynamic table, so each block stands alone).
fn generate_header_block(addr: std::net::SocketAddr) -> Vec<u8> {
    let literal = |out: &mut Vec<u8>, prefix: &[u8], value: &str| {
        out.extend_from_slice(prefix);
        out.push(value.len() as u8);
        out.extend_from_slice(value.as_bytes());
    };
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    literal(&mut block, &[0x04], "/duet.v1.Generation/Generate"); // :path
    literal(&mut block, &[0x01], &addr.to_string()); // :authority
    literal(&mut block, &[0x0f, 0x10], "application/grpc"); // content-type
    literal(&mut block, &[0x00], "te"); // a new name, then its value
    block.push(8);
    block.extend_from_slice(b"trailers");
    block
}

/// Reads frames until the connection ends: how many RST_STREAM frames came, and the error
/// code of the GOAWAY, if one came.
async fn read_resets(mut from: tokio::net::tcp::OwnedReadHalf) -> (usize, Option<u32>) {
    use tokio::io::AsyncReadExt;
    let (mut resets, mut goaway) = (0, None);
    let mut head = [0u8; 9];
    while from.read_exact(&mut head).await.is_ok() {
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0; len];
        if from.read_exact(&mut payload).await.is_err() {
            break;
        }
        match head[3] {
            0x3 => resets += 1,
            0x7 => goaway = Some(u32::from_be_bytes(payload[4..8].try_into().unwrap())),
            _ => {}
        }
    }
    (resets, goaway)
}

/// One connection opens 10,000 calls and makes the server reset each for a protocol error
/// of the client's (a WINDOW_UPDATE that overflows the stream's window: the "MadeYouReset"
/// flood). Past `http2.max_local_error_reset_streams` (256) the server sends GOAWAY
/// ENHANCE_YOUR_CALM and closes the connection, its memory grows by less than 100 MB, and
/// it answers others.
#[tokio::test]
async fn a_flood_of_streams_the_server_must_reset_closes_the_connection() {
    use tokio::io::AsyncWriteExt;
    let (_m, _target, coordinator) = target_only(|_| {}).await;
    wait_serving(&coordinator.url(), "").await;
    let before = rss_bytes();
    let tcp = tokio::net::TcpStream::connect(coordinator.addr)
        .await
        .unwrap();
    let (from, mut to) = tcp.into_split();
    let reader = tokio::spawn(read_resets(from));
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    to.write_all(&hello).await.unwrap();
    let block = generate_header_block(coordinator.addr);
    let overflow = 0x7fff_ffffu32.to_be_bytes();
    for stream in (1..20_000).step_by(2) {
        let mut frames = frame(0x1, 0x4, stream, &block); // HEADERS, END_HEADERS
        frames.extend(frame(0x8, 0, stream, &overflow)); // WINDOW_UPDATE
        if to.write_all(&frames).await.is_err() {
            break;
        }
    }
    let (resets, goaway) = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .expect("the connection stayed open")
        .unwrap();
    assert_eq!(goaway, Some(0xb), "ENHANCE_YOUR_CALM after {resets} resets");
    assert!(resets <= 256, "{resets} resets");
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

/// A coordinator whose `http2.*` bounds are tightened by `limits`, serving.
async fn bounded(
    limits: impl FnOnce(&mut duet_serving::grpc::Http2Limits),
) -> (TinyModels, Running, Running) {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    let mut config = coordinator_config(&target.url(), None);
    limits(&mut config.http2);
    let coordinator = start_coordinator(config);
    wait_serving(&coordinator.url(), "").await;
    (m, target, coordinator)
}

/// A Generate whose body stalls one byte short of the 1 MiB message it announces ends after
/// `http2.body_timeout_ms` (here 500 ms) with an error status, freeing its stream.
#[tokio::test]
async fn a_body_that_stalls_ends_its_call() {
    let (_m, _target, coordinator) = bounded(|l| l.body_timeout_ms = 500).await;
    let mut send = h2_client(coordinator.addr).await;
    let (answer, mut body) = send
        .send_request(generate_headers(coordinator.addr), false)
        .unwrap();
    // A gRPC message frame: uncompressed, 1 MiB long; all but its last byte comes.
    let mut frame = vec![0u8; 5 + (1 << 20) - 1];
    frame[1..5].copy_from_slice(&(1u32 << 20).to_be_bytes());
    body.send_data(Bytes::from(frame), false).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(5), async move {
        let response = answer.await.unwrap();
        let in_headers = response.headers().get("grpc-status").cloned();
        let status = match in_headers {
            Some(status) => status,
            None => {
                let mut body = response.into_body();
                let trailers = body.trailers().await.unwrap().unwrap();
                trailers["grpc-status"].clone()
            }
        };
        status.to_str().unwrap().to_string()
    })
    .await
    .expect("the stalled call did not end within 5 s");
    assert_ne!(status, "0");
    still_serves(&coordinator.url()).await;
}

/// The HTTP API's server keeps the same bounds: a client that sends its headers too slowly
/// (`http2.header_timeout_ms`) is closed (on the metrics port too), a body that stalls (`body_timeout_ms`) is answered
/// 400, a connection past `max_connections` is closed as it arrives, and the API still
/// answers.
#[tokio::test]
async fn the_http_api_bounds_slow_clients_and_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_m, _target, coordinator) = bounded(|l| {
        l.header_timeout_ms = 500;
        l.body_timeout_ms = 500;
        l.max_connections = 4;
    })
    .await;
    let addr = coordinator.http_addr;
    let connect = || async move { tokio::net::TcpStream::connect(addr).await.unwrap() };
    // What the server sends before it closes the connection, if it does within 3 s.
    let answer = |mut tcp: tokio::net::TcpStream| async move {
        let mut raw = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(3), tcp.read_to_end(&mut raw));
        read.await
            .ok()
            .map(|_| String::from_utf8_lossy(&raw).to_string())
    };

    // On the metrics port (probes, scrapes) as well.
    for port in [addr, coordinator.metrics_addr] {
        let mut slow = tokio::net::TcpStream::connect(port).await.unwrap();
        slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n")
            .await
            .unwrap();
        assert!(answer(slow).await.is_some(), "slow headers held {port}");
    }

    let mut stalled = connect().await;
    let head = "POST /v1/completions HTTP/1.1\r\nHost: duet\r\nConnection: close\r\n\
                Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"";
    stalled.write_all(head.as_bytes()).await.unwrap();
    let answered = answer(stalled)
        .await
        .expect("a stalled body held the connection");
    assert!(answered.starts_with("HTTP/1.1 400"), "{answered}");

    // The two closed connections' slots are free by now.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(connect().await);
    }
    assert_eq!(answer(connect().await).await.as_deref(), Some(""));
    drop(idle);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _) = http(addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, 200);
}
