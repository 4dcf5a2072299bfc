//! duet-bench: the end-to-end benchmark over a running coordinator. Runs each prompt of a JSONL
//! file greedily target-only and with the draft model for each K, and prints one JSON line per
//! prompt, then a `"total": true` line with the aggregate (tokens/s, acceptance, mean accepted
//! length, coordinator overhead per round, speedup, token identity).

use anyhow::{Context, Result, bail};
use clap::Parser;
use duet_proto::Completion;
use duet_proto::v1::generate_request::Input;
use duet_proto::v1::generation_client::GenerationClient;
use duet_proto::v1::{ChatMessage, GenerateRequest, Messages, SpeculationMethod, Timings};
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;
use tonic::transport::{Channel, Endpoint};

/// Largest message the client accepts (the services' own limit).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

#[derive(Parser, Debug)]
#[command(about = "Benchmark speculative decoding against target-only decoding over gRPC")]
struct Args {
    /// JSONL prompt file: one object per line with `prompt` (string) and optional `chat: true`
    /// (send it as one user message); an `id` or `task_id` field is copied to the output.
    #[arg(long)]
    prompts: PathBuf,
    /// Use only the first N prompts.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Draft tokens per round to measure (repeatable or a comma list).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    k: Vec<u32>,
    /// Coordinator address.
    #[arg(long, default_value = "http://127.0.0.1:50061")]
    addr: String,
    /// Warm-up: run the first N prompts once with each method before measuring (not reported).
    #[arg(long, value_name = "N", default_value_t = 1)]
    warmup: usize,
}

/// One line of the prompt file.
#[derive(Deserialize, Debug)]
struct PromptLine {
    prompt: String,
    #[serde(default)]
    chat: bool,
    #[serde(default, alias = "task_id")]
    id: Option<Value>,
}

/// How one run proposes tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Method {
    /// Target only.
    None,
    /// Draft model with K draft tokens per round.
    Draft(u32),
}

impl Method {
    fn label(self) -> &'static str {
        match self {
            Method::None => "none",
            Method::Draft(_) => "draft_model",
        }
    }

    fn k(self) -> Option<u32> {
        match self {
            Method::None => None,
            Method::Draft(k) => Some(k),
        }
    }
}

/// What one Generate call produced, from its Finished usage and the bench's own clock.
#[derive(Debug)]
struct RunResult {
    method: Method,
    /// Wall time around the whole stream, measured here.
    wall_s: f64,
    prompt_tokens: u32,
    completion_tokens: u32,
    finish_reason: i32,
    /// The method and K the server reports it used.
    server_method: i32,
    num_speculative_tokens: u32,
    draft_proposed: u32,
    draft_accepted: u32,
    rounds: u32,
    fell_back: bool,
    fallback_reason: String,
    timings: Timings,
    token_ids: Vec<u32>,
}

impl RunResult {
    fn tokens_per_s(&self) -> Option<f64> {
        ratio(f64::from(self.completion_tokens), self.wall_s)
    }

    fn json(&self) -> Value {
        let t = &self.timings;
        let mut value = json!({
            "method": self.method.label(),
            "k": self.method.k(),
            "server_method": duet_proto::method_name(self.server_method),
            "num_speculative_tokens": self.num_speculative_tokens,
            "finish_reason": duet_proto::finish_reason_name(self.finish_reason),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "wall_ms": round3(self.wall_s * 1e3),
            "tokens_per_s": self.tokens_per_s().map(round3),
            "draft_tokens_proposed": self.draft_proposed,
            "draft_tokens_accepted": self.draft_accepted,
            "rounds": self.rounds,
            "fell_back_to_target_only": self.fell_back,
            "fallback_reason": self.fallback_reason,
            "timings": {
                "time_to_first_token_ms": t.time_to_first_token_ms,
                "total_ms": t.total_ms,
                "prefill_ms": t.prefill_ms,
                "rounds_ms": t.rounds_ms,
                "draft_forward_ms": t.draft_forward_ms,
                "target_forward_ms": t.target_forward_ms,
                "queue_ms": t.queue_ms,
            },
        });
        let derived = Derived::of(&self.totals());
        derived.insert_into(&mut value);
        value
    }

    /// This run alone, as a one-run aggregate (so per-run and total figures share one formula).
    fn totals(&self) -> Totals {
        let mut totals = Totals::default();
        totals.add(self);
        totals
    }
}

/// Sums over the runs of one method.
#[derive(Debug, Default, Clone)]
struct Totals {
    runs: usize,
    completion_tokens: u64,
    wall_s: f64,
    draft_proposed: u64,
    draft_accepted: u64,
    rounds: u64,
    /// Sums of the runs' timings.
    timings: Timings,
    fell_back: usize,
    /// Runs whose tokens differed from the target-only run of the same prompt.
    not_identical: usize,
    /// Time to first token of each run.
    ttft_ms: Vec<f64>,
    /// Per prompt: this method's tokens/s over target-only's (speculative methods).
    speedups: Vec<f64>,
}

impl Totals {
    fn add(&mut self, run: &RunResult) {
        self.runs += 1;
        self.completion_tokens += u64::from(run.completion_tokens);
        self.wall_s += run.wall_s;
        self.draft_proposed += u64::from(run.draft_proposed);
        self.draft_accepted += u64::from(run.draft_accepted);
        self.rounds += u64::from(run.rounds);
        let (sum, t) = (&mut self.timings, &run.timings);
        sum.rounds_ms += t.rounds_ms;
        sum.draft_forward_ms += t.draft_forward_ms;
        sum.target_forward_ms += t.target_forward_ms;
        sum.queue_ms += t.queue_ms;
        self.fell_back += usize::from(run.fell_back);
        self.ttft_ms.push(run.timings.time_to_first_token_ms);
    }

    fn tokens_per_s(&self) -> Option<f64> {
        ratio(self.completion_tokens as f64, self.wall_s)
    }
}

/// Figures derived from sums: the same formulas for one run and for a whole method.
#[derive(Debug)]
struct Derived {
    acceptance_rate: Option<f64>,
    /// Tokens committed per target forward pass (vLLM's mean acceptance length).
    mean_accepted_length: Option<f64>,
    /// Round wall time not spent in worker forward passes or queues, per round.
    overhead_ms_per_round: Option<f64>,
    /// That overhead as a percentage of the mean round time.
    overhead_pct: Option<f64>,
}

impl Derived {
    fn of(t: &Totals) -> Self {
        let rounds = t.rounds as f64;
        let overhead_ms_per_round = duet_proto::overhead_ms_per_round(&t.timings, t.rounds);
        let mean_round_ms = ratio(t.timings.rounds_ms, rounds);
        Derived {
            acceptance_rate: ratio(t.draft_accepted as f64, t.draft_proposed as f64),
            mean_accepted_length: ratio(t.completion_tokens as f64, rounds),
            overhead_ms_per_round,
            overhead_pct: overhead_ms_per_round
                .zip(mean_round_ms)
                .and_then(|(o, r)| ratio(100.0 * o, r)),
        }
    }

    fn insert_into(&self, value: &mut Value) {
        value["acceptance_rate"] = json!(self.acceptance_rate.map(round3));
        value["mean_accepted_length"] = json!(self.mean_accepted_length.map(round3));
        value["overhead_ms_per_round"] = json!(self.overhead_ms_per_round.map(round3));
        value["overhead_pct"] = json!(self.overhead_pct.map(round3));
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let mut prompts = read_prompts(&args.prompts)?;
    if let Some(limit) = args.limit {
        prompts.truncate(limit);
    }
    if prompts.is_empty() {
        bail!("no prompts in {}", args.prompts.display());
    }
    let channel = Endpoint::from_shared(args.addr.clone())
        .with_context(|| format!("invalid address {:?}", args.addr))?
        .tcp_nodelay(true)
        .connect()
        .await
        .with_context(|| format!("cannot connect to {}", args.addr))?;
    let client = GenerationClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let methods: Vec<Method> = std::iter::once(Method::None)
        .chain(args.k.iter().map(|&k| Method::Draft(k)))
        .collect();

    warm_up(&client, &prompts, &methods, &args).await;

    let mut totals = vec![Totals::default(); methods.len()];
    let mut errors = 0usize;
    for (index, prompt) in prompts.iter().enumerate() {
        match run_prompt(&client, prompt, &methods, args.max_tokens).await {
            Ok(runs) => {
                println!("{}", prompt_json(index, prompt, &runs));
                for (total, run) in totals.iter_mut().zip(&runs) {
                    total.add(run);
                    total.not_identical += usize::from(!identical(run, &runs[0]));
                    if run.method != Method::None {
                        total
                            .speedups
                            .extend(speedup(run.tokens_per_s(), runs[0].tokens_per_s()));
                    }
                }
            }
            Err(e) => {
                eprintln!("prompt {index}: {e:#}");
                errors += 1;
            }
        }
    }
    println!("{}", total_json(&methods, &totals, errors, &args));
    Ok(())
}

fn read_prompts(path: &Path) -> Result<Vec<PromptLine>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{} line {}: not a prompt object", path.display(), n + 1))
        })
        .collect()
}

/// Runs the first `--warmup` prompts once with each method, discarding the results.
async fn warm_up(
    client: &GenerationClient<Channel>,
    prompts: &[PromptLine],
    methods: &[Method],
    args: &Args,
) {
    for prompt in prompts.iter().take(args.warmup) {
        for &method in methods {
            if let Err(e) = generate(client, prompt, method, args.max_tokens).await {
                eprintln!("warm-up ({}): {e:#}", method.label());
            }
        }
    }
}

/// Runs one prompt with every method in turn (target-only first); fails on the first error.
async fn run_prompt(
    client: &GenerationClient<Channel>,
    prompt: &PromptLine,
    methods: &[Method],
    max_tokens: u32,
) -> Result<Vec<RunResult>> {
    let mut runs = Vec::with_capacity(methods.len());
    for &method in methods {
        let run = generate(client, prompt, method, max_tokens)
            .await
            .with_context(|| match method.k() {
                Some(k) => format!("{} K={k}", method.label()),
                None => method.label().to_string(),
            })?;
        runs.push(run);
    }
    Ok(runs)
}

fn request(prompt: &PromptLine, method: Method, max_tokens: u32) -> GenerateRequest {
    let input = if prompt.chat {
        Input::Messages(Messages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: prompt.prompt.clone(),
            }],
        })
    } else {
        Input::Prompt(prompt.prompt.clone())
    };
    let (speculation, k) = match method {
        Method::None => (SpeculationMethod::None, 0),
        Method::Draft(k) => (SpeculationMethod::DraftModel, k),
    };
    GenerateRequest {
        input: Some(input),
        max_tokens,
        temperature: 0.0,
        speculation: speculation as i32,
        num_speculative_tokens: k,
        ..GenerateRequest::default()
    }
}

/// One greedy Generate call, timed around the whole stream.
async fn generate(
    client: &GenerationClient<Channel>,
    prompt: &PromptLine,
    method: Method,
    max_tokens: u32,
) -> Result<RunResult> {
    let request = request(prompt, method, max_tokens);
    let start = Instant::now();
    let stream = client
        .clone()
        .generate(request)
        .await
        .map_err(status_error)?
        .into_inner();
    let done = Completion::read(stream, |_| {})
        .await
        .map_err(status_error)?;
    let wall_s = start.elapsed().as_secs_f64();
    let usage = done.usage;
    Ok(RunResult {
        method,
        wall_s,
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        finish_reason: done.finish_reason.unwrap_or_default(),
        server_method: usage.method,
        num_speculative_tokens: usage.num_speculative_tokens,
        draft_proposed: usage.draft_tokens_proposed,
        draft_accepted: usage.draft_tokens_accepted,
        rounds: usage.rounds,
        fell_back: usage.fell_back_to_target_only,
        fallback_reason: usage.fallback_reason,
        timings: usage.timings.unwrap_or_default(),
        token_ids: done.token_ids,
    })
}

fn status_error(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", status.code(), status.message())
}

fn identical(run: &RunResult, target_only: &RunResult) -> bool {
    run.token_ids == target_only.token_ids
}

/// The output line for one prompt: its runs, target-only first, each speculative run with its
/// speedup over target-only and whether its tokens were identical.
fn prompt_json(index: usize, prompt: &PromptLine, runs: &[RunResult]) -> Value {
    let target_only = &runs[0];
    let runs: Vec<Value> = runs
        .iter()
        .map(|run| {
            let mut value = run.json();
            if run.method != Method::None {
                value["speedup"] = json!(speedup(run.tokens_per_s(), target_only.tokens_per_s()));
                value["identical"] = json!(identical(run, target_only));
            }
            value
        })
        .collect();
    json!({
        "index": index,
        "id": prompt.id,
        "chat": prompt.chat,
        "prompt_tokens": target_only.prompt_tokens,
        "runs": runs,
    })
}

/// The final aggregate line.
fn total_json(methods: &[Method], totals: &[Totals], errors: usize, args: &Args) -> Value {
    let target_only = totals[0].tokens_per_s();
    let methods: Vec<Value> = methods
        .iter()
        .zip(totals)
        .map(|(&method, t)| {
            let mut value = json!({
                "method": method.label(),
                "k": method.k(),
                "runs": t.runs,
                "completion_tokens": t.completion_tokens,
                "wall_s": round3(t.wall_s),
                "tokens_per_s": t.tokens_per_s().map(round3),
                "draft_tokens_proposed": t.draft_proposed,
                "draft_tokens_accepted": t.draft_accepted,
                "rounds": t.rounds,
                "fell_back_to_target_only": t.fell_back,
                // Completion tokens over the time spent in rounds (after the prefill).
                "decode_tokens_per_s": ratio(t.completion_tokens as f64, t.timings.rounds_ms / 1e3).map(round3),
                "median_time_to_first_token_ms": median(&t.ttft_ms).map(round3),
            });
            Derived::of(t).insert_into(&mut value);
            if method != Method::None {
                value["speedup"] = json!(speedup(t.tokens_per_s(), target_only));
                value["not_identical"] = json!(t.not_identical);
                let mut per_prompt = t.speedups.clone();
                per_prompt.sort_by(f64::total_cmp);
                value["speedup_per_prompt"] = json!({
                    "min": per_prompt.first(),
                    "median": median(&per_prompt),
                    "max": per_prompt.last(),
                    "slower_than_target_only": per_prompt.iter().filter(|&&x| x < 1.0).count(),
                });
            }
            value
        })
        .collect();
    json!({
        "total": true,
        "prompts": totals[0].runs,
        "errors": errors,
        "max_tokens": args.max_tokens,
        "methods": methods,
    })
}

fn speedup(speculative: Option<f64>, target_only: Option<f64>) -> Option<f64> {
    speculative
        .zip(target_only)
        .and_then(|(s, t)| ratio(s, t))
        .map(round3)
}

/// The middle value (the upper one of the two middles for an even count).
fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied()
}

fn ratio(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator)
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}
