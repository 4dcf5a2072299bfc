//! duet-client: calls Generate on a duet coordinator, prints the completion as it streams in,
//! then the usage figures (to stderr, or as one JSON object on stdout with `--json`).

use clap::{ArgGroup, Parser};
use duet_proto::Completion;
use duet_proto::v1::generate_request::Input;
use duet_proto::v1::{
    ChatMessage, GenerateRequest, Messages, PromptLogprobs, ProposerUsage, SpeculationMethod,
    Timings, TokenLogprobs, Usage,
};
use duet_tools::connect::Connection;
use serde_json::json;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(Parser, Debug)]
#[command(about = "Generate text with a duet coordinator and print the usage figures")]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "chat"])))]
struct Args {
    /// Coordinator address (https:// for TLS).
    #[arg(long, default_value = "http://127.0.0.1:50061")]
    addr: String,
    #[command(flatten)]
    connection: Connection,
    /// Raw prompt text.
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// One user chat message (rendered with the target model's chat template).
    #[arg(long, value_name = "TEXT")]
    chat: Option<String>,
    /// Upper bound on completion tokens (0: the server's default).
    #[arg(long, default_value_t = 0)]
    max_tokens: u32,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: disabled).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Nucleus sampling mass in (0, 1] (unset: disabled).
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the tokens at least this share as likely as the most likely one (0:
    /// disabled).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop string (repeatable).
    #[arg(long, value_name = "TEXT")]
    stop: Vec<String>,
    /// How tokens are proposed.
    #[arg(long, value_parser = method, default_value = "auto")]
    method: SpeculationMethod,
    /// Draft tokens per round for the draft-model method (0: the server's choice).
    #[arg(short = 'k', long, default_value_t = 0)]
    num_speculative_tokens: u32,
    /// OpenAI's presence and frequency penalties, each in [-2, 2].
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// vLLM's repetition penalty, > 0 (1: none): a token seen in the prompt or the
    /// completion is less likely above 1.
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Ask for each completion token's log-probability and the N (0-20) most likely tokens'
    /// at its position (in the JSON output, `logprobs`).
    #[arg(long, value_name = "N")]
    logprobs: Option<u32>,
    /// Ask for each prompt token's log-probability after the first and the N (0-20) most
    /// likely tokens' at its position (in the JSON output, `prompt_logprobs`).
    #[arg(long, value_name = "N")]
    prompt_logprobs: Option<u32>,
    /// Add BIAS (-100 to 100) to token ID's logit at every position (OpenAI's logit_bias);
    /// repeatable.
    #[arg(long, value_name = "ID=BIAS", value_parser = token_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Go on past end-of-sequence tokens until --max-tokens or a stop string.
    #[arg(long)]
    ignore_eos: bool,
    /// A token id that ends the completion as the end-of-sequence token does (vLLM's
    /// stop_token_ids); repeatable.
    #[arg(long, value_name = "ID")]
    stop_token_id: Vec<u32>,
    /// The text ends with the stop string that ended it (vLLM's
    /// include_stop_str_in_output).
    #[arg(long)]
    include_stop_str: bool,
    /// Special (control) tokens the model writes keep their text (vLLM's
    /// skip_special_tokens false).
    #[arg(long)]
    keep_special_tokens: bool,
    /// Fill in the middle: the completion goes between --prompt and this text (a code
    /// model's fill-in-the-middle tokens around them).
    #[arg(long)]
    suffix: Option<String>,
    /// With --suffix: another file of the repository, read before the middle in the
    /// model's repository-level format (repeat for more, the most relevant last).
    #[arg(long, value_name = "PATH", requires = "suffix")]
    repository_file: Vec<std::path::PathBuf>,
    /// With --repository-file: the repository's name.
    #[arg(long, default_value = "")]
    repository_name: String,
    /// With --repository-file: the path of the file being completed.
    #[arg(long, default_value = "")]
    file_path: String,
    /// The completion ends before a line indented by fewer spaces or tabs (llama.cpp's
    /// n_indent).
    #[arg(long, default_value_t = 0)]
    min_line_indent: u32,
    /// The completion ends once it holds a line, this many milliseconds after the first
    /// round (llama.cpp's t_max_predict_ms).
    #[arg(long, default_value_t = 0)]
    max_predict_ms: u32,
    /// A cached prompt prefix only from requests of the same salt (vLLM's cache_salt).
    #[arg(long, default_value = "")]
    cache_salt: String,
    /// The target's LoRA adapter, by the name its target-workers load it as.
    #[arg(long, default_value = "")]
    adapter: String,
    /// Where the server's places are all taken: the lower waits less (vLLM's priority).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    priority: i32,
    /// No end-of-sequence token, nor stop string, before this many completion tokens.
    #[arg(long, default_value_t = 0)]
    min_tokens: u32,
    /// Text the completion is expected to repeat in large part (OpenAI's predicted output):
    /// NGRAM and AUTO draft from it.
    #[arg(long, value_name = "TEXT", default_value = "")]
    prediction: String,
    /// More variables for the chat template of `--chat`, a JSON object (Qwen3's
    /// `{"enable_thinking": false}`, say).
    #[arg(long, value_name = "JSON", default_value = "")]
    chat_template_kwargs: String,
    /// Structured output: the completion is one JSON value this JSON Schema accepts.
    #[arg(long, value_name = "SCHEMA", group = "format")]
    json_schema: Option<String>,
    /// Structured output: the completion is a JSON object.
    #[arg(long, group = "format")]
    json_object: bool,
    /// Structured output: the whole completion matches this regular expression.
    #[arg(long, value_name = "REGEX", group = "format")]
    regex: Option<String>,
    /// Structured output: the completion follows this grammar (llguidance's Lark dialect).
    #[arg(long, value_name = "GRAMMAR", group = "format")]
    lark: Option<String>,
    /// Print the final usage as one JSON object on stdout (with the text) instead of streaming
    /// the text and printing human-readable usage.
    #[arg(long)]
    json: bool,
    /// Before calling, wait up to SECS seconds for the coordinator's health to be SERVING.
    #[arg(long, value_name = "SECS")]
    wait_ready: Option<f64>,
}

/// `--method`: a method's short name (`auto`, `draft_model` or `draft`, `ngram`, `none`).
fn method(name: &str) -> Result<SpeculationMethod, String> {
    duet_proto::parse_method(name).ok_or_else(|| format!("unknown method {name:?}"))
}

/// What the client saw of one Generate call.
struct Outcome {
    completion: Completion,
    /// Wall time of the whole call measured here.
    client_ms: f64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<(), String> {
    let channel = channel(&args.connection, &args.addr)?;
    if let Some(secs) = args.wait_ready {
        wait_ready(channel.clone(), &args.addr, secs).await?;
    }
    let client = args.connection.client(channel)?;
    let request = GenerateRequest {
        repository: repository(args)?,
        ..request(args)
    };
    let outcome = generate(client, request, !args.json)
        .await
        .map_err(|status| status_message(&status, &args.addr))?;
    if args.json {
        println!("{}", usage_json(&outcome));
    } else {
        eprint!("{}", usage_text(&outcome));
    }
    Ok(())
}

/// `<code>: <message>`, naming the address when the server could not be reached.
fn status_message(status: &tonic::Status, addr: &str) -> String {
    let message = format!("{:?}: {}", status.code(), status.message());
    if status.code() == tonic::Code::Unavailable {
        format!("{message} (coordinator at {addr})")
    } else {
        message
    }
}

/// A lazily connecting channel: connection failures surface as UNAVAILABLE on each call, so
/// `--wait-ready` can keep trying until the server is up.
fn channel(connection: &Connection, addr: &str) -> Result<Channel, String> {
    let endpoint = connection
        .endpoint(addr)?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    Ok(endpoint.connect_lazy())
}

/// Polls grpc.health.v1 Check (the overall status, "") until SERVING or `secs` have passed.
async fn wait_ready(channel: Channel, addr: &str, secs: f64) -> Result<(), String> {
    let limit = Duration::try_from_secs_f64(secs)
        .map_err(|e| format!("invalid --wait-ready {secs}: {e}"))?;
    let deadline = Instant::now() + limit;
    let mut health = HealthClient::new(channel);
    let mut last = String::from("no answer");
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let check = health.check(HealthCheckRequest {
            service: String::new(),
        });
        match tokio::time::timeout(remaining, check).await {
            Ok(Ok(response)) => {
                let status = response.into_inner().status;
                if status == ServingStatus::Serving as i32 {
                    return Ok(());
                }
                last = ServingStatus::try_from(status)
                    .map_or_else(|_| format!("status {status}"), |s| s.as_str_name().into());
            }
            Ok(Err(status)) => last = format!("{:?}: {}", status.code(), status.message()),
            Err(_) => {}
        }
        if Instant::now() + Duration::from_millis(250) >= deadline {
            return Err(format!(
                "{addr} was not SERVING within {secs} s (last health check: {last})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn request(args: &Args) -> GenerateRequest {
    let input = match (&args.prompt, &args.chat) {
        (Some(prompt), _) => Input::Prompt(prompt.clone()),
        (None, chat) => Input::Messages(Messages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: chat.clone().unwrap_or_default(),
                ..Default::default()
            }],
        }),
    };
    GenerateRequest {
        input: Some(input),
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        stop: args.stop.clone(),
        speculation: args.method as i32,
        num_speculative_tokens: args.num_speculative_tokens,
        logprobs: args.logprobs.is_some(),
        top_logprobs: args.logprobs.unwrap_or(0),
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        repetition_penalty: args.repetition_penalty,
        prompt_logprobs: args.prompt_logprobs,
        logit_bias: args.logit_bias.iter().copied().collect(),
        ignore_eos: args.ignore_eos,
        stop_token_ids: args.stop_token_id.clone(),
        include_stop_str_in_output: args.include_stop_str,
        skip_special_tokens: args.keep_special_tokens.then_some(false),
        suffix: args.suffix.clone(),
        cache_salt: args.cache_salt.clone(),
        adapter: args.adapter.clone(),
        priority: args.priority,
        min_tokens: args.min_tokens,
        prediction: args.prediction.clone(),
        structured_output: structured_output(args),
        tools: Vec::new(),
        tool_choice: String::new(),
        parallel_tool_calls: None,
        chat_template_kwargs: args.chat_template_kwargs.clone(),
        // Read from files by `repository`.
        repository: None,
        min_line_indent: args.min_line_indent,
        max_predict_ms: args.max_predict_ms,
    }
}

/// The repository around the middle, its files read from `--repository-file`.
fn repository(args: &Args) -> Result<Option<duet_proto::v1::Repository>, String> {
    if args.repository_file.is_empty() {
        return Ok(None);
    }
    let read = |path: &std::path::PathBuf| match std::fs::read_to_string(path) {
        Ok(text) => Ok(duet_proto::v1::RepositoryFile {
            path: path.display().to_string(),
            text,
        }),
        Err(e) => Err(format!("reading {}: {e}", path.display())),
    };
    Ok(Some(duet_proto::v1::Repository {
        name: args.repository_name.clone(),
        path: args.file_path.clone(),
        files: args
            .repository_file
            .iter()
            .map(read)
            .collect::<Result<_, _>>()?,
    }))
}

/// The structured output the flags ask for, if any (clap allows one).
fn structured_output(args: &Args) -> Option<duet_proto::v1::StructuredOutput> {
    use duet_proto::v1::structured_output::Format;
    let format = match (&args.json_schema, args.json_object, &args.regex, &args.lark) {
        (Some(schema), ..) => Format::JsonSchema(schema.clone()),
        (_, true, ..) => Format::JsonObject(true),
        (_, _, Some(regex), _) => Format::Regex(regex.clone()),
        (.., Some(grammar)) => Format::Lark(grammar.clone()),
        _ => return None,
    };
    Some(duet_proto::v1::StructuredOutput {
        format: Some(format),
    })
}

/// Runs Generate, printing each chunk's text to stdout as it arrives when `echo` is set.
async fn generate(
    mut client: duet_tools::connect::Client,
    request: GenerateRequest,
    echo: bool,
) -> Result<Outcome, tonic::Status> {
    let start = Instant::now();
    let stream = client.generate(request).await?.into_inner();
    let completion = Completion::read(stream, |text| emit(text, echo)).await?;
    Ok(Outcome {
        completion,
        client_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

fn emit(text: &str, echo: bool) {
    if echo && !text.is_empty() {
        let mut stdout = std::io::stdout().lock();
        // A closed stdout (say, piped into `head`) is not worth failing the call for.
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    }
}

fn ratio(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator)
}

fn usage_json(outcome: &Outcome) -> serde_json::Value {
    let c = &outcome.completion;
    let usage = c.usage.clone();
    let timings = usage.timings.unwrap_or_default();
    let overhead = duet_proto::overhead_ms_per_round(&timings, u64::from(usage.rounds));
    json!({
        "text": c.text,
        "finish_reason": duet_proto::finish_reason_name(c.finish_reason.unwrap_or_default()),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "repository_files_left_out": usage.repository_files_left_out,
        "method": duet_proto::method_name(usage.method),
        "num_speculative_tokens": usage.num_speculative_tokens,
        "k_chosen_per_round": usage.k_chosen_per_round,
        "draft_tokens_proposed": usage.draft_tokens_proposed,
        "draft_tokens_accepted": usage.draft_tokens_accepted,
        "acceptance_rate": ratio(
            f64::from(usage.draft_tokens_accepted),
            f64::from(usage.draft_tokens_proposed),
        ),
        "rounds": usage.rounds,
        "mean_tokens_per_round": ratio(f64::from(usage.completion_tokens), f64::from(usage.rounds)),
        "fell_back_to_target_only": usage.fell_back_to_target_only,
        "fallback_reason": usage.fallback_reason,
        "proposers": usage.proposers.iter().map(|p| json!({
            "method": duet_proto::method_name(p.method),
            "rounds": p.rounds,
            "draft_tokens_proposed": p.draft_tokens_proposed,
            "draft_tokens_accepted": p.draft_tokens_accepted,
        })).collect::<Vec<_>>(),
        "timings": {
            "time_to_first_token_ms": timings.time_to_first_token_ms,
            "total_ms": timings.total_ms,
            "prefill_ms": timings.prefill_ms,
            "rounds_ms": timings.rounds_ms,
            "draft_forward_ms": timings.draft_forward_ms,
            "target_forward_ms": timings.target_forward_ms,
            "queue_ms": timings.queue_ms,
            "admission_wait_ms": timings.admission_wait_ms,
        },
        "tokens_per_s": ratio(f64::from(usage.completion_tokens), timings.total_ms / 1e3),
        "overhead_ms_per_round": overhead,
        "client_ms": outcome.client_ms,
        "logprobs": logprobs_json(&c.token_ids, &c.logprobs),
        "prompt_logprobs": c.prompt.as_ref().map(prompt_logprobs_json),
    })
}

/// The prompt's tokens after the first (which nothing precedes) with their figures.
fn prompt_logprobs_json(p: &PromptLogprobs) -> serde_json::Value {
    logprobs_json(p.token_ids.get(1..).unwrap_or(&[]), &p.logprobs)
}

/// `--logit-bias`'s `ID=BIAS`.
fn token_bias(arg: &str) -> Result<(u32, f32), String> {
    let (id, bias) = arg.split_once('=').ok_or("expected ID=BIAS")?;
    let id = id.parse().map_err(|e| format!("token id {id:?}: {e}"))?;
    let bias = bias.parse().map_err(|e| format!("bias {bias:?}: {e}"))?;
    Ok((id, bias))
}

/// Each token's id, log-probability and most likely alternatives (`[id, logprob]` pairs),
/// where the call asked for them; else null.
fn logprobs_json(ids: &[u32], logprobs: &[TokenLogprobs]) -> serde_json::Value {
    if logprobs.is_empty() {
        return serde_json::Value::Null;
    }
    let tokens = ids.iter().zip(logprobs).map(|(id, l)| {
        let top = l.top_token_ids.iter().zip(&l.top_logprobs);
        json!({
            "token_id": id,
            "logprob": l.logprob,
            "top": top.map(|(id, lp)| json!([id, lp])).collect::<Vec<_>>(),
        })
    });
    serde_json::Value::Array(tokens.collect())
}

/// The human-readable usage block, starting on a line of its own after a blank line (stdout
/// keeps exactly the completion text, so the line break after it is printed here).
fn usage_text(outcome: &Outcome) -> String {
    let c = &outcome.completion;
    let usage = c.usage.clone();
    let timings = usage.timings.unwrap_or_default();
    let overhead = duet_proto::overhead_ms_per_round(&timings, u64::from(usage.rounds));
    let method = duet_proto::method_name(usage.method);
    let mut lines = vec![
        String::new(),
        String::new(),
        format!(
            "finish: {}",
            duet_proto::finish_reason_name(c.finish_reason.unwrap_or_default())
        ),
        format!(
            "prompt tokens: {}, completion tokens: {}",
            usage.prompt_tokens, usage.completion_tokens
        ),
    ];
    if usage.repository_files_left_out > 0 {
        let n = usage.repository_files_left_out;
        lines.push(format!("repository files left out for room: {n}"));
    }
    let k = usage.num_speculative_tokens;
    lines.push(match SpeculationMethod::try_from(usage.method) {
        Ok(SpeculationMethod::None) => format!("method: {method}"),
        _ if usage.k_chosen_per_round => format!("method: {method} (K at most {k})"),
        _ => format!("method: {method} (K={k})"),
    });
    if usage.method != SpeculationMethod::None as i32 {
        let acceptance = ratio(
            f64::from(usage.draft_tokens_accepted),
            f64::from(usage.draft_tokens_proposed),
        );
        lines.push(format!(
            "draft tokens: proposed {}, accepted {} (acceptance {})",
            usage.draft_tokens_proposed,
            usage.draft_tokens_accepted,
            fmt_opt(acceptance, 2)
        ));
    }
    if !usage.proposers.is_empty() {
        let by: Vec<String> = usage.proposers.iter().map(proposer_text).collect();
        lines.push(format!("rounds by proposer: {}", by.join(", ")));
    }
    if usage.drafted_ahead > 0 {
        lines.push(format!(
            "drafted ahead: {} Propose calls beside a Verify, {} rounds used their drafts",
            usage.drafted_ahead, usage.drafted_ahead_used
        ));
    }
    let per_round = ratio(f64::from(usage.completion_tokens), f64::from(usage.rounds));
    lines.push(format!(
        "rounds: {} (mean {} tokens per round)",
        usage.rounds,
        fmt_opt(per_round, 2)
    ));
    lines.push(if usage.fell_back_to_target_only {
        format!("fell back to target-only: yes ({})", usage.fallback_reason)
    } else {
        "fell back to target-only: no".into()
    });
    lines.extend(timing_lines(&usage, &timings, overhead));
    lines.push(format!("client wall time: {:.1} ms", outcome.client_ms));
    if c.text.ends_with('\n') {
        lines.remove(0);
    }
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

/// The usage's timings, as `usage_text` shows them.
fn timing_lines(usage: &Usage, timings: &Timings, overhead: Option<f64>) -> Vec<String> {
    let tokens_per_s = ratio(f64::from(usage.completion_tokens), timings.total_ms / 1e3);
    let mut lines = vec![format!(
        "time to first token: {:.1} ms, total: {:.1} ms, {} tokens/s",
        timings.time_to_first_token_ms,
        timings.total_ms,
        fmt_opt(tokens_per_s, 1)
    )];
    if timings.admission_wait_ms > 0.0 {
        lines.push(format!(
            "of it waiting for a place (the coordinator's queue): {:.1} ms",
            timings.admission_wait_ms
        ));
    }
    lines.push(format!(
        "forward time: draft {:.1} ms, target {:.1} ms, queued {:.1} ms; \
         coordinator+network overhead {} ms per round",
        timings.draft_forward_ms,
        timings.target_forward_ms,
        timings.queue_ms,
        fmt_opt(overhead, 2)
    ));
    lines
}

/// `ngram 12 (40 drafted, 31 accepted)`, or `none 3`.
fn proposer_text(p: &ProposerUsage) -> String {
    let name = duet_proto::method_name(p.method);
    match p.draft_tokens_proposed {
        0 => format!("{name} {}", p.rounds),
        n => format!(
            "{name} {} ({n} drafted, {} accepted)",
            p.rounds, p.draft_tokens_accepted
        ),
    }
}

fn fmt_opt(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".into(), |v| format!("{v:.decimals$}"))
}
