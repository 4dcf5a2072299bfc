//! The three services over real gRPC on tiny random models: exactness of greedy speculation,
//! fallback, cancellation, validation, concurrency, and the sampling distribution.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use duet_proto::v1::SpeculationMethod::{Auto, DraftModel, Ngram, None as TargetOnly};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

mod exactness;
mod failures;
mod lookup_streams;
mod output;
mod requests;
mod sampling;
mod scheduling;
mod sessions;
mod trees;
mod workers;

/// A tiny target-worker alone, serving.
async fn serving_target() -> (TinyModels, Running) {
    let m = tiny_models();
    let target = start_target(worker_config(&m.target));
    wait_serving(&target.url(), "").await;
    (m, target)
}

/// A tiny draft-worker alone, serving.
async fn serving_draft() -> (TinyModels, Running) {
    let m = tiny_models();
    let draft = start_draft(worker_config(&m.draft));
    wait_serving(&draft.url(), "").await;
    (m, draft)
}

/// A request of `prompt` constrained to `format`, seeded.
fn constrained(
    format: &pb::structured_output::Format,
    method: pb::SpeculationMethod,
    temperature: f32,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        structured_output: Some(pb::StructuredOutput {
            format: Some(format.clone()),
        }),
        temperature,
        seed: 7,
        ..request("the cat sat. the cat", 64, method)
    }
}

fn chat(messages: &[(&str, &str)]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Messages(pb::Messages {
            messages: messages
                .iter()
                .map(|(role, content)| pb::ChatMessage {
                    role: role.to_string(),
                    content: content.to_string(),
                    ..Default::default()
                })
                .collect(),
        })),
        ..request("", 8, TargetOnly)
    }
}

/// The Describe answer of the worker at `url`.
async fn described(url: &str) -> pb::ModelDescription {
    duet_proto::v1::worker_client::WorkerClient::connect(url.to_string())
        .await
        .unwrap()
        .describe(pb::DescribeRequest::default())
        .await
        .unwrap()
        .into_inner()
}

/// Whether the worker at `url` verifies trees of drafts (its Describe: on a CPU, not on a
/// GPU).
async fn verifies_trees(url: &str) -> bool {
    described(url).await.verifies_trees
}

/// The target's logits after `ids` computed as a target-worker computes them: the prompt's
/// head (`ids[..prompt_len - 1]`) prefilled, the rest fed on the invariant path. On a CPU
/// this equals one forward pass bitwise; on a GPU prefill rounds differently, and a
/// reference computed otherwise would not be the distribution the workers sample from.
fn worker_logits(model: &duet_engine::Model, ids: &[u32], prompt_len: usize) -> Vec<f32> {
    let mut cache = model.new_cache(64).unwrap();
    let head = &ids[..prompt_len - 1];
    if !head.is_empty() {
        model
            .prefill(&mut cache, head, duet_engine::LogitsFor::None)
            .unwrap();
    }
    let logits = model
        .forward(&mut cache, &ids[head.len()..], duet_engine::LogitsFor::Last)
        .unwrap();
    logits.last().unwrap().to_vec()
}
