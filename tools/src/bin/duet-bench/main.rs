//! duet-bench: the end-to-end benchmark over a running coordinator. Runs JSONL prompt sets
//! greedily with each speculation method, at each concurrency, the methods interleaved group
//! by group in balanced orders (so the machine's drift hits them alike), and prints one
//! JSON line per set, concurrency and method (aggregate tokens/s, ratio to NONE and its
//! spread over repeats, latencies as a caller sees them, acceptance, rounds by proposer,
//! token identity with NONE), then Markdown tables of the ratios and the latencies on
//! stderr. With `--conversations` it runs multi-turn sets instead, to compare coordinators
//! (`conversations`: the prefix cache and its routing).

mod conversations;
mod report;

use anyhow::{Context, Result, bail};
use clap::Parser;
use duet_proto::Completion;
use duet_proto::v1::generate_request::Input;
use duet_proto::v1::{ChatMessage, GenerateRequest, Messages, SpeculationMethod, Usage};
use duet_tools::connect::{Client, Connection};
use report::{Totals, latency_markdown, markdown, ratio, round3, summary};
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Benchmark duet's speculation methods against target-only decoding over gRPC")]
struct Args {
    /// JSONL prompt file, one object per line with `prompt` (string) and optional `chat: true`
    /// (send it as one user message); repeatable: each file is a set, named after its stem
    /// (or NAME=PATH).
    #[arg(
        long = "prompts",
        required_unless_present = "conversations",
        value_name = "[NAME=]PATH"
    )]
    sets: Vec<String>,
    /// JSONL conversation file, one object per line with `turns` (the user's messages, in
    /// order) and optional `system` and `id`; repeatable, named like `--prompts`. Each
    /// conversation runs on every `--addr` with `--methods`' first method, greedily, each
    /// turn sent with the answers so far (see `conversations`).
    #[arg(long = "conversations", value_name = "[NAME=]PATH")]
    conversations: Vec<String>,
    /// Use only the first N prompts of each set.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Sampling temperature (0: greedy). Sampling requests carry the prompt's line number as
    /// their seed; their texts are compared with NONE's only where the method is NONE too (on
    /// another coordinator: the same seed gives the same text), since speculative sampling
    /// gives the same distribution, not the same draws; elsewhere `not_identical_to_none` is
    /// null.
    #[arg(long, default_value_t = 0.0, value_parser = temperature)]
    temperature: f32,
    /// Methods, each `none`, `draft_model`, `ngram` or `auto`, optionally with K
    /// (`draft_model:4`; without it the server's) and a coordinator named by `--addr`
    /// (`draft_model:4@overlap`; without it the first); NONE is always run, on the first
    /// coordinator, as the reference.
    #[arg(long, value_delimiter = ',', default_value = "draft_model,ngram,auto")]
    methods: Vec<String>,
    /// Concurrent streams to measure at (each level runs at least as many requests as it has
    /// streams, cycling through the prompts).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Coordinator address, `[NAME=]URL` (https:// for TLS); repeatable, to compare
    /// coordinators with different settings on the same workers (methods name theirs with
    /// `@NAME`).
    #[arg(long = "addr", default_value = "http://127.0.0.1:50061")]
    addrs: Vec<String>,
    #[command(flatten)]
    connection: Connection,
    /// Warm-up: run the first prompt of each set once with each method before measuring,
    /// and every prompt's prefill once (one token, NONE; three of DRAFT_MODEL where a
    /// method is DRAFT_MODEL), so that every method finds the workers' prefix caches
    /// holding it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    warmup: bool,
    /// Also print one JSON line per request (with its token ids).
    #[arg(long)]
    per_request: bool,
    /// Run every set and concurrency this many times over (the groups interleaved anew each
    /// time): the ratios are pooled and also given per repeat, to show how much they move.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
}

impl Args {
    fn greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether `method`'s texts must be NONE's: every greedy one, and a sampling NONE's.
    fn same_text_as_none(&self, method: Method<'_>) -> bool {
        self.greedy() || method.method == SpeculationMethod::None
    }
}

/// One line of a prompt file.
#[derive(Deserialize, Debug, Clone)]
struct PromptLine {
    prompt: String,
    #[serde(default)]
    chat: bool,
    /// Fill in the middle: the completion goes between `prompt` and this text.
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default, alias = "task_id")]
    id: Option<Value>,
    /// Its line in the file, from 1: a sampling request's seed.
    #[serde(skip)]
    line: u64,
}

#[derive(Debug)]
struct PromptSet {
    name: String,
    prompts: Vec<PromptLine>,
}

/// A method as requested: the wire value, K (0: the server's choice) and the coordinator.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Method<'a> {
    method: SpeculationMethod,
    k: u32,
    /// The coordinator's name and its index in `--addr` (0 and no name: the first).
    at: (usize, &'a str),
}

impl<'a> Method<'a> {
    const NONE: Method<'static> = Method {
        method: SpeculationMethod::None,
        k: 0,
        at: (0, ""),
    };

    /// `text` as `METHOD[:K][@COORDINATOR]`, the coordinator one of `coordinators`' names.
    fn parse(text: &str, coordinators: &'a [Coordinator]) -> Result<Self> {
        let (text, at) = match text.split_once('@') {
            Some((text, name)) => match coordinators.iter().position(|c| c.name == name) {
                Some(i) => (text, (i, coordinators[i].name.as_str())),
                None => bail!("no --addr is named {name:?} (in {text:?})"),
            },
            None => (text, (0, "")),
        };
        let (name, k) = match text.split_once(':') {
            Some((name, k)) => (name, k.parse().with_context(|| format!("K in {text:?}"))?),
            None => (text, 0),
        };
        let Some(method) = duet_proto::parse_method(name) else {
            bail!("unknown method {name:?} (none, draft_model, ngram, auto)");
        };
        Ok(Self { method, k, at })
    }

    fn label(self) -> String {
        let mut label = duet_proto::method_name(self.method as i32);
        if self.k > 0 {
            label.push_str(&format!(":{}", self.k));
        }
        if self.at.0 > 0 {
            label.push_str(&format!("@{}", self.at.1));
        }
        label
    }
}

/// A coordinator to send requests to.
#[derive(Debug)]
struct Coordinator {
    name: String,
    client: Client,
}

impl Coordinator {
    /// `[NAME=]URL`, connected.
    async fn connect(spec: &str, connection: &Connection) -> Result<Self> {
        let (name, url) = match spec.split_once('=') {
            Some((name, url)) => (name.to_string(), url),
            None => (String::new(), spec),
        };
        let channel = connection
            .endpoint(url)
            .map_err(anyhow::Error::msg)?
            .tcp_nodelay(true)
            .connect()
            .await
            .with_context(|| format!("cannot connect to {url}"))?;
        let client = connection.client(channel).map_err(anyhow::Error::msg)?;
        Ok(Self { name, client })
    }
}

/// What one Generate call produced, from its final usage and the bench's own clock.
#[derive(Debug)]
struct RunResult {
    wall_s: f64,
    completion: Completion,
    /// From the call to the first message with tokens (time to first token).
    first_s: Option<f64>,
    /// Between consecutive messages with tokens (a speculative round's tokens come in one).
    gaps_s: Vec<f64>,
}

impl RunResult {
    fn usage(&self) -> &Usage {
        &self.completion.usage
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
    if !args.conversations.is_empty() {
        return conversations::run(&args).await;
    }
    let sets = args
        .sets
        .iter()
        .map(|s| read_set(s, args.limit))
        .collect::<Result<Vec<_>>>()?;
    let coordinators = connect_all(&args).await?;
    let mut methods = vec![Method::NONE];
    for m in &args.methods {
        let m = Method::parse(m, &coordinators)?;
        if !methods.contains(&m) {
            methods.push(m);
        }
    }

    if args.warmup {
        for set in &sets {
            for &method in &methods {
                let client = &coordinators[method.at.0].client;
                if let Err(e) = generate(client, &set.prompts[0], method, &args).await {
                    eprintln!("warm-up ({}): {e:#}", method.label());
                }
            }
            // Otherwise the method that meets a prompt first pays its prefill and the others
            // find it cached: at as many streams as prompts, NONE's group in the first
            // repeat every time. The draft-worker's too where a method drafts with the
            // draft model: on shared cores (`take_turns`) a cold draft prefill holds the
            // cores for seconds while every stream waits. Each coordinator a method runs on
            // gets its own: another stack (other workers) would otherwise meet the prompts
            // cold in its first group.
            for (at, coordinator) in coordinators.iter().enumerate() {
                let on_it: Vec<Method<'_>> =
                    methods.iter().filter(|m| m.at.0 == at).copied().collect();
                if on_it.is_empty() {
                    continue;
                }
                let (warm, tokens) = prefill_warm_up(&on_it);
                for prompt in &set.prompts {
                    let mut prefill = request(prompt, warm, &args);
                    prefill.max_tokens = tokens;
                    if let Err(e) = send(&coordinator.client, prefill).await {
                        eprintln!("warm-up (prefill): {e:#}");
                    }
                }
            }
        }
    }
    let mut table = Vec::new();
    for set in &sets {
        for &concurrency in &args.concurrency {
            let totals = measure(&coordinators, set, &methods, concurrency, &args).await;
            for (method, t) in methods.iter().zip(&totals) {
                let line = summary(set, concurrency, *method, t, &totals[0], &args);
                println!("{line}");
                table.push(line);
            }
        }
    }
    eprint!("{}", markdown(&table, &methods));
    eprint!("{}", latency_markdown(&table));
    Ok(())
}

/// Every `--addr`, connected, once `--concurrency` is checked.
async fn connect_all(args: &Args) -> Result<Vec<Coordinator>> {
    if args.concurrency.contains(&0) {
        bail!("--concurrency takes numbers of streams, 1 or more");
    }
    let mut coordinators = Vec::new();
    for spec in &args.addrs {
        coordinators.push(Coordinator::connect(spec, &args.connection).await?);
    }
    Ok(coordinators)
}

/// `[NAME=]PATH`: the name (the file's stem unless given) and the path.
fn named_path(spec: &str) -> (String, PathBuf) {
    match spec.split_once('=') {
        Some((name, path)) => (name.to_string(), PathBuf::from(path)),
        None => {
            let path = PathBuf::from(spec);
            let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
            (stem.unwrap_or_else(|| spec.to_string()), path)
        }
    }
}

fn read_set(spec: &str, limit: Option<usize>) -> Result<PromptSet> {
    let (name, path) = named_path(spec);
    let mut prompts = read_prompts(&path)?;
    if let Some(limit) = limit {
        prompts.truncate(limit);
    }
    if prompts.is_empty() {
        bail!("no prompts in {}", path.display());
    }
    Ok(PromptSet { name, prompts })
}

fn read_prompts(path: &Path) -> Result<Vec<PromptLine>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            let mut prompt: PromptLine = serde_json::from_str(line).with_context(|| {
                format!("{} line {}: not a prompt object", path.display(), n + 1)
            })?;
            prompt.line = n as u64 + 1;
            Ok(prompt)
        })
        .collect()
}

/// Runs the set at `concurrency` streams with every method: the requests (the prompts,
/// cycled to at least `concurrency` of them) go in groups of `concurrency`, and each group
/// runs with each method in turn, in the orders of [`balanced_order`] from group to group.
async fn measure(
    coordinators: &[Coordinator],
    set: &PromptSet,
    methods: &[Method<'_>],
    concurrency: usize,
    args: &Args,
) -> Vec<Totals> {
    let n = set.prompts.len().max(concurrency);
    let requests: Vec<&PromptLine> = (0..n)
        .map(|i| &set.prompts[i % set.prompts.len()])
        .collect();
    let mut totals = vec![Totals::default(); methods.len()];
    let groups: Vec<&[&PromptLine]> = requests.chunks(concurrency).collect();
    let runs = groups.len() * args.repeat as usize;
    // Each repeat runs the groups again; the order of the methods changes from run to run.
    for (k, group) in groups.iter().cycle().take(runs).enumerate() {
        let g = k % groups.len();
        let order = balanced_order(methods.len(), k);
        if g == 0 {
            for t in &mut totals {
                t.repeats.push((0, 0.0));
            }
        }
        let mut reference: Option<Vec<Option<Vec<u32>>>> = None;
        let mut results: Vec<Option<Vec<Result<RunResult>>>> =
            methods.iter().map(|_| None).collect();
        for m in order {
            let start = Instant::now();
            let runs = group
                .iter()
                .map(|p| generate(&coordinators[methods[m].at.0].client, p, methods[m], args));
            let runs = futures::future::join_all(runs).await;
            totals[m].add_wall(start.elapsed().as_secs_f64());
            results[m] = Some(runs);
        }
        for (m, runs) in results.into_iter().enumerate() {
            let runs = runs.unwrap_or_default();
            if m == 0 {
                reference = Some(
                    runs.iter()
                        .map(|r| r.as_ref().ok().map(|r| r.completion.token_ids.clone()))
                        .collect(),
                );
            }
            for (i, run) in runs.into_iter().enumerate() {
                match run {
                    Ok(run) => {
                        // Compared where the NONE run of the same prompt succeeded.
                        let same = match reference.as_ref().and_then(|r| r[i].as_ref()) {
                            Some(tokens) if args.same_text_as_none(methods[m]) => {
                                *tokens == run.completion.token_ids
                            }
                            _ => true,
                        };
                        totals[m].not_identical += usize::from(!same);
                        totals[m].add(&run);
                        if args.per_request {
                            println!(
                                "{}",
                                request_json(
                                    set,
                                    g * concurrency + i,
                                    group[i],
                                    methods[m],
                                    concurrency,
                                    &run
                                )
                            );
                        }
                    }
                    Err(e) => {
                        eprintln!("{} {} x{concurrency}: {e:#}", set.name, methods[m].label());
                        totals[m].errors += 1;
                    }
                }
            }
        }
    }
    totals
}

/// The order the `n` methods run in on the `run`-th group: the rows of a Williams square,
/// one after the other, so that over `n` runs (`2n` when `n` is odd) each method goes at
/// each turn equally often and right after each other method equally often. A method's
/// figures then owe nothing to which method ran before it (a warm cache, a slow drift, a
/// worker still closing the last group's sessions), where a rotation would always put the
/// same one before it.
fn balanced_order(n: usize, run: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    // The first row: 0, 1, n-1, 2, n-2, ...; row r adds r to each.
    let first = (0..n).map(|i| match i {
        0 => 0,
        _ if i % 2 == 1 => i.div_ceil(2),
        _ => n - i / 2,
    });
    let rows = if n.is_multiple_of(2) { n } else { 2 * n };
    let row = run % rows;
    let order: Vec<usize> = first.map(|f| (f + row) % n).collect();
    // With odd n the second n rows are the first n reversed.
    if row >= n {
        order.into_iter().rev().collect()
    } else {
        order
    }
}

/// How the warm-up prefills each prompt: one token of NONE (the target alone), or where a
/// method drafts with the draft model, three of DRAFT_MODEL with K = 1 (a target-only
/// first token, then a round that opens the draft session: both prefills).
fn prefill_warm_up(methods: &[Method<'_>]) -> (Method<'static>, u32) {
    match methods
        .iter()
        .any(|m| m.method == SpeculationMethod::DraftModel)
    {
        true => {
            let draft = Method {
                method: SpeculationMethod::DraftModel,
                k: 1,
                ..Method::NONE
            };
            (draft, 3)
        }
        false => (Method::NONE, 1),
    }
}

fn request(prompt: &PromptLine, method: Method<'_>, args: &Args) -> GenerateRequest {
    let input = if prompt.chat {
        Input::Messages(Messages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: prompt.prompt.clone(),
                ..Default::default()
            }],
        })
    } else {
        Input::Prompt(prompt.prompt.clone())
    };
    GenerateRequest {
        input: Some(input),
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        seed: prompt.line,
        speculation: method.method as i32,
        num_speculative_tokens: method.k,
        suffix: prompt.suffix.clone(),
        ..GenerateRequest::default()
    }
}

async fn generate(
    client: &Client,
    prompt: &PromptLine,
    method: Method<'_>,
    args: &Args,
) -> Result<RunResult> {
    send(client, request(prompt, method, args)).await
}

/// One Generate call, timed around the whole stream and at each message that brings
/// tokens.
async fn send(client: &Client, request: GenerateRequest) -> Result<RunResult> {
    let start = Instant::now();
    let status = |s: tonic::Status| anyhow::anyhow!("{:?}: {}", s.code(), s.message());
    let mut stream = client
        .clone()
        .generate(request)
        .await
        .map_err(status)?
        .into_inner();
    let mut completion = Completion::default();
    let (mut first_s, mut last_s, mut gaps_s) = (None, 0.0, Vec::new());
    while let Some(message) = stream.message().await.map_err(status)? {
        let before = completion.token_ids.len();
        completion.add(message);
        if completion.token_ids.len() > before {
            let at = start.elapsed().as_secs_f64();
            match first_s {
                None => first_s = Some(at),
                Some(_) => gaps_s.push(at - last_s),
            }
            last_s = at;
        }
    }
    completion.ended().map_err(status)?;
    Ok(RunResult {
        wall_s: start.elapsed().as_secs_f64(),
        completion,
        first_s,
        gaps_s,
    })
}

fn request_json(
    set: &PromptSet,
    index: usize,
    prompt: &PromptLine,
    method: Method<'_>,
    concurrency: usize,
    run: &RunResult,
) -> Value {
    let u = run.usage();
    json!({
        "set": set.name,
        "index": index,
        "id": prompt.id,
        "method": method.label(),
        "concurrency": concurrency,
        "wall_ms": round3(run.wall_s * 1e3),
        "ttft_ms": run.first_s.map(|s| round3(s * 1e3)),
        "prefill_ms": u.timings.as_ref().map(|t| round3(t.prefill_ms)),
        "completion_tokens": u.completion_tokens,
        "tokens_per_s": ratio(f64::from(u.completion_tokens), run.wall_s).map(round3),
        "rounds": u.rounds,
        "draft_tokens_proposed": u.draft_tokens_proposed,
        "draft_tokens_accepted": u.draft_tokens_accepted,
        "drafted_ahead": u.drafted_ahead,
        "drafted_ahead_used": u.drafted_ahead_used,
        "fell_back_to_target_only": u.fell_back_to_target_only,
        "token_ids": run.completion.token_ids,
    })
}

/// A sampling temperature the coordinator takes: finite, 0 or more.
fn temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("{s:?} is not a temperature (a number, 0 or more)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Over a whole square every method runs once per group, goes at each turn equally
    /// often, and follows each other method equally often.
    #[test]
    fn orders_are_balanced() {
        assert_eq!(balanced_order(4, 0), [0, 1, 3, 2]);
        assert_eq!(balanced_order(4, 1), [1, 2, 0, 3]);
        assert_eq!(balanced_order(3, 3), [2, 1, 0], "odd: the square reversed");
        assert_eq!(balanced_order(1, 5), [0]);
        for n in 2..=7_usize {
            let rows = if n.is_multiple_of(2) { n } else { 2 * n };
            let mut at_turn = HashMap::new();
            let mut after = HashMap::new();
            for run in 0..rows {
                let order = balanced_order(n, run);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n {n} run {run}");
                for (turn, &m) in order.iter().enumerate() {
                    *at_turn.entry((turn, m)).or_insert(0) += 1;
                }
                for pair in order.windows(2) {
                    *after.entry((pair[0], pair[1])).or_insert(0) += 1;
                }
            }
            let each = rows / n;
            assert!(at_turn.values().all(|&c| c == each), "n {n}: {at_turn:?}");
            assert_eq!(at_turn.len(), n * n);
            let pairs = rows * (n - 1) / (n * (n - 1));
            assert!(after.values().all(|&c| c == pairs), "n {n}: {after:?}");
            assert_eq!(after.len(), n * (n - 1));
        }
    }

    /// `--temperature` reaches the request, seeded by the prompt's line in its file; the
    /// option takes no negative or non-finite value.
    #[test]
    fn sampling_requests_carry_their_temperature_and_seed() {
        let dir = std::env::temp_dir().join(format!("duet-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.jsonl");
        std::fs::write(
            &file,
            "{\"prompt\": \"a\"}\n\n{\"prompt\": \"b\", \"chat\": true}\n",
        )
        .unwrap();
        let prompts = read_prompts(&file).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(prompts.iter().map(|p| p.line).collect::<Vec<_>>(), [1, 3]);

        let args =
            Args::try_parse_from(["duet-bench", "--prompts", "p.jsonl", "--temperature", "0.7"])
                .unwrap();
        let r = request(&prompts[1], Method::NONE, &args);
        assert_eq!((r.temperature, r.seed, r.max_tokens), (0.7, 3, 128));
        let greedy = Args::try_parse_from(["duet-bench", "--prompts", "p.jsonl"]).unwrap();
        assert_eq!(request(&prompts[0], Method::NONE, &greedy).temperature, 0.0);
        // Sampling texts are compared with NONE's where the method is NONE (another
        // coordinator's), greedy texts always.
        let auto = Method {
            method: SpeculationMethod::Auto,
            ..Method::NONE
        };
        let compared = |a: &Args| (a.same_text_as_none(Method::NONE), a.same_text_as_none(auto));
        assert_eq!(
            (compared(&args), compared(&greedy)),
            ((true, false), (true, true))
        );
        for bad in ["-1", "NaN", "inf", "warm"] {
            let parsed =
                Args::try_parse_from(["duet-bench", "--prompts", "p", "--temperature", bad]);
            assert!(parsed.is_err(), "{bad}");
        }
    }
}
