use super::*;

#[derive(Clone, Default)]
struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// Telemetry with traces on (exporting nowhere) writing its log lines into `Lines`.
fn capture(format: LogFormat) -> (Telemetry, Lines) {
    let lines = Lines::default();
    let writer = lines.clone();
    let t = Telemetry::build(
        "duet-test",
        &TelemetryConfig::default(),
        true,
        format,
        "info",
        move || writer.clone(),
    )
    .unwrap();
    (t, lines)
}

/// Logs one line inside a server span whose caller sent `traceparent`.
fn log_in_a_traced_call(format: LogFormat) -> String {
    let (t, lines) = capture(format);
    tracing::dispatcher::with_default(t.dispatch(), || {
        let mut request = tonic::Request::new(());
        let traceparent = format!("00-{TRACE}-{PARENT}-01");
        request
            .metadata_mut()
            .insert("traceparent", traceparent.parse().unwrap());
        let span = server_span(&request, "duet.v1.Test", "Call");
        let _in = span.enter();
        tracing::info!(answer = 42, "inside");
        // What a client call made here would send on.
        let mut outgoing = tonic::metadata::MetadataMap::new();
        inject(&mut outgoing);
        let sent = outgoing.get("traceparent").unwrap().to_str().unwrap();
        assert!(sent.starts_with(&format!("00-{TRACE}-")), "{sent}");
        assert!(
            !sent.contains(PARENT),
            "the server span is the new parent: {sent}"
        );
    });
    let bytes = lines.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn text_lines_carry_the_callers_trace_id() {
    let line = log_in_a_traced_call(LogFormat::Text);
    assert!(
        line.contains(&format!("trace_id={TRACE} span_id=")),
        "{line}"
    );
    assert!(
        line.contains("inside") && line.contains("answer=42"),
        "{line}"
    );
}

#[test]
fn json_lines_carry_the_callers_trace_id() {
    let line = log_in_a_traced_call(LogFormat::Json);
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["trace_id"], TRACE, "{line}");
    assert_eq!(v["span_id"].as_str().unwrap().len(), 16, "{line}");
    assert_eq!(v["fields"]["message"], "inside", "{line}");
}

#[test]
fn lines_outside_a_trace_have_no_ids() {
    let (t, lines) = capture(LogFormat::Text);
    tracing::dispatcher::with_default(t.dispatch(), || tracing::info!("plain"));
    let line = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    assert!(
        line.contains("plain") && !line.contains("trace_id"),
        "{line}"
    );
}

#[test]
fn bad_settings_name_their_key() {
    let bad = |f: fn(&mut TelemetryConfig)| {
        let mut c = TelemetryConfig::default();
        f(&mut c);
        c.validate().unwrap_err().to_string()
    };
    assert!(bad(|c| c.sampling_ratio = 1.5).contains("telemetry.sampling_ratio"));
    assert!(bad(|c| c.otlp_endpoint = "collector:4317".into()).contains("otlp_endpoint"));
    assert!(bad(|c| c.max_queue_size = 0).contains("max_queue_size"));
    let ok = TelemetryConfig {
        otlp_endpoint: "http://otel-collector.observability:4317".into(),
        ..TelemetryConfig::default()
    };
    ok.validate().unwrap();
}
