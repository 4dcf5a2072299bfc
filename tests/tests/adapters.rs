//! LoRA adapters through the real services: a target-worker that loads one, chosen per
//! request over gRPC (`adapter`) and the OpenAI-compatible API (`model`).

use duet_e2e::common::*;
use duet_engine::testing::TinyAdapter;
use duet_proto::v1 as pb;
use pb::SpeculationMethod::{Auto, DraftModel, Ngram, None as TargetOnly};
use serde_json::{Value, json};

/// A prompt over two of the prefix cache's 32-token blocks (the tiny vocabulary spells it
/// nearly a byte a token), so that a later request of it may start from cached rows.
const PROMPT: &str =
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";

/// Writes `adapter` for the tiny target into `dir`.
fn write_adapter(m: &TinyModels, dir: &std::path::Path, adapter: TinyAdapter) {
    let target = duet_engine::Model::load(&m.target, &Default::default()).unwrap();
    adapter.write(dir, target.config()).unwrap();
}

/// A target-worker's configuration of the tiny target loading a random adapter as `tuned`,
/// whose directory lives as long as the returned one.
fn tuned_target(m: &TinyModels) -> (tempfile::TempDir, duet_worker_core::WorkerConfig) {
    let dir = tempfile::tempdir().unwrap();
    write_adapter(m, dir.path(), TinyAdapter::default());
    let mut config = worker_config(&m.target);
    config.lora_adapters = [("tuned".to_string(), dir.path().to_path_buf())].into();
    (dir, config)
}

/// The tiny stack, its target-worker loading a random adapter as `tuned`; the adapter's
/// directory lives as long as the returned one.
async fn adapted_stack() -> (TinyModels, tempfile::TempDir, Stack) {
    let m = tiny_models();
    let (dir, config) = tuned_target(&m);
    let stack = Stack::start_with(worker_config(&m.draft), config);
    wait_stack(&stack).await;
    (m, dir, stack)
}

/// Why the stack's target-worker refuses a session of the adapter `name`
/// (`INVALID_ARGUMENT`).
async fn worker_refuses(stack: &Stack, name: &str) -> String {
    let mut worker = pb::worker_client::WorkerClient::connect(stack.target.url())
        .await
        .unwrap();
    let open = pb::OpenSessionRequest {
        prompt: vec![1, 2, 3],
        capacity: 16,
        adapter: name.into(),
        ..Default::default()
    };
    let refused = worker.open_session(open).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    refused.message().to_string()
}

fn with_adapter(method: pb::SpeculationMethod, adapter: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        adapter: adapter.into(),
        ..request(PROMPT, 24, method)
    }
}

/// Every method's greedy text with the adapter is the adapted target's own (NONE's with
/// it), token for token, and not the target's without it; the draft model proposes for it
/// (without the adapter, which its worker does not load). The same prompt's rows without
/// the adapter, in the target's prefix cache by then, are not the adapted session's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_gives_the_adapted_targets_own_text() {
    let (_m, _dir, stack) = adapted_stack().await;
    let url = stack.coordinator.url();
    let plain = generate(&url, request(PROMPT, 24, TargetOnly))
        .await
        .unwrap();
    let adapted = generate(&url, with_adapter(TargetOnly, "tuned"))
        .await
        .unwrap();
    assert_eq!(adapted.token_ids.len(), 24);
    assert_ne!(adapted.token_ids, plain.token_ids);
    for method in [DraftModel, Ngram, Auto] {
        let got = generate(&url, with_adapter(method, "tuned")).await.unwrap();
        assert_eq!(got.token_ids, adapted.token_ids, "{method:?}");
        if method == DraftModel {
            assert!(got.usage.draft_tokens_proposed > 0, "{:?}", got.usage);
        }
    }
    let again = generate(&url, request(PROMPT, 24, TargetOnly))
        .await
        .unwrap();
    assert_eq!(again.token_ids, plain.token_ids);
}

/// The target-worker's Describe names its adapters, and it refuses to open a session of
/// another; a request for one it does not load is refused before it takes a place, naming
/// those it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_an_adapter_not_loaded_is_refused_naming_those_that_are() {
    let (_m, _dir, stack) = adapted_stack().await;
    let mut worker = pb::worker_client::WorkerClient::connect(stack.target.url())
        .await
        .unwrap();
    let described = worker.describe(pb::DescribeRequest::default()).await;
    let described = described.unwrap().into_inner();
    assert_eq!(described.adapters, ["tuned"]);
    assert!(!described.adapters_from_dir && !described.tokenizer.is_empty());
    // What the coordinator asks when it knows the model: all but the tokenizer's bytes.
    let without_tokenizer = pb::DescribeRequest {
        without_tokenizer: true,
    };
    let short = worker
        .describe(without_tokenizer)
        .await
        .unwrap()
        .into_inner();
    let whole = pb::ModelDescription {
        tokenizer: Vec::new(),
        ..described
    };
    assert_eq!(short, whole);
    let refused = worker_refuses(&stack, "nope").await;
    let why = "adapter: `nope` is not one of this worker's (tuned)";
    assert_eq!(refused, why);
    let refused = generate(&stack.coordinator.url(), with_adapter(DraftModel, "nope"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert_eq!(refused.message(), "adapter: `nope` is not one of tuned");
}

/// OpenAI's and Ollama's `model` names the adapter: `/v1/models` and `/api/tags` list it
/// beside the target (`/v1/models/tuned` gives its card alone, `/metrics` its
/// `lora_requests_info`), a chat for it answers its text (gRPC's with `adapter`) under its
/// name, and any other name is the target alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_apis_model_chooses_an_adapter() {
    let (_m, _dir, stack) = adapted_stack().await;
    let addr = stack.coordinator.http_addr;
    let (status, listed) = http(addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, 200, "{listed}");
    let ids: Vec<Value> = (json_of(&listed)["data"].as_array().unwrap().iter())
        .map(|m| json!([m["id"], m["parent"]]))
        .collect();
    assert_eq!(
        ids,
        [
            json!(["target.gguf", null]),
            json!(["tuned", "target.gguf"])
        ]
    );
    let (status, body) = http(addr, "GET", "/v1/models/tuned", &[], "").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json_of(&body), json_of(&listed)["data"][1]);
    assert_eq!(lora_info(addr).await, ["1", "tuned"]);

    let chat = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": PROMPT}],
               "max_tokens": 16, "temperature": 0, "speculation": "draft_model"})
        .to_string()
    };
    let grpc = |adapter: &str| pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: PROMPT.into(),
                ..Default::default()
            }],
        })),
        adapter: adapter.into(),
        max_tokens: 16,
        speculation: DraftModel as i32,
        ..Default::default()
    };
    let url = stack.coordinator.url();
    for (model, adapter, named) in [("tuned", "tuned", "tuned"), ("gpt-4o", "", "target.gguf")] {
        let (status, body) = post(addr, "/v1/chat/completions", &chat(model)).await;
        assert_eq!(status, 200, "{body}");
        let answer = json_of(&body);
        assert_eq!(answer["model"], named);
        let want = grpc_text(&url, grpc(adapter)).await;
        assert_eq!(answer["choices"][0]["message"]["content"], want, "{model}");
        let ollama = json!({"model": model, "stream": false, "speculation": "draft_model",
                            "messages": [{"role": "user", "content": PROMPT}],
                            "options": {"temperature": 0, "num_predict": 16}});
        let (status, body) = post(addr, "/api/chat", &ollama.to_string()).await;
        assert_eq!(status, 200, "{body}");
        let answer = json_of(&body);
        assert_eq!(answer["model"], named);
        assert_eq!(answer["message"]["content"], want, "{model}");
    }
    let (status, body) = http(addr, "GET", "/api/tags", &[], "").await;
    assert_eq!(status, 200, "{body}");
    let tags: Vec<Value> = (json_of(&body)["models"].as_array().unwrap().iter())
        .map(|m| json!([m["name"], m["details"]["parent_model"]]))
        .collect();
    assert_eq!(
        tags,
        [json!(["target.gguf", ""]), json!(["tuned", "target.gguf"])]
    );
}

/// A draft-worker's adapters are the draft model's under the names requests give the
/// target's: a request of one it loads drafts with it (here the draft model is the target's
/// file with the target's adapter, so it proposes the adapted target's very tokens and
/// every draft is accepted), one of a name it lacks drafts without (fewer accepted); the
/// text is the adapted target's either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_worker_drafts_with_its_adapter_of_the_requests_name() {
    let m = tiny_models();
    let (_tuned, mut target) = tuned_target(&m);
    let mut draft = worker_config(&m.target);
    draft.lora_adapters = target.lora_adapters.clone();
    let other = tempfile::tempdir().unwrap();
    let seed = 12;
    write_adapter(
        &m,
        other.path(),
        TinyAdapter {
            seed,
            ..Default::default()
        },
    );
    target
        .lora_adapters
        .insert("other".into(), other.path().into());
    let stack = Stack::start_with(draft, target);
    wait_stack(&stack).await;
    let url = stack.coordinator.url();
    for (name, all_accepted) in [("tuned", true), ("other", false)] {
        let alone = generate(&url, with_adapter(TargetOnly, name))
            .await
            .unwrap();
        let drafted = generate(&url, with_adapter(DraftModel, name))
            .await
            .unwrap();
        assert_eq!(drafted.token_ids, alone.token_ids, "{name}");
        let usage = &drafted.usage;
        assert!(usage.draft_tokens_proposed > 0, "{name}: {usage:?}");
        let accepted_all = usage.draft_tokens_accepted == usage.draft_tokens_proposed;
        assert_eq!(accepted_all, all_accepted, "{name}: {usage:?}");
    }
}

/// A target-worker whose adapter directory is missing refuses to start, naming it.
#[tokio::test]
async fn a_missing_adapter_directory_fails_the_start() {
    let m = tiny_models();
    let mut target = worker_config(&m.target);
    target.lora_adapter_dir = "/nonexistent/adapters".into();
    let refused = refused_start::<duet_target_worker::Verifier>(target).await;
    let why = "target.gguf: LoRA adapter /nonexistent/adapters: not a directory \
               (lora_adapter_dir)";
    assert!(
        refused.starts_with("loading ") && refused.ends_with(why),
        "{refused}"
    );
}

/// Two target replicas of one model, one loading the adapter and one not (a rollout that
/// adds it, half done): every request of the adapter opens on the replica that loads it,
/// while the others go to either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_an_adapter_opens_only_where_it_is_loaded() {
    let m = tiny_models();
    let (_dir, loads) = tuned_target(&m);
    let loads = start_target(loads);
    wait_serving(&loads.url(), "").await;
    // The other starts after the coordinator has described the first (whose adapters it
    // takes as the names it accepts).
    let later = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let urls = format!("{}, http://{later}", loads.url());
    let coordinator = start_coordinator(coordinator_config(&urls, None));
    wait_serving(&coordinator.url(), "").await;
    let lacks = start_target_at(worker_config(&m.target), later);
    wait_serving(&lacks.url(), "").await;
    let url = coordinator.url();
    for _ in 0..4 {
        generate(&url, with_adapter(TargetOnly, "tuned"))
            .await
            .unwrap();
    }
    assert_eq!([prefills(&loads).await, prefills(&lacks).await], [4.0, 0.0]);
    for prompt in ["the cat", "a dog", "the end", "one more"] {
        generate(&url, request(prompt, 6, TargetOnly))
            .await
            .unwrap();
    }
    assert!(prefills(&lacks).await > 0.0);
}

/// A target-worker's adapter directory: adapters copied in after the start are served by
/// name without a restart of the worker or the coordinator (which lists them); one is read
/// when first asked for, given up past `max_loaded_adapters` and read again, and read again
/// when its files change, whose sessions then take none of the earlier files' cached rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_copied_into_the_directory_are_served_without_a_restart() {
    let m = tiny_models();
    let (_tuned, mut config) = tuned_target(&m);
    let dir = tempfile::tempdir().unwrap();
    config.lora_adapter_dir = dir.path().into();
    config.max_loaded_adapters = 1;
    let stack = Stack::start_with(worker_config(&m.draft), config);
    wait_stack(&stack).await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    let text = |name: &'static str, method| generate(&url, with_adapter(method, name));
    let tuned = text("tuned", TargetOnly).await.unwrap();

    // `late` is `tuned`'s files, `other` another adapter's; named by OpenAI's `model`
    // first, by gRPC's `adapter` once the coordinator's list may be asked for again (a
    // second after it last was).
    let other = || TinyAdapter {
        rank: 8,
        seed: 12,
        ..Default::default()
    };
    write_adapter(&m, &dir.path().join("other"), other());
    let completion = json!({"model": "other", "prompt": PROMPT, "max_tokens": 24,
                            "temperature": 0});
    let (status, body) = post(http_addr, "/v1/completions", &completion.to_string()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json_of(&body)["model"], "other");
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    write_adapter(&m, &dir.path().join("late"), TinyAdapter::default());
    assert_eq!(
        text("late", DraftModel).await.unwrap().token_ids,
        tuned.token_ids
    );
    let other_text = text("other", TargetOnly).await.unwrap();
    assert_ne!(other_text.token_ids, tuned.token_ids);
    assert_eq!(json_of(&body)["choices"][0]["text"], other_text.text);
    assert_eq!(
        text("late", TargetOnly).await.unwrap().token_ids,
        tuned.token_ids
    );
    // Its files change (to `other`'s): the next session reads them again.
    write_adapter(&m, &dir.path().join("late"), other());
    let changed = text("late", TargetOnly).await.unwrap();
    assert_eq!(changed.token_ids, other_text.token_ids);

    let metrics = scrape(&stack.target).await;
    // other, late, other, late (each given up for the next), late's changed files.
    let reads = sample(&metrics, "duet_worker_lora_adapter_reads_total");
    assert_eq!(reads, 5.0);
    assert_eq!(sample(&metrics, "duet_worker_lora_adapters_loaded"), 1.0);
    let (status, body) = http(http_addr, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, 200, "{body}");
    let ids: Vec<Value> = (json_of(&body)["data"].as_array().unwrap().iter())
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(ids, ["target.gguf", "late", "other", "tuned"]);
    assert_eq!(lora_info(http_addr).await, ["3", "late,other,tuned"]);
}

/// The labels `max_lora` and `running_lora_adapters` of the one series of
/// `duet_lora_requests_info` on the coordinator's API port (its value: a time this year or
/// later; `waiting_lora_adapters` empty).
async fn lora_info(api: std::net::SocketAddr) -> [String; 2] {
    let (status, figures) = http(api, "GET", "/metrics", &[], "").await;
    assert_eq!(status, 200, "{figures}");
    let series: Vec<&str> = (figures.lines())
        .filter(|l| l.starts_with("duet_lora_requests_info{"))
        .collect();
    assert_eq!(series.len(), 1, "{figures}");
    let (labels, value) = series[0].rsplit_once(' ').unwrap();
    assert!(value.parse::<f64>().unwrap() > 1.7e9, "{value}");
    let label = |name: &str| {
        let from = labels.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
        labels[from..from + labels[from..].find('"').unwrap()].to_string()
    };
    assert_eq!(label("waiting_lora_adapters"), "");
    [label("max_lora"), label("running_lora_adapters")]
}

/// A directory adapter's name is a plain file name: one that leads out of the directory
/// is refused by the coordinator and by the worker, though an adapter lies there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_adapters_name_never_leads_out_of_it() {
    let m = tiny_models();
    let root = tempfile::tempdir().unwrap();
    write_adapter(&m, &root.path().join("outside"), TinyAdapter::default());
    write_adapter(
        &m,
        &root.path().join("adapters/inside"),
        TinyAdapter::default(),
    );
    let mut config = worker_config(&m.target);
    config.lora_adapter_dir = root.path().join("adapters");
    let stack = Stack::start_with(worker_config(&m.draft), config);
    wait_stack(&stack).await;
    let url = stack.coordinator.url();
    let refused = generate(&url, with_adapter(TargetOnly, "../outside"))
        .await
        .unwrap_err();
    let why = "adapter: `../outside` is not one of inside";
    assert_eq!(
        (refused.code(), refused.message()),
        (tonic::Code::InvalidArgument, why)
    );
    let why = "adapter: `../outside` is not one of this worker's (inside)";
    assert_eq!(worker_refuses(&stack, "../outside").await, why);
    generate(&url, with_adapter(TargetOnly, "inside"))
        .await
        .unwrap();
}

/// An adapter removed from the target's directory while the coordinator still lists it
/// (within the second before it asks again): the target refuses the session, the
/// coordinator asks for the list at once, and the request is refused as naming an adapter
/// no longer there (INVALID_ARGUMENT over gRPC, 400 over HTTP), not as its own failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_removed_since_it_was_listed_is_refused_as_the_requests() {
    let m = tiny_models();
    let dir = tempfile::tempdir().unwrap();
    for name in ["gone", "also-gone", "kept"] {
        write_adapter(&m, &dir.path().join(name), TinyAdapter::default());
    }
    let mut config = worker_config(&m.target);
    config.lora_adapter_dir = dir.path().into();
    let stack = Stack::start_with(worker_config(&m.draft), config);
    wait_stack(&stack).await;
    let (url, http_addr) = (stack.coordinator.url(), stack.coordinator.http_addr);
    for name in ["gone", "also-gone"] {
        generate(&url, with_adapter(TargetOnly, name))
            .await
            .unwrap();
    }
    std::fs::remove_dir_all(dir.path().join("also-gone")).unwrap();
    let completion = json!({"model": "also-gone", "prompt": PROMPT, "max_tokens": 8});
    let (status, body) = post(http_addr, "/v1/completions", &completion.to_string()).await;
    assert_eq!(status, 400, "{body}");
    let no_longer = "`also-gone` is no longer one of the target-workers' (gone, kept)";
    assert!(body.contains(no_longer), "{body}");
    // Listed again just now, with `gone`: removed next, it is refused the same way.
    std::fs::remove_dir_all(dir.path().join("gone")).unwrap();
    let refused = generate(&url, with_adapter(DraftModel, "gone"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(
        refused.message(),
        "adapter: `gone` is no longer one of the target-workers' (kept)"
    );
    generate(&url, with_adapter(TargetOnly, "kept"))
        .await
        .unwrap();
}
