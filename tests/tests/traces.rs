//! Traces end to end: the three services export OTLP/gRPC to a receiver in this process;
//! one Generate is one trace across them, with a span per speculation round whose
//! attributes agree with the response's usage.

use duet_e2e::common::{self, *};
use duet_proto::v1 as pb;
use duet_proto::v1::SpeculationMethod::DraftModel;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An OTLP/gRPC trace receiver that keeps every span it is sent.
#[derive(Debug, Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Span>>>);

#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    kind: i32,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    status: i32,
    start: u64,
    end: u64,
    attributes: HashMap<String, Value>,
}

impl Span {
    fn int(&self, key: &str) -> Option<i64> {
        match self.attributes.get(key)? {
            Value::IntValue(v) => Some(*v),
            other => panic!("{key} on {} is not an integer: {other:?}", self.name),
        }
    }

    fn str(&self, key: &str) -> Option<&str> {
        match self.attributes.get(key)? {
            Value::StringValue(v) => Some(v),
            other => panic!("{key} on {} is not a string: {other:?}", self.name),
        }
    }
}

fn attributes(kvs: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> HashMap<String, Value> {
    kvs.iter()
        .filter_map(|kv| Some((kv.key.clone(), kv.value.clone()?.value?)))
        .collect()
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let resource = attributes(&rs.resource.unwrap_or_default().attributes);
            let service = match resource.get("service.name") {
                Some(Value::StringValue(s)) => s.clone(),
                _ => String::new(),
            };
            for s in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                spans.push(Span {
                    service: service.clone(),
                    name: s.name,
                    kind: s.kind,
                    trace_id: s.trace_id,
                    span_id: s.span_id,
                    parent: s.parent_span_id,
                    status: s.status.map_or(0, |st| st.code),
                    start: s.start_time_unix_nano,
                    end: s.end_time_unix_nano,
                    attributes: attributes(&s.attributes),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Receiver {
    async fn start() -> (Self, String) {
        let receiver = Self::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        tokio::spawn(server);
        (receiver, url)
    }

    fn trace(&self, trace_id: &[u8]) -> Vec<Span> {
        let spans = self.0.lock().unwrap();
        spans
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    }

    /// The spans of `trace_id` once its root-side `Generate` span (the last to end) is in.
    async fn wait_for(&self, stack: &Stack, trace_id: &[u8]) -> Vec<Span> {
        for _ in 0..100 {
            stack.flush_traces();
            let spans = self.trace(trace_id);
            if spans.iter().any(|s| s.name == GENERATE) {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let all = self.0.lock().unwrap();
        let names: Vec<_> = all
            .iter()
            .map(|s| (&s.service, &s.name, &s.trace_id[..2]))
            .collect();
        panic!("no Generate span for the trace arrived; have {names:?}");
    }
}

const GENERATE: &str = "duet.v1.Generation/Generate";

fn traced_request(
    trace_id: &[u8; 16],
    parent: &[u8; 8],
    req: pb::GenerateRequest,
) -> tonic::Request<pb::GenerateRequest> {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut request = tonic::Request::new(req);
    let traceparent = format!("00-{}-{}-01", hex(trace_id), hex(parent));
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    request
}

fn only<'a>(spans: &'a [Span], what: &str, keep: impl Fn(&Span) -> bool) -> &'a Span {
    let found: Vec<_> = spans.iter().filter(|s| keep(s)).collect();
    assert_eq!(found.len(), 1, "expected one {what}, found {}", found.len());
    found[0]
}

fn children<'a>(spans: &'a [Span], parent: &Span, name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| s.parent == parent.span_id && s.name == name)
        .collect()
}

/// The client span `name` under `parent` (coordinator) whose call `worker` served, the
/// worker's server span under it, and that server span's `queue` and `forward` children.
fn call<'a>(spans: &'a [Span], parent: &Span, name: &str, worker: &str) -> (&'a Span, &'a Span) {
    let served_by_worker = |client: &Span| {
        spans.iter().any(|s| {
            s.parent == client.span_id && s.kind == SpanKind::Server as i32 && s.service == worker
        })
    };
    let client = only(spans, &format!("{name} client span to {worker}"), |s| {
        s.parent == parent.span_id
            && s.name == name
            && s.kind == SpanKind::Client as i32
            && served_by_worker(s)
    });
    assert_eq!(client.service, "duet-coordinator");
    let server = only(spans, &format!("{name} server span"), |s| {
        s.parent == client.span_id && s.kind == SpanKind::Server as i32
    });
    assert_eq!(server.service, worker);
    assert_eq!(server.name, name);
    for child in ["queue", "forward"] {
        let c = children(spans, server, child);
        assert_eq!(c.len(), 1, "{name} has no {child} span");
        assert_eq!(c[0].service, worker);
        // The call lasts until its model work is done, even when the handler returned
        // first (a streamed Propose).
        assert!(
            server.start <= c[0].start && c[0].end <= server.end,
            "{name}'s {child} span lies outside it"
        );
    }
    (client, server)
}

/// A draft with the target's seed and one layer fewer: it agrees with the target often,
/// not always (the test checks that both happen).
fn tiny_pair_that_partly_agrees() -> TinyModels {
    let m = tiny_models();
    duet_engine::testing::TinyModel::default()
        .write(&m.draft)
        .unwrap();
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_per_request_across_the_three_services() {
    let (receiver, endpoint) = Receiver::start().await;
    let m = tiny_pair_that_partly_agrees();
    let stack = Stack::start_traced(&m.draft, &m.target, &endpoint);
    wait_stack(&stack).await;
    let url = stack.coordinator.url();

    // A caller's trace continues into duet.
    let (trace_id, caller) = ([0x4b; 16], [0x21; 8]);
    let mut req = request("the cat sat on", 40, DraftModel);
    req.num_speculative_tokens = 4;
    let mut traced = traced_request(&trace_id, &caller, req);
    let id = "gw-1c9e".parse().unwrap();
    traced.metadata_mut().insert("x-request-id", id);
    let out = generate(&url, traced).await.unwrap();
    let usage = &out.usage;
    assert_eq!(out.finish_reason, Some(pb::FinishReason::Length as i32));
    assert!(usage.draft_tokens_accepted > 0, "{usage:?}");
    assert!(
        usage.draft_tokens_accepted < usage.draft_tokens_proposed,
        "the test needs a rejection: {usage:?}"
    );
    let spans = receiver.wait_for(&stack, &trace_id).await;
    for service in [
        "duet-coordinator",
        "duet-draft-worker",
        "duet-target-worker",
    ] {
        assert!(
            spans.iter().any(|s| s.service == service),
            "no span from {service} in the caller's trace"
        );
    }

    // Generate: a server span under the caller's, carrying the request's outcome.
    let generate = only(&spans, "Generate span", |s| s.name == GENERATE);
    assert_eq!(generate.service, "duet-coordinator");
    assert_eq!(generate.parent, caller);
    let request_id = generate.str("rpc.grpc.request.metadata.x-request-id");
    assert_eq!(request_id, Some("gw-1c9e"));
    assert_eq!(generate.kind, SpanKind::Server as i32);
    assert_eq!(
        generate.int("duet.prompt_tokens"),
        Some(usage.prompt_tokens as i64)
    );
    assert_eq!(
        generate.int("duet.completion_tokens"),
        Some(usage.completion_tokens as i64)
    );
    assert_eq!(generate.int("duet.rounds"), Some(usage.rounds as i64));
    assert_eq!(generate.str("duet.finish_reason"), Some("length"));
    assert_eq!(generate.str("duet.method"), Some("draft_model"));
    match generate.attributes.get("duet.acceptance_rate") {
        Some(Value::DoubleValue(r)) => {
            let want = usage.draft_tokens_accepted as f64 / usage.draft_tokens_proposed as f64;
            assert!((r - want).abs() < 1e-9, "{r} vs {want}");
        }
        other => panic!("acceptance rate: {other:?}"),
    }

    // Prefill: the target's session opened under it, answered by its worker; on shared
    // cores the draft's opens in the round after the first token, under that round.
    let prefill = only(&spans, "prefill span", |s| {
        s.name == "prefill" && s.parent == generate.span_id
    });
    call(
        &spans,
        prefill,
        "duet.v1.Worker/OpenSession",
        "duet-target-worker",
    );

    // One span per round, in order, whose attributes add up to the usage.
    let mut rounds = children(&spans, generate, "speculate.round");
    rounds.sort_by_key(|r| r.int("duet.round"));
    assert_eq!(rounds.len(), usage.rounds as usize);
    call(
        &spans,
        rounds[1],
        "duet.v1.Worker/OpenSession",
        "duet-draft-worker",
    );
    let (mut proposed, mut accepted, mut committed) = (0, 0, 0);
    let mut rejections = 0;
    let mut previous: Option<&Span> = None;
    for (i, round) in rounds.iter().enumerate() {
        assert_eq!(round.int("duet.round"), Some(i as i64));
        let k = round.int("duet.k").unwrap();
        let a = round.int("duet.accepted").unwrap();
        proposed += k;
        accepted += a;
        committed += round.int("duet.committed").unwrap();
        let (_, verify) = call(
            &spans,
            round,
            "duet.v1.TargetWorker/Verify",
            "duet-target-worker",
        );
        assert_eq!(verify.int("duet.draft_tokens"), Some(k));
        if k > 0 {
            let (_, propose) = call(
                &spans,
                round,
                "duet.v1.DraftWorker/Propose",
                "duet-draft-worker",
            );
            assert_eq!(propose.int("duet.k"), Some(k));
        }
        let rollback = children(&spans, round, "rollback");
        if a < k {
            rejections += 1;
            assert_eq!(round.int("duet.first_rejected_position"), Some(a));
            assert_eq!(
                rollback.len(),
                1,
                "round {i} rejected a token but has no rollback"
            );
            assert_eq!(
                rollback[0].int("duet.target.rollback_tokens"),
                Some(k - a),
                "round {i}"
            );
        } else {
            assert!(
                rollback.is_empty(),
                "round {i} accepted all yet rolled back"
            );
        }
        // The rollback happens at the start of the next call: the target-worker drops
        // exactly what the previous round said it would.
        let expected = previous
            .and_then(|p| p.int("duet.target.rollback_tokens"))
            .unwrap_or(0);
        assert_eq!(
            verify.int("duet.rewound_tokens"),
            Some(expected),
            "round {i}"
        );
        previous = Some(round);
    }
    assert_eq!(proposed, usage.draft_tokens_proposed as i64);
    assert_eq!(accepted, usage.draft_tokens_accepted as i64);
    assert_eq!(committed, usage.completion_tokens as i64);
    assert!(rejections > 0);

    // Nothing was dropped, and the exporters count what they sent.
    for service in [&stack.coordinator, &stack.draft, &stack.target] {
        let metrics = scrape(service).await;
        let prefix = if std::ptr::eq(service, &stack.coordinator) {
            "duet"
        } else {
            "duet_worker"
        };
        assert!(sample(&metrics, &format!("{prefix}_otel_spans_exported_total")) > 0.0);
        assert_eq!(
            sample(&metrics, &format!("{prefix}_otel_spans_dropped_total")),
            0.0
        );
    }

    // A refused request is a failed span in the caller's trace.
    let (bad_trace, bad_caller) = ([0x5c; 16], [0x31; 8]);
    let mut bad = request("x", 10, DraftModel);
    bad.temperature = -1.0;
    let status = common::generate(&url, traced_request(&bad_trace, &bad_caller, bad))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let spans = receiver.wait_for(&stack, &bad_trace).await;
    let refused = only(&spans, "refused Generate span", |s| s.name == GENERATE);
    assert_eq!(refused.parent, bad_caller);
    assert_eq!(refused.status, StatusCode::Error as i32);

    // A structured output names its kind on the Generate span (the first request had none).
    assert_eq!(generate.str("duet.structured_output"), None);
    let (shaped_trace, shaped_caller) = ([0x6d; 16], [0x41; 8]);
    let shaped = pb::GenerateRequest {
        structured_output: Some(pb::StructuredOutput {
            format: Some(pb::structured_output::Format::Regex("[a-z]{3}".into())),
        }),
        ..request("the cat", 10, DraftModel)
    };
    common::generate(&url, traced_request(&shaped_trace, &shaped_caller, shaped))
        .await
        .unwrap();
    let spans = receiver.wait_for(&stack, &shaped_trace).await;
    let shaped = only(&spans, "structured Generate span", |s| s.name == GENERATE);
    assert_eq!(shaped.str("duet.structured_output"), Some("regex"));
}

/// Drafting ahead in a trace: each round that drafted ahead holds a `draft.ahead` span whose
/// Propose client span starts once the round's Verify client span has (the draft drafts
/// while the target verifies), and inside its time window in most rounds. Not in all: the
/// tiny model's Verify takes under a millisecond, and on a loaded machine (CI runs the
/// suite's tests side by side on two cores) the task can be put off that long between
/// sending the Verify and the call made ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafting_ahead_runs_inside_the_verify_window() {
    let (receiver, endpoint) = Receiver::start().await;
    let m = tiny_models();
    let traces = duet_serving::telemetry::TelemetryConfig {
        otlp_endpoint: endpoint,
        export_interval_ms: 100,
        ..Default::default()
    };
    // The target as its own draft: every guess holds, so most rounds draft ahead.
    let mut draft = worker_config(&m.target);
    draft.telemetry = traces.clone();
    let mut target = worker_config(&m.target);
    target.telemetry = traces.clone();
    let (draft, target) = (start_draft(draft), start_target(target));
    let mut config = coordinator_config(&target.url(), Some(&draft.url()));
    config.telemetry = traces;
    config.speculation.overlap_drafting = true;
    config.speculation.take_turns = false;
    let stack = Stack {
        coordinator: start_coordinator(config),
        draft,
        target,
    };
    wait_stack(&stack).await;

    let trace_id = [0x6d; 16];
    let mut req = request("the cat", 30, DraftModel);
    req.num_speculative_tokens = 4;
    let out = generate(
        &stack.coordinator.url(),
        traced_request(&trace_id, &[0x41; 8], req),
    )
    .await
    .unwrap();
    assert!(out.usage.drafted_ahead_used > 0, "{:?}", out.usage);
    let spans = receiver.wait_for(&stack, &trace_id).await;
    let generate = only(&spans, "Generate span", |s| s.name == GENERATE);
    let client = |parent: &Span, name: &str| {
        only(&spans, &format!("{name} client span"), |s| {
            s.parent == parent.span_id && s.name == name && s.kind == SpanKind::Client as i32
        })
        .clone()
    };
    let (mut beside, mut inside) = (0, 0);
    for round in children(&spans, generate, "speculate.round") {
        let ahead = children(&spans, round, "draft.ahead");
        if ahead.is_empty() {
            continue;
        }
        assert_eq!(ahead.len(), 1);
        let verify = client(round, "duet.v1.TargetWorker/Verify");
        let propose = client(ahead[0], "duet.v1.DraftWorker/Propose");
        assert!(
            verify.start <= propose.start,
            "the Propose made ahead ({}..{}) starts before the Verify ({}..{})",
            propose.start,
            propose.end,
            verify.start,
            verify.end
        );
        beside += 1;
        inside += u32::from(propose.start < verify.end);
    }
    assert_eq!(beside, out.usage.drafted_ahead);
    assert!(
        2 * inside > beside,
        "{inside} of {beside} calls made ahead start inside their round's Verify"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_does_not_affect_serving() {
    // A port nothing listens on.
    let endpoint = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let m = tiny_models();
    let stack = Stack::start_traced(&m.draft, &m.target, &endpoint);
    wait_stack(&stack).await;
    let out = generate(&stack.coordinator.url(), request("the cat", 30, DraftModel))
        .await
        .unwrap();
    assert_eq!(out.finish_reason, Some(pb::FinishReason::Length as i32));
    assert!(out.usage.draft_tokens_proposed > 0);
    // The spans were tried, failed, and counted; none of it reached the caller.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        stack.flush_traces();
        let failed = sample(
            &scrape(&stack.coordinator).await,
            "duet_otel_spans_failed_total",
        );
        if failed > 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no export failure counted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A request to the OpenAI-compatible HTTP API is one trace too: its server span
/// (`POST /v1/completions`) continues the caller's `traceparent`, carries the request's
/// outcome and its `x-request-id` (which the answer carries back), and holds the rounds,
/// whose worker calls reach both workers.
#[tokio::test]
async fn an_http_request_is_one_trace_from_its_traceparent() {
    let (receiver, endpoint) = Receiver::start().await;
    let m = tiny_pair_that_partly_agrees();
    let stack = Stack::start_traced(&m.draft, &m.target, &endpoint);
    wait_stack(&stack).await;
    let (trace_id, caller) = ([0x5c; 16], [0x31; 8]);
    let traceparent = format!("00-{}-{}-01", "5c".repeat(16), "31".repeat(8));
    let body = r#"{"prompt": "the cat sat on", "max_tokens": 12, "speculation": "draft_model"}"#;
    let headers = [
        ("traceparent", traceparent.as_str()),
        ("x-request-id", "gw-7f3a"),
    ];
    let (status, head, answer) = http_exchange(
        stack.coordinator.http_addr,
        "POST",
        "/v1/completions",
        &headers,
        body,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(header_of(&head, "x-request-id"), Some("gw-7f3a"));
    let name = "POST /v1/completions";
    let mut spans = Vec::new();
    for _ in 0..100 {
        stack.flush_traces();
        spans = receiver.trace(&trace_id);
        if spans.iter().any(|s| s.name == name) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let server = only(&spans, "HTTP server span", |s| s.name == name);
    assert_eq!(server.service, "duet-coordinator");
    assert_eq!(server.parent, caller);
    assert_eq!(server.kind, SpanKind::Server as i32);
    assert_eq!(server.int("duet.completion_tokens"), Some(12));
    assert_eq!(server.str("duet.method"), Some("draft_model"));
    let request_id = server.str("http.request.header.x-request-id");
    assert_eq!(request_id, Some("gw-7f3a"));
    assert!(!children(&spans, server, "speculate.round").is_empty());
    for service in ["duet-draft-worker", "duet-target-worker"] {
        assert!(
            spans.iter().any(|s| s.service == service),
            "no span from {service} in the caller's trace"
        );
    }
}
