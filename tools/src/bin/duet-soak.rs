//! duet-soak: mixed traffic against a running coordinator for a while (normal requests of
//! every method, callers that cancel mid-stream, bad requests and amplification bodies,
//! readers that stall, HTTP/2 stream and reset floods, more streams than the coordinator
//! admits), then checks what a long-running service must hold
//! to: no error but the expected codes, no session left on the workers, and no memory
//! growth in the services' processes. Prints one JSON line and a summary; exits non-zero
//! when a check fails.

use anyhow::{Context, Result};
use clap::Parser;
use duet_proto::Completion;
use duet_proto::v1::generate_request::Input;
use duet_proto::v1::generation_client::GenerationClient;
use duet_proto::v1::worker_client::WorkerClient;
use duet_proto::v1::{ChatMessage, GenerateRequest, Messages, SpeculationMethod, StatsRequest};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic::transport::Channel;

#[derive(Parser, Debug)]
#[command(about = "Soak a running duet: mixed traffic, then leak and memory checks")]
struct Args {
    /// Coordinator address.
    #[arg(long, default_value = "http://127.0.0.1:50061")]
    addr: String,
    /// The workers' addresses (their open sessions must drop to 0 at the end).
    #[arg(long, value_delimiter = ',', required = true)]
    workers: Vec<String>,
    /// Processes whose resident memory must not grow, as NAME=PID (repeatable).
    #[arg(long = "pid", value_name = "NAME=PID")]
    pids: Vec<String>,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 600)]
    seconds: u64,
    /// Concurrent callers (set it above the coordinator's max_concurrent_requests).
    #[arg(long, default_value_t = 16)]
    callers: usize,
    /// Allowed growth of each process's resident memory, in percent, from its level a fifth
    /// into the run (the traffic at full concurrency, every cache allocated once) to the end.
    #[arg(long, default_value_t = 5.0)]
    max_rss_growth: f64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// The kinds of call, and the codes each may end with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A whole generation with a random method: OK, or RESOURCE_EXHAUSTED over the limit.
    Normal,
    /// Reads one message and goes away.
    Cancelled,
    /// A request the API must refuse: INVALID_ARGUMENT.
    Bad,
    /// Opens a long stream and reads nothing for a few seconds, then goes away.
    Stalled,
    /// On a connection of its own, opens 1,000 calls that never send a body and lets them
    /// hang for a second; then a normal generation on the caller's connection.
    StreamFlood,
    /// On a connection of its own, opens and at once resets calls until the server closes
    /// the connection (the HTTP/2 rapid reset); then a normal generation.
    ResetFlood,
}

impl Kind {
    fn expected(self, code: Code) -> bool {
        match self {
            Kind::Bad => code == Code::InvalidArgument,
            _ => matches!(code, Code::Ok | Code::ResourceExhausted),
        }
    }
}

const PROMPTS: &[&str] = &[
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain what a hash map is to a new programmer.",
    "Rewrite this loop as a list comprehension:\nresult = []\nfor x in items:\n    if x > 0:\n        result.append(x * 2)\n",
    "Write a haiku about autumn rain.",
];

fn prompt(text: &str, max_tokens: u32, method: SpeculationMethod) -> GenerateRequest {
    GenerateRequest {
        input: Some(Input::Prompt(text.into())),
        max_tokens,
        speculation: method as i32,
        ..Default::default()
    }
}

fn bad(rng: &mut impl Rng) -> GenerateRequest {
    let ok = prompt(PROMPTS[0], 8, SpeculationMethod::Auto);
    match rng.random_range(0..6) {
        0 => GenerateRequest {
            temperature: -1.0,
            ..ok
        },
        1 => prompt("", 8, SpeculationMethod::Auto),
        2 => GenerateRequest {
            input: Some(Input::Messages(Messages {
                messages: vec![ChatMessage {
                    role: "wizard".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
            })),
            ..ok
        },
        3 => GenerateRequest {
            stop: vec!["x".repeat(10_000)],
            ..ok
        },
        // Amplification bodies: within the byte limit, each entry two bytes that would
        // decode to a whole struct (refused from the raw bytes).
        4 => GenerateRequest {
            input: Some(Input::Messages(Messages {
                messages: vec![ChatMessage::default(); 500_000],
            })),
            ..ok
        },
        _ => GenerateRequest {
            stop: vec![String::new(); 500_000],
            ..ok
        },
    }
}

#[derive(Debug, Default)]
struct Tally {
    /// (kind, code) → calls.
    calls: BTreeMap<(String, String), u64>,
    unexpected: u64,
    tokens: u64,
}

async fn one_call(
    client: &mut GenerationClient<Channel>,
    addr: &str,
    kind: Kind,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> (Code, u64) {
    let methods = [
        SpeculationMethod::None,
        SpeculationMethod::DraftModel,
        SpeculationMethod::Ngram,
        SpeculationMethod::Auto,
    ];
    let text = PROMPTS[rng.random_range(0..PROMPTS.len())];
    let method = methods[rng.random_range(0..methods.len())];
    let req = match kind {
        Kind::Normal | Kind::StreamFlood | Kind::ResetFlood => {
            prompt(text, rng.random_range(8..48), method)
        }
        Kind::Cancelled => prompt(text, 64, method),
        Kind::Bad => bad(rng),
        Kind::Stalled => prompt(text, 256, method),
    };
    if matches!(kind, Kind::StreamFlood | Kind::ResetFlood)
        && let Err(e) = flood(addr, kind).await
    {
        eprintln!("soak: {kind:?} could not start: {e:#}");
    }
    let stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(status) => return (status.code(), 0),
    };
    match kind {
        Kind::Normal | Kind::Bad | Kind::StreamFlood | Kind::ResetFlood => {
            match Completion::read(stream, |_| {}).await {
                Ok(done) => (Code::Ok, u64::from(done.usage.completion_tokens)),
                Err(status) => (status.code(), 0),
            }
        }
        Kind::Cancelled => {
            let mut stream = stream;
            match stream.message().await {
                Ok(_) => (Code::Ok, 0),
                Err(status) => (status.code(), 0),
            }
        }
        Kind::Stalled => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            drop(stream);
            (Code::Ok, 0)
        }
    }
}

async fn caller(addr: String, until: Instant, seed: u64, tally: Arc<Mutex<Tally>>) -> Result<()> {
    let mut client = GenerationClient::connect(addr.clone()).await?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    while Instant::now() < until {
        let kind = match rng.random_range(0..20) {
            0..=7 => Kind::Normal,
            8..=11 => Kind::Cancelled,
            12..=14 => Kind::Bad,
            15..=17 => Kind::Stalled,
            18 => Kind::StreamFlood,
            _ => Kind::ResetFlood,
        };
        let (code, tokens) = one_call(&mut client, &addr, kind, &mut rng).await;
        {
            let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
            *t.calls
                .entry((format!("{kind:?}"), format!("{code:?}")))
                .or_default() += 1;
            t.tokens += tokens;
            if !kind.expected(code) {
                t.unexpected += 1;
            }
        }
        if code == Code::ResourceExhausted {
            // Over the limit: back off, as a well-behaved client does.
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..1000))).await;
        }
    }
    Ok(())
}

/// A flood of `kind` on a new HTTP/2 connection to the coordinator at `addr` (plaintext).
async fn flood(addr: &str, kind: Kind) -> Result<()> {
    let authority = addr.split_once("://").map_or(addr, |(_, a)| a);
    let tcp = tokio::net::TcpStream::connect(authority).await?;
    let (mut send, connection) = h2::client::handshake(tcp).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let headers = || {
        http::Request::post(format!("http://{authority}/duet.v1.Generation/Generate"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
    };
    let mut held = Vec::new();
    for _ in 0..1_000 {
        // The server's stream limit holds the rest back; a closed connection ends the flood.
        let Ok(ready) = tokio::time::timeout(Duration::from_secs(1), send.ready()).await else {
            break;
        };
        let Ok(ready) = ready else { break };
        send = ready;
        let Ok((answer, mut stream)) = send.send_request(headers()?, false) else {
            break;
        };
        match kind {
            Kind::ResetFlood => stream.send_reset(h2::Reason::CANCEL),
            _ => held.push((answer, stream)),
        }
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(())
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")
}

async fn open_sessions(workers: &[String]) -> Result<Vec<u32>> {
    let mut all = Vec::new();
    for w in workers {
        let mut c = WorkerClient::connect(w.clone()).await?;
        all.push(c.stats(StatsRequest {}).await?.into_inner().active_sessions);
    }
    Ok(all)
}

/// One request of each method, so the start figures include the models' working memory.
async fn warm(addr: &str) -> Result<()> {
    let mut client = GenerationClient::connect(addr.to_string()).await?;
    for method in [
        SpeculationMethod::None,
        SpeculationMethod::DraftModel,
        SpeculationMethod::Ngram,
        SpeculationMethod::Auto,
    ] {
        let s = client.generate(prompt(PROMPTS[0], 16, method)).await?;
        Completion::read(s.into_inner(), |_| {}).await?;
    }
    Ok(())
}

/// Resident memory every tenth of the run: the first fifth is the warm-up (every cache
/// allocated once), growth counts from there.
async fn sample_rss(pids: Vec<(String, u32)>, seconds: u64) -> Result<Vec<Vec<u64>>> {
    let step = Duration::from_secs(seconds) / 10;
    let mut series = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(step).await;
        let now = pids.iter().map(|(_, p)| rss_kib(*p));
        series.push(now.collect::<Result<Vec<u64>>>()?);
    }
    Ok(series)
}

/// Sessions still open on each worker once the callers are done. They close in the
/// background after each request: this gives them a moment.
async fn sessions_left(workers: &[String]) -> Result<Vec<u32>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let open = open_sessions(workers).await?;
        if open.iter().all(|&n| n == 0) || Instant::now() > deadline {
            return Ok(open);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each process's memory: at the end of the warm-up, at the end, the growth between, and
/// every tenth of the run.
fn memory_report(
    pids: &[(String, u32)],
    series: &[Vec<u64>],
    before: &[u64],
    after: &[u64],
    growth: &[f64],
) -> Vec<serde_json::Value> {
    pids.iter()
        .enumerate()
        .zip(before.iter().zip(after).zip(growth))
        .map(|((i, (name, _)), ((b, a), g))| {
            let mib: Vec<u64> = series.iter().map(|s| s[i] / 1024).collect();
            serde_json::json!({
                "process": name,
                "rss_kib_warm": b,
                "rss_kib_end": a,
                "growth_pct": (g * 10.0).round() / 10.0,
                "rss_mib_each_tenth": mib,
            })
        })
        .collect()
}

async fn run(args: Args) -> Result<bool> {
    let pids: Vec<(String, u32)> = args
        .pids
        .iter()
        .map(|p| {
            let (name, pid) = p.split_once('=').context("--pid NAME=PID")?;
            Ok((name.to_string(), pid.parse()?))
        })
        .collect::<Result<_>>()?;
    warm(&args.addr).await?;
    let started = Instant::now();
    let series = tokio::spawn(sample_rss(pids.clone(), args.seconds));
    let until = started + Duration::from_secs(args.seconds);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let callers: Vec<_> = (0..args.callers)
        .map(|i| {
            tokio::spawn(caller(
                args.addr.clone(),
                until,
                args.seed + i as u64,
                tally.clone(),
            ))
        })
        .collect();
    for c in callers {
        c.await??;
    }
    let series = series.await??;
    let before = series.get(1).context("no memory samples")?.clone();
    let elapsed = started.elapsed().as_secs_f64();

    let sessions = sessions_left(&args.workers).await?;
    let after: Vec<u64> = pids
        .iter()
        .map(|(_, p)| rss_kib(*p))
        .collect::<Result<_>>()?;
    let growth: Vec<f64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (*a as f64 / *b as f64 - 1.0) * 100.0)
        .collect();

    let t = tally.lock().unwrap_or_else(|e| e.into_inner());
    let calls: u64 = t.calls.values().sum();
    let ok = t.unexpected == 0
        && sessions.iter().all(|&n| n == 0)
        && growth.iter().all(|&g| g < args.max_rss_growth);
    let memory = memory_report(&pids, &series, &before, &after, &growth);
    let by_kind: BTreeMap<String, u64> = t
        .calls
        .iter()
        .map(|((kind, code), n)| (format!("{kind}/{code}"), *n))
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "seconds": elapsed.round(),
            "callers": args.callers,
            "calls": calls,
            "calls_by_kind_and_code": by_kind,
            "unexpected": t.unexpected,
            "completion_tokens": t.tokens,
            "sessions_left": sessions,
            "memory": memory,
            "ok": ok,
        })
    );
    eprintln!(
        "{calls} calls in {elapsed:.0} s ({} unexpected), {} completion tokens; sessions left {:?}; RSS growth {:?} %",
        t.unexpected, t.tokens, sessions, growth
    );
    Ok(ok)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("soak: a check failed");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("soak: {e:#}");
            ExitCode::from(2)
        }
    }
}
