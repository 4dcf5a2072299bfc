//! What structured output costs on a model's vocabulary (docs/benchmarks.md, "Structured
//! output"): reading the vocabulary for llguidance (a target-worker's start), compiling a
//! JSON schema (a session's open), and a Verify's masks (a committed position and up to four
//! drafts), over a JSON text of the schema. The default target model unless a GGUF path is
//! given.
//!
//!     cargo run --release -p duet-engine --example structured-masks [MODEL.gguf]

use duet_engine::Tokenizer;
use duet_engine::structured::{Format, Grammars};
use std::time::Instant;

const SCHEMA: &str = r#"{"type": "object", "properties": {"name": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "tags"]}"#;
const TEXT: &str = "{\n  \"name\": \"add\",\n  \"tags\": [\"math\", \"arithmetic\"]\n}";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).map_or_else(
        || duet_engine::cached_model_path("qwen2.5-coder-1.5b-instruct.gguf"),
        Into::into,
    );
    let tokenizer = Tokenizer::load(&path)?;
    let start = Instant::now();
    let grammars = Grammars::new(&tokenizer, tokenizer.vocab_size())?;
    println!(
        "vocabulary read: {:.0} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let start = Instant::now();
    let mut constraint = grammars.constrain(&Format::JsonSchema(SCHEMA.into()))?;
    println!(
        "schema compiled: {:.2} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let ids = tokenizer.encode_literal(TEXT)?;
    let start = Instant::now();
    for i in 0..ids.len() {
        constraint.masks(&ids[..i], &ids[i..(i + 4).min(ids.len())])?;
    }
    let per_call = start.elapsed().as_secs_f64() * 1e6 / ids.len() as f64;
    println!("masks per Verify: {per_call:.0} µs ({} calls)", ids.len());
    Ok(())
}
