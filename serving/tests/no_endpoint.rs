//! Without an OTLP endpoint duet builds no span at all. Its own test binary: callsite
//! interest is cached process-wide, and other tests' subscribers (with traces on) would
//! make it depend on timing; a service process has one subscriber, as here.

use duet_serving::telemetry::{LogFormat, Telemetry, TelemetryConfig, client_span, inject};

#[test]
fn without_an_endpoint_spans_cost_nothing() {
    let t = Telemetry::new(
        "duet-test",
        &TelemetryConfig::default(),
        LogFormat::Text,
        "info",
    )
    .unwrap();
    t.install().unwrap();
    let span = client_span("duet.v1.Test", "Call");
    assert!(span.is_disabled(), "a span was built with traces off");
    let _in = span.enter();
    let mut outgoing = tonic::metadata::MetadataMap::new();
    inject(&mut outgoing);
    assert!(outgoing.is_empty(), "trace context was sent: {outgoing:?}");
}
