//! LoRA adapters on tiny random-weight models: an adapted session computes what the model
//! with the merged weights computes, keeps batch invariance, and refuses what it cannot run.

use candle_core::quantized::gguf_file;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use duet_engine::testing::{TinyAdapter, TinyModel, chunked_logits};
use duet_engine::{
    Adapter, Architecture, EngineError, KvCache, LoadOptions, LogitsFor, Model, SequenceInput,
};
use std::path::Path;
use std::sync::Arc;

const TOKENS: [u32; 13] = [5, 200, 17, 3, 99, 255, 260, 1, 42, 42, 7, 150, 268];

fn load(path: &Path) -> Model {
    Model::load(path, &LoadOptions::default()).unwrap()
}

fn tiny(dir: &Path, model: TinyModel) -> Model {
    let path = dir.join(format!("{}.gguf", model.architecture.name()));
    model.write(&path).unwrap();
    load(&path)
}

/// Every row of logits of `TOKENS` fed `chunk` tokens a pass into `cache`.
fn logits(model: &Model, mut cache: KvCache, chunk: usize) -> Vec<Vec<f32>> {
    chunked_logits(model, &mut cache, &TOKENS, chunk)
}

/// The default tiny model and a random adapter for it, in a directory that lives as long
/// as the returned one.
fn tiny_adapted() -> (tempfile::TempDir, Model, Arc<Adapter>) {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path(), TinyModel::default());
    TinyAdapter::default()
        .write(&dir.path().join("a"), model.config())
        .unwrap();
    let adapter = model.load_adapter("a", &dir.path().join("a")).unwrap();
    (dir, model, adapter)
}

fn adapted(model: &Model, adapter: &Arc<Adapter>) -> KvCache {
    model
        .new_adapted_cache(TOKENS.len(), Some(adapter.clone()))
        .unwrap()
}

/// PEFT's module name to the GGUF tensor it changes.
fn gguf_name(module: &str) -> &'static str {
    match module {
        "q_proj" => "attn_q",
        "k_proj" => "attn_k",
        "v_proj" => "attn_v",
        "o_proj" => "attn_output",
        "gate_proj" => "ffn_gate",
        "up_proj" => "ffn_up",
        "down_proj" => "ffn_down",
        other => panic!("no projection {other}"),
    }
}

/// Writes `base` with each weight the adapter changes merged: `W + alpha/r · B A`, a Llama
/// model's q and k rows permuted as llama.cpp's converter permutes Hugging Face's (each
/// head's two halves interleaved).
fn write_merged(base: &Path, merged: &Path, adapter: &TinyAdapter, model: &Model) {
    let c = model.config();
    let mut file = std::fs::File::open(base).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let deltas = adapter.tensors(c).unwrap();
    let scale = adapter.alpha / adapter.rank as f64;
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        let mut t = content.tensor(&mut file, name, &Device::Cpu).unwrap();
        let (layer, rest) = name["blk.".len().min(name.len())..]
            .split_once('.')
            .unwrap_or(("", ""));
        for module in &adapter.modules {
            if !name.starts_with("blk.") || rest != format!("{}.weight", gguf_name(module)) {
                continue;
            }
            let mlp = ["gate_proj", "up_proj", "down_proj"].contains(module);
            let part = if mlp { "mlp" } else { "self_attn" };
            let key = format!("base_model.model.model.layers.{layer}.{part}.{module}");
            let (a, b) = (
                &deltas[&format!("{key}.lora_A.weight")],
                &deltas[&format!("{key}.lora_B.weight")],
            );
            let mut delta = (b.matmul(a).unwrap() * scale).unwrap();
            let heads = match *module {
                "q_proj" => c.n_heads,
                "k_proj" => c.n_kv_heads,
                _ => 0,
            };
            if c.architecture == Architecture::Llama && heads > 0 {
                let (out, inputs) = delta.dims2().unwrap();
                delta = delta
                    .reshape((heads, 2, out / heads / 2, inputs))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .reshape((out, inputs))
                    .unwrap();
            }
            let w = (t.dequantize(&Device::Cpu).unwrap() + delta).unwrap();
            t = QTensor::quantize(&w, GgmlDType::F32).unwrap();
        }
        tensors.push((name.clone(), t));
    }
    let metadata: Vec<_> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<_> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut out = std::fs::File::create(merged).unwrap();
    gguf_file::write(&mut out, &metadata, &tensors).unwrap();
}

/// On models whose projections are F32, an adapted session's logits are those of the model
/// with the adapter merged into its weights (each architecture: Qwen2's biases, Qwen3's head
/// norms after q and k, Llama's permuted q and k), to f32 rounding, with the same greedy
/// token at every position.
#[test]
fn an_adapted_session_computes_what_the_merged_weights_compute() {
    for architecture in [
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Llama,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let spec = TinyModel {
            architecture,
            float_weights: true,
            head_dim: (architecture == Architecture::Qwen3).then_some(32),
            ..TinyModel::default()
        };
        let base = dir.path().join("base.gguf");
        spec.write(&base).unwrap();
        let model = load(&base);
        let adapter = TinyAdapter::default();
        adapter
            .write(&dir.path().join("adapter"), model.config())
            .unwrap();
        let loaded = model
            .load_adapter("tuned", &dir.path().join("adapter"))
            .unwrap();
        let merged = dir.path().join("merged.gguf");
        write_merged(&base, &merged, &adapter, &model);
        let merged = load(&merged);

        let ours = logits(&model, adapted(&model, &loaded), 4);
        let want = logits(&merged, merged.new_cache(TOKENS.len()).unwrap(), 4);
        let plain = logits(&model, model.new_cache(TOKENS.len()).unwrap(), 4);
        let diff = |a: &[Vec<f32>], b: &[Vec<f32>]| {
            let pairs = a.iter().flatten().zip(b.iter().flatten());
            pairs.map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
        };
        assert!(
            diff(&ours, &want) < 1e-3,
            "{architecture:?}: {}",
            diff(&ours, &want)
        );
        assert!(
            diff(&plain, &want) > 0.1,
            "{architecture:?}: the adapter changes the logits"
        );
        let greedy = |rows: &[Vec<f32>]| -> Vec<u32> {
            rows.iter()
                .map(|r| duet_engine::sampling::argmax(r).unwrap())
                .collect()
        };
        assert_eq!(greedy(&ours), greedy(&want), "{architecture:?}");
    }
}

/// A delta of zero (PEFT's `lora_B` before training) leaves every logit bitwise the base
/// model's.
#[test]
fn a_zero_delta_leaves_the_logits_bitwise_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path(), TinyModel::default());
    let zero = TinyAdapter {
        b_scale: 0.0,
        ..TinyAdapter::default()
    };
    zero.write(&dir.path().join("zero"), model.config())
        .unwrap();
    let zero = model
        .load_adapter("zero", &dir.path().join("zero"))
        .unwrap();
    let base = logits(&model, model.new_cache(TOKENS.len()).unwrap(), 13);
    assert_eq!(logits(&model, adapted(&model, &zero), 13), base);
}

/// An adapted session's rows come out bitwise the same fed one at a time, four at a time,
/// all at once, prefilled, and beside a session without the adapter (whose own rows are
/// those it computes alone).
#[test]
fn adapted_rows_do_not_depend_on_the_pass_that_computes_them() {
    let (_dir, model, adapter) = tiny_adapted();
    let one = logits(&model, adapted(&model, &adapter), 1);
    assert_eq!(logits(&model, adapted(&model, &adapter), 4), one);
    assert_eq!(logits(&model, adapted(&model, &adapter), 13), one);
    let mut cache = adapted(&model, &adapter);
    let prefilled = model.prefill(&mut cache, &TOKENS, LogitsFor::All).unwrap();
    assert_eq!(prefilled.row(12), &one[12][..]);

    let base = logits(&model, model.new_cache(TOKENS.len()).unwrap(), 1);
    let (mut a, mut b) = (
        adapted(&model, &adapter),
        model.new_cache(TOKENS.len()).unwrap(),
    );
    let input = |cache| SequenceInput::chain(cache, &TOKENS, LogitsFor::All);
    let out = model
        .forward_batch(&mut [input(&mut a), input(&mut b)])
        .unwrap();
    assert_eq!(out[0].row(12), &one[12][..]);
    assert_eq!(out[1].row(12), &base[12][..]);
    assert_ne!(one[12], base[12]);
}

/// Rows computed with one adapter are never copied into a session of another, or of none,
/// nor of another load of the same name (its files may have changed since), whose prefix
/// cache salt differs too.
#[test]
fn a_cache_takes_a_prefix_only_from_a_cache_of_its_adapter() {
    let (dir, model, adapter) = tiny_adapted();
    let mut donor = adapted(&model, &adapter);
    model.forward(&mut donor, &TOKENS, LogitsFor::None).unwrap();
    let mut plain = model.new_cache(TOKENS.len()).unwrap();
    let refused = plain.copy_prefix(&donor, 8).unwrap_err();
    assert!(matches!(refused, EngineError::CacheMismatch), "{refused}");
    let reloaded = model.load_adapter("a", &dir.path().join("a")).unwrap();
    let refused = adapted(&model, &reloaded).copy_prefix(&donor, 8);
    assert!(matches!(refused, Err(EngineError::CacheMismatch)));
    assert_ne!(reloaded.salt(7), adapter.salt(7));
    assert_eq!(adapter.salt(7), adapter.salt(7));
    let mut same = adapted(&model, &adapter);
    same.copy_prefix(&donor, 8).unwrap();
    assert_eq!(same.tokens(), &TOKENS[..8]);
}

/// What an adapter cannot be run as is refused at loading, saying why.
#[test]
fn an_adapter_the_model_cannot_run_is_refused_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path(), TinyModel::default());
    let refusal = |name: &str, edit: &dyn Fn(&Path)| -> String {
        let path = dir.path().join(name);
        TinyAdapter::default().write(&path, model.config()).unwrap();
        edit(&path);
        model.load_adapter(name, &path).unwrap_err().to_string()
    };
    let wider = TinyModel {
        hidden: 96,
        heads: 6,
        ..TinyModel::default()
    };
    std::fs::create_dir(dir.path().join("wider")).unwrap();
    let other = tiny(&dir.path().join("wider"), wider);
    let wrong_shape = refusal("shape", &|path| {
        TinyAdapter::default().write(path, other.config()).unwrap();
    });
    assert!(
        wrong_shape.ends_with(
            "layers.0.mlp.down_proj.lora_A.weight: lora_A is 4x128 and lora_B 96x4; \
             this model's projection takes 128 inputs to 64 outputs"
        ),
        "{wrong_shape}"
    );
    let dora = refusal("dora", &|path| {
        let config = r#"{"r": 4, "lora_alpha": 8, "use_dora": true}"#;
        std::fs::write(path.join("adapter_config.json"), config).unwrap();
    });
    assert!(dora.ends_with("DoRA (use_dora) is not supported"), "{dora}");
    let embedding = refusal("embedding", &|path| {
        let mut tensors = TinyAdapter::default().tensors(model.config()).unwrap();
        let name = "base_model.model.model.embed_tokens.lora_A.weight";
        tensors.insert(
            name.into(),
            Tensor::zeros((4, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&tensors, path.join("adapter_model.safetensors")).unwrap();
    });
    assert!(
        embedding.contains(
            "tensor base_model.model.model.embed_tokens.lora_A.weight is not a projection's \
             lora_A or lora_B"
        ),
        "{embedding}"
    );
}
