//! `--calibrate`: the target's greedy text for each prompt, read by the draft one token at a
//! time, and what that says of the draft's confidence (how often its greedy token is the
//! target's, by its probability), of drafting a guessed rejection's branch ahead, and of
//! trees against chains of as many rows.

use super::{Args, round2};
use anyhow::{Context, Result};
use duet_engine::sampling::argmax_probability;
use duet_engine::speculate::decode_greedy;
use duet_engine::{ChatMessage, ExtraLogits, LogitsFor, Model, SequenceInput, Tokenizer};
use serde_json::json;
use std::path::Path;

/// Probability bands of `calibrate`: a draft token's probability falls in the first band
/// whose upper end exceeds it.
const BANDS: [f32; 6] = [0.3, 0.5, 0.7, 0.9, 0.97, f32::INFINITY];

/// The draft's view of one position of the target's text.
pub(super) struct Position {
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
pub(super) fn teacher_forced(
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
pub(super) fn bands(texts: &[Vec<Position>]) -> Vec<serde_json::Value> {
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
pub(super) fn rejections(texts: &[Vec<Position>], k: usize) -> serde_json::Value {
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
pub(super) fn trees(texts: &[Vec<Position>], rows: usize) -> serde_json::Value {
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
