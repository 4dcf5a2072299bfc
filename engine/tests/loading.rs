//! Loading errors and the GGUF tokenizer on tiny files written by the test.

use candle_core::quantized::gguf_file::{self, Value};
use duet_engine::testing::{TinyModel, tiny_vocab_size};
use duet_engine::{ChatMessage, EngineError, LoadOptions, Model, Tokenizer};
use std::path::Path;

fn write_metadata_only(path: &Path, metadata: &[(&str, Value)]) {
    let mut file = std::fs::File::create(path).unwrap();
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut file, &metadata, &[]).unwrap();
}

#[test]
fn unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.gguf");
    write_metadata_only(
        &path,
        &[("general.architecture", Value::String("gpt2".into()))],
    );
    let err = Model::load(&path, &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, EngineError::UnsupportedArchitecture(a) if a == "gpt2"));
    assert!(err.to_string().contains("`gpt2`"), "{err}");
}

#[test]
fn missing_metadata_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("partial.gguf");
    write_metadata_only(
        &path,
        &[
            ("general.architecture", Value::String("qwen2".into())),
            ("qwen2.embedding_length", Value::U32(64)),
        ],
    );
    let err = Model::load(&path, &LoadOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("qwen2.attention.head_count"),
        "{err}"
    );
}

#[test]
fn not_a_gguf_file_and_missing_file_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("junk.gguf");
    std::fs::write(&path, b"definitely not gguf").unwrap();
    let err = Model::load(&path, &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::Gguf { .. }), "{err}");
    let err = Model::load(&dir.path().join("absent.gguf"), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, EngineError::Io { .. }), "{err}");
}

#[test]
fn tiny_tokenizer_round_trips_and_parses_special_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel::default().write(&path).unwrap();
    let tok = Tokenizer::load(&path).unwrap();
    assert_eq!(tok.vocab_size(), tiny_vocab_size());

    let text = "the cat = def f(x):\n\treturn 42 — ünï 漢字 🙂";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // " the" is one merged token.
    let the = tok.encode(" the", false).unwrap();
    assert_eq!(the.len(), 1);

    let im_start = 256 + 10 + 1;
    let im_end = im_start + 1;
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&(im_start as u32)));
    assert_eq!(ids.last(), Some(&(im_end as u32)));
    assert!(tok.is_eos(im_end as u32));
    assert!(tok.is_eos(256 + 10)); // <|endoftext|>

    let bytes: Vec<u8> = tok
        .encode("漢", false)
        .unwrap()
        .iter()
        .flat_map(|&id| tok.token_bytes(id).unwrap())
        .collect();
    assert_eq!(bytes, "漢".as_bytes());

    let prompt = tok
        .apply_chat_template(&[ChatMessage::new("user", "hello")], true)
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn tokenizer_travels_as_a_tensorless_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel::default().write(&path).unwrap();
    let bytes = duet_engine::tokenizer::tokenizer_gguf(&path).unwrap();
    assert_eq!(
        bytes,
        duet_engine::tokenizer::tokenizer_gguf(&path).unwrap()
    );
    let model_bytes = std::fs::metadata(&path).unwrap().len() as usize;
    assert!(
        bytes.len() < model_bytes,
        "{} >= {model_bytes}",
        bytes.len()
    );

    let from_file = Tokenizer::load(&path).unwrap();
    let from_bytes = Tokenizer::from_gguf_bytes(&bytes).unwrap();
    let text = "<|im_start|>user\nthe cat 漢字<|im_end|>";
    assert_eq!(
        from_bytes.encode(text, false).unwrap(),
        from_file.encode(text, false).unwrap()
    );
    assert_eq!(from_bytes.eos_tokens(), from_file.eos_tokens());
    assert_eq!(from_bytes.chat_template(), from_file.chat_template());
}
