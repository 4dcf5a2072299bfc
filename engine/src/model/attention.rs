//! Causal grouped-query attention over a session's KV cache.
//!
//! Two kernels compute the same thing. `Host` (CPU) works on the raw cache rows: each query
//! row attends to exactly the keys at positions `0..=pos`, so a row's result does not depend on
//! how many tokens were fed with it. That batch invariance is what makes greedy speculation
//! exact: verifying K drafted tokens in one pass sees what K single-token steps would see.
//! `Tensor` uses candle ops (matmul + mask + softmax) and runs on any device; on the invariant
//! path it takes one query row at a time, so that a row meets the same GPU kernels as in a
//! decode step.

use super::config::ModelConfig;
use super::linear::MatmulPath;
use crate::error::Result;
use candle_core::{DType, Device, Storage, Tensor};
use std::cell::RefCell;
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Batch-invariant CPU kernel on raw cache rows.
    Host,
    /// candle tensor ops; runs on every device.
    Tensor,
}

impl AttentionKernel {
    pub(crate) fn default_for(device: &Device) -> Self {
        if device.is_cpu() {
            Self::Host
        } else {
            Self::Tensor
        }
    }
}

/// Where one sequence's rows sit in the batch and where its new tokens start in its cache.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub(crate) row: usize,
    pub(crate) len: usize,
    pub(crate) start: usize,
    /// For a tree of tokens (`SequenceInput::parents`), each row's path: the cache rows of
    /// its ancestors in the span and its own, in position order. `None`: a chain.
    pub(crate) paths: Option<Vec<Vec<usize>>>,
}

impl Span {
    /// The cache rows row `i` attends to.
    fn keys(&self, i: usize) -> Keys<'_> {
        match &self.paths {
            None => Keys {
                prefix: self.start + i + 1,
                path: &[],
            },
            Some(paths) => Keys {
                prefix: self.start,
                path: &paths[i],
            },
        }
    }
}

/// The cache rows one query row attends to, in position order: the first `prefix` rows,
/// then the rows of `path`. A tree's row and the same tokens fed as a chain meet the same
/// keys and values in the same order, so their arithmetic is the same.
#[derive(Debug, Clone, Copy)]
struct Keys<'a> {
    prefix: usize,
    path: &'a [usize],
}

impl Keys<'_> {
    /// Every cache row in order: a chain's keys, however many a query reads.
    const IN_ORDER: Keys<'static> = Keys {
        prefix: usize::MAX,
        path: &[],
    };

    fn len(&self) -> usize {
        self.prefix + self.path.len()
    }

    /// The cache row of the `t`th key.
    fn row(&self, t: usize) -> usize {
        match t < self.prefix {
            true => t,
            false => self.path[t - self.prefix],
        }
    }

    fn rows(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        (0..self.prefix).chain(self.path.iter().copied())
    }
}

/// Each token's path in a tree given by `parents` (see `SequenceInput::parents`): the
/// indices of its ancestors and its own, in order, offset by `start`.
pub(crate) fn tree_paths(parents: &[u32], start: usize) -> Result<Vec<Vec<usize>>> {
    let bad = |why: String| crate::error::EngineError::BadTree(why);
    let mut paths: Vec<Vec<usize>> = Vec::with_capacity(parents.len());
    for (i, &p) in parents.iter().enumerate() {
        let p = p as usize;
        let path = match i {
            0 if p == 0 => vec![start],
            0 => return Err(bad(format!("the first token's parent is {p}, not 0"))),
            _ if p >= i => {
                return Err(bad(format!(
                    "token {i} follows token {p}, not one before it"
                )));
            }
            _ => {
                let mut path = paths[p].clone();
                path.push(start + i);
                path
            }
        };
        paths.push(path);
    }
    Ok(paths)
}

/// Attention for one forward pass: the sequences' spans and, built once per pass rather
/// than once per layer, the host kernel's work items or, for the tensor kernel on the
/// throughput path, the sequences' causal masks.
#[derive(Debug)]
pub(crate) struct Plan {
    kernel: AttentionKernel,
    /// The tensor kernel one query row at a time (the invariant path): a row then goes
    /// through the same tensor shapes, and so the same GPU kernels, as when it is decoded
    /// alone, whatever the rows beside it.
    per_row: bool,
    spans: Vec<Span>,
    items: Vec<Item>,
    masks: Vec<Tensor>,
}

impl Plan {
    pub(crate) fn new(
        c: &ModelConfig,
        kernel: AttentionKernel,
        path: MatmulPath,
        spans: Vec<Span>,
        device: &Device,
    ) -> Result<Self> {
        let per_row = kernel == AttentionKernel::Tensor && path == MatmulPath::Invariant;
        let masks = match kernel {
            AttentionKernel::Tensor if !per_row => spans
                .iter()
                .map(|span| causal_mask(span, device))
                .collect::<Result<_>>()?,
            _ => Vec::new(),
        };
        let items = match kernel {
            AttentionKernel::Host => work_items(
                &spans,
                c.n_kv_heads,
                c.group_size(),
                candle_core::utils::get_num_threads(),
            ),
            AttentionKernel::Tensor => Vec::new(),
        };
        Ok(Self {
            kernel,
            per_row,
            spans,
            items,
            masks,
        })
    }

    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// `q`: `[total, n_heads, head_dim]` (rotary applied); `caches[i]`: keys and values of
    /// sequence `i` for this layer, already holding its new rows. Returns
    /// `[total, n_heads * head_dim]`.
    pub(crate) fn attend(
        &self,
        c: &ModelConfig,
        q: &Tensor,
        caches: &[(&Tensor, &Tensor)],
    ) -> Result<Tensor> {
        match self.kernel {
            AttentionKernel::Host => attend_host(c, q, caches, &self.spans, &self.items),
            AttentionKernel::Tensor if self.per_row => attend_rows(c, q, caches, &self.spans),
            AttentionKernel::Tensor => attend_tensor(c, q, caches, &self.spans, &self.masks),
        }
    }
}

/// `[n, start + n]`: 0 where query row i may look (`Span::keys`), -inf elsewhere.
fn causal_mask(span: &Span, device: &Device) -> Result<Tensor> {
    let (n, len) = (span.len, span.start + span.len);
    let mut mask = vec![f32::NEG_INFINITY; n * len];
    for i in 0..n {
        for j in span.keys(i).rows() {
            mask[i * len + j] = 0.0;
        }
    }
    Ok(Tensor::from_vec(mask, (n, len), device)?)
}

/// softmax(q K^T / sqrt(d) + mask) V for `n` query rows against the first `len` cached
/// keys and values: `q` `[n, n_heads, head_dim]` in, `[n, n_heads * head_dim]` out.
fn attend_block(
    c: &ModelConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    len: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (g, kvh, hd) = (c.group_size(), c.n_kv_heads, c.head_dim);
    let n = q.dim(0)?;
    let scale = 1.0 / (hd as f64).sqrt();
    // Query head h uses key/value head h / g: lay the g heads of a group out as rows.
    let q = q
        .reshape((n, kvh, g, hd))?
        .permute((1, 2, 0, 3))?
        .contiguous()?
        .reshape((kvh, g * n, hd))?;
    let k = k.narrow(0, 0, len)?.transpose(0, 1)?.contiguous()?;
    let v = v.narrow(0, 0, len)?.transpose(0, 1)?.contiguous()?;
    let scores = (q.matmul(&k.t()?)? * scale)?.reshape((kvh, g, n, len))?;
    let scores = match mask {
        Some(mask) => scores.broadcast_add(&mask.to_dtype(scores.dtype())?)?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let out = probs.reshape((kvh, g * n, len))?.matmul(&v)?;
    Ok(out
        .reshape((kvh, g, n, hd))?
        .permute((2, 0, 1, 3))?
        .reshape((n, kvh * g * hd))?)
}

/// Each query row on its own, over the keys up to its position: on CUDA our kernel (one
/// launch per sequence), elsewhere candle's ops with no mask and the shapes of a decode step
/// at that position.
fn attend_rows(
    c: &ModelConfig,
    q: &Tensor,
    caches: &[(&Tensor, &Tensor)],
    spans: &[Span],
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(q.dim(0)?);
    for (span, (k, v)) in spans.iter().zip(caches) {
        #[cfg(feature = "cuda")]
        if q.device().is_cuda()
            && span.paths.is_none()
            && super::cuda::attention_fits(span.start + span.len)
        {
            let rows = q.narrow(0, span.row, span.len)?;
            outs.push(super::cuda::attend(&rows, k, v, span.start, c.n_kv_heads)?);
            continue;
        }
        for i in 0..span.len {
            let row = q.narrow(0, span.row + i, 1)?;
            let keys = span.keys(i);
            if keys.path.is_empty() {
                outs.push(attend_block(c, &row, k, v, keys.len(), None)?);
                continue;
            }
            // A tree's row: its keys gathered into the shapes of the chain's.
            let at: Vec<u32> = keys.rows().map(|r| r as u32).collect();
            let at = Tensor::from_vec(at, keys.len(), q.device())?;
            let (k, v) = (k.index_select(&at, 0)?, v.index_select(&at, 0)?);
            outs.push(attend_block(c, &row, &k, &v, keys.len(), None)?);
        }
    }
    Ok(Tensor::cat(&outs, 0)?)
}

fn attend_tensor(
    c: &ModelConfig,
    q: &Tensor,
    caches: &[(&Tensor, &Tensor)],
    spans: &[Span],
    masks: &[Tensor],
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(spans.len());
    for ((span, (k, v)), mask) in spans.iter().zip(caches).zip(masks) {
        let rows = q.narrow(0, span.row, span.len)?;
        outs.push(attend_block(
            c,
            &rows,
            k,
            v,
            span.start + span.len,
            Some(mask),
        )?);
    }
    Ok(Tensor::cat(&outs, 0)?)
}

/// A pointer to the output buffer that worker threads write disjoint rows of.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);
// SAFETY: every (row, head) item writes only its own `head_dim` slice of the buffer, and the
// buffer outlives the parallel region.
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}

impl OutRows {
    /// # Safety
    /// `start..start + len` must lie in the buffer and be written by no other thread.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        // SAFETY: upheld by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Host attention's unit of work: the query rows `rows` (of span `span`) and the query heads
/// `heads` (of the group that reads key/value head `kv_head`) go over that head's cache rows
/// together, so each cached key and value is read once for all of them. Attending one (row,
/// head) at a time read a sequence's whole cache once per query head; with several sessions
/// in a pass (their caches do not stay in the CPU's caches) that reading, not the
/// arithmetic, was most of attention's time.
#[derive(Debug, Clone, PartialEq)]
struct Item {
    span: usize,
    kv_head: usize,
    rows: Range<usize>,
    heads: Range<usize>,
}

/// Query rows of one sequence per [`Item`]: their queries and scores stay in the core's
/// own cache, and a verification's K+1 rows still spread over the threads.
const ROW_BLOCK: usize = 4;

/// Items per thread at least, where there are heads to split: threads take items as they
/// come free, so one that starts late (waking up) leaves the others a share to take.
const ITEMS_PER_THREAD: usize = 4;

/// Cached positions from which a span's rows are grouped. Below it each (row, head) is an
/// item of its own, attended one cached row after the other: a short cache stays in the
/// core's caches whichever head reads it, so grouping saved nothing there in the engine,
/// and service runs on chat prompts (under ~250 positions) read a few percent slower with
/// it (perhaps only their spread: docs/benchmarks.md, "Several sessions in one pass").
const GROUPED_FROM: usize = 256;

/// The pass's attention work. A span reaching [`GROUPED_FROM`] positions gives, for each
/// key/value head and block of rows (a tree's: each row), one item with all the group's
/// query heads, unless
/// there would be too few items for the threads (a decode step of one session: a row and
/// two key/value heads), where the group's heads are split over more items. A shorter
/// span gives one item per (row, head).
fn work_items(spans: &[Span], kv_heads: usize, group: usize, threads: usize) -> Vec<Item> {
    let grouped = |span: &Span| span.start + span.len >= GROUPED_FROM;
    // A tree's rows attend to different keys past the span's start: a row per item.
    let row_block = |span: &Span| match span.paths {
        None => ROW_BLOCK,
        Some(_) => 1,
    };
    let single: usize = spans
        .iter()
        .filter(|s| !grouped(s))
        .map(|s| s.len * kv_heads * group)
        .sum();
    let blocks: usize = spans
        .iter()
        .filter(|s| grouped(s))
        .map(|s| s.len.div_ceil(row_block(s)))
        .sum();
    let wanted = (threads * ITEMS_PER_THREAD).saturating_sub(single);
    let parts = wanted
        .div_ceil((blocks * kv_heads).max(1))
        .clamp(1, group.max(1));
    let per_item = group.div_ceil(parts).max(1);
    let mut items = Vec::new();
    for (index, span) in spans.iter().enumerate() {
        let (row_step, head_step) = match grouped(span) {
            true => (row_block(span), per_item),
            false => (1, 1),
        };
        for kv_head in 0..kv_heads {
            for first in (0..span.len).step_by(row_step) {
                for head in (0..group).step_by(head_step) {
                    items.push(Item {
                        span: index,
                        kv_head,
                        rows: first..(first + row_step).min(span.len),
                        heads: head..(head + head_step).min(group),
                    });
                }
            }
        }
    }
    items
}

fn attend_host(
    c: &ModelConfig,
    q: &Tensor,
    caches: &[(&Tensor, &Tensor)],
    spans: &[Span],
    items: &[Item],
) -> Result<Tensor> {
    let (g, kvh, hd, nh) = (c.group_size(), c.n_kv_heads, c.head_dim, c.n_heads);
    let scale = 1.0 / (hd as f32).sqrt();
    let q = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let total: usize = spans.iter().map(|s| s.len).sum();
    let mut out = vec![0f32; total * nh * hd];
    let out_ptr = OutRows(out.as_mut_ptr());
    let guards: Vec<_> = caches
        .iter()
        .map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()))
        .collect();
    let cached = guards
        .iter()
        .map(|(k, v)| Ok((host_rows(k)?, host_rows(v)?)))
        .collect::<Result<Vec<_>>>()?;
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            for item in &items[range] {
                let span = &spans[item.span];
                let (keys, values) = cached[item.span];
                let mut rows = KvRows {
                    keys,
                    values,
                    stride: kvh * hd,
                    offset: item.kv_head * hd,
                    head_dim: hd,
                    order: Keys::IN_ORDER,
                };
                if item.rows.len() == 1 && item.heads.len() == 1 {
                    let i = item.rows.start;
                    let at = ((span.row + i) * nh + item.kv_head * g + item.heads.start) * hd;
                    // SAFETY: (row, h) belongs to this item alone.
                    let dst = unsafe { out_ptr.slice(at, hd) };
                    let query = &q[at..at + hd];
                    // A chain's row (every decode step) walks a plain range of rows.
                    match span.paths {
                        None => {
                            attend_row(query, &rows, 0..span.start + i + 1, scale, &mut scores, dst)
                        }
                        Some(_) => {
                            attend_row(query, &rows, span.keys(i).rows(), scale, &mut scores, dst)
                        }
                    }
                    continue;
                }
                // A tree's item is one row: its heads read that row's keys, in its order.
                if span.paths.is_some() {
                    rows.order = span.keys(item.rows.start);
                }
                let mut queries = Vec::with_capacity(item.rows.len() * item.heads.len());
                for i in item.rows.clone() {
                    let row = span.row + i;
                    for j in item.heads.clone() {
                        let h = item.kv_head * g + j;
                        let at = (row * nh + h) * hd;
                        queries.push(Query {
                            query: &q[at..at + hd],
                            keys: span.keys(i).len(),
                            // SAFETY: (row, h) belongs to this item alone.
                            dst: unsafe { out_ptr.slice(at, hd) },
                        });
                    }
                }
                attend_rows_of_head(&mut queries, &rows, scale, &mut scores);
            }
        })
    });
    drop(guards);
    Ok(Tensor::from_vec(out, (total, nh * hd), &Device::Cpu)?)
}

/// A CPU cache tensor's f32 rows from its first one on.
fn host_rows<'a, G: std::ops::Deref<Target = Storage>>(
    (storage, layout): &'a (G, &candle_core::Layout),
) -> Result<&'a [f32]> {
    let Storage::Cpu(store) = &**storage else {
        let msg = "host attention needs a CPU KV cache".into();
        return Err(candle_core::Error::Msg(msg).into());
    };
    Ok(&store.as_slice::<f32>()?[layout.start_offset()..])
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One key/value head's rows in a token-major cache, the `t`th key at cache row
/// `order.row(t)`: in order for a chain, along its path for a tree's row.
struct KvRows<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    stride: usize,
    offset: usize,
    head_dim: usize,
    order: Keys<'a>,
}

impl KvRows<'_> {
    fn at(&self, t: usize) -> usize {
        self.order.row(t) * self.stride + self.offset
    }

    fn key(&self, t: usize) -> &[f32] {
        let at = self.at(t);
        &self.keys[at..at + self.head_dim]
    }

    fn value(&self, t: usize) -> &[f32] {
        let at = self.at(t);
        &self.values[at..at + self.head_dim]
    }
}

/// One query row of one head: it attends to the first `keys` cached rows, into `dst`.
struct Query<'a> {
    query: &'a [f32],
    keys: usize,
    dst: &'a mut [f32],
}

/// softmax(q·K[0..keys] * scale) · V[0..keys] for each query, all over the same key/value
/// head, reading each cached row once for all of them. Each query's own arithmetic is that
/// of attending it alone, operation for operation (the same dot products, the maximum,
/// exponentials and sums, and value rows added in position order), so its result does not
/// depend on which queries share the call: that is what keeps a row's attention the same
/// in decode and in verification.
fn attend_rows_of_head(
    queries: &mut [Query<'_>],
    rows: &KvRows<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
) {
    let n = queries.iter().map(|q| q.keys).max().unwrap_or(0);
    scores.clear();
    scores.resize(queries.len() * n, 0.0);
    // Scores: each cached key against the queries four at a time (four independent sums in
    // flight), kept where the query reaches that far.
    for t in 0..n {
        let key = rows.key(t);
        let mut at = 0;
        while at < queries.len() {
            let take = (queries.len() - at).min(4);
            let mut block = [0f32; 4];
            match take {
                4 => block = dots(std::array::from_fn(|i| queries[at + i].query), key),
                _ => {
                    for (i, b) in block.iter_mut().take(take).enumerate() {
                        *b = dots([queries[at + i].query], key)[0];
                    }
                }
            }
            for (i, &d) in block.iter().take(take).enumerate() {
                if t < queries[at + i].keys {
                    scores[(at + i) * n + t] = d * scale;
                }
            }
            at += take;
        }
    }
    let mut sums = Vec::with_capacity(queries.len());
    for (query, s) in queries.iter().zip(scores.chunks_exact_mut(n.max(1))) {
        let s = &mut s[..query.keys];
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        sums.push(sum);
    }
    for query in queries.iter_mut() {
        query.dst.fill(0.0);
    }
    // Values: a block of cached rows at a time (it stays in the core's first-level cache
    // while every query adds it), each query's sum kept in registers over the block.
    for first in (0..n).step_by(VALUE_BLOCK) {
        for (query, s) in queries.iter_mut().zip(scores.chunks_exact(n)) {
            let end = (first + VALUE_BLOCK).min(query.keys);
            if end > first {
                add_weighted(query.dst, &s[first..end], rows, first);
            }
        }
    }
    for (query, sum) in queries.iter_mut().zip(sums) {
        let inv = 1.0 / sum;
        for d in query.dst.iter_mut() {
            *d *= inv;
        }
    }
}

/// softmax(q·K * scale) · V over the cache rows `keys` (in position order) for one query
/// row, into `dst`.
fn attend_row(
    query: &[f32],
    rows: &KvRows<'_>,
    keys: impl Iterator<Item = usize> + Clone,
    scale: f32,
    scores: &mut Vec<f32>,
    dst: &mut [f32],
) {
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for t in keys.clone() {
        let s = dots([query], rows.key(t))[0] * scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    dst.fill(0.0);
    for (t, &w) in keys.zip(scores.iter()) {
        axpy(w, rows.value(t), dst);
    }
    let inv = 1.0 / sum;
    for d in dst.iter_mut() {
        *d *= inv;
    }
}

#[inline]
fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = xi.mul_add(w, *yi);
    }
}

/// Cached value rows per block of [`attend_rows_of_head`]'s value sums: 64 rows of a
/// 128-wide head are 32 KiB.
const VALUE_BLOCK: usize = 64;

/// Lanes of the dot products' partial sums (one 256-bit register).
const LANES: usize = 8;

/// `N` dot products with `key`, each with eight partial sums over the lanes, added up in
/// lane order, then the elements past the last whole eight: every query's result is the
/// same whatever `N` and whichever queries it is computed with.
#[inline]
fn dots<const N: usize>(queries: [&[f32]; N], key: &[f32]) -> [f32; N] {
    let (whole, rest) = key.as_chunks::<LANES>();
    let mut acc = [[0f32; LANES]; N];
    for (c, k) in whole.iter().enumerate() {
        for (a, q) in acc.iter_mut().zip(&queries) {
            let q = &q[c * LANES..(c + 1) * LANES];
            for i in 0..LANES {
                a[i] = q[i].mul_add(k[i], a[i]);
            }
        }
    }
    let done = whole.len() * LANES;
    std::array::from_fn(|n| {
        let mut s = acc[n].iter().sum::<f32>();
        for (x, y) in queries[n][done..].iter().zip(rest) {
            s = x.mul_add(*y, s);
        }
        s
    })
}

/// Elements of `dst` whose sums are kept in registers at once (eight 256-bit registers).
const SUM_BLOCK: usize = 64;

/// `dst += weights[i] * value(first + i)` for each `i` in order: each element of `dst`
/// gets the same fused multiply-adds in the same order as when the rows are added one
/// after the other, but a block of elements stays in registers over all the rows.
#[inline]
fn add_weighted(dst: &mut [f32], weights: &[f32], rows: &KvRows<'_>, first: usize) {
    let (blocks, rest) = dst.as_chunks_mut::<SUM_BLOCK>();
    for (b, block) in blocks.iter_mut().enumerate() {
        let mut acc = *block;
        for (i, &w) in weights.iter().enumerate() {
            let value = &rows.value(first + i)[b * SUM_BLOCK..(b + 1) * SUM_BLOCK];
            for (a, x) in acc.iter_mut().zip(value) {
                *a = x.mul_add(w, *a);
            }
        }
        *block = acc;
    }
    let done = blocks.len() * SUM_BLOCK;
    for (i, &w) in weights.iter().enumerate() {
        let value = &rows.value(first + i)[done..];
        for (d, x) in rest.iter_mut().zip(value) {
            *d = x.mul_add(w, *d);
        }
    }
}

#[cfg(test)]
mod tests;
