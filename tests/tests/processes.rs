//! Faults with real processes and real signals: each service runs in a process of its own
//! (this test binary started again as that service, through the same start-up as the
//! binaries: configuration layers, signal handling, drain), and the test kills, stops,
//! continues and terminates them mid-stream.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use duet_proto::v1::SpeculationMethod::{DraftModel, None as TargetOnly};
use duet_serving::startup::CommonArgs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic_health::pb::health_check_response::ServingStatus;

/// Which service a child process runs, and its `--set` overrides (KEY=VALUE, `;`-separated).
const CHILD: &str = "DUET_E2E_CHILD";
const CHILD_SET: &str = "DUET_E2E_CHILD_SET";

/// The entry point of the child processes, not a test: ignored in the test run, started
/// with `--include-ignored` in a child.
#[test]
#[ignore = "the entry point of the child processes"]
fn child_process() {
    let which = std::env::var(CHILD).expect("run only as a child process");
    let args = CommonArgs {
        config: None,
        set: std::env::var(CHILD_SET)
            .unwrap_or_default()
            .split(';')
            .map(String::from)
            .collect(),
        check_config: false,
        print_config: false,
    };
    let served = match which.as_str() {
        "coordinator" => duet_coordinator::service().main(&args, &[], duet_coordinator::run),
        "draft" => {
            use duet_worker_core::Worker;
            duet_draft_worker::Drafter::service().main(
                &args,
                &[],
                duet_worker_core::serve::<duet_draft_worker::Drafter>,
            )
        }
        "target" => {
            use duet_worker_core::Worker;
            duet_target_worker::Verifier::service().main(
                &args,
                &[],
                duet_worker_core::serve::<duet_target_worker::Verifier>,
            )
        }
        other => panic!("no service {other}"),
    };
    served.unwrap();
}

/// A service in a process of its own; killed when dropped.
struct Process {
    child: Child,
    addr: std::net::SocketAddr,
}

impl Process {
    /// Starts `which` on a free port. Between finding the port free and the child binding
    /// it another test may take it, and the child then exits at once: it is started again
    /// on another port.
    fn start(which: &str, set: &[String]) -> Self {
        Self::start_logging(which, set, ("warn", None))
    }

    /// [`Process::start`] with `RUST_LOG` = `filter`, its log lines written to `file` (else
    /// the test's own stderr).
    fn start_logging(which: &str, set: &[String], (filter, file): (&str, Option<&Path>)) -> Self {
        for _ in 0..5 {
            let addr = free_addr();
            let mut set = set.to_vec();
            set.push(format!("listen={addr}"));
            set.push("metrics_listen=".into());
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "child_process",
                    "--include-ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, which)
                .env(CHILD_SET, set.join(";"))
                .env("RUST_LOG", filter)
                .stdout(Stdio::null())
                .stderr(match file {
                    Some(file) => std::fs::File::create(file).unwrap().into(),
                    None => Stdio::inherit(),
                })
                .spawn()
                .unwrap();
            std::thread::sleep(Duration::from_millis(300));
            if child.try_wait().unwrap().is_none() {
                return Self { child, addr };
            }
        }
        panic!("{which} exited at start on five free ports");
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{signal}");
    }

    /// Waits for the process to exit by itself; its exit status.
    fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn worker(which: &str, model: &std::path::Path) -> Process {
    Process::start(
        which,
        &[format!("model={}", model.display()), "max_context=0".into()],
    )
}

fn coordinator(target: &str, draft: &str, extra: &[&str]) -> Process {
    let mut set = vec![
        format!("target.address={target}"),
        format!("draft.address={draft}"),
        "target.health_interval_ms=50".into(),
        "draft.health_interval_ms=50".into(),
        // Several coordinators run at once: none takes the HTTP API's fixed port.
        "http_listen=".into(),
    ];
    set.extend(extra.iter().map(|s| s.to_string()));
    Process::start("coordinator", &set)
}

async fn ready(processes: &[&Process]) {
    for p in processes {
        wait_serving(&p.url(), "").await;
    }
}

/// Reads the first two messages of a stream (on shared cores the first is a target-only
/// step, made before the draft session opens; the second a drafted round), does `fault`,
/// and reads the rest (the generation is held a few rounds ahead of the reader).
async fn with_fault_mid_stream(
    url: &str,
    req: pb::GenerateRequest,
    fault: impl AsyncFnOnce(),
) -> Result<Completion, tonic::Status> {
    let mut stream = open_stream(url, req).await;
    let mut out = Completion::default();
    for _ in 0..2 {
        out.add(stream.message().await.unwrap().unwrap());
    }
    fault().await;
    out.read_rest(&mut stream, |_| {}).await?;
    Ok(out)
}

/// SIGKILL on the draft-worker mid-stream: the request completes target-only with the
/// same tokens.
#[tokio::test]
async fn sigkill_on_the_draft_worker_mid_stream() {
    let m = tiny_models();
    let (mut draft, target) = (worker("draft", &m.draft), worker("target", &m.target));
    let c = coordinator(&target.url(), &draft.url(), &[]);
    ready(&[&draft, &target, &c]).await;
    wait_serving(&c.url(), "duet.v1.DraftWorker").await;
    let want = generate(&c.url(), request("the cat", 200, TargetOnly))
        .await
        .unwrap();
    let mut req = request("the cat", 200, DraftModel);
    req.num_speculative_tokens = 2;
    let got = with_fault_mid_stream(&c.url(), req, async || {
        draft.child.kill().unwrap();
        draft.child.wait().unwrap();
    })
    .await
    .unwrap();
    assert_eq!(got.token_ids, want.token_ids);
    assert!(got.usage.draft_tokens_proposed > 0);
    assert!(got.usage.fell_back_to_target_only, "{:?}", got.usage);
}

/// SIGSTOP on the draft-worker: the request in flight falls back within draft.timeout_ms,
/// the breaker opens; SIGCONT: a trial request uses it again and the breaker closes.
#[tokio::test]
async fn sigstop_then_sigcont_on_the_draft_worker() {
    let m = tiny_models();
    let (draft, target) = (worker("draft", &m.draft), worker("target", &m.target));
    let c = coordinator(
        &target.url(),
        &draft.url(),
        &["draft.timeout_ms=500", "draft.control_timeout_ms=300"],
    );
    ready(&[&draft, &target, &c]).await;
    wait_serving(&c.url(), "duet.v1.DraftWorker").await;
    let url = c.url();
    let want = generate(&url, request("the cat", 60, TargetOnly))
        .await
        .unwrap();
    let started = Instant::now();
    let got = with_fault_mid_stream(&url, request("the cat", 60, DraftModel), async || {
        draft.signal("STOP")
    })
    .await
    .unwrap();
    assert_eq!(got.token_ids, want.token_ids);
    assert!(got.usage.fell_back_to_target_only, "{:?}", got.usage);
    assert!(
        got.usage.fallback_reason.contains("500 ms"),
        "{}",
        got.usage.fallback_reason
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    wait_health(&url, "duet.v1.DraftWorker", ServingStatus::NotServing).await;
    // Stopped, it answers no health check: requests skip it.
    let skipped = generate(&url, request("the cat", 10, DraftModel))
        .await
        .unwrap();
    assert!(skipped.usage.fell_back_to_target_only);

    draft.signal("CONT");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let g = generate(&url, request("the cat", 60, DraftModel))
            .await
            .unwrap();
        assert_eq!(g.token_ids, want.token_ids);
        if !g.usage.fell_back_to_target_only {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the draft-worker never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_serving(&url, "duet.v1.DraftWorker").await;
}

/// SIGSTOP on the draft-worker while a request's draft session opens there: the open holds
/// the draft's turn (`take_turns`), and another request's target calls wait for it
/// `speculation.turn_wait_ms` at most, then go ahead beside it, instead of waiting out the
/// open's deadline.
#[tokio::test]
async fn a_stopped_draft_holds_other_streams_up_for_one_turn_wait_only() {
    let m = tiny_models();
    let (draft, target) = (worker("draft", &m.draft), worker("target", &m.target));
    let c = coordinator(
        &target.url(),
        &draft.url(),
        &[
            "speculation.turn_wait_ms=300",
            "draft.open_timeout_ms=20000",
            // The stopped worker stays in use (its health checks wait) for the test's length.
            "draft.control_timeout_ms=20000",
        ],
    );
    ready(&[&draft, &target, &c]).await;
    wait_serving(&c.url(), "duet.v1.DraftWorker").await;
    let url = c.url();
    let want = generate(&url, request("the cat", 20, TargetOnly))
        .await
        .unwrap();
    draft.signal("STOP");
    // On shared cores its draft session opens after its first token: on the stopped worker.
    let mut stalled = open_stream(&url, request("a dog", 20, DraftModel)).await;
    stalled.message().await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let got = generate(&url, request("the cat", 20, TargetOnly))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(got.token_ids, want.token_ids);
    assert!(
        (Duration::from_millis(300)..Duration::from_secs(3)).contains(&waited),
        "{waited:?}"
    );
    draft.signal("CONT");
    let mut rest = Completion::default();
    rest.read_rest(&mut stalled, |_| {}).await.unwrap();
    assert!(rest.usage.completion_tokens > 0);
}

/// SIGKILL on the target replica serving a request: the request goes on on the other
/// replica, the text identical, the failover in `usage`.
#[tokio::test]
async fn sigkill_on_one_of_two_target_replicas_mid_stream() {
    let m = tiny_models();
    let draft = worker("draft", &m.draft);
    let mut targets = [worker("target", &m.target), worker("target", &m.target)];
    let replicas = format!("{}, {}", targets[0].url(), targets[1].url());
    let c = coordinator(&replicas, &draft.url(), &[]);
    ready(&[&draft, &targets[0], &targets[1], &c]).await;
    let want = generate(&c.url(), request("the cat", 200, TargetOnly))
        .await
        .unwrap();
    let got = with_fault_mid_stream(&c.url(), request("the cat", 200, TargetOnly), async || {
        // Only the one serving: the request moves to the other at once, which would then
        // hold a session too.
        for t in &mut targets {
            if worker_sessions(&t.url()).await == 1 {
                t.child.kill().unwrap();
                t.child.wait().unwrap();
                break;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(got.token_ids, want.token_ids);
    assert_eq!(got.usage.target_failovers.len(), 1, "{:?}", got.usage);
}

/// SIGSTOP on the target replica serving a request: its Verify deadline follows the
/// replica's measured pace (`target.verify_timeout_floor_ms` here 1 s), so the request fails
/// over within seconds, not `target.timeout_ms` (60 s).
#[tokio::test]
async fn sigstop_on_one_of_two_target_replicas_fails_over_within_the_verify_floor() {
    let m = tiny_models();
    let draft = worker("draft", &m.draft);
    let targets = [worker("target", &m.target), worker("target", &m.target)];
    let replicas = format!("{}, {}", targets[0].url(), targets[1].url());
    let c = coordinator(
        &replicas,
        &draft.url(),
        &["target.verify_timeout_floor_ms=1000"],
    );
    ready(&[&draft, &targets[0], &targets[1], &c]).await;
    let want = generate(&c.url(), request("the cat", 200, TargetOnly))
        .await
        .unwrap();
    let mut stopped = None;
    let started = Instant::now();
    let got = with_fault_mid_stream(&c.url(), request("the cat", 200, TargetOnly), async || {
        for t in &targets {
            if worker_sessions(&t.url()).await == 1 {
                t.signal("STOP");
                stopped = Some(t);
                break;
            }
        }
    })
    .await
    .unwrap();
    let took = started.elapsed();
    stopped.expect("a replica held the session").signal("CONT");
    assert_eq!(got.token_ids, want.token_ids);
    assert_eq!(got.usage.target_failovers.len(), 1, "{:?}", got.usage);
    assert!(took < Duration::from_secs(15), "{took:?}");
}

/// SIGTERM on the coordinator with streams running: it stops taking new calls, the running
/// streams finish whole, then the process exits by itself.
#[tokio::test]
async fn sigterm_on_the_coordinator_lets_running_streams_finish() {
    let m = tiny_models();
    let (draft, target) = (worker("draft", &m.draft), worker("target", &m.target));
    let mut c = coordinator(&target.url(), &draft.url(), &[]);
    ready(&[&draft, &target, &c]).await;
    let url = c.url();
    let want = generate(&url, request("the cat", 200, DraftModel))
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut s = open_stream(&url, request("the cat", 200, DraftModel)).await;
        let mut out = Completion::default();
        out.add(s.message().await.unwrap().unwrap());
        streams.push((s, out));
    }
    // Watch health on a connection made before the signal: the draining server takes no
    // new connections.
    let mut health = watch_health(&url).await;
    c.signal("TERM");
    wait_not_serving(&mut health, Duration::from_secs(20)).await;
    // A call that never ends by itself would hold the drain to its deadline.
    drop(health);
    for (mut s, mut out) in streams {
        out.read_rest(&mut s, |_| {}).await.unwrap();
        assert_eq!(out.finish_reason, Some(pb::FinishReason::Length as i32));
        assert_eq!(out.token_ids, want.token_ids);
    }
    let status = c.wait(Duration::from_secs(20));
    assert!(status.success(), "{status:?}");
}

/// Each finished request's line in the coordinator's log (`duet_coordinator::requests`)
/// names its id: an HTTP call's `x-request-id`, a gRPC call's metadata.
#[tokio::test]
async fn each_finished_request_logs_its_id() {
    let m = tiny_models();
    let target = worker("target", &m.target);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("coordinator.log");
    let api = free_addr();
    let set = [
        format!("target.address={}", target.url()),
        "draft.address=http://127.0.0.1:1".into(),
        "target.health_interval_ms=50".into(),
        format!("http_listen={api}"),
    ];
    let filter = "warn,duet_coordinator::requests=info";
    let coordinator = Process::start_logging("coordinator", &set, (filter, Some(&log)));
    ready(&[&target, &coordinator]).await;
    let body = r#"{"prompt": "the cat", "max_tokens": 4, "speculation": "none"}"#;
    let headers = [("x-request-id", "gw-http-1")];
    let (status, answer) = http(api, "POST", "/v1/completions", &headers, body).await;
    assert_eq!(status, 200, "{answer}");
    let mut call = tonic::Request::new(request("the cat", 4, TargetOnly));
    call.metadata_mut()
        .insert("x-request-id", "gw-grpc-1".parse().unwrap());
    generate(&coordinator.url(), call).await.unwrap();
    let wanted = [
        "request_id=gw-http-1 method=none",
        "request_id=gw-grpc-1 method=none",
    ];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(&log).unwrap();
        let logged = |want| {
            text.lines()
                .any(|l| l.contains("request finished") && l.contains(want))
        };
        if wanted.iter().all(logged) {
            break;
        }
        assert!(Instant::now() < deadline, "{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
