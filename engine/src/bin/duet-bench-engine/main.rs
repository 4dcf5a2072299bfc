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
use duet_engine::{Adapter, LoadOptions, LogitsFor, Model, SequenceInput, Tokenizer};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

mod calibrate;
use calibrate::{bands, rejections, teacher_forced, trees};

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
