//! Multi-turn sets, to compare coordinators (say, workers with the prefix cache on and off,
//! or prefix-aware routing against routing by load): each conversation's turns go one after
//! another, each with the answers so far, and the conversations interleave: every
//! conversation's first turn, then every second turn, and so on, `concurrency` at a time.
//! The coordinators take each turn in alternating order, so that the machine's drift hits
//! them alike. Per set, concurrency and coordinator: one JSON line (time to first token
//! overall and per turn, tokens per second, the prompt tokens taken from the prefix cache,
//! the later turns that found their conversation so far there, token identity with the
//! first coordinator), then a Markdown table on stderr.

use super::report::{cell, percentiles, ratio, round3};
use super::{Args, Coordinator, RunResult, connect_all, named_path, send};
use anyhow::{Context, Result, bail};
use duet_proto::v1::generate_request::Input;
use duet_proto::v1::{ChatMessage, GenerateRequest, Messages};
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::Instant;

/// One line of a conversation file.
#[derive(Deserialize, Debug, Clone)]
struct Conversation {
    #[serde(default)]
    system: Option<String>,
    turns: Vec<String>,
}

#[derive(Debug)]
struct Set {
    name: String,
    conversations: Vec<Conversation>,
}

/// One request's figures.
#[derive(Debug, Clone)]
struct Turn {
    ttft_ms: Option<f64>,
    wall_s: f64,
    completion_tokens: u32,
    prompt_tokens: u32,
    prompt_tokens_cached: u32,
    token_ids: Vec<u32>,
}

/// One coordinator's run of a set: its conversations so far, and each request's figures
/// by turn.
#[derive(Debug, Default)]
struct Run {
    histories: Vec<Vec<ChatMessage>>,
    turns: Vec<Vec<Option<Turn>>>,
    /// Wall time of the groups, concurrent requests counted once.
    wall_s: f64,
    errors: usize,
}

pub async fn run(args: &Args) -> Result<()> {
    let sets = args
        .conversations
        .iter()
        .map(|s| read_set(s, args.limit))
        .collect::<Result<Vec<_>>>()?;
    let coordinators = connect_all(args).await?;
    let mut lines = Vec::new();
    for set in &sets {
        for &concurrency in &args.concurrency {
            let runs = run_set(&coordinators, set, concurrency, args).await?;
            for (c, run) in coordinators.iter().zip(&runs) {
                let line = summary(set, concurrency, c, run, &runs[0]);
                println!("{line}");
                lines.push(line);
            }
        }
    }
    eprint!("{}", markdown(&lines));
    Ok(())
}

fn read_set(spec: &str, limit: Option<usize>) -> Result<Set> {
    let (name, path) = named_path(spec);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut conversations = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str::<Conversation>(line)
                .with_context(|| format!("{} line {}: not a conversation", path.display(), n + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some(limit) = limit {
        conversations.truncate(limit);
    }
    if conversations.iter().all(|c| c.turns.is_empty()) {
        bail!("no turns in {}", path.display());
    }
    Ok(Set {
        name,
        conversations,
    })
}

/// Runs `set` on every coordinator, turn by turn (see the module docs).
async fn run_set(
    coordinators: &[Coordinator],
    set: &Set,
    concurrency: usize,
    args: &Args,
) -> Result<Vec<Run>> {
    let method = match args.methods.first() {
        Some(m) => duet_proto::parse_method(m.split([':', '@']).next().unwrap_or(m))
            .with_context(|| format!("unknown method {m:?}"))?,
        None => duet_proto::v1::SpeculationMethod::Auto,
    };
    let mut runs: Vec<Run> = coordinators
        .iter()
        .map(|_| Run {
            histories: set.conversations.iter().map(start).collect(),
            ..Run::default()
        })
        .collect();
    let template = GenerateRequest {
        max_tokens: args.max_tokens,
        speculation: method as i32,
        ..GenerateRequest::default()
    };
    let most = set.conversations.iter().map(|c| c.turns.len()).max();
    for turn in 0..most.unwrap_or(0) {
        let mut order: Vec<usize> = (0..coordinators.len()).collect();
        if turn % 2 == 1 {
            order.reverse();
        }
        for c in order {
            run_turn(
                &coordinators[c],
                set,
                turn,
                concurrency,
                &template,
                &mut runs[c],
            )
            .await;
        }
    }
    Ok(runs)
}

/// A conversation's messages before its first turn.
fn start(c: &Conversation) -> Vec<ChatMessage> {
    c.system
        .iter()
        .map(|s| ChatMessage {
            role: "system".into(),
            content: s.clone(),
            ..Default::default()
        })
        .collect()
}

/// Turn `turn` of every conversation that has one, `concurrency` at a time; each answer
/// joins its conversation.
async fn run_turn(
    coordinator: &Coordinator,
    set: &Set,
    turn: usize,
    concurrency: usize,
    template: &GenerateRequest,
    run: &mut Run,
) {
    let due: Vec<usize> = (0..set.conversations.len())
        .filter(|&i| turn < set.conversations[i].turns.len())
        .collect();
    for group in due.chunks(concurrency) {
        let requests = group.iter().map(|&i| {
            let mut messages = run.histories[i].clone();
            messages.push(ChatMessage {
                role: "user".into(),
                content: set.conversations[i].turns[turn].clone(),
                ..Default::default()
            });
            let request = GenerateRequest {
                input: Some(Input::Messages(Messages { messages })),
                ..template.clone()
            };
            send(&coordinator.client, request)
        });
        let start = Instant::now();
        let results = futures::future::join_all(requests).await;
        run.wall_s += start.elapsed().as_secs_f64();
        for (&i, result) in group.iter().zip(results) {
            let figures = match result {
                Ok(r) => Some(answered(run, i, set, turn, r)),
                Err(e) => {
                    eprintln!("{} {} turn {}: {e:#}", set.name, coordinator.name, turn + 1);
                    run.errors += 1;
                    None
                }
            };
            if run.turns.len() <= turn {
                run.turns
                    .resize(turn + 1, vec![None; set.conversations.len()]);
            }
            run.turns[turn][i] = figures;
        }
    }
}

/// Adds the turn and its answer to conversation `i`'s history; the request's figures.
fn answered(run: &mut Run, i: usize, set: &Set, turn: usize, r: RunResult) -> Turn {
    let history = &mut run.histories[i];
    history.push(ChatMessage {
        role: "user".into(),
        content: set.conversations[i].turns[turn].clone(),
        ..Default::default()
    });
    history.push(ChatMessage {
        role: "assistant".into(),
        content: r.completion.text.clone(),
        ..Default::default()
    });
    let u = &r.completion.usage;
    Turn {
        ttft_ms: r.first_s.map(|s| s * 1e3),
        wall_s: r.wall_s,
        completion_tokens: u.completion_tokens,
        prompt_tokens: u.prompt_tokens,
        prompt_tokens_cached: u.prompt_tokens_cached,
        token_ids: r.completion.token_ids,
    }
}

/// The line for one set, concurrency and coordinator; `first` is the first coordinator's
/// run, the reference for TTFT ratios and token identity.
fn summary(set: &Set, concurrency: usize, c: &Coordinator, run: &Run, first: &Run) -> Value {
    let all: Vec<&Turn> = run.turns.iter().flatten().flatten().collect();
    let sum = |f: fn(&Turn) -> u32| all.iter().map(|t| u64::from(f(t))).sum::<u64>();
    let ttft = |turns: &[Option<Turn>]| -> Vec<f64> {
        turns.iter().flatten().filter_map(|t| t.ttft_ms).collect()
    };
    let by_turn: Vec<Value> = run
        .turns
        .iter()
        .zip(&first.turns)
        .map(|(mine, theirs)| {
            let (a, b) = (percentiles(&ttft(mine), &[50.0]), percentiles(&ttft(theirs), &[50.0]));
            let r = a["p50"].as_f64().zip(b["p50"].as_f64());
            json!({"ttft_ms_p50": a["p50"], "ratio_to_first": r.and_then(|(a, b)| ratio(a, b)).map(round3)})
        })
        .collect();
    let all_ttft: Vec<f64> = all.iter().filter_map(|t| t.ttft_ms).collect();
    let first_ttft: Vec<f64> = first
        .turns
        .iter()
        .flatten()
        .flatten()
        .filter_map(|t| t.ttft_ms)
        .collect();
    let p50 = |v: &[f64]| percentiles(v, &[50.0])["p50"].as_f64();
    let (found, later) = history_found(run);
    let not_identical = run
        .turns
        .iter()
        .flatten()
        .zip(first.turns.iter().flatten())
        .filter(|(a, b)| matches!((a, b), (Some(a), Some(b)) if a.token_ids != b.token_ids))
        .count();
    json!({
        "set": set.name,
        "conversations": set.conversations.len(),
        "concurrency": concurrency,
        "addr": c.name,
        "requests": all.len(),
        "errors": run.errors,
        "ttft_ms": percentiles(&all_ttft, &[50.0, 95.0]),
        "ttft_p50_ratio_to_first": p50(&all_ttft).zip(p50(&first_ttft)).and_then(|(a, b)| ratio(a, b)).map(round3),
        "by_turn": by_turn,
        "tokens_per_s": ratio(sum(|t| t.completion_tokens) as f64, run.wall_s).map(round3),
        "mean_request_s": ratio(all.iter().map(|t| t.wall_s).sum(), all.len() as f64).map(round3),
        "prompt_tokens": sum(|t| t.prompt_tokens),
        "prompt_tokens_cached": sum(|t| t.prompt_tokens_cached),
        "hit_rate": ratio(sum(|t| t.prompt_tokens_cached) as f64, sum(|t| t.prompt_tokens) as f64).map(round3),
        "history_hit_rate": ratio(found as f64, later as f64).map(round3),
        "not_identical_to_first": not_identical,
    })
}

/// Of the turns after a conversation's first (both turns answered), how many found at
/// least the previous turn's whole prompt in the cache (what routing decides), and how many
/// there were.
fn history_found(run: &Run) -> (usize, usize) {
    let mut found = 0;
    let mut later = 0;
    for pair in run.turns.windows(2) {
        for (before, now) in pair[0].iter().zip(&pair[1]) {
            if let (Some(before), Some(now)) = (before, now) {
                later += 1;
                found += usize::from(now.prompt_tokens_cached + 1 >= before.prompt_tokens);
            }
        }
    }
    (found, later)
}

/// A row per set, concurrency and coordinator.
fn markdown(lines: &[Value]) -> String {
    let mut out = String::from(
        "\n| set | streams | addr | TTFT p50 ms | TTFT p95 ms | last turn TTFT p50 ms (x first) | tok/s | hit rate | history found | not identical |\n|---|---|---|---|---|---|---|---|---|---|",
    );
    for l in lines {
        let last = l["by_turn"].as_array().and_then(|t| t.last()).cloned();
        let last = last.unwrap_or_default();
        out.push_str(&format!(
            "\n| {} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} |",
            l["set"].as_str().unwrap_or_default(),
            l["concurrency"],
            l["addr"].as_str().unwrap_or_default(),
            cell(&l["ttft_ms"]["p50"]),
            cell(&l["ttft_ms"]["p95"]),
            cell(&last["ttft_ms_p50"]),
            last["ratio_to_first"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.2}")),
            cell(&l["tokens_per_s"]),
            l["hit_rate"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.2}")),
            l["history_hit_rate"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.2}")),
            l["not_identical_to_first"],
        ));
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(ttft_ms: f64, prompt: u32, cached: u32, tokens: &[u32]) -> Option<Turn> {
        Some(Turn {
            ttft_ms: Some(ttft_ms),
            wall_s: 1.0,
            completion_tokens: tokens.len() as u32,
            prompt_tokens: prompt,
            prompt_tokens_cached: cached,
            token_ids: tokens.to_vec(),
        })
    }

    /// The line's figures: time to first token per turn against the first coordinator's,
    /// the hit rate over all prompt tokens, and the answers that differ from the first's.
    #[tokio::test]
    async fn a_runs_line_compares_it_with_the_first() {
        let set = Set {
            name: "chat".into(),
            conversations: vec![],
        };
        let off = Run {
            turns: vec![
                vec![turn(100.0, 50, 0, &[1, 2]), turn(300.0, 60, 0, &[3])],
                vec![turn(400.0, 150, 0, &[4]), turn(800.0, 160, 0, &[5])],
            ],
            wall_s: 4.0,
            ..Run::default()
        };
        let on = Run {
            turns: vec![
                vec![turn(100.0, 50, 0, &[1, 2]), turn(300.0, 60, 30, &[3])],
                vec![turn(40.0, 150, 140, &[4]), turn(80.0, 160, 50, &[9])],
            ],
            wall_s: 2.5,
            errors: 1,
            ..Run::default()
        };
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let coordinator = Coordinator {
            name: "on".into(),
            client: duet_tools::connect::Connection::default()
                .client(channel)
                .unwrap(),
        };
        let line = summary(&set, 2, &coordinator, &on, &off);
        assert_eq!(line["by_turn"][0]["ttft_ms_p50"], 100.0);
        assert_eq!(line["by_turn"][0]["ratio_to_first"], 1.0);
        assert_eq!(line["by_turn"][1]["ttft_ms_p50"], 40.0);
        assert_eq!(line["by_turn"][1]["ratio_to_first"], 0.1);
        assert_eq!(line["prompt_tokens"], 420);
        assert_eq!(line["prompt_tokens_cached"], 220);
        assert_eq!(line["hit_rate"], 0.524);
        // Second turns: 140 cached of a first prompt of 50 (found), 50 of 60 (not).
        assert_eq!(line["history_hit_rate"], 0.5);
        assert_eq!(line["tokens_per_s"], 2.0);
        assert_eq!(line["not_identical_to_first"], 1);
        assert_eq!(
            (line["requests"].clone(), line["errors"].clone()),
            (json!(4), json!(1))
        );
        let table = markdown(&[line]);
        assert!(
            table
                .contains("| chat | 2 | on | 80.0 | 300.0 | 40.0 (0.10) | 2.0 | 0.52 | 0.50 | 1 |"),
            "{table}"
        );
    }
}
