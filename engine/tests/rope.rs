//! Rotary scaling as GGUF files state it: the kinds read, the ones refused by name, and
//! Llama 3.1's per-frequency factors reaching the forward pass.

use candle_core::quantized::gguf_file::Value;
use duet_engine::testing::{TinyModel, logits_after_prefix, test_load_options};
use duet_engine::{Architecture, Model, RopeScaling};

const TOKENS: [u32; 12] = [5, 200, 17, 3, 99, 255, 260, 1, 42, 42, 7, 150];

/// A tiny model of `architecture` with `metadata` under its name and `rope_freqs`, loaded.
fn load(
    architecture: Architecture,
    metadata: &[(&str, Value)],
    rope_freqs: Option<Vec<f32>>,
) -> duet_engine::Result<Model> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let name = architecture.name();
    TinyModel {
        architecture,
        metadata: (metadata.iter())
            .map(|(k, v)| (format!("{name}.{k}"), v.clone()))
            .collect(),
        rope_freqs,
        ..TinyModel::default()
    }
    .write(&path)
    .unwrap();
    Model::load(&path, &test_load_options())
}

fn scaling(metadata: &[(&str, Value)]) -> RopeScaling {
    let model = load(Architecture::Qwen2, metadata, None).unwrap();
    model.config().rope_scaling
}

#[test]
fn scalings_are_read_as_llama_cpp_reads_them() {
    let text = |s: &str| Value::String(s.into());
    assert_eq!(scaling(&[]), RopeScaling::None);
    // A factor without a type is linear, llama.cpp's default; `none` ignores the factor.
    let factor = ("rope.scaling.factor", Value::F32(4.0));
    assert_eq!(
        scaling(std::slice::from_ref(&factor)),
        RopeScaling::Linear { factor: 4.0 }
    );
    let none = [("rope.scaling.type", text("none")), factor.clone()];
    assert_eq!(scaling(&none), RopeScaling::None);
    let old_key = [("rope.scale_linear", Value::F32(2.0))];
    assert_eq!(scaling(&old_key), RopeScaling::Linear { factor: 2.0 });
    let yarn = [("rope.scaling.type", text("yarn")), factor.clone()];
    let whole_context = RopeScaling::Yarn {
        factor: 4.0,
        original_context: TinyModel::default().context_length,
    };
    assert_eq!(scaling(&yarn), whole_context);
    let original = ("rope.scaling.original_context_length", Value::U32(64));
    let yarn = [yarn[0].clone(), factor, original];
    let yarn_64 = RopeScaling::Yarn {
        factor: 4.0,
        original_context: 64,
    };
    assert_eq!(scaling(&yarn), yarn_64);
    let model = load(
        Architecture::Qwen2,
        &[("rope.scaling.attn_factor", Value::F32(0.5))],
        None,
    );
    assert_eq!(model.unwrap().config().rope_attn_factor, 0.5);
}

#[test]
fn scalings_the_forward_pass_cannot_follow_are_refused_by_key() {
    let text = |s: &str| Value::String(s.into());
    let refused = |metadata: &[(&str, Value)]| {
        let error = load(Architecture::Llama, metadata, None).unwrap_err();
        error.to_string()
    };
    let longrope = refused(&[("rope.scaling.type", text("longrope"))]);
    assert!(longrope.contains("llama.rope.scaling.type"), "{longrope}");
    assert!(
        longrope.contains("`longrope` is not supported"),
        "{longrope}"
    );
    let log_multiplier = refused(&[
        ("rope.scaling.type", text("yarn")),
        ("rope.scaling.factor", Value::F32(40.0)),
        ("rope.scaling.yarn_log_multiplier", Value::F32(0.1)),
    ]);
    assert!(
        log_multiplier.contains("llama.rope.scaling.yarn_log_multiplier"),
        "{log_multiplier}"
    );
    let negative = refused(&[("rope.scaling.factor", Value::F32(-2.0))]);
    assert!(negative.contains("llama.rope.scaling.factor"), "{negative}");
    // Rotating half of each 16-wide head (some GPT-NeoX-style models do) is refused; the
    // whole head, as SmolLM2's file states it, loads.
    let partial = refused(&[("rope.dimension_count", Value::U32(8))]);
    assert!(partial.contains("llama.rope.dimension_count"), "{partial}");
    let whole = [("rope.dimension_count", Value::U32(16))];
    assert!(load(Architecture::Llama, &whole, None).is_ok());
}

/// Llama 3.1's `rope_freqs.weight` divides each frequency by its factor: factors of 1 leave
/// every logit as it was, others move them, and a tensor of the wrong length is refused.
#[test]
fn frequency_factors_reach_the_forward_pass() {
    let logits = |factors: Option<Vec<f32>>| {
        let model = load(Architecture::Llama, &[], factors).unwrap();
        logits_after_prefix(&model, &TOKENS, 4, 8)
    };
    let plain = logits(None);
    assert_eq!(logits(Some(vec![1.0; 8])), plain);
    let scaled = logits(Some((0..8).map(|i| 1.0 + i as f32).collect()));
    assert_ne!(scaled, plain);
    assert_eq!(scaled.len(), plain.len());
    let error = load(Architecture::Llama, &[], Some(vec![1.0; 4])).unwrap_err();
    assert!(error.to_string().contains("rope_freqs.weight"), "{error}");
}
