//! The CUDA step's bookkeeping, on the host (tested without a GPU): row buckets, how a
//! pass's rows split into steps, the layout of the per-step input buffer, and which rows'
//! logits each mat-vec launch computes and which projections share one.
//!
//! A step runs a fixed number of rows (a bucket), so that its launches, captured once into
//! a CUDA graph, fit every pass with up to that many rows; rows past the pass's own are
//! padding that writes to a scratch cache. Everything that changes from step to step sits
//! in one input buffer, written by one host-to-device copy before the step.

// Without the `cuda` feature only the tests use the bookkeeping.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::ops::Range;

/// Row counts a step is compiled for: a pass of `n` rows runs in the smallest bucket that
/// holds it. From 8 rows on each bucket is at most half again the one before, so a pass
/// pads fewer than half its rows (40 rows, 8 streams verifying 4 drafts, run as 48, not 64).
pub(crate) const BUCKETS: [usize; 10] = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64];
/// The most rows one step takes; longer passes run as several steps.
pub(crate) const MAX_ROWS: usize = BUCKETS[BUCKETS.len() - 1];
/// The most keys a tree's row (`SequenceInput::parents`) reads past the cache rows it
/// shares with a chain (`RowKeys::tail`): a tree of up to 65 tokens (64 drafts after the
/// last token) fits whatever its shape.
pub(crate) const TREE_PATH: usize = 64;
/// Rows per launch of candle's mat-vec kernel: up to four, each row's sums run in the same
/// order whatever the count (`super::cuda`'s module docs).
pub(crate) const MATVEC_ROWS: usize = 4;

/// The most parts the tensor-core mat-vec splits a row's units into ([`k_splits`]).
pub(crate) const MAX_K_SPLITS: usize = 8;

/// How many parts the tensor-core mat-vec splits a weight row's `units` (32 values each)
/// into, each part taken by blocks of its own whose `warps` warps walk it, so that no warp
/// walks more than about `iterations` units one after the other (0: never split). A
/// one-row pass waits on that walk (each unit's weights loaded before the next). It depends
/// on the weight's shape alone, never on the rows, so a row's parts are added in the same
/// order in every pass.
pub(crate) fn k_splits(units: usize, warps: usize, iterations: usize) -> usize {
    match iterations {
        0 => 1,
        _ => units.div_ceil(warps * iterations).clamp(1, MAX_K_SPLITS),
    }
}

/// [`k_splits`] for a weight of `n` outputs where the parts of [`MAX_ROWS`] rows must fit
/// `capacity` f32 of scratch, else whole: by the weight's shape alone, whatever the pass.
pub(crate) fn k_splits_fitting(
    units: usize,
    (warps, iterations): (usize, usize),
    n: usize,
    capacity: usize,
) -> usize {
    match k_splits(units, warps, iterations) {
        split if split * MAX_ROWS * n <= capacity => split,
        _ => 1,
    }
}

/// The smallest bucket holding `rows` (1..=[`MAX_ROWS`]).
pub(crate) fn bucket_for(rows: usize) -> usize {
    assert!((1..=MAX_ROWS).contains(&rows), "{rows} rows in one step");
    BUCKETS.into_iter().find(|&b| b >= rows).unwrap_or(MAX_ROWS)
}

/// A pass's rows `0..total` as steps of at most [`MAX_ROWS`], in order: a later step's rows
/// attend to the keys and values the earlier steps wrote.
pub(crate) fn steps(total: usize) -> impl Iterator<Item = Range<usize>> {
    (0..total)
        .step_by(MAX_ROWS)
        .map(move |first| first..(first + MAX_ROWS).min(total))
}

/// The input buffer: each row's token, position, cache slot, key prefix and LoRA adapter's
/// table, then each row's cache pointers (keys and values of every layer), then each tree
/// row's key tail, for [`MAX_ROWS`] rows whatever the bucket, so that every bucket's graph
/// reads the same addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InputLayout {
    pub(crate) layers: usize,
}

impl InputLayout {
    /// Byte offset of the `u32` tokens.
    pub(crate) const TOKENS: usize = 0;
    /// Byte offset of the `u32` positions.
    pub(crate) const POSITIONS: usize = MAX_ROWS * 4;
    /// Byte offset of the `u32` cache slots each row's keys and values are written to.
    pub(crate) const SLOTS: usize = MAX_ROWS * 8;
    /// Byte offset of the `u32` key prefixes (`RowKeys::prefix`).
    pub(crate) const PREFIXES: usize = MAX_ROWS * 12;
    /// Byte offset of the `u64` addresses of each row's adapter's table (0: none).
    pub(crate) const ADAPTERS: usize = MAX_ROWS * 16;
    /// Byte offset of the `u64` cache pointers, `[row][layer][keys, values]`.
    pub(crate) const CACHES: usize = MAX_ROWS * 24;

    /// Byte offset of the `u32` key tails, [`TREE_PATH`] a row (`RowKeys::tail`).
    pub(crate) fn paths(&self) -> usize {
        Self::CACHES + MAX_ROWS * self.layers * 2 * 8
    }

    pub(crate) fn bytes(&self) -> usize {
        self.paths() + MAX_ROWS * TREE_PATH * 4
    }

    /// Writes one step's rows into `buf` (of [`InputLayout::bytes`]): `rows[i]` is row i;
    /// rows from `rows.len()` to `bucket` are padding (token 0 at position 0 of `scratch`,
    /// the scratch cache's per-layer pointers). Returns the bytes to copy: up to the last
    /// row's cache pointers, or where a row is a tree's, up to the last row's key tail.
    pub(crate) fn fill(
        &self,
        buf: &mut [u8],
        rows: &[StepRow<'_>],
        bucket: usize,
        scratch: &[[u64; 2]],
    ) -> usize {
        assert!(rows.len() <= bucket && bucket <= MAX_ROWS);
        assert_eq!(buf.len(), self.bytes());
        assert_eq!(scratch.len(), self.layers);
        let origin = RowKeys::chain(0);
        let pad = StepRow {
            token: 0,
            keys: &origin,
            caches: scratch,
            adapter: 0,
        };
        let mut tree = false;
        for i in 0..bucket {
            let row = rows.get(i).unwrap_or(&pad);
            assert_eq!(
                row.caches.len(),
                self.layers,
                "a cache pointer pair per layer"
            );
            put(buf, Self::TOKENS + i * 4, &row.token.to_le_bytes());
            put(
                buf,
                Self::POSITIONS + i * 4,
                &row.keys.position().to_le_bytes(),
            );
            put(buf, Self::SLOTS + i * 4, &row.keys.slot().to_le_bytes());
            put(buf, Self::PREFIXES + i * 4, &row.keys.prefix.to_le_bytes());
            put(buf, Self::ADAPTERS + i * 8, &row.adapter.to_le_bytes());
            for (layer, [k, v]) in row.caches.iter().enumerate() {
                let at = Self::CACHES + ((i * self.layers + layer) * 2) * 8;
                put(buf, at, &k.to_le_bytes());
                put(buf, at + 8, &v.to_le_bytes());
            }
            for (j, slot) in row.keys.tail.iter().enumerate() {
                put(
                    buf,
                    self.paths() + (i * TREE_PATH + j) * 4,
                    &slot.to_le_bytes(),
                );
            }
            tree |= !row.keys.tail.is_empty();
        }
        match tree {
            true => self.paths() + bucket * TREE_PATH * 4,
            false => Self::CACHES + bucket * self.layers * 2 * 8,
        }
    }
}

fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

/// What the step did with CUDA graphs, for the worker's log and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphReport {
    /// Row buckets captured so far.
    pub captured: usize,
    /// Why capture failed (the step then stays eager), once it has.
    pub failure: Option<String>,
}

/// One row of a step: its token, its place in its sequence's cache, its sequence's cache
/// (device pointers to each layer's keys and values) and the device address of its
/// sequence's LoRA adapter's table (`lora::Adapter::step_table`; 0: none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepRow<'a> {
    pub(crate) token: u32,
    pub(crate) keys: &'a RowKeys,
    pub(crate) caches: &'a [[u64; 2]],
    pub(crate) adapter: u64,
}

/// The cache rows a row's attention reads, in order: the first `prefix`, then `tail`. A
/// chain's row at position p reads rows 0..=p. A tree's token sits one position past its
/// parent; it reads the cache's rows up to where its path leaves the slots a chain's would
/// take, then its path's slots from there, its own last. Its position and the slot its keys
/// and values go to follow from that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowKeys {
    pub(crate) prefix: u32,
    pub(crate) tail: Vec<u32>,
}

impl RowKeys {
    /// A chain's row at `position`.
    pub(crate) fn chain(position: u32) -> Self {
        Self {
            prefix: position + 1,
            tail: Vec::new(),
        }
    }

    /// The row's position: one less than the keys it reads.
    pub(crate) fn position(&self) -> u32 {
        self.prefix + self.tail.len() as u32 - 1
    }

    /// The cache slot the row writes: its own, the last key it reads.
    pub(crate) fn slot(&self) -> u32 {
        self.tail.last().copied().unwrap_or_else(|| self.position())
    }

    /// A tree's token whose `path` holds its ancestors' cache rows and its own, in order,
    /// from the first of its sequence's new tokens (`attention::tree_paths`). `None` where
    /// its tail would be longer than [`TREE_PATH`].
    pub(crate) fn tree(path: &[usize]) -> Option<Self> {
        let &start = path.first()?;
        let chain = path
            .iter()
            .enumerate()
            .take_while(|&(d, &row)| row == start + d)
            .count();
        let tail = &path[chain..];
        (tail.len() <= TREE_PATH).then(|| Self {
            prefix: (start + chain) as u32,
            tail: tail.iter().map(|&row| row as u32).collect(),
        })
    }
}

/// The mat-vec launches that compute logits for the `wanted` rows of a step: each
/// `(first row, rows)` is at most `per_launch` consecutive wanted rows, and the outputs
/// go to consecutive rows of a compact buffer in the same order.
pub(crate) fn logits_launches(wanted: &[bool], per_launch: usize) -> Vec<(usize, usize)> {
    let mut launches = Vec::new();
    let mut i = 0;
    while i < wanted.len() {
        if !wanted[i] {
            i += 1;
            continue;
        }
        let mut end = i;
        while end < wanted.len() && wanted[end] && end - i < per_launch {
            end += 1;
        }
        launches.push((i, end - i));
        i = end;
    }
    launches
}

/// How the CUDA step's attention splits a row's keys: chunks of `chunk` keys, chunk c to
/// part c % `parts`, a block a part and head, the parts added in part order after. A row's
/// split depends on its position alone, whatever the shape. `grouped`: a block a part and
/// kv head instead, for all the query heads that share it (at most [`ATTN_GROUP_MAX`]),
/// each chunk's keys and values read once for them, each head's sums in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AttnShape {
    pub(crate) parts: usize,
    pub(crate) chunk: usize,
    pub(crate) grouped: bool,
}

/// The most query heads a kv head may serve for attention by groups (`AttnShape::grouped`;
/// more run a block a head).
pub(crate) const ATTN_GROUP_MAX: usize = 8;

impl AttnShape {
    /// Many short parts: a one-row pass's attention is a few blocks' walk over the keys,
    /// and shorter walks (more blocks side by side) shorten it, more than the longer adding
    /// of parts after costs (docs/benchmarks.md, "Attention in shorter parts"). By groups:
    /// a kv head's keys and values are read once for all its query heads instead of once
    /// for each, with the same sums ("Fusion, attention by groups and Qwen3 on the step
    /// by default").
    pub(crate) const DEFAULT: Self = Self {
        parts: 64,
        chunk: 16,
        grouped: true,
    };

    /// `PARTSxCHUNK`, with `g` after it for attention by groups, as a shape the kernels
    /// take: 1 to 64 parts, chunks of 16, 32 or 64 keys (a chunk's keys are a block's
    /// threads' at most).
    pub(crate) fn parse(v: &str) -> Option<Self> {
        let (v, grouped) = match v.strip_suffix('g') {
            Some(v) => (v, true),
            None => (v, false),
        };
        let (parts, chunk) = v.split_once('x')?;
        let shape = Self {
            parts: parts.parse().ok()?,
            chunk: chunk.parse().ok()?,
            grouped,
        };
        let valid = (1..=64).contains(&shape.parts) && [16, 32, 64].contains(&shape.chunk);
        valid.then_some(shape)
    }
}

/// One mat-vec launch over projections that read the same input (a layer's q, k and v;
/// its gate and up): `members` of the projections in order, their weights' rows one after
/// another, writing `[MAX_ROWS, width]` f32 from `base` (f32 from the projections' buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProjectionLaunch {
    pub(crate) members: Range<usize>,
    pub(crate) base: usize,
    pub(crate) width: usize,
}

/// Where a projection's outputs sit in the projections' buffer: its row 0 at `offset` f32,
/// each next row `stride` f32 on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProjectionOut {
    pub(crate) offset: usize,
    pub(crate) stride: usize,
}

/// The launches for projections of `(weight type, outputs)` that share an input: with
/// `fuse`, each run of consecutive projections of one type as one launch (the mat-vec
/// kernels sum each output feature over its own weight row, so it comes out as its own
/// projection's launch computes it), else one launch a projection; and where each
/// projection's outputs sit. The launches fill `MAX_ROWS` times the outputs' sum of f32
/// either way.
pub(crate) fn projection_launches<T: PartialEq>(
    projections: &[(T, usize)],
    fuse: bool,
) -> (Vec<ProjectionLaunch>, Vec<ProjectionOut>) {
    let mut launches: Vec<ProjectionLaunch> = Vec::new();
    for (i, (dtype, _)) in projections.iter().enumerate() {
        match launches.last_mut() {
            Some(last) if fuse && projections[last.members.start].0 == *dtype => {
                last.members.end = i + 1
            }
            _ => launches.push(ProjectionLaunch {
                members: i..i + 1,
                base: 0,
                width: 0,
            }),
        }
    }
    let mut outs = Vec::with_capacity(projections.len());
    let mut base = 0;
    for launch in &mut launches {
        launch.base = base;
        launch.width = projections[launch.members.clone()]
            .iter()
            .map(|p| p.1)
            .sum();
        let mut column = 0;
        for (_, width) in &projections[launch.members.clone()] {
            outs.push(ProjectionOut {
                offset: base + column,
                stride: launch.width,
            });
            column += width;
        }
        base += MAX_ROWS * launch.width;
    }
    (launches, outs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 1.5B's rows with 16 warps and about 4 units a warp: its 1,536-wide rows (48
    /// units) whole, its 8,960-wide down projection (280 units) in 5 parts; never more than
    /// the most, and 0 iterations never split.
    #[test]
    fn long_rows_split_into_parts_by_their_width_alone() {
        assert_eq!(k_splits(48, 16, 4), 1);
        assert_eq!(k_splits(280, 16, 4), 5);
        assert_eq!(k_splits(280, 16, 1), MAX_K_SPLITS);
        assert_eq!(k_splits(280, 16, 0), 1);
        assert_eq!(k_splits(0, 16, 4), 1);
    }

    /// Scratch for 8 parts of the 1.5B's hidden width: its down projection splits, a
    /// vocabulary-wide projection of the same units does not.
    #[test]
    fn a_weight_splits_only_where_its_parts_fit_the_scratch() {
        let capacity = MAX_K_SPLITS * MAX_ROWS * 1536;
        assert_eq!(k_splits_fitting(280, (16, 4), 1536, capacity), 5);
        assert_eq!(k_splits_fitting(280, (16, 4), 151_936, capacity), 1);
        assert_eq!(k_splits_fitting(280, (16, 4), 1536, 0), 1);
    }

    #[test]
    fn each_row_count_takes_the_smallest_bucket_that_holds_it() {
        let got: Vec<usize> = [1, 2, 3, 4, 5, 8, 9, 17, 33, 40, 64]
            .into_iter()
            .map(bucket_for)
            .collect();
        assert_eq!(got, [1, 2, 4, 4, 8, 8, 12, 24, 48, 48, 64]);
    }

    #[test]
    #[should_panic(expected = "65 rows in one step")]
    fn a_step_holds_at_most_max_rows() {
        bucket_for(65);
    }

    #[test]
    fn long_passes_split_into_steps_in_order() {
        assert_eq!(
            steps(5).map(|r| (r.start, r.end)).collect::<Vec<_>>(),
            [(0, 5)]
        );
        assert_eq!(
            steps(64).map(|r| (r.start, r.end)).collect::<Vec<_>>(),
            [(0, 64)]
        );
        assert_eq!(steps(130).collect::<Vec<_>>(), [0..64, 64..128, 128..130]);
        assert_eq!(steps(0).count(), 0);
    }

    fn u32_at(buf: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(buf[at..at + 4].try_into().unwrap())
    }

    fn u64_at(buf: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(buf[at..at + 8].try_into().unwrap())
    }

    fn u32s(buf: &[u8], at: usize, n: usize) -> Vec<u32> {
        (0..n).map(|i| u32_at(buf, at + i * 4)).collect()
    }

    #[test]
    fn inputs_hold_each_row_and_pad_to_the_bucket_with_the_scratch_cache() {
        let layout = InputLayout { layers: 2 };
        assert_eq!(layout.bytes(), 1536 + 64 * 2 * 2 * 8 + 64 * 64 * 4);
        let a = [[0x1000, 0x2000], [0x3000, 0x4000]];
        let b = [[0x5000, 0x6000], [0x7000, 0x8000]];
        let scratch = [[0xa0, 0xb0], [0xc0, 0xd0]];
        let keys = [11, 3, 12].map(RowKeys::chain);
        let row = |token, keys, caches, adapter| StepRow {
            token,
            keys,
            caches,
            adapter,
        };
        let rows = [
            row(7, &keys[0], &a, 0xada),
            row(8, &keys[1], &b, 0),
            row(9, &keys[2], &a, 0xada),
        ];
        let mut buf = vec![0xffu8; layout.bytes()];
        let copied = layout.fill(&mut buf, &rows, 4, &scratch);
        assert_eq!(copied, 1536 + 4 * 2 * 2 * 8);
        assert_eq!(u32s(&buf, 0, 4), [7, 8, 9, 0], "tokens");
        assert_eq!(u32s(&buf, 256, 4), [11, 3, 12, 0], "positions");
        assert_eq!(u32s(&buf, 512, 4), [11, 3, 12, 0], "slots");
        assert_eq!(u32s(&buf, 768, 4), [12, 4, 13, 1], "prefixes");
        let adapters: Vec<u64> = (0..5).map(|i| u64_at(&buf, 1024 + i * 8)).collect();
        assert_eq!(adapters, [0xada, 0, 0xada, 0, u64::MAX], "adapters");
        let caches: Vec<u64> = (0..16).map(|i| u64_at(&buf, 1536 + i * 8)).collect();
        assert_eq!(
            caches,
            [
                0x1000, 0x2000, 0x3000, 0x4000, // row 0: a
                0x5000, 0x6000, 0x7000, 0x8000, // row 1: b
                0x1000, 0x2000, 0x3000, 0x4000, // row 2: a
                0xa0, 0xb0, 0xc0, 0xd0, // row 3: padding
            ]
        );
        // Past the bucket nothing is written, nor any key tail for chains.
        assert_eq!(u32_at(&buf, 4 * 4), u32::MAX);
        assert_eq!(u64_at(&buf, 1536 + 16 * 8), u64::MAX);
        assert_eq!(u32_at(&buf, layout.paths()), u32::MAX);
    }

    /// A tree after 10 cached tokens (the tree of the engine's forward test): r; a after r;
    /// b after a; c after r; d after c; e after b. Each token sits one position past its
    /// parent, writes the slot of its index past the cache, and reads the cache's rows up
    /// to where its path leaves a chain's slots, then the rest of its path.
    #[test]
    fn a_trees_rows_read_their_paths_keys() {
        let parents = [0, 0, 1, 0, 3, 2];
        let paths = crate::model::attention::tree_paths(&parents, 10).unwrap();
        let keys: Vec<RowKeys> = paths.iter().map(|p| RowKeys::tree(p).unwrap()).collect();
        let row = |position, slot, prefix, tail: &[u32]| (position, slot, prefix, tail.to_vec());
        let got: Vec<_> = keys
            .iter()
            .map(|k| (k.position(), k.slot(), k.prefix, k.tail.clone()))
            .collect();
        assert_eq!(
            got,
            [
                row(10, 10, 11, &[]),       // r
                row(11, 11, 12, &[]),       // r a: where a chain's rows are
                row(12, 12, 13, &[]),       // r a b
                row(11, 13, 11, &[13]),     // r, then c
                row(12, 14, 11, &[13, 14]), // r, then c d
                row(13, 15, 13, &[15]),     // r a b, then e
            ]
        );
        let layout = InputLayout { layers: 1 };
        let cache = [[0x1000, 0x2000]];
        let rows: Vec<StepRow<'_>> = keys
            .iter()
            .map(|keys| StepRow {
                token: 1,
                keys,
                caches: &cache,
                adapter: 0,
            })
            .collect();
        let mut buf = vec![0xffu8; layout.bytes()];
        let copied = layout.fill(&mut buf, &rows, 8, &cache);
        assert_eq!(copied, layout.paths() + 8 * TREE_PATH * 4);
        assert_eq!(
            u32s(&buf, 256, 8),
            [10, 11, 12, 11, 12, 13, 0, 0],
            "positions"
        );
        assert_eq!(u32s(&buf, 512, 8), [10, 11, 12, 13, 14, 15, 0, 0], "slots");
        assert_eq!(
            u32s(&buf, 768, 8),
            [11, 12, 13, 11, 11, 13, 1, 1],
            "prefixes"
        );
        let tail = |row: usize, n| u32s(&buf, layout.paths() + row * TREE_PATH * 4, n);
        assert_eq!(tail(3, 1), [13]);
        assert_eq!(tail(4, 2), [13, 14]);
        assert_eq!(tail(5, 1), [15]);
    }

    #[test]
    fn a_tree_row_reads_at_most_tree_path_keys_past_the_chain() {
        let path: Vec<usize> = std::iter::once(0).chain(2..TREE_PATH + 2).collect();
        let keys = RowKeys::tree(&path).unwrap();
        assert_eq!((keys.prefix, keys.tail.len()), (1, TREE_PATH));
        let longer: Vec<usize> = std::iter::once(0).chain(2..TREE_PATH + 3).collect();
        assert_eq!(RowKeys::tree(&longer), None);
    }

    #[test]
    fn logits_launches_cover_wanted_runs_some_rows_at_most() {
        let wanted = |s: &str| s.chars().map(|c| c == 'x').collect::<Vec<_>>();
        assert_eq!(logits_launches(&wanted("x"), MATVEC_ROWS), [(0, 1)]);
        assert_eq!(logits_launches(&wanted("..x"), MATVEC_ROWS), [(2, 1)]);
        assert_eq!(
            logits_launches(&wanted("xxxxxx.xx..x"), MATVEC_ROWS),
            [(0, 4), (4, 2), (7, 2), (11, 1)]
        );
        assert_eq!(
            logits_launches(&wanted("xxxxxx.xx..x"), MAX_ROWS),
            [(0, 6), (7, 2), (11, 1)]
        );
        assert!(logits_launches(&wanted("...."), MAX_ROWS).is_empty());
    }

    /// The 0.5B's q, k (Q5_0) and v (Q8_0): q and k as one launch of 1,024 outputs a row,
    /// v on its own after them; unfused, three launches one after another; the 1.5B's
    /// layers where v is Q4_K too, one launch; types that agree only apart, never fused.
    #[test]
    fn projections_of_one_type_in_a_row_fuse_into_one_launch() {
        use candle_core::quantized::GgmlDType::{Q4K, Q5_0, Q8_0};
        let launch = |members, base, width| ProjectionLaunch {
            members,
            base,
            width,
        };
        let out = |offset, stride| ProjectionOut { offset, stride };
        let small = [(Q5_0, 896), (Q5_0, 128), (Q8_0, 128)];
        let (launches, outs) = projection_launches(&small, true);
        assert_eq!(
            launches,
            [launch(0..2, 0, 1024), launch(2..3, MAX_ROWS * 1024, 128)]
        );
        assert_eq!(
            outs,
            [out(0, 1024), out(896, 1024), out(MAX_ROWS * 1024, 128)]
        );
        let (launches, outs) = projection_launches(&small, false);
        assert_eq!(
            launches,
            [
                launch(0..1, 0, 896),
                launch(1..2, MAX_ROWS * 896, 128),
                launch(2..3, MAX_ROWS * 1024, 128)
            ]
        );
        assert_eq!(
            outs,
            [
                out(0, 896),
                out(MAX_ROWS * 896, 128),
                out(MAX_ROWS * 1024, 128)
            ]
        );
        let (launches, outs) = projection_launches(&[(Q4K, 1536), (Q4K, 256), (Q4K, 256)], true);
        assert_eq!(launches, [launch(0..3, 0, 2048)]);
        assert_eq!(outs, [out(0, 2048), out(1536, 2048), out(1792, 2048)]);
        let (launches, _) = projection_launches(&[(Q4K, 64), (Q8_0, 64), (Q4K, 64)], true);
        assert_eq!(launches.len(), 3);
    }

    #[test]
    fn an_attention_shape_is_read_where_the_kernels_take_it() {
        let shape = |parts, chunk, grouped| {
            Some(AttnShape {
                parts,
                chunk,
                grouped,
            })
        };
        assert_eq!(AttnShape::parse("16x64"), shape(16, 64, false));
        assert_eq!(AttnShape::parse("64x16"), shape(64, 16, false));
        assert_eq!(AttnShape::parse("64x16g"), shape(64, 16, true));
        for bad in [
            "16", "0x64", "65x16", "16x48", "16x128", "16x64x1", "x", "many", "g", "64gx16",
            "64x16gg",
        ] {
            assert_eq!(AttnShape::parse(bad), None, "{bad}");
        }
    }
}
