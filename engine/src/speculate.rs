//! Greedy speculative decoding in one process: the reference loop for the services (which run
//! the same steps over gRPC) and the engine benchmark's estimate of what speculation gains.

use crate::error::{EngineError, Result};
use crate::model::{LogitsFor, Model};
use crate::sampling::argmax;
use crate::verify::verify_greedy;

/// Generates `n` tokens after `prompt` greedily with `model` alone, the way a worker decodes:
/// the prompt through [`Model::prefill`], then one token per [`Model::forward`]. The baseline
/// that [`speculate_greedy`] must reproduce.
pub fn decode_greedy(model: &Model, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyInput);
    }
    let mut cache = model.new_cache(prompt.len() + n)?;
    let logits = model.prefill(&mut cache, prompt, LogitsFor::Last)?;
    let mut out = vec![argmax(logits.last().unwrap_or_default())?];
    while out.len() < n {
        let logits = model.forward(&mut cache, &out[out.len() - 1..], LogitsFor::Last)?;
        out.push(argmax(logits.last().unwrap_or_default())?);
    }
    out.truncate(n);
    Ok(out)
}

/// What a speculative run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculated {
    /// The `n` generated tokens.
    pub tokens: Vec<u32>,
    /// Draft-verify rounds run.
    pub rounds: usize,
    /// Drafted tokens the target accepted.
    pub accepted: usize,
    /// Tokens the draft proposed.
    pub proposed: usize,
}

/// Generates `n` tokens after `prompt` greedily with `k` drafted tokens per round. Each round
/// the draft catches up on committed tokens it lacks and proposes `k` more, the target scores
/// them in one pass, [`verify_greedy`] keeps the agreeing prefix plus the target's own next
/// token, and both caches are cut back to the committed prefix. With batch-invariant models
/// the result equals the target decoding alone, token for token.
pub fn speculate_greedy(
    draft: &Model,
    target: &Model,
    prompt: &[u32],
    n: usize,
    k: usize,
) -> Result<Speculated> {
    // k = 0 would be plain decoding with a useless draft pass each round.
    if prompt.is_empty() || k == 0 {
        return Err(EngineError::EmptyInput);
    }
    let capacity = prompt.len() + n + k + 1;
    let (mut d, mut t) = (draft.new_cache(capacity)?, target.new_cache(capacity)?);
    let logits = target.prefill(&mut t, prompt, LogitsFor::Last)?;
    draft.prefill(&mut d, prompt, LogitsFor::None)?;
    let next = argmax(logits.last().unwrap_or_default())?;
    let mut committed = prompt.to_vec();
    committed.push(next);
    let mut run = Speculated {
        tokens: Vec::new(),
        rounds: 0,
        accepted: 0,
        proposed: 0,
    };
    while committed.len() - prompt.len() < n {
        let have = d.len();
        let mut logits = draft.forward(&mut d, &committed[have..], LogitsFor::Last)?;
        let mut proposed = Vec::with_capacity(k);
        for i in 0..k {
            proposed.push(argmax(logits.last().unwrap_or_default())?);
            if i + 1 < k {
                logits = draft.forward(&mut d, &proposed[i..], LogitsFor::Last)?;
            }
        }
        // The target scores the committed tokens it lacks (the last one) and the proposals.
        let base = committed.len();
        let missing = base - t.len();
        let mut input = committed[t.len()..].to_vec();
        input.extend_from_slice(&proposed);
        let logits = target.forward(&mut t, &input, LogitsFor::All)?;
        let argmaxes = (missing - 1..logits.rows())
            .map(|i| argmax(logits.row(i)))
            .collect::<Result<Vec<_>, _>>()?;
        let verdict = verify_greedy(&proposed, &argmaxes)?;
        run.rounds += 1;
        run.proposed += k;
        run.accepted += verdict.accepted;
        committed.extend_from_slice(&proposed[..verdict.accepted]);
        committed.push(verdict.token);
        // Cut back to the committed prefix; its last token is fed next round.
        t.truncate(base + verdict.accepted)?;
        d.truncate(d.len().min(base + verdict.accepted))?;
    }
    committed.truncate(prompt.len() + n);
    run.tokens = committed.split_off(prompt.len());
    Ok(run)
}
