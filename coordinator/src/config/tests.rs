use super::*;
use duet_serving::config::{Sources, load};

fn with(overrides: &[&str]) -> Result<CoordinatorConfig, ConfigError> {
    let c: CoordinatorConfig = load(
        &CoordinatorConfig::default(),
        &Sources {
            env_prefix: "DUET_COORDINATOR",
            env: Some(Default::default()),
            overrides: overrides.iter().map(|s| s.to_string()).collect(),
            ..Sources::default()
        },
    )?;
    c.validate()?;
    Ok(c)
}

#[test]
fn defaults_are_valid_and_nested_keys_override() {
    let c = with(&[
        "draft.timeout_ms=50",
        "speculation.num_speculative_tokens=6",
    ])
    .unwrap();
    assert_eq!(c.draft.timeout_ms, 50);
    assert_eq!(c.speculation.num_speculative_tokens, 6);
    assert_eq!(c.target, CoordinatorConfig::default().target);
    // Separate devices: the workers side by side.
    assert!(
        with(&[
            "speculation.take_turns=false",
            "speculation.concurrent_prefill=true",
            "speculation.overlap_drafting=true"
        ])
        .is_ok()
    );
    // A method with no draft tokens is valid where no request gets K chosen for it.
    assert!(
        with(&[
            "speculation.adaptive.choose_k=false",
            "speculation.adaptive.max_draft_model_tokens=0",
        ])
        .is_ok()
    );
    // No draft-worker is a valid set-up (target only).
    assert!(with(&["draft.address="]).is_ok());
    // Replicas: several URLs, or one name that resolves to several.
    assert!(with(&["target.address=http://10.0.0.1:50063, http://10.0.0.2:50063"]).is_ok());
    assert!(with(&["target.address=http://duet-target-worker:50063"]).is_ok());
}

#[test]
fn bad_values_name_their_key() {
    for (set, key) in [
        ("listen=nowhere", "listen"),
        ("target.address=127.0.0.1:50063", "target.address"),
        ("target.address=http://a:1,b:2", "target.address"),
        ("target.address=http://no-port", "target.address"),
        (
            "draft.discovery_interval_ms=0",
            "draft.discovery_interval_ms",
        ),
        ("draft.timeout_ms=0", "draft.timeout_ms"),
        (
            "target.min_prefill_tokens_per_s=0",
            "target.min_prefill_tokens_per_s",
        ),
        ("speculation.auto_method=fastest", "speculation.auto_method"),
        (
            "speculation.ngram.min_match=0",
            "speculation.ngram.min_match",
        ),
        (
            "speculation.adaptive.max_ngram_tokens=17",
            "speculation.adaptive.max_ngram_tokens",
        ),
        (
            "speculation.adaptive.max_draft_model_tokens=0",
            "speculation.adaptive.max_draft_model_tokens",
        ),
        (
            "speculation.adaptive.tree_alternatives=8",
            "speculation.adaptive.tree_alternatives",
        ),
        (
            "speculation.adaptive.tree_alternatives_above=1.5",
            "speculation.adaptive.tree_alternatives_above",
        ),
        (
            "speculation.num_speculative_tokens=17",
            "speculation.num_speculative_tokens",
        ),
        (
            "speculation.overlap_drafting=true",
            "speculation.overlap_drafting",
        ),
        ("max_concurrent_requests=0", "max_concurrent_requests"),
        ("runtime.busy_poll_ms=50", "runtime.async_threads"),
        (
            "speculation.proposal_cache.max_entries=0",
            "speculation.proposal_cache.max_entries",
        ),
        ("speculation.proposal_cache.sharing=tenants", "sharing"),
        ("target.address=https://127.0.0.1:1", "target.tls.ca_file"),
        ("draft.tls.domain=worker", "draft.tls"),
        ("tls.cert_file=/no/such.crt", "tls.key_file"),
        ("auth_token_file=/no/such/token", "auth_token_file"),
        ("limits.max_input_bytes=0", "limits.max_input_bytes"),
        ("routing.min_prefix_share=1.5", "routing.min_prefix_share"),
        ("draft.timeout=5", "timeout"),
    ] {
        let err = with(&[set]).unwrap_err().to_string();
        assert!(err.contains(key), "{set}: {err}");
    }
}
