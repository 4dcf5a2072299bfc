//! The engine's logits for a text, for comparing with another implementation on the same
//! file (`scripts/check-llama-cpp` compares them with llama.cpp's): the text's tokens, one a
//! line, to `OUT.tokens`, and every position's logits as little-endian f32 rows to `OUT`.
//! `--tiny DIR` writes instead the tiny random models of each architecture and rotary
//! scaling (plain, linear, YaRN, Llama 3.1's frequency factors).
//!
//!     cargo run --release -p duet-engine --example logits -- MODEL.gguf TEXT OUT
//!     cargo run --release -p duet-engine --example logits -- --tiny DIR

use candle_core::quantized::gguf_file::Value;
use duet_engine::testing::{TinyModel, logits_after_prefix};
use duet_engine::{Architecture, LoadOptions, Model, Tokenizer};
use std::io::Write;
use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match &args[..] {
        [flag, dir] if flag == "--tiny" => write_tiny(Path::new(dir)),
        [model, text, out] => write_logits(Path::new(model), text, Path::new(out)),
        _ => Err("usage: logits MODEL.gguf TEXT OUT | logits --tiny DIR".into()),
    }
}

fn write_logits(model: &Path, text: &str, out: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let tokens = Tokenizer::load(model)?.encode(text, false)?;
    let model = Model::load(model, &LoadOptions::default())?;
    let rows = logits_after_prefix(&model, &tokens, 0, 64);
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    for value in rows.iter().flatten() {
        file.write_all(&value.to_le_bytes())?;
    }
    let lines: Vec<String> = tokens.iter().map(u32::to_string).collect();
    std::fs::write(out.with_extension("tokens"), lines.join("\n") + "\n")?;
    println!("{} positions x {} logits", rows.len(), model.config().vocab);
    Ok(())
}

/// Tiny models with a 512-token context whose scalings move angles well within it: linear
/// by 4, YaRN by 4 over an original 64 positions, factors of 1 to 8 on the frequencies.
fn write_tiny(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    fn scaling(kind: &str, extra: &[(&'static str, Value)]) -> Vec<(&'static str, Value)> {
        let mut keys = vec![
            ("rope.scaling.type", Value::String(kind.into())),
            ("rope.scaling.factor", Value::F32(4.0)),
        ];
        keys.extend(extra.iter().cloned());
        keys
    }
    let yarn_keys = [("rope.scaling.original_context_length", Value::U32(64))];
    let factors: Vec<f32> = (0..8).map(|i| 1.0 + i as f32).collect();
    let models = [
        ("llama-plain", Architecture::Llama, vec![], None),
        ("llama-freqs", Architecture::Llama, vec![], Some(factors)),
        ("qwen2-plain", Architecture::Qwen2, vec![], None),
        (
            "qwen2-linear",
            Architecture::Qwen2,
            scaling("linear", &[]),
            None,
        ),
        (
            "qwen2-yarn",
            Architecture::Qwen2,
            scaling("yarn", &yarn_keys),
            None,
        ),
        ("qwen3-plain", Architecture::Qwen3, vec![], None),
    ];
    for (name, architecture, keys, rope_freqs) in models {
        let arch = architecture.name();
        TinyModel {
            architecture,
            // Heads wider than the model's width over their count, as in Qwen3-0.6B.
            head_dim: (architecture == Architecture::Qwen3).then_some(32),
            context_length: 512,
            metadata: (keys.into_iter())
                .map(|(k, v)| (format!("{arch}.{k}"), v))
                .collect(),
            rope_freqs,
            ..TinyModel::default()
        }
        .write(&dir.join(format!("{name}.gguf")))?;
        println!("{}", dir.join(format!("{name}.gguf")).display());
    }
    Ok(())
}
