//! Engine benchmark: prefill and greedy decode speed, and the wall time of one forward pass of
//! K tokens after a prompt, for each GGUF model given (with `--sessions N`: also one batched
//! pass of K tokens in each of N sessions, as a target-worker verifies N streams), and the
//! time to read a row of its logits greedily or into a sampling distribution. Prints one
//! JSON object per model.
//! With `--draft D --calibrate PROMPTS.jsonl`: how often the draft's greedy token is the
//! target's, by the draft's own probability of it (what AUTO's early stop relies on), and
//! what drafting a guessed rejection's branch ahead could have found ready, and what a tree
//! (a chain and one branch from its least sure position, or grown best first) commits a round
//! against a chain of as many rows.

use anyhow::{Context, Result};
use clap::Parser;
use duet_engine::sampling::{
    Draw, DrawFrom, SamplingParams, argmax, argmax_probability, process_logits,
    proposal_distribution,
};
use duet_engine::speculate::{decode_greedy, speculate_greedy};
use duet_engine::{
    Adapter, ChatMessage, ExtraLogits, LoadOptions, LogitsFor, Model, SequenceInput, Tokenizer,
};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Measure prefill, decode and K-token forward times of GGUF models")]
struct Args {
    /// GGUF model files.
    #[arg(required = true)]
    models: Vec<PathBuf>,
    /// Prompt text (a code prompt by default).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate greedily for the decode figure.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Batch sizes for the K-token forward timings.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    k: Vec<usize>,
    /// Also time one batched pass of K tokens in each of N sessions (each after the prompt),
    /// as a target-worker runs the Verify calls of N concurrent requests, for each N given.
    #[arg(long, value_delimiter = ',')]
    sessions: Vec<usize>,
    /// Timed repetitions of each K-token forward (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Also run greedy speculative decoding in process with this draft model against each
    /// model given (the targets), and report its speed next to the target alone.
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Load the models given with logits for the first N token ids and the special tokens
    /// only (`LoadOptions::shortlist`): a draft model's speed in a draft-worker with
    /// `vocab_shortlist = N`.
    #[arg(long)]
    shortlist: Option<usize>,
    /// With --draft: the draft computes logits only for the first N token ids and the
    /// special tokens (`LoadOptions::shortlist`).
    #[arg(long, requires = "draft")]
    draft_shortlist: Option<usize>,
    /// With --calibrate and --draft-shortlist: the draft does not take the prompt's and
    /// text's tokens into its extra ids (the first ids and the special tokens only).
    #[arg(long, requires = "draft_shortlist")]
    no_own_tokens: bool,
    /// Drafted tokens per round for --draft.
    #[arg(long, default_value_t = 4)]
    draft_k: usize,
    /// With --draft: instead of timings, how well the draft's confidence predicts the
    /// target on the prompts of this JSONL file (`prompt`, and `chat: true` for a user
    /// message): for each prompt the target's greedy continuation of --tokens tokens, then
    /// at each of its positions the draft's greedy token and that token's probability
    /// given the target's text. Prints, per probability band, how often the draft's token
    /// was the target's; and, over greedy rounds of 1 to --draft-k tokens, how often a round's
    /// first rejection was at the draft's least sure token and the target chose the draft's
    /// second choice there (a branch drafted ahead for that guess would have been ready).
    #[arg(long, requires = "draft")]
    calibrate: Option<PathBuf>,
    /// With --calibrate: also replay trees grown best first (each round's rows are the draft's
    /// guesses of highest probability along their path, each guess offering its N likeliest
    /// next tokens), for every row count of the trees report.
    #[arg(long, requires = "calibrate", default_value_t = 0)]
    best_first_children: usize,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// On CUDA: replay the decode and verify step from CUDA graphs (`LoadOptions::cuda_graphs`);
    /// `false`: launch its kernels one by one.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    cuda_graphs: bool,
    /// Load the projections of one input whose weights share a type as one weight, or
    /// each apart (`LoadOptions::fuse_projections`; default: the device's).
    #[arg(long)]
    fuse_projections: Option<bool>,
    /// Include the generated text in the output.
    #[arg(long)]
    show_text: bool,
    /// Run every session with a random LoRA adapter of this rank on all seven projections
    /// of every layer (what an adapter costs a pass).
    #[arg(long)]
    adapter_rank: Option<usize>,
    /// Also decode drawing each token at this temperature from its whole row (read to the
    /// host, the engine's sampler, seed 0) on a thread of its own, as a sampling request's
    /// steps do on a worker's model thread: its rate, and per token the pass with the row's
    /// copy, the host's time in the sampler and the page faults the process took (Linux).
    #[arg(long)]
    temperature: Option<f32>,
}

const DEFAULT_PROMPT: &str = "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number iteratively, with a docstring and type hints.<|im_end|>\n<|im_start|>assistant\n";

fn main() -> Result<()> {
    let args = Args::parse();
    let options = LoadOptions {
        device: duet_engine::select_device(&args.device)?,
        cuda_graphs: args.cuda_graphs,
        fuse_projections: args.fuse_projections,
        ..LoadOptions::default()
    };
    let draft = match &args.draft {
        Some(path) => Some(Model::load(
            path,
            &LoadOptions {
                shortlist: args.draft_shortlist,
                ..options.clone()
            },
        )?),
        None => None,
    };
    if let (Some(file), Some(draft)) = (&args.calibrate, &draft) {
        for path in &args.models {
            let target = Model::load(path, &options)?;
            let tokenizer = Tokenizer::load(path)?;
            let texts = teacher_forced(draft, &target, &tokenizer, file, &args)
                .with_context(|| format!("calibrating against {}", path.display()))?;
            println!(
                "{}",
                json!({
                    "model": path.display().to_string(),
                    "bands": bands(&texts),
                    "rejections": (1..=args.draft_k)
                        .map(|k| rejections(&texts, k))
                        .collect::<Vec<_>>(),
                    "trees": (2..=2 * args.draft_k)
                        .map(|rows| trees(&texts, rows))
                        .collect::<Vec<_>>(),
                })
            );
        }
        return Ok(());
    }
    for path in &args.models {
        let t = Instant::now();
        let model = Model::load(
            path,
            &LoadOptions {
                shortlist: args.shortlist,
                ..options.clone()
            },
        )?;
        let load_s = t.elapsed().as_secs_f64();
        let tokenizer = Tokenizer::load(path)?;
        let prompt = tokenizer.encode(args.prompt.as_deref().unwrap_or(DEFAULT_PROMPT), true)?;
        let adapter = (args.adapter_rank)
            .map(|rank| random_adapter(&model, rank))
            .transpose()?;
        let mut report = bench(&model, &tokenizer, &prompt, &args, adapter.as_ref())
            .with_context(|| format!("benchmarking {}", path.display()))?;
        report["model"] = json!(path.file_name().map(|n| n.to_string_lossy().into_owned()));
        report["load_s"] = json!(round2(load_s));
        if let Some(draft) = &draft {
            report["speculative"] = speculative(draft, &model, &prompt, &args)
                .with_context(|| format!("speculating on {}", path.display()))?;
        }
        println!("{report}");
    }
    Ok(())
}

/// Greedy generation of `--tokens` tokens by the target alone and with the draft (both timed
/// from the prompt's prefill on), and whether they produced the same tokens.
fn speculative(
    draft: &Model,
    target: &Model,
    prompt: &[u32],
    args: &Args,
) -> Result<serde_json::Value> {
    let t = Instant::now();
    let alone = decode_greedy(target, prompt, args.tokens)?;
    let alone_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let run = speculate_greedy(draft, target, prompt, args.tokens, args.draft_k)?;
    let speculative_s = t.elapsed().as_secs_f64();
    Ok(json!({
        "k": args.draft_k,
        "target_alone_tok_s": round2(args.tokens as f64 / alone_s),
        "speculative_tok_s": round2(args.tokens as f64 / speculative_s),
        "speedup": round2(alone_s / speculative_s),
        "rounds": run.rounds,
        "acceptance_rate": round2(run.accepted as f64 / run.proposed as f64),
        "same_tokens": run.tokens == alone,
    }))
}

/// Probability bands of `calibrate`: a draft token's probability falls in the first band
/// whose upper end exceeds it.
const BANDS: [f32; 6] = [0.3, 0.5, 0.7, 0.9, 0.97, f32::INFINITY];

/// The draft's view of one position of the target's text.
struct Position {
    /// The draft's greedy token and its probability.
    token: u32,
    p: f32,
    /// The draft's second choice.
    second: u32,
    /// The target's token.
    wanted: u32,
    /// With --best-first-children: for a round starting here, the order (0 first) in which a
    /// tree grown best first takes the target's token at each depth, for as many depths as
    /// the tree of 2 x --draft-k rows reaches on the target's text.
    best_first: Option<Vec<usize>>,
}

/// The `n` likeliest tokens of a row of logits with their probabilities, likeliest first.
fn top_probabilities(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    for (id, &x) in (0u32..).zip(row) {
        if top.len() < n || top.last().is_some_and(|&(_, low)| x > low) {
            let at = top.partition_point(|&(_, y)| y >= x);
            top.insert(at, (id, x));
            top.truncate(n);
        }
    }
    top.into_iter()
        .map(|(id, x)| (id, (x - max).exp() / sum))
        .collect()
}

/// For each of the file's prompts, the target's greedy continuation read by the draft one
/// token at a time: what the draft predicts at each position.
fn teacher_forced(
    draft: &Model,
    target: &Model,
    tokenizer: &Tokenizer,
    file: &Path,
    args: &Args,
) -> Result<Vec<Vec<Position>>> {
    let (tokens, own_tokens) = (args.tokens, !args.no_own_tokens);
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let mut texts = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let row: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("line {}", i + 1))?;
        let prompt = row["prompt"].as_str().context("no `prompt`")?;
        let ids = match row["chat"].as_bool().unwrap_or(false) {
            true => tokenizer.encode_chat(&[ChatMessage::new("user", prompt)], true)?,
            false => tokenizer.encode(prompt, true)?,
        };
        let continuation = decode_greedy(target, &ids, tokens)?;
        let end = continuation
            .iter()
            .position(|&t| tokenizer.is_eos(t))
            .map_or(continuation.len(), |at| at + 1);
        // The draft reads the prompt and the target's text, one token at a time, and a
        // shortlisted draft takes each token it reads into its extra ids, as a draft-worker's
        // session does. The cache has room for a guess past the text's end.
        let mut cache = draft.new_cache(ids.len() + end + 2 * args.draft_k)?;
        draft.prefill(&mut cache, &ids[..ids.len() - 1], LogitsFor::None)?;
        let mut extra = ExtraLogits::default();
        if own_tokens {
            draft.extend_shortlist(&mut extra, &ids)?;
        }
        let mut fed = vec![ids[ids.len() - 1]];
        fed.extend_from_slice(&continuation[..end - 1]);
        let (mut positions, mut tops) = (Vec::with_capacity(end), Vec::new());
        for (&input, &wanted) in fed.iter().zip(&continuation[..end]) {
            if own_tokens {
                draft.extend_shortlist(&mut extra, &[input])?;
            }
            let mut seq = [SequenceInput {
                cache: &mut cache,
                tokens: &[input],
                logits: LogitsFor::Last,
                extra: Some(&extra),
                greedy: false,
                draws: &[],
                parents: &[],
            }];
            let logits = draft.forward_batch(&mut seq)?.remove(0);
            let row = logits.row(0);
            let (token, p) = argmax_probability(row)?;
            let second = (0u32..)
                .zip(row)
                .filter(|&(id, _)| id != token)
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map_or(token, |(id, _)| id);
            if args.best_first_children > 0 {
                tops.push(top_probabilities(row, args.best_first_children));
            }
            positions.push(Position {
                token,
                p,
                second,
                wanted,
                best_first: None,
            });
        }
        if args.best_first_children > 0 {
            let text = Forced {
                draft,
                prompt: &ids,
                continuation: &continuation[..end],
                tops: &tops,
            };
            let grown = text.best_first(&mut cache, own_tokens, 2 * args.draft_k)?;
            for (x, taken) in positions.iter_mut().zip(grown) {
                x.best_first = Some(taken);
            }
        }
        texts.push(positions);
    }
    Ok(texts)
}

/// A prompt and the target's greedy text after it, with the draft's likeliest tokens at each
/// of the text's positions given the text before it.
struct Forced<'a> {
    draft: &'a Model,
    prompt: &'a [u32],
    continuation: &'a [u32],
    tops: &'a [Vec<(u32, f32)>],
}

impl Forced<'_> {
    /// `grow_best_first` for a round starting at each of the text's positions in turn, with
    /// the draft's cache and extra ids (`own_tokens`) as they are there: the prompt and the
    /// text so far.
    fn best_first(
        &self,
        cache: &mut duet_engine::KvCache,
        own_tokens: bool,
        rows: usize,
    ) -> Result<Vec<Vec<usize>>> {
        // The text is read into the cache again, a token a round start: a guess off the text
        // cuts the cache back to where its round starts, which drops the rows after it.
        let draft = self.draft;
        cache.truncate(self.prompt.len())?;
        let mut extra = ExtraLogits::default();
        if own_tokens {
            draft.extend_shortlist(&mut extra, self.prompt)?;
        }
        let mut grown = Vec::with_capacity(self.continuation.len());
        for (at, &token) in self.continuation.iter().enumerate() {
            grown.push(self.grow_best_first(cache, own_tokens.then_some(&extra), at, rows)?);
            draft.forward(cache, &[token], LogitsFor::None)?;
            if own_tokens {
                draft.extend_shortlist(&mut extra, &[token])?;
            }
        }
        Ok(grown)
    }

    /// A tree of up to `rows` guesses after the text's first `at` tokens, grown best first:
    /// each step takes the pending guess whose path the draft finds likeliest (the product
    /// of its tokens' probabilities) and offers that guess's likeliest next tokens. Returns,
    /// for depths 1, 2, ..., the step that took the target's token there, up to the first
    /// depth the tree misses. A guess off the target's text reads its next tokens from a
    /// draft pass over its path.
    fn grow_best_first(
        &self,
        cache: &mut duet_engine::KvCache,
        extra: Option<&ExtraLogits>,
        at: usize,
        rows: usize,
    ) -> Result<Vec<usize>> {
        let wanted = &self.continuation[at..];
        let mut pending: Vec<(Vec<u32>, f32)> =
            self.tops[at].iter().map(|&(t, p)| (vec![t], p)).collect();
        let mut taken = Vec::new();
        for step in 0..rows {
            // Past the tree's last guess on the target's text, no later step changes what
            // the target takes.
            let depth = taken.len();
            let alive = depth < wanted.len()
                && pending
                    .iter()
                    .any(|(path, _)| path.len() == depth + 1 && path[..] == wanted[..=depth]);
            if !alive {
                break;
            }
            let best = (0..pending.len())
                .max_by(|&a, &b| pending[a].1.total_cmp(&pending[b].1))
                .expect("the target's guess is pending");
            let (path, p) = pending.swap_remove(best);
            let on_text = path.len() <= wanted.len() && path[..] == wanted[..path.len()];
            if on_text {
                taken.push(step);
            }
            if step + 1 == rows {
                break;
            }
            let next = match on_text {
                true if at + path.len() < self.tops.len() => self.tops[at + path.len()].clone(),
                true => Vec::new(),
                false => self.next_after(cache, extra, at, &path)?,
            };
            pending.extend(next.into_iter().map(|(t, q)| {
                let mut longer = path.clone();
                longer.push(t);
                (longer, p * q)
            }));
        }
        Ok(taken)
    }

    /// The draft's likeliest next tokens after the text's first `at` tokens and `path`
    /// (`cache` holds the prompt and those tokens, before and after).
    fn next_after(
        &self,
        cache: &mut duet_engine::KvCache,
        extra: Option<&ExtraLogits>,
        at: usize,
        path: &[u32],
    ) -> Result<Vec<(u32, f32)>> {
        let mut seq = [SequenceInput {
            cache,
            tokens: path,
            logits: LogitsFor::Last,
            extra,
            greedy: false,
            draws: &[],
            parents: &[],
        }];
        let logits = self.draft.forward_batch(&mut seq)?.remove(0);
        cache.truncate(self.prompt.len() + at)?;
        Ok(top_probabilities(logits.row(0), self.tops[at].len()))
    }
}

/// Per band of the draft's probability of its greedy token, the tokens and how many were
/// the target's.
fn bands(texts: &[Vec<Position>]) -> Vec<serde_json::Value> {
    let mut counts = [(0usize, 0usize); BANDS.len()];
    for x in texts.iter().flatten() {
        let band = BANDS
            .iter()
            .position(|&top| x.p < top)
            .unwrap_or(BANDS.len() - 1);
        counts[band].0 += 1;
        counts[band].1 += usize::from(x.token == x.wanted);
    }
    let mut low = 0.0;
    let mut bands = Vec::new();
    for (&top, &(n, matched)) in BANDS.iter().zip(&counts) {
        let share = if n == 0 {
            None
        } else {
            Some(round2(matched as f64 / n as f64))
        };
        let (from, to) = (round2(f64::from(low)), round2(f64::from(top.min(1.0))));
        bands.push(json!({"from": from, "to": to, "tokens": n, "target_agrees": share}));
        low = top;
    }
    bands
}

/// Greedy rounds of `k` drafted tokens over the texts: how many there were, how many
/// rejected a draft, and in how many a branch drafted ahead for one guessed rejection (the
/// target's token at the draft's least sure position is the draft's second choice there)
/// would have been the right one; and how many rounds right after a rejecting one rejected
/// their first token (those a pre-verify of that token would end early). The guess reads the draft's confidence given the target's
/// text, which past a round's first wrong token is only an estimate of what the draft,
/// drafting on its own tokens, would have said.
fn rejections(texts: &[Vec<Position>], k: usize) -> serde_json::Value {
    let (mut rounds, mut rejecting, mut guessed, mut first_wrong) = (0usize, 0, 0, 0);
    for text in texts {
        let (mut at, mut after_rejection) = (0, false);
        while at < text.len() {
            let round = &text[at..(at + k.max(1)).min(text.len())];
            rounds += 1;
            let first = round.iter().position(|x| x.token != x.wanted);
            first_wrong += usize::from(after_rejection && first == Some(0));
            after_rejection = first.is_some();
            let Some(first) = first else {
                // All accepted, and the target's next token with them.
                at += round.len() + 1;
                continue;
            };
            rejecting += 1;
            let guess = (0..round.len()).min_by(|&a, &b| round[a].p.total_cmp(&round[b].p));
            guessed +=
                usize::from(guess == Some(first) && round[first].second == round[first].wanted);
            at += first + 1;
        }
    }
    let mismatched: Vec<_> = texts
        .iter()
        .flatten()
        .filter(|x| x.token != x.wanted)
        .collect();
    let second = mismatched.iter().filter(|x| x.second == x.wanted).count();
    json!({
        "k": k,
        "rounds": rounds,
        "rejecting": rejecting,
        "branch_ready": guessed,
        "first_wrong_after_rejection": first_wrong,
        "mismatched_tokens": mismatched.len(),
        "target_took_second_choice": second,
    })
}

/// Greedy rounds over the texts, each verifying `rows` drafts: as one chain, and as trees
/// of a chain of `rows - d` and a branch of `d` rows at one of the chain's positions (the
/// draft's second choice there, then its greedy tokens after it). Committed tokens a round
/// for each. The branch goes at the chain's least sure position where its probability is
/// under a threshold (elsewhere the round verifies a chain of `rows`), or, as a bound on
/// every way of placing one branch, at the chain's first wrong token, known in hindsight. A
/// branch is taken only where the target's token is that second choice, so its later tokens
/// are the draft's on the target's text, read exactly; the least sure position, like
/// `rejections`' guess, reads the draft's confidence given the target's text.
fn trees(texts: &[Vec<Position>], rows: usize) -> serde_json::Value {
    let least_sure = |under: f32| {
        move |head: &[Position]| {
            let at = (0..head.len()).min_by(|&a, &b| head[a].p.total_cmp(&head[b].p))?;
            (head[at].p < under).then_some(at)
        }
    };
    let hindsight = |head: &[Position]| head.iter().position(|x| x.token != x.wanted);
    let per_round = |branch: usize, point: &dyn Fn(&[Position]) -> Option<usize>| {
        mean_committed(texts, |text, at| {
            let head = &text[at..(at + rows - branch).min(text.len())];
            let (round, point) = match point(head) {
                Some(j) if branch > 0 => (head, Some(j)),
                _ => (&text[at..(at + rows).min(text.len())], None),
            };
            match round.iter().position(|x| x.token != x.wanted) {
                None => round.len() + 1,
                Some(f) if point == Some(f) && round[f].second == round[f].wanted => {
                    let after = text[at + f + 1..].iter().take(branch - 1);
                    f + 2 + after.take_while(|x| x.token == x.wanted).count()
                }
                Some(f) => f + 1,
            }
        })
    };
    let trees = (1..rows).map(|d| {
        let under = [0.3, 0.5, 0.7, 0.9, 1.01].map(|u| per_round(d, &least_sure(u)));
        json!({"branch": d, "least_sure_under_0.3_0.5_0.7_0.9_1": under,
               "hindsight": per_round(d, &hindsight)})
    });
    json!({
        "rows": rows,
        "chain": per_round(0, &hindsight),
        "trees": trees.collect::<Vec<_>>(),
        "best_first": best_first_rounds(texts, rows),
    })
}

/// Committed tokens a round of trees of `rows` guesses grown best first (`Forced::
/// grow_best_first`), where --best-first-children asked for them.
fn best_first_rounds(texts: &[Vec<Position>], rows: usize) -> Option<f64> {
    let grown = texts.iter().flatten().all(|x| x.best_first.is_some());
    grown.then(|| {
        mean_committed(texts, |text, at| {
            let taken = text[at].best_first.as_deref().unwrap_or_default();
            taken.iter().take_while(|&&step| step < rows).count() + 1
        })
    })
}

/// Mean tokens committed a round by greedy rounds walking each text from its start, where a
/// round starting at `at` commits `commit(text, at)` tokens (at least one; at most the
/// text's rest).
fn mean_committed(texts: &[Vec<Position>], commit: impl Fn(&[Position], usize) -> usize) -> f64 {
    let (mut rounds, mut committed) = (0usize, 0usize);
    for text in texts {
        let mut at = 0;
        while at < text.len() {
            let n = commit(text, at).min(text.len() - at);
            rounds += 1;
            committed += n;
            at += n;
        }
    }
    round2(committed as f64 / rounds.max(1) as f64)
}

fn median_ms(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2] * 1e3
}

/// Median ms by K.
type Timings = serde_json::Map<String, serde_json::Value>;

/// K-token forwards right after the prompt, rolled back after each timing: median ms
/// reading each row's greedy choice (a greedy Verify), and reading every row's logits (a
/// sampling one), by K.
fn k_forwards(
    model: &Model,
    cache: &mut duet_engine::KvCache,
    prompt_len: usize,
    generated: &[u32],
    args: &Args,
) -> Result<(Timings, Timings)> {
    cache.truncate(prompt_len)?;
    let (mut forward_ms, mut logits_ms) = (serde_json::Map::new(), serde_json::Map::new());
    for &k in &args.k {
        let tokens: Vec<u32> = generated.iter().cycle().take(k).copied().collect();
        for (greedy, out) in [(true, &mut forward_ms), (false, &mut logits_ms)] {
            let mut times = Vec::with_capacity(args.reps);
            for _ in 0..args.reps.max(1) {
                let t = Instant::now();
                match greedy {
                    true => greedy_pass(model, cache, &tokens, LogitsFor::All).map(drop)?,
                    false => model.forward(cache, &tokens, LogitsFor::All).map(drop)?,
                }
                times.push(t.elapsed().as_secs_f64());
                cache.truncate(prompt_len)?;
            }
            out.insert(k.to_string(), json!(round2(median_ms(times))));
        }
    }
    Ok((forward_ms, logits_ms))
}

/// A decode drawing each token from its whole row: tokens a second, and per token the
/// milliseconds of the pass (the row's copy to the host included) and of the sampler, and
/// the page faults taken; and the same decode with each token drawn where the row is
/// (`SequenceInput::draws`: on a GPU with `DUET_CUDA_DRAW=1`, the GPU's draw): tokens a
/// second, and how many of its tokens are the first decode's before the two part; and so
/// drawn with top-k 40 and top-p 0.9 too (the GPU's boundaries found over the row), and
/// each token drawn from the row's proposal (a draft model's sampled steps).
struct Sampled {
    tok_s: f64,
    forward_ms: f64,
    sampler_ms: f64,
    faults: Option<f64>,
    drawn_tok_s: f64,
    drawn_same: usize,
    drawn_cut_tok_s: f64,
    proposed_tok_s: f64,
}

/// `tokens` tokens decoded after the prompt's rows in `cache`, each drawn at `temperature`
/// from its whole row, on a thread spawned for it: a worker's model thread is one, and
/// where a large block's pages come from (an allocator's arena a thread) is part of what
/// a drawn token costs.
fn sampled_decode(
    model: &Model,
    cache: &mut duet_engine::KvCache,
    prompt: &[u32],
    tokens: usize,
    temperature: f32,
) -> Result<Sampled> {
    let params = SamplingParams {
        temperature,
        ..SamplingParams::greedy()
    };
    let decode = move || -> Result<Sampled> {
        let mut rng = duet_engine::sampling::rng_for(0);
        cache.truncate(prompt.len() - 1)?;
        let mut next = prompt[prompt.len() - 1];
        let (mut forward, mut sampler) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        let (faults, t) = (minor_faults(), Instant::now());
        let mut texts = Vec::with_capacity(tokens);
        for _ in 0..tokens {
            let passed = Instant::now();
            let logits = model.forward(cache, &[next], LogitsFor::Last)?;
            let drawn = Instant::now();
            forward += drawn - passed;
            let row = logits.last().context("no logits")?;
            next = process_logits(row, &params)?.sample(&mut rng);
            sampler += drawn.elapsed();
            texts.push(next);
        }
        let per_token = |d: std::time::Duration| d.as_secs_f64() / tokens.max(1) as f64;
        let faults = faults.zip(minor_faults()).map(|(a, b)| (b - a) as f64);
        let tok_s = 1.0 / per_token(t.elapsed());
        let (drawn_tok_s, drawn) =
            drawn_decode(model, cache, prompt, tokens, (params, DrawFrom::Row))?;
        let cut = SamplingParams {
            top_k: 40,
            top_p: 0.9,
            ..params
        };
        let (drawn_cut_tok_s, _) =
            drawn_decode(model, cache, prompt, tokens, (cut, DrawFrom::Row))?;
        let (proposed_tok_s, _) =
            drawn_decode(model, cache, prompt, tokens, (params, DrawFrom::Proposal))?;
        Ok(Sampled {
            tok_s,
            forward_ms: per_token(forward) * 1e3,
            sampler_ms: per_token(sampler) * 1e3,
            faults: faults.map(|f| f / tokens.max(1) as f64),
            drawn_tok_s,
            drawn_same: texts.iter().zip(&drawn).take_while(|(a, b)| a == b).count(),
            drawn_cut_tok_s,
            proposed_tok_s,
        })
    };
    std::thread::scope(|s| s.spawn(decode).join())
        .map_err(|_| anyhow::anyhow!("the sampled decode's thread panicked"))?
}

impl Sampled {
    fn report(&self, report: &mut serde_json::Value) {
        report["sampled_decode_tok_s"] = json!(round2(self.tok_s));
        report["sampled_forward_ms"] = json!(round3(self.forward_ms));
        report["sampler_ms"] = json!(round3(self.sampler_ms));
        report["sampled_faults_per_token"] = json!(self.faults.map(round2));
        report["drawn_decode_tok_s"] = json!(round2(self.drawn_tok_s));
        report["drawn_tokens_as_whole_rows"] = json!(self.drawn_same);
        report["drawn_top_k_p_decode_tok_s"] = json!(round2(self.drawn_cut_tok_s));
        report["proposed_decode_tok_s"] = json!(round2(self.proposed_tok_s));
    }
}

/// `tokens` tokens decoded after the prompt's rows in `cache` as [`sampled_decode`] does
/// (seed 0), each drawn where the row is, from the row's distribution `from` says (its
/// proposal, as a draft model's steps draw, or the row's): tokens a second, and the tokens.
fn drawn_decode(
    model: &Model,
    cache: &mut duet_engine::KvCache,
    prompt: &[u32],
    tokens: usize,
    (params, from): (SamplingParams, DrawFrom),
) -> Result<(f64, Vec<u32>)> {
    let mut rng = duet_engine::sampling::rng_for(0);
    cache.truncate(prompt.len() - 1)?;
    let mut next = prompt[prompt.len() - 1];
    let mut texts = Vec::with_capacity(tokens);
    let t = Instant::now();
    for _ in 0..tokens {
        let draw = Draw {
            from: from.clone(),
            ..Draw::new(params, &mut rng)
        };
        let mut seqs = [SequenceInput {
            cache: &mut *cache,
            tokens: &[next],
            logits: LogitsFor::Last,
            extra: None,
            greedy: false,
            draws: std::slice::from_ref(&draw),
            parents: &[],
        }];
        let logits = model.forward_batch(&mut seqs)?.remove(0);
        next = logits.drawn(0, &draw)?.token;
        texts.push(next);
    }
    Ok((tokens as f64 / t.elapsed().as_secs_f64(), texts))
}

/// The page faults the process has taken that needed no read (`minflt` of
/// `/proc/self/stat`); `None` where there is no such file.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command's name, which is in parentheses and may hold spaces.
    let fields = &stat[stat.rfind(')')? + 1..];
    fields.split_whitespace().nth(7)?.parse().ok()
}

/// Milliseconds (the median of 50) to read one row of logits (the prompt's last) as the
/// workers read them: a greedy token, with its probability, and a sampling distribution at
/// temperature 0.7, plain, with top-k 40 and with top-p 0.9.
fn row_reads(row: &[f32]) -> Result<serde_json::Value> {
    let time = |read: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut s = Vec::with_capacity(50);
        for _ in 0..50 {
            let t = Instant::now();
            read()?;
            s.push(t.elapsed().as_secs_f64());
        }
        Ok(round3(median_ms(s)))
    };
    let sampled = |top_k: usize, top_p: f32| SamplingParams {
        temperature: 0.7,
        top_k,
        top_p,
        min_p: 0.0,
        seed: 0,
    };
    let mut report = json!({
        "vocab": row.len(),
        "argmax": time(&mut || Ok(argmax(row).map(drop)?))?,
        "argmax_probability": time(&mut || Ok(argmax_probability(row).map(drop)?))?,
    });
    for (name, params) in [
        ("sample", sampled(0, 1.0)),
        ("sample_top_k", sampled(40, 1.0)),
        ("sample_top_p", sampled(0, 0.9)),
    ] {
        report[name] = json!(time(&mut || Ok(process_logits(row, &params).map(drop)?))?);
    }
    // A draft's distribution at the same temperature, without its tail, and its size.
    let proposal = || proposal_distribution(row, &sampled(0, 1.0));
    report["proposal"] = json!(time(&mut || Ok(proposal().map(drop)?))?);
    report["proposal_tokens"] = json!(proposal()?.len());
    Ok(report)
}

/// A random adapter of `rank` on every projection of `model` (its files written to a
/// scratch directory, removed once it is loaded).
fn random_adapter(model: &Model, rank: usize) -> Result<Arc<Adapter>> {
    let dir = std::env::temp_dir().join(format!("duet-bench-adapter-{}", std::process::id()));
    let adapter = duet_engine::testing::TinyAdapter {
        rank,
        alpha: 2.0 * rank as f64,
        b_scale: 0.01,
        ..Default::default()
    };
    adapter.write(&dir, model.config())?;
    let loaded = model.load_adapter("bench", &dir);
    std::fs::remove_dir_all(&dir)?;
    Ok(loaded?)
}

/// Prefill, greedy decode and K-token forward timings of one model (its sessions with
/// `adapter`, if any).
fn bench(
    model: &Model,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    args: &Args,
    adapter: Option<&Arc<Adapter>>,
) -> Result<serde_json::Value> {
    let max_k = args.k.iter().copied().max().unwrap_or(1);
    // 40: `rows_unlike_one_row_passes`'s widest pass.
    let capacity = prompt.len() + args.tokens + max_k.max(40) + 1;
    let mut cache = model.new_adapted_cache(capacity, adapter.cloned())?;

    // Warm-up: the first pass faults the weights in and starts candle's thread pool; on
    // CUDA the first decode steps build the CUDA step (compiling its kernels) and capture
    // its one-row graph.
    model.prefill(&mut cache, &prompt[..prompt.len().min(8)], LogitsFor::Last)?;
    for _ in 0..2 {
        model.forward(&mut cache, &prompt[..1], LogitsFor::Last)?;
    }
    cache.truncate(0)?;

    let t = Instant::now();
    let logits = model.prefill(&mut cache, prompt, LogitsFor::Last)?;
    let prefill_s = t.elapsed().as_secs_f64();
    let row_ms = row_reads(logits.last().context("no logits")?)?;

    let mut next = argmax(logits.last().context("no logits")?)?;
    let mut generated = vec![next];
    let t = Instant::now();
    for _ in 1..args.tokens {
        let logits = greedy_pass(model, &mut cache, &[next], LogitsFor::Last)?;
        next = logits.greedy(0)?.token;
        generated.push(next);
    }
    let decode_s = t.elapsed().as_secs_f64();

    let sampled = match args.temperature {
        Some(t) => Some(sampled_decode(model, &mut cache, prompt, args.tokens, t)?),
        None => None,
    };
    let (forward_ms, logits_ms) = k_forwards(model, &mut cache, prompt.len(), &generated, args)?;
    let batch_ms = batch_forwards(model, prompt, &generated, args, adapter)?;
    let c = model.config();
    let mut report = json!({
        "architecture": c.architecture.name(),
        "layers": c.n_layers,
        "hidden": c.hidden,
        "device": args.device,
        "threads": candle_core::utils::get_num_threads(),
        "prompt_tokens": prompt.len(),
        "prefill_tok_s": round2(prompt.len() as f64 / prefill_s),
        "decode_tokens": generated.len(),
        "decode_tok_s": round2((generated.len() - 1) as f64 / decode_s),
        "forward_ms": forward_ms,
        "forward_logits_ms": logits_ms,
        "row_ms": row_ms,
    });
    if !args.sessions.is_empty() {
        report["batch_forward_ms"] = json!(batch_ms);
    }
    if let Some(s) = sampled {
        s.report(&mut report);
    }
    // Only CUDA has a step apart from candle's ops to compare.
    if let Some(graphs) = model.cuda_graphs() {
        report["cuda_graphs"] = json!({"captured": graphs.captured, "failure": graphs.failure});
        report["step_against_candle"] =
            step_against_candle(model, &mut cache, prompt.len(), &generated)?;
        report["rows_unlike_one_row_passes"] =
            rows_unlike_one_row_passes(model, &mut cache, prompt.len(), &generated)?;
    }
    if args.show_text {
        report["text"] = json!(tokenizer.decode(&generated, false)?);
    }
    Ok(report)
}

/// On CUDA, 8 rows after the prompt through the CUDA step and through candle's ops: the
/// largest difference of a logit and the largest logit (the two round differently, so
/// they agree to rounding, not to the bit), and how many rows' argmaxes differ.
fn step_against_candle(
    model: &Model,
    cache: &mut duet_engine::KvCache,
    prompt: usize,
    generated: &[u32],
) -> Result<serde_json::Value> {
    let tokens: Vec<u32> = generated.iter().cycle().take(8).copied().collect();
    let mut rows = Vec::new();
    for m in [model.clone(), model.with_cuda_step(false)] {
        cache.truncate(prompt)?;
        rows.push(m.forward(cache, &tokens, LogitsFor::All)?);
    }
    cache.truncate(prompt)?;
    let (mut diff, mut largest, mut argmaxes) = (0f32, 0f32, 0);
    for i in 0..tokens.len() {
        let (a, b) = (rows[0].row(i), rows[1].row(i));
        for (x, y) in a.iter().zip(b) {
            diff = diff.max((x - y).abs());
            largest = largest.max(y.abs());
        }
        argmaxes += usize::from(argmax(a)? != argmax(b)?);
    }
    Ok(json!({"max_diff": diff, "max_logit": largest, "argmax_differs": argmaxes}))
}

/// On CUDA, for passes of 8 and 40 rows after the prompt: how many rows' logits differ in
/// any bit from the same rows decoded one a pass. Batch invariance says none, whatever
/// kernels the row counts take (the mat-vec's by rows: `DUET_CUDA_MATVEC`).
fn rows_unlike_one_row_passes(
    model: &Model,
    cache: &mut duet_engine::KvCache,
    prompt: usize,
    generated: &[u32],
) -> Result<serde_json::Value> {
    let mut unlike = serde_json::Map::new();
    for n in [8, 40] {
        let tokens: Vec<u32> = generated.iter().cycle().take(n).copied().collect();
        cache.truncate(prompt)?;
        let together = model.forward(cache, &tokens, LogitsFor::All)?;
        cache.truncate(prompt)?;
        let mut differ = 0;
        for (i, token) in tokens.iter().enumerate() {
            let alone = model.forward(cache, &[*token], LogitsFor::Last)?;
            let bits = |row: &[f32]| row.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            differ += usize::from(bits(together.row(i)) != bits(alone.row(0)));
        }
        unlike.insert(n.to_string(), json!(differ));
    }
    cache.truncate(prompt)?;
    Ok(json!(unlike))
}

/// One pass over `tokens` that reads only each row's greedy choice (`SequenceInput::greedy`).
fn greedy_pass(
    model: &Model,
    cache: &mut duet_engine::KvCache,
    tokens: &[u32],
    logits: LogitsFor,
) -> Result<duet_engine::Logits> {
    let mut seq = [SequenceInput {
        cache,
        tokens,
        logits,
        extra: None,
        greedy: true,
        draws: &[],
        parents: &[],
    }];
    Ok(model.forward_batch(&mut seq)?.remove(0))
}

/// For each N in `--sessions` and each K: the median time of one `forward_batch` of K tokens
/// in each of N sessions holding the prompt, reading each row's greedy choice (N greedy
/// streams verified together), keyed "NxK".
fn batch_forwards(
    model: &Model,
    prompt: &[u32],
    generated: &[u32],
    args: &Args,
    adapter: Option<&Arc<Adapter>>,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    let max_k = args.k.iter().copied().max().unwrap_or(1);
    let mut times_ms = serde_json::Map::new();
    for &n in &args.sessions {
        let mut caches = (0..n)
            .map(|_| {
                let mut cache = model.new_adapted_cache(prompt.len() + max_k, adapter.cloned())?;
                model.prefill(&mut cache, prompt, LogitsFor::None)?;
                Ok(cache)
            })
            .collect::<Result<Vec<_>>>()?;
        for &k in &args.k {
            let tokens: Vec<u32> = generated.iter().cycle().take(k).copied().collect();
            let mut times = Vec::with_capacity(args.reps);
            for _ in 0..args.reps.max(1) {
                let mut seqs: Vec<_> = caches
                    .iter_mut()
                    .map(|cache| SequenceInput {
                        cache,
                        tokens: &tokens,
                        logits: LogitsFor::All,
                        extra: None,
                        greedy: true,
                        draws: &[],
                        parents: &[],
                    })
                    .collect();
                let t = Instant::now();
                model.forward_batch(&mut seqs)?;
                times.push(t.elapsed().as_secs_f64());
                for cache in &mut caches {
                    cache.truncate(prompt.len())?;
                }
            }
            times_ms.insert(format!("{n}x{k}"), json!(round2(median_ms(times))));
        }
    }
    Ok(times_ms)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}
