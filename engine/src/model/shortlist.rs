//! A draft model's vocabulary shortlist (`LoadOptions::shortlist`): logits for the first ids
//! and the special tokens only, plus, per session, the rarer ids its own text holds.
//!
//! The vocabulary projection is the largest matmul of a small model (37% of the bytes the
//! 0.5B draft reads per token), and BPE tokenizers number their tokens by merge order, so
//! the first ids are the common ones. What the first ids miss in code is mostly the
//! prompt's own identifiers (`vowels`, `_pal`), which a session adds back as its extra ids
//! ([`ExtraLogits`]): a few hundred rows at most, projected for that session alone.

use super::linear::{Linear, MatmulPath};
use crate::error::Result;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QStorage, QTensor};
use candle_core::{DType, Tensor};
use std::borrow::Cow;
use std::sync::Arc;

/// The most extra ids a session takes in (its projection costs about this many vocabulary
/// rows per token); the rest of a session's rare tokens are not drafted.
pub const MAX_EXTRA_IDS: usize = 2048;

/// The ids the shortlisted projection computes, and the whole projection for sessions' extra
/// ids.
#[derive(Debug)]
pub(crate) struct Shortlist {
    /// Ascending.
    pub(crate) ids: Vec<u32>,
    /// Whether each id of the vocabulary is among `ids`.
    kept: Vec<bool>,
    /// The whole vocabulary projection's weight, for sessions' extra ids.
    full: Arc<QTensor>,
    /// Its bytes on the host where it lives on a GPU, for gathering extra ids' rows: reading
    /// a GPU tensor's bytes copies the whole vocabulary's rows back, far too slow to do each
    /// time a session meets a new rare token.
    host: Option<Vec<u8>>,
}

impl Shortlist {
    /// The first `n` ids and the special tokens (any GGUF token type but normal) of the
    /// vocabulary projection `full`, and the projection of those rows; `None` where that is
    /// the whole vocabulary.
    pub(crate) fn new(
        content: &Content,
        n: Option<usize>,
        full: Arc<QTensor>,
    ) -> Result<Option<(Self, Linear)>> {
        const NORMAL: i32 = 1;
        let vocab = full.shape().dims2()?.0;
        let Some(n) = n.filter(|&n| n < vocab) else {
            return Ok(None);
        };
        let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(types)) => {
                types.iter().map(|t| t.to_i32().unwrap_or(NORMAL)).collect()
            }
            _ => Vec::new(),
        };
        let kept: Vec<bool> = (0..vocab)
            .map(|id| id < n || types.get(id).is_some_and(|&t| t != NORMAL))
            .collect();
        let ids: Vec<u32> = (0u32..)
            .zip(&kept)
            .filter(|(_, k)| **k)
            .map(|(id, _)| id)
            .collect();
        let data = full.data()?;
        let rows = Linear::new(Arc::new(gather_rows(&full, &data, &ids)?), None)?;
        let host = (!full.device().is_cpu()).then(|| data.into_owned());
        let shortlist = Self {
            ids,
            kept,
            full,
            host,
        };
        Ok(Some((shortlist, rows)))
    }

    /// Adds the ids of `tokens` that the shortlist lacks to `extra` (up to
    /// [`MAX_EXTRA_IDS`]); rebuilds its projection when any was new.
    pub(crate) fn extend(&self, extra: &mut ExtraLogits, tokens: &[u32]) -> Result<()> {
        let before = extra.ids.len();
        for &t in tokens {
            let known = self.kept.get(t as usize).is_none_or(|&k| k);
            if !known && extra.ids.len() < MAX_EXTRA_IDS && !extra.ids.contains(&t) {
                extra.ids.push(t);
            }
        }
        if extra.ids.len() > before {
            let data = match &self.host {
                Some(host) => Cow::Borrowed(host.as_slice()),
                None => self.full.data()?,
            };
            let rows = gather_rows(&self.full, &data, &extra.ids)?;
            extra.head = Some(Linear::new(Arc::new(rows), None)?);
        }
        Ok(())
    }

    /// `logits` (rows over the shortlist) as rows over the whole vocabulary, `-inf` for the
    /// ids left out.
    pub(crate) fn widen(&self, logits: &[f32], vocab: usize) -> Vec<f32> {
        let mut out = vec![f32::NEG_INFINITY; logits.len() / self.ids.len() * vocab];
        scatter(logits, &self.ids, &mut out, vocab);
        out
    }
}

/// One session's ids beyond its model's shortlist: rare tokens of its prompt and text
/// (`Model::extend_shortlist`), whose logits its forward passes add (`SequenceInput::extra`).
#[derive(Debug, Default)]
pub struct ExtraLogits {
    /// In the order first seen (the rows of `head`).
    ids: Vec<u32>,
    head: Option<Linear>,
}

impl ExtraLogits {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Writes the extra ids' logits for `h` (final hidden rows, normed) into `wide` (the
    /// same rows over the whole vocabulary).
    pub(crate) fn project(
        &self,
        h: &Tensor,
        path: MatmulPath,
        wide: &mut [f32],
        vocab: usize,
    ) -> Result<()> {
        if let Some(x) = self.logits(h, path)? {
            scatter(&x, &self.ids, wide, vocab);
        }
        Ok(())
    }

    /// The extra ids' logits for the rows of `h`, `rows x ids`, in the order of
    /// [`ExtraLogits::ids`]; `None` while there are none.
    pub(crate) fn logits(&self, h: &Tensor, path: MatmulPath) -> Result<Option<Vec<f32>>> {
        let Some(head) = &self.head else {
            return Ok(None);
        };
        let x = head.forward(h, path)?.to_dtype(DType::F32)?;
        Ok(Some(x.flatten_all()?.to_vec1::<f32>()?))
    }
}

pub(crate) fn scatter(narrow: &[f32], ids: &[u32], wide: &mut [f32], vocab: usize) {
    for (row, out) in narrow
        .chunks_exact(ids.len())
        .zip(wide.chunks_exact_mut(vocab))
    {
        for (&x, &id) in row.iter().zip(ids) {
            out[id as usize] = x;
        }
    }
}

/// The rows `ids` of a quantized matrix whose bytes are `data`, on its device.
fn gather_rows(t: &QTensor, data: &[u8], ids: &[u32]) -> Result<QTensor> {
    let (rows, cols) = t.shape().dims2()?;
    let row_bytes = data.len() / rows;
    let mut out = Vec::with_capacity(ids.len() * row_bytes);
    for &id in ids {
        out.extend_from_slice(&data[id as usize * row_bytes..][..row_bytes]);
    }
    let storage = QStorage::from_data(Cow::Owned(out), &t.device(), t.dtype())?;
    Ok(QTensor::new(storage, (ids.len(), cols))?)
}
