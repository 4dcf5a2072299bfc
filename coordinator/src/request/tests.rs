//! Validation's unit tests: each field's bounds, K, penalties, stop tokens, priority,
//! adapters, the cache salt, fill in the middle.

use super::*;
use crate::workers::{AdapterNames, Models};
use duet_engine::testing::TinyModel;

/// A request for the prompt "x", every other field its default.
fn prompt_x() -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt("x".into())),
        ..Default::default()
    }
}

/// K and who chooses it, for a request of `method` with `k` on a server with `config`.
fn k_of(method: pb::SpeculationMethod, k: u32, config: &CoordinatorConfig) -> (usize, bool) {
    let req = pb::GenerateRequest {
        speculation: method as i32,
        num_speculative_tokens: k,
        ..prompt_x()
    };
    let c = check(req, config).unwrap();
    (c.k, c.choose_k)
}

#[test]
fn a_named_method_without_k_gets_the_controllers_k_up_to_its_limit() {
    use pb::SpeculationMethod::{Auto, DraftModel, Ngram, None};
    let mut config = CoordinatorConfig::default();
    for (method, k, expected) in [
        (DraftModel, 0, (8, true)),
        (Ngram, 0, (16, true)),
        (Auto, 0, (16, true)),
        (DraftModel, 3, (3, false)),
        (Ngram, 5, (5, false)),
        (Auto, 5, (5, true)),
        (None, 0, (4, false)),
    ] {
        assert_eq!(k_of(method, k, &config), expected, "{method:?} K={k}");
    }
    config.speculation.adaptive.choose_k = false;
    assert_eq!(k_of(DraftModel, 0, &config), (4, false));
    assert_eq!(k_of(Ngram, 0, &config), (4, false));
    assert_eq!(k_of(Auto, 0, &config), (16, true));
}

#[test]
fn penalties_stay_within_their_ranges() {
    let config = CoordinatorConfig::default();
    let with = |presence_penalty, frequency_penalty, repetition_penalty| {
        let req = pb::GenerateRequest {
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            ..prompt_x()
        };
        check(req, &config).map(|c| c.penalties)
    };
    let ok = Penalties {
        presence: -2.0,
        frequency: 2.0,
        repetition: 1.1,
    };
    assert_eq!(with(-2.0, 2.0, 1.1), Ok(ok));
    // An unset repetition penalty is none.
    assert_eq!(with(0.0, 0.0, 0.0), Ok(Penalties::default()));
    let e = with(0.0, 2.5, 1.0).unwrap_err();
    assert_eq!(e.to_string(), "frequency_penalty: 2.5 is outside [-2, 2]");
    assert_eq!(
        with(f32::NAN, 0.0, 1.0).unwrap_err().field,
        "presence_penalty"
    );
    let e = with(0.0, 0.0, -1.0).unwrap_err();
    assert_eq!(e.to_string(), "repetition_penalty: -1 must be a number > 0");
}

/// At most 64 stop tokens; with `min_tokens` the workers hold them back until then.
#[test]
fn stop_tokens_are_few_and_held_back_until_min_tokens() {
    let config = CoordinatorConfig::default();
    let with = |stop_token_ids: Vec<u32>, min_tokens| {
        let req = pb::GenerateRequest {
            stop_token_ids,
            min_tokens,
            ..prompt_x()
        };
        check(req, &config).map(|c| c.stop_token_ids)
    };
    assert_eq!(with(vec![3, 9], 0), Ok(vec![3, 9]));
    assert_eq!(with(vec![3], 2), Ok(vec![3]));
    let e = with(vec![1; 65], 0).unwrap_err();
    assert_eq!(e.to_string(), "stop_token_ids: 65 tokens; at most 64");
}

/// A `priority` is taken where the server schedules by priority, refused where it
/// admits first come, first served (the default, as vLLM's).
#[test]
fn a_priority_needs_priority_scheduling() {
    let mut config = CoordinatorConfig::default();
    let req = pb::GenerateRequest {
        priority: -1,
        ..prompt_x()
    };
    let e = check(req.clone(), &config).unwrap_err();
    let why = "priority: this server admits first come, first served \
               (scheduling_policy = \"fcfs\")";
    assert_eq!(e.to_string(), why);
    assert!(check(prompt_x(), &config).is_ok());
    config.scheduling_policy = SchedulingPolicy::Priority;
    assert!(check(req, &config).is_ok());
}

/// A request's adapter: none where empty; one the target loads is taken; another, or
/// any where it loads none, is refused naming those it loads; a name over 256 bytes is
/// refused before any is compared.
#[test]
fn an_adapter_is_one_the_target_loads() {
    let config = CoordinatorConfig::default();
    let with = |name: &str, adapters: &[&str]| {
        let req = pb::GenerateRequest {
            adapter: name.into(),
            ..prompt_x()
        };
        let models = Models {
            adapters: AdapterNames::new(adapters.iter().map(|a| a.to_string()).collect(), false),
            ..(*crate::generation::fakes::models()).clone()
        };
        let valid = check(req, &config).and_then(|c| c.tokenize(&models, 16));
        valid.map(|v| v.adapter).map_err(|e| e.to_string())
    };
    assert_eq!(with("", &[]), Ok(None));
    assert_eq!(with("sql", &["chat", "sql"]), Ok(Some("sql".into())));
    let unknown = "adapter: `nope` is not one of chat, sql";
    assert_eq!(with("nope", &["chat", "sql"]), Err(unknown.into()));
    let none = "adapter: `sql`: the target-workers load no adapters";
    assert_eq!(with("sql", &[]), Err(none.into()));
    let long = "adapter: 257 bytes; at most 256";
    assert_eq!(with(&"a".repeat(257), &["chat"]), Err(long.into()));
}

/// A request's `cache_salt`: none where empty, else a salt of its own (two salts
/// differ), at most 1024 bytes; mixed with a tenant's, either alone stays itself.
#[test]
fn a_cache_salt_is_hashed_and_bounded() {
    let config = CoordinatorConfig::default();
    let with = |salt: &str| {
        let req = pb::GenerateRequest {
            cache_salt: salt.into(),
            ..prompt_x()
        };
        check(req, &config).map(|c| c.cache_salt)
    };
    assert_eq!(with(""), Ok(0));
    let (a, b) = (with("a").unwrap(), with("b").unwrap());
    assert!(a != 0 && b != 0 && a != b);
    assert_eq!(with("a"), Ok(a));
    let e = with(&"x".repeat(1025)).unwrap_err();
    assert_eq!(e.to_string(), "cache_salt: 1025 bytes; at most 1024");
    assert_eq!(
        (mix_salts(0, 0), mix_salts(a, 0), mix_salts(0, b)),
        (0, a, b)
    );
    assert!(![0, a, b].contains(&mix_salts(a, b)));
}

/// A suffix goes with a text prompt only (an empty one too), the two within
/// `max_input_bytes` together.
#[test]
fn a_suffix_goes_with_a_text_prompt() {
    let mut config = CoordinatorConfig::default();
    config.limits.max_input_bytes = 8;
    let with = |input| {
        let req = pb::GenerateRequest {
            input: Some(input),
            suffix: Some("abcd".into()),
            ..Default::default()
        };
        check(req, &config).map(|_| ())
    };
    use pb::generate_request::Input as In;
    assert_eq!(with(In::Prompt(String::new())), Ok(()));
    assert_eq!(with(In::Prompt("efgh".into())), Ok(()));
    let e = with(In::Prompt("efghi".into())).unwrap_err();
    assert_eq!(e.to_string(), "suffix: 9 bytes with the prompt; at most 8");
    let ids = In::PromptTokenIds(pb::TokenIds { ids: vec![1] });
    let e = with(ids).unwrap_err();
    let why = "suffix: with a text prompt only (not messages or prompt_token_ids)";
    assert_eq!(e.to_string(), why);
}

/// The tokenizer of `model` (a code model) and its models, of a context of 256.
fn code_models(model: TinyModel) -> (duet_engine::Tokenizer, Models) {
    let tok = model.tokenizer().unwrap();
    let vocab = tok.vocab_size();
    let models = Models::new(tok.clone(), String::new(), (vocab, 256), "coder".into());
    (tok, models)
}

/// A prompt and its suffix are the model's fill-in-the-middle prompt, the tokens that
/// end a middle added to the request's own; a model without such tokens refuses it.
#[test]
fn a_suffix_asks_a_code_model_for_the_middle() {
    let (tok, coder) = code_models(TinyModel::coder());
    let req = pb::GenerateRequest {
        suffix: Some(" sat".into()),
        stop_token_ids: vec![5],
        ..prompt_x()
    };
    let checked = || check(req.clone(), &CoordinatorConfig::default()).unwrap();
    let valid = checked().tokenize(&coder, 16).unwrap();
    let infill = tok.encode_infill("x", " sat", None, usize::MAX);
    assert_eq!(valid.prompt, infill.unwrap().unwrap().ids);
    let ends = tok.infill().unwrap().ends();
    assert_eq!(valid.stop_token_ids, [vec![5], ends].concat());
    let plain = crate::generation::fakes::models();
    let e = checked().tokenize(&plain, 16).unwrap_err();
    let why = "suffix: the target model has no fill-in-the-middle tokens";
    assert_eq!(e.to_string(), why);
}

/// The repository around a middle comes first, its first files left out where the
/// prompt would leave the context less room than max_tokens (or, unset, the server's
/// default); with a suffix only, within the input bytes, and of a model with the
/// repository-level tokens. The line and time limits reach the request.
#[test]
fn a_repository_comes_before_the_middle_as_room_allows() {
    let (tok, coder) = code_models(TinyModel::coder());
    let file = |text: &str| pb::RepositoryFile {
        path: "a.py".into(),
        text: text.into(),
    };
    let repository = pb::Repository {
        name: "r".into(),
        path: "b.py".into(),
        files: vec![file(&"old ".repeat(30)), file("new")],
    };
    let req = |max_tokens| pb::GenerateRequest {
        suffix: Some(" sat".into()),
        repository: Some(repository.clone()),
        max_tokens,
        min_line_indent: 4,
        max_predict_ms: 250,
        ..prompt_x()
    };
    let valid = |max_tokens, default| {
        let checked = check(req(max_tokens), &CoordinatorConfig::default()).unwrap();
        checked.tokenize(&coder, default).unwrap()
    };
    let whole = valid(16, 16);
    assert_eq!(whole.repository_files_left_out, 0);
    let (min, limit) = (whole.min_line_indent, whole.max_predict);
    assert_eq!(
        (min, limit),
        (4, Some(std::time::Duration::from_millis(250)))
    );
    let room = 256 - whole.prompt.len();
    let cut = valid(room as u32 + 1, 16);
    assert_eq!(cut.repository_files_left_out, 1);
    assert!(cut.prompt.len() < whole.prompt.len());
    let text = tok.decode(&cut.prompt, false).unwrap();
    assert!(text.starts_with("<|repo_name|>r\n<|file_sep|>a.py\nnew\n<|file_sep|>b.py\n"));
    assert_eq!(valid(0, room as u32 + 1).repository_files_left_out, 1);
    // With a suffix only; within the input bytes; of a model with the tokens.
    let config = CoordinatorConfig::default();
    let alone = pb::GenerateRequest {
        suffix: None,
        ..req(0)
    };
    let e = check(alone, &config).unwrap_err();
    assert_eq!(e.to_string(), "repository: with a suffix only");
    let mut small = CoordinatorConfig::default();
    small.limits.max_input_bytes = 100;
    let e = check(req(0), &small).unwrap_err();
    let why = "repository: 136 bytes, 5 more with the prompt and suffix; at most 100";
    assert_eq!(e.to_string(), why);
    let (_, no_repository) = code_models(TinyModel::coder_without_repository());
    let e = check(req(0), &config).unwrap().tokenize(&no_repository, 16);
    let why = "repository: the target model has no repository-level tokens";
    assert_eq!(e.unwrap_err().to_string(), why);
}

#[test]
fn min_p_is_a_share_from_zero_to_one() {
    let config = CoordinatorConfig::default();
    let with = |min_p| {
        let req = pb::GenerateRequest {
            min_p,
            temperature: 1.0,
            ..prompt_x()
        };
        check(req, &config).map(|c| c.sampling.min_p)
    };
    assert_eq!(with(0.0), Ok(0.0));
    assert_eq!(with(1.0), Ok(1.0));
    let e = with(1.5).unwrap_err();
    assert_eq!(e.to_string(), "min_p: 1.5 is outside [0, 1]");
    assert_eq!(with(f32::NAN).unwrap_err().field, "min_p");
}

#[test]
fn top_logprobs_need_logprobs_and_stay_within_twenty() {
    let config = CoordinatorConfig::default();
    let with = |logprobs: bool, top_logprobs: u32| {
        let req = pb::GenerateRequest {
            logprobs,
            top_logprobs,
            ..prompt_x()
        };
        check(req, &config).map(|c| c.logprobs)
    };
    assert_eq!(with(false, 0), Ok(None));
    assert_eq!(with(true, 0), Ok(Some(0)));
    assert_eq!(with(true, 20), Ok(Some(20)));
    let e = with(true, 21).unwrap_err();
    assert_eq!(e.to_string(), "top_logprobs: 21; at most 20");
    let e = with(false, 2).unwrap_err();
    assert_eq!(e.to_string(), "top_logprobs: set logprobs to ask for them");
}

/// A prompt given as token ids is read as given: no tokenizer, no template; it must
/// hold a token, each inside the target's vocabulary, and leave room in the context.
/// Its figures may be asked for with up to 20 most likely tokens.
#[test]
fn a_prompt_of_token_ids_is_read_as_given() {
    let config = CoordinatorConfig::default();
    let models = crate::generation::fakes::models();
    let with = |ids: Vec<u32>, prompt_logprobs: Option<u32>| {
        let req = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::PromptTokenIds(pb::TokenIds {
                ids,
            })),
            prompt_logprobs,
            ..Default::default()
        };
        check(req, &config)?.tokenize(&models, 16)
    };
    let valid = with(vec![3, 1, 4, 1, 5], Some(20)).unwrap();
    assert_eq!(valid.prompt, [3, 1, 4, 1, 5]);
    assert_eq!((valid.prompt_logprobs, valid.max_tokens), (Some(20), 16));
    assert_eq!(with(vec![3], None).unwrap().prompt_logprobs, None);
    let e = with(vec![3], Some(21)).unwrap_err();
    assert_eq!(e.to_string(), "prompt_logprobs: 21; at most 20");
    let e = with(Vec::new(), None).unwrap_err();
    assert_eq!(e.to_string(), "prompt_token_ids: must not be empty");
    let vocab = models.vocab as u32;
    let e = with(vec![1, vocab], None).unwrap_err();
    let why = format!("prompt_token_ids: {vocab} is outside the target's vocabulary of {vocab}");
    assert_eq!(e.to_string(), why);
    let e = with(vec![1; models.context], None).unwrap_err();
    assert_eq!(e.field, "prompt");
}
