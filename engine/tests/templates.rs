//! Real models' chat templates under duet's Jinja: every one parses and finds the tags,
//! functions, filters, tests and methods it uses (what Hugging Face's Jinja gives them).
//! The templates are llama.cpp's collection (`models/templates` in its sources, as
//! llama-cpp-python's sdist carries them: `scripts/gpu-peer --build` leaves them under
//! target/llama-cpp), not kept here:
//!
//!     DUET_TEMPLATES=target/llama-cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates \
//!         cargo test -p duet-engine --test templates -- --ignored

use duet_engine::testing::TinyModel;
use duet_engine::{ChatExtras, ChatMessage, Tokenizer};

/// What a template the environment lacks something for fails with. A template may still
/// refuse a conversation on purpose (`raise_exception`: Gemma 2 takes no system message) or
/// read a variable its callers give it (Command R's tool descriptions), as with Hugging
/// Face's Jinja.
const MISSING: [&str; 5] = [
    "syntax error",
    "unknown function",
    "unknown filter",
    "unknown test",
    "unknown method",
];

#[test]
#[ignore = "needs llama.cpp's templates: DUET_TEMPLATES=DIR"]
fn real_templates_find_what_they_use() {
    let dir = std::env::var("DUET_TEMPLATES").expect("DUET_TEMPLATES: a folder of .jinja files");
    let mut paths: Vec<_> = (std::fs::read_dir(&dir).unwrap().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no templates in {dir}");
    let work = tempfile::tempdir().unwrap();
    let tool = serde_json::json!({"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}}}}});
    let kwargs = serde_json::json!({"enable_thinking": false});
    let extras = ChatExtras {
        tools: std::slice::from_ref(&tool),
        kwargs: kwargs.as_object(),
    };
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi there"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "The weather in Paris?"),
    ];
    let (mut rendered, mut missing) = (0, Vec::new());
    for path in &paths {
        let source = std::fs::read_to_string(path).unwrap();
        let gguf = work.path().join("t.gguf");
        let model = TinyModel {
            chat_template: Some(source),
            ..TinyModel::default()
        };
        model.write(&gguf).unwrap();
        let tok = Tokenizer::load(&gguf).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let results = [
            tok.encode_chat(&messages, true),
            tok.encode_chat_with(&messages, extras, true),
        ];
        for result in results {
            match result {
                Ok(_) => rendered += 1,
                Err(e) if MISSING.iter().any(|m| e.to_string().contains(m)) => {
                    missing.push(format!("{name}: {e}"));
                }
                Err(e) => eprintln!("{name}: refused: {e}"),
            }
        }
    }
    eprintln!("{rendered} renderings of {} templates", paths.len());
    assert!(missing.is_empty(), "{missing:#?}");
}
