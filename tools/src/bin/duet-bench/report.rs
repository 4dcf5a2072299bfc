//! What a run adds up to: each method's sums over its requests, the JSON line for a set,
//! concurrency and method, and the Markdown tables of ratios and latencies.

use super::{Args, Method, PromptSet, RunResult};
use duet_proto::v1::Timings;
use serde_json::{Value, json};

/// Sums over the requests of one method at one concurrency.
#[derive(Debug, Default, Clone)]
pub(crate) struct Totals {
    requests: usize,
    pub(crate) errors: usize,
    completion_tokens: u64,
    draft_proposed: u64,
    draft_accepted: u64,
    rounds: u64,
    /// Rounds whose drafts were made ahead, beside the round before's Verify.
    drafted_ahead_used: u64,
    timings: Timings,
    fell_back: usize,
    /// Requests whose tokens differed from NONE's for the same prompt.
    pub(crate) not_identical: usize,
    /// Rounds, proposed and accepted draft tokens by proposer.
    proposers: std::collections::BTreeMap<String, [u64; 3]>,
    /// Completion tokens and wall time (of the groups: concurrent requests counted once)
    /// of each repeat.
    pub(crate) repeats: Vec<(u64, f64)>,
    /// Per request: time to first token, and time per output token after it (ms).
    ttft_ms: Vec<f64>,
    tpot_ms: Vec<f64>,
    /// Gaps between a stream's messages, all requests together (ms).
    itl_ms: Vec<f64>,
}

impl Totals {
    pub(crate) fn add(&mut self, run: &RunResult) {
        let u = run.usage();
        self.requests += 1;
        self.completion_tokens += u64::from(u.completion_tokens);
        self.draft_proposed += u64::from(u.draft_tokens_proposed);
        self.draft_accepted += u64::from(u.draft_tokens_accepted);
        self.rounds += u64::from(u.rounds);
        self.drafted_ahead_used += u64::from(u.drafted_ahead_used);
        let t = u.timings.unwrap_or_default();
        let sum = &mut self.timings;
        sum.rounds_ms += t.rounds_ms;
        sum.draft_forward_ms += t.draft_forward_ms;
        sum.target_forward_ms += t.target_forward_ms;
        sum.queue_ms += t.queue_ms;
        sum.draft_ahead_ms += t.draft_ahead_ms;
        self.fell_back += usize::from(u.fell_back_to_target_only);
        for p in &u.proposers {
            let entry = self
                .proposers
                .entry(duet_proto::method_name(p.method))
                .or_default();
            entry[0] += u64::from(p.rounds);
            entry[1] += u64::from(p.draft_tokens_proposed);
            entry[2] += u64::from(p.draft_tokens_accepted);
        }
        if let Some(first) = run.first_s {
            self.ttft_ms.push(first * 1e3);
            if u.completion_tokens > 1 {
                let after = (run.wall_s - first) * 1e3;
                self.tpot_ms
                    .push(after / f64::from(u.completion_tokens - 1));
            }
        }
        self.itl_ms.extend(run.gaps_s.iter().map(|g| g * 1e3));
        let (tokens, _) = self.repeats.last_mut().expect("a repeat was started");
        *tokens += u64::from(u.completion_tokens);
    }

    /// A group's wall time, counted once for its concurrent requests.
    pub(crate) fn add_wall(&mut self, wall_s: f64) {
        let (_, wall) = self.repeats.last_mut().expect("a repeat was started");
        *wall += wall_s;
    }

    fn wall_s(&self) -> f64 {
        self.repeats.iter().map(|&(_, wall)| wall).sum()
    }

    fn tokens_per_s(&self) -> Option<f64> {
        ratio(self.completion_tokens as f64, self.wall_s())
    }

    /// Tokens per second in each repeat.
    fn tokens_per_s_by_repeat(&self) -> impl Iterator<Item = Option<f64>> + '_ {
        self.repeats.iter().map(|&(t, w)| ratio(t as f64, w))
    }
}

/// The line for one set, concurrency and method.
pub(crate) fn summary(
    set: &PromptSet,
    concurrency: usize,
    method: Method<'_>,
    t: &Totals,
    none: &Totals,
    args: &Args,
) -> Value {
    let proposers: serde_json::Map<String, Value> = t
        .proposers
        .iter()
        .map(|(name, [rounds, proposed, accepted])| {
            let value = json!({"rounds": rounds, "proposed": proposed, "accepted": accepted});
            (name.clone(), value)
        })
        .collect();
    let by_repeat: Vec<Option<f64>> = t
        .tokens_per_s_by_repeat()
        .zip(none.tokens_per_s_by_repeat())
        .map(|(a, b)| a.zip(b).and_then(|(a, b)| ratio(a, b)).map(round3))
        .collect();
    json!({
        "set": set.name,
        "prompts": set.prompts.len(),
        "concurrency": concurrency,
        "method": method.label(),
        "requests": t.requests,
        "errors": t.errors,
        "max_tokens": args.max_tokens,
        "completion_tokens": t.completion_tokens,
        "wall_s": round3(t.wall_s()),
        "tokens_per_s": t.tokens_per_s().map(round3),
        "ratio_to_none": t.tokens_per_s().zip(none.tokens_per_s()).and_then(|(a, b)| ratio(a, b)).map(round3),
        "ratio_by_repeat": by_repeat,
        "ttft_ms": percentiles(&t.ttft_ms, &[50.0, 90.0]),
        "tpot_ms": percentiles(&t.tpot_ms, &[50.0, 90.0]),
        "itl_ms": percentiles(&t.itl_ms, &[50.0, 90.0, 99.0]),
        "acceptance_rate": ratio(t.draft_accepted as f64, t.draft_proposed as f64).map(round3),
        "tokens_per_round": ratio(t.completion_tokens as f64, t.rounds as f64).map(round3),
        "rounds_drafted_ahead": ratio(t.drafted_ahead_used as f64, t.rounds as f64).map(round3),
        "overhead_ms_per_round": duet_proto::overhead_ms_per_round(&t.timings, t.rounds).map(round3),
        // Forward time per round (the draft's calls made ahead that answered included):
        // beside NONE's target figure, how much passes running at once slow each other.
        "target_ms_per_round": ratio(t.timings.target_forward_ms, t.rounds as f64).map(round3),
        "draft_ms_per_round": ratio(t.timings.draft_forward_ms, t.rounds as f64).map(round3),
        "fell_back_to_target_only": t.fell_back,
        "not_identical_to_none": args.same_text_as_none(method).then_some(t.not_identical),
        "proposers": proposers,
    })
}

/// Ratios to NONE, a row per set and concurrency, a column per method.
pub(crate) fn markdown(lines: &[Value], methods: &[Method<'_>]) -> String {
    let mut out = String::from("\n| set | streams | none tok/s |");
    for m in &methods[1..] {
        out.push_str(&format!(" {} |", m.label()));
    }
    out.push_str("\n|---|---|---|");
    out.push_str(&"---|".repeat(methods.len() - 1));
    for row in lines.chunks(methods.len()) {
        let none = &row[0];
        let failed = match none["errors"].as_u64().unwrap_or(0) {
            0 => String::new(),
            n => format!(" ({n} failed)"),
        };
        out.push_str(&format!(
            "\n| {} | {} | {}{failed} |",
            none["set"].as_str().unwrap_or_default(),
            none["concurrency"],
            none["tokens_per_s"]
        ));
        for cell in &row[1..] {
            let mut ratio = cell["ratio_to_none"]
                .as_f64()
                .map_or("-".into(), |r| format!("{r:.2}x"));
            let repeats: Vec<f64> = cell["ratio_by_repeat"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default();
            if repeats.len() > 1 {
                let (lo, hi) = repeats
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(lo, hi), &r| (lo.min(r), hi.max(r)));
                ratio.push_str(&format!(" ({lo:.2}-{hi:.2})"));
            }
            let differs = cell["not_identical_to_none"].as_u64().unwrap_or(0);
            let mut mark = String::new();
            if differs > 0 {
                mark.push_str(&format!(" ({differs} differ)"));
            }
            let failed = cell["errors"].as_u64().unwrap_or(0);
            if failed > 0 {
                mark.push_str(&format!(" ({failed} failed)"));
            }
            out.push_str(&format!(" {ratio}{mark} |"));
        }
    }
    out.push('\n');
    out
}

/// Latencies as a caller sees them, a row per set, concurrency and method.
pub(crate) fn latency_markdown(lines: &[Value]) -> String {
    let mut out = String::from(
        "\n| set | streams | method | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms |\n|---|---|---|---|---|---|---|",
    );
    for l in lines {
        out.push_str(&format!(
            "\n| {} | {} | {} | {} | {} | {} | {} |",
            l["set"].as_str().unwrap_or_default(),
            l["concurrency"],
            l["method"].as_str().unwrap_or_default(),
            cell(&l["ttft_ms"]["p50"]),
            cell(&l["tpot_ms"]["p50"]),
            cell(&l["itl_ms"]["p50"]),
            cell(&l["itl_ms"]["p99"]),
        ));
    }
    out.push('\n');
    out
}

/// The `ps` percentiles of `values` (nearest rank), as `{"p50": .., ...}`; nulls when empty.
pub(crate) fn percentiles(values: &[f64], ps: &[f64]) -> Value {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let at = |p: f64| {
        let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
        sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
    };
    ps.iter()
        .map(|&p| (format!("p{p}"), json!(at(p).map(round3))))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// A table cell: a number to one decimal, or "-".
pub(crate) fn cell(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.1}"))
}

pub(crate) fn ratio(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator)
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_proto::v1::SpeculationMethod;

    /// Nearest rank: the smallest value with at least p% of the values at or below it.
    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let p = percentiles(&values, &[50.0, 90.0, 99.0]);
        assert_eq!(p, json!({"p50": 5.0, "p90": 9.0, "p99": 10.0}));
        assert_eq!(
            percentiles(&[], &[50.0]),
            json!({"p50": null}),
            "no values, no figure"
        );
    }

    /// With repeats, a ratio cell also shows the lowest and highest repeat.
    #[test]
    fn the_table_shows_the_spread_over_repeats() {
        let none = json!({"set": "s", "concurrency": 8, "tokens_per_s": 40.0, "errors": 0});
        let auto = json!({"ratio_to_none": 1.07, "ratio_by_repeat": [1.12, 1.01, 1.08],
            "not_identical_to_none": 0, "errors": 0});
        let auto_method = Method {
            method: SpeculationMethod::Auto,
            k: 0,
            at: (0, ""),
        };
        let table = markdown(&[none, auto], &[Method::NONE, auto_method]);
        assert!(
            table.ends_with("| s | 8 | 40.0 | 1.07x (1.01-1.12) |\n"),
            "{table}"
        );
    }
}
