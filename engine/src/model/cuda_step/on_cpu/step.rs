//! The whole step on the CPU: the launches [`StepPtrs`] makes for a model's passes (every
//! layer's, the vocabulary projection's, the greedy summaries'), run on the kernels'
//! sources built for the CPU, with the model's tensors, the step's buffers and the caches
//! at the addresses the launches and the step's inputs name. Held to a forward pass of the
//! same weights in f64 (`reference`), and to themselves bit for bit across passes, trees
//! and sequences sharing a pass.

use super::super::launch::Launch;
use super::super::matvec::{self, Choice, FewForm, MmaShape};
use super::super::resources::Addrs;
use super::super::{DRAFTED_MAX, KERNELS, Place, StepPtrs, scratch_addrs, source_for};
use super::{
    Script, build, candle_launchers, candle_mat_vec_source, f32_bytes, global_kernels, reference,
};
use crate::model::attention::tree_paths;
use crate::model::greedy::{Greedy, Summary};
use crate::model::linear::Linear;
use crate::model::lora::Adapter;
use crate::model::step_plan::{self, InputLayout, RowKeys, StepRow};
use crate::sampling::{
    Distribution, Draw, DrawFrom, Drawn, Excluded, argmax, proposal_distribution,
};
use crate::testing::{TinyAdapter, TinyModel, check_drawn, check_proposal, draw_settings};
use crate::{Architecture, LoadOptions, Model};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// The step's kernels, our mat-vec's (the tensor cores' default shape, the few-row form up
/// to 4 rows) and candle's in one source, built once a process.
fn binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let few = FewForm { rows: 4, lanes: 2 };
        let body = format!("{KERNELS}\n{}\n{}", matvec::SOURCE, candle_mat_vec_source());
        let source = source_for(&body, MMA, few);
        let mut kernels = global_kernels(KERNELS);
        kernels.extend(super::mat_vec::kernel_names(MMA, few));
        kernels.extend(candle_launchers());
        build("whole-step", &source, &kernels)
    })
}

const MMA: MmaShape = MmaShape {
    tiles: 4,
    warps: 16,
    unroll: 2,
    iterations: 4,
};

/// The mat-vec kernels a test's passes take: candle's (`None`, a GPU's default), the
/// warp-per-feature ones (`tiled`), and the tensor cores' with their few-row form up to 4
/// rows (`mma`).
fn choices() -> [Option<Choice>; 3] {
    let choice = |mode, few_rows| Choice {
        mode,
        mma: MMA,
        few_rows,
    };
    [None, Some(choice("tiled", 0)), Some(choice("mma", 4))]
}

/// A choice's name in a test's messages.
fn named(choice: Option<Choice>) -> &'static str {
    choice.map_or("candle", |c| c.mode)
}

/// A model's tensors where a script put them; with `candle_padding`, each weight followed
/// by the bytes candle's CUDA backend pads a loaded weight with (its mat-vec reads a row
/// past the last where a block takes two rows and the weight has an odd count).
struct Loaded<'s, 'a> {
    script: &'s mut Script<'a>,
    count: usize,
    candle_padding: bool,
}

impl Loaded<'_, '_> {
    fn name(&mut self) -> String {
        self.count += 1;
        format!("tensor{}", self.count)
    }
}

impl Place for Loaded<'_, '_> {
    fn tensor(&mut self, t: &Tensor) -> crate::Result<u64> {
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        let name = self.name();
        Ok(self.script.load_f32(&name, &values))
    }

    fn weight<'l>(&mut self, linear: &'l Linear) -> crate::Result<(&'l QTensor, u64)> {
        let (weight, name) = (linear.loaded(), self.name());
        let mut bytes = weight.data()?.into_owned();
        if self.candle_padding {
            let (dtype, row_padding) = (weight.dtype(), super::super::ROW_PADDING);
            let padding = row_padding * dtype.type_size() / dtype.block_size();
            bytes.resize(bytes.len() + padding, 0);
        }
        Ok((weight, self.script.load(&name, &bytes)))
    }
}

/// A row of a pass: its token, the keys it reads and writes, its sequence's cache, its
/// sequence's adapter's table (0: none).
struct Row {
    token: u32,
    keys: RowKeys,
    seq: usize,
    adapter: u64,
}

/// Rows for `tokens` appended to sequence `seq`'s cache as a chain after `start` tokens.
fn chain(seq: usize, start: usize, tokens: &[u32]) -> Vec<Row> {
    let at = |(i, &token)| Row {
        token,
        keys: RowKeys::chain((start + i) as u32),
        seq,
        adapter: 0,
    };
    tokens.iter().enumerate().map(at).collect()
}

/// [`chain`]'s rows for a sequence of the adapter whose table is at `adapter`.
fn adapted_chain(seq: usize, start: usize, tokens: &[u32], adapter: u64) -> Vec<Row> {
    let rows = chain(seq, start, tokens).into_iter();
    rows.map(|r| Row { adapter, ..r }).collect()
}

/// Rows for a tree of `tokens` by `parents` (as `SequenceInput::parents`) after `start`.
fn tree(seq: usize, start: usize, tokens: &[u32], parents: &[u32]) -> Vec<Row> {
    let paths = tree_paths(parents, start).unwrap();
    let at = |(&token, path): (&u32, &Vec<usize>)| Row {
        token,
        keys: RowKeys::tree(path).unwrap(),
        seq,
        adapter: 0,
    };
    tokens.iter().zip(&paths).map(at).collect()
}

/// The step of a model loaded on the CPU, run on the CPU: a script holding the model's
/// tensors, the step's buffers and a cache a sequence, and each pass's launches.
struct StepOnCpu<'m, 'a> {
    model: &'m Model,
    script: Script<'a>,
    ptrs: StepPtrs,
    layout: InputLayout,
    scratch: Vec<[u64; 2]>,
    caches: Vec<Vec<[u64; 2]>>,
    /// Each pass's rows with logits.
    passes: Vec<usize>,
    /// Adapters placed.
    adapters: usize,
}

impl<'m, 'a> StepOnCpu<'m, 'a> {
    fn new(dir: &'a Path, model: &'m Model, choice: Option<Choice>) -> Self {
        let (c, w) = (&model.inner.config, &model.inner.weights);
        let mut script = Script::new(dir);
        let layout = InputLayout { layers: c.n_layers };
        let lm_rows = w.lm_head.out_features();
        let mut alloc = |name: &str, bytes: usize| Ok(script.zeros(name, bytes));
        let addrs = Addrs::new(c, lm_rows, &layout, &mut alloc).unwrap();
        let mut loaded = Loaded {
            script: &mut script,
            count: 0,
            candle_padding: choice.is_none(),
        };
        let ptrs = StepPtrs::new(c, w, addrs, choice, &mut loaded).unwrap();
        assert_eq!(ptrs.matvec, choice, "every weight has a tiled kernel");
        Self {
            model,
            script,
            scratch: scratch_addrs(c, addrs.scratch_cache),
            ptrs,
            layout,
            caches: Vec::new(),
            passes: Vec::new(),
            adapters: 0,
        }
    }

    /// `adapter`'s deltas and its table (`Adapter::step_table`) in the script; the table's
    /// address, for its sequences' rows.
    fn adapter(&mut self, adapter: &Adapter) -> u64 {
        self.adapters += 1;
        let (script, n) = (&mut self.script, self.adapters);
        let table = adapter.step_table(|layer, module, a, b_t| {
            let name = |part| format!("lora{n}l{layer}m{}{part}", module as usize);
            let bytes = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>();
            Ok([
                script.load(&name("a"), &bytes(a)),
                script.load(&name("b"), &bytes(b_t)),
            ])
        });
        self.script.load(&format!("lora{n}"), &table.unwrap())
    }

    /// A new sequence's cache of `capacity` tokens (left as NaN bytes: a key read before
    /// it is written shows); its index.
    fn sequence(&mut self, capacity: usize) -> usize {
        let c = &self.model.inner.config;
        let bytes = capacity * c.n_kv_heads * c.head_dim * 4;
        let seq = self.caches.len();
        let cache = (0..c.n_layers)
            .map(|layer| {
                let name = |part: &str| format!("s{seq}l{layer}{part}");
                [name("k"), name("v")].map(|name| self.script.alloc(&name, bytes))
            })
            .collect();
        self.caches.push(cache);
        seq
    }

    /// One pass of `rows` (at most `MAX_ROWS`), the rows `wanted` marks projected to
    /// logits and summarised; the pass's index.
    fn pass(&mut self, rows: &[Row], wanted: &[bool]) -> usize {
        let p = self.passes.len();
        let bucket = step_plan::bucket_for(rows.len());
        let step_rows: Vec<StepRow<'_>> = (rows.iter())
            .map(|r| StepRow {
                token: r.token,
                keys: &r.keys,
                caches: &self.caches[r.seq],
                adapter: r.adapter,
            })
            .collect();
        let lora = rows.iter().any(|r| r.adapter != 0);
        let mut inputs = vec![0; self.layout.bytes()];
        let bytes = (self.layout).fill(&mut inputs, &step_rows, bucket, &self.scratch);
        let at = self.ptrs.addrs.tokens;
        (self.script).write(at, &format!("inputs{p}.in"), &inputs[..bytes]);
        // The embeddings of the rows' tokens, padding rows token 0's, as the GPU's step
        // copies them in.
        let mut ids: Vec<u32> = rows.iter().map(|r| r.token).collect();
        ids.resize(bucket, 0);
        let ids = Tensor::new(ids, &Device::Cpu).unwrap();
        let x = self.model.inner.weights.embedding.embedding(&ids).unwrap();
        let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (self.script).write(self.ptrs.addrs.x, &format!("x{p}.in"), &f32_bytes(&x));
        let mut launches: Vec<Launch> = self.ptrs.layer_launches(bucket, lora);
        let (projection, logits) = self.ptrs.logits_launches(wanted);
        launches.extend(projection);
        launches.push(self.ptrs.greedy(logits));
        self.script.launches(&launches);
        self.script.save_as("logits", &format!("logits{p}"));
        self.script.save_as("summaries", &format!("summaries{p}"));
        self.script.save_as("hidden_out", &format!("hidden{p}"));
        self.passes.push(logits);
        p
    }

    /// The first `rows` rows of pass `p`'s last hidden states.
    fn hidden(&self, p: usize, rows: usize) -> Vec<Vec<f32>> {
        let h = self.model.inner.config.hidden;
        let hidden = self.script.floats(&format!("hidden{p}"));
        hidden.chunks(h).take(rows).map(<[f32]>::to_vec).collect()
    }

    fn run(&self) {
        self.script.run(binary());
    }

    /// Pass `p`'s rows of logits, each checked against its greedy summary: the token and
    /// probability the host chooses from the row.
    fn logits(&self, p: usize) -> Vec<Vec<f32>> {
        let n = self.ptrs.lm_head.n;
        let logits = self.script.floats(&format!("logits{p}"));
        let summaries = self.script.floats(&format!("summaries{p}"));
        let rows: Vec<Vec<f32>> = (0..self.passes[p])
            .map(|r| logits[r * n..(r + 1) * n].to_vec())
            .collect();
        for (r, row) in rows.iter().enumerate() {
            let s = [0, 1, 2].map(|i| summaries[3 * r + i]);
            let got = Summary::from_kernel(s, |i| i as u32).greedy().unwrap();
            let want = Greedy::of_row(row).unwrap();
            assert_eq!(got.token, want.token, "pass {p} row {r}");
            assert!(
                (got.probability - want.probability).abs() <= 1e-6,
                "pass {p} row {r}"
            );
        }
        rows
    }
}

const TOKENS: [u32; 13] = [5, 200, 17, 3, 99, 255, 260, 1, 42, 42, 7, 150, 268];

/// A tiny model of `architecture` loaded on the CPU, its weights as a GPU loads them
/// (Q5_0 kept), its projections fused or not.
fn tiny(dir: &Path, architecture: Architecture, fuse: bool) -> Model {
    let path = dir.join(format!("{architecture:?}.gguf"));
    TinyModel {
        architecture,
        seed: 5,
        head_dim: (architecture == Architecture::Qwen3).then_some(32),
        ..TinyModel::default()
    }
    .write(&path)
    .unwrap();
    let options = LoadOptions {
        transcode_q5_0: false,
        fuse_projections: Some(fuse),
        ..LoadOptions::default()
    };
    Model::load(&path, &options).unwrap()
}

/// Holds the step's rows of logits to the reference's: each logit within 1e-4 of it
/// (relative, past 1), but in at most a third of the rows, each within 0.5. Where f32
/// puts a value on the other side of a rounding of the 8-bit grid than f64 does, its
/// row's logits move a little more, and through that row's keys those of later rows that
/// attend to it (one such value in Llama's row 5 with candle's kernel moves rows 5, 8, 9
/// and 10 by 0.1-0.14); a mistake in what a launch reads moves every row it touches.
fn assert_close(got: &[Vec<f32>], want: &[Vec<f64>], case: &str) {
    let mut off = 0;
    for (r, (got, want)) in got.iter().zip(want).enumerate() {
        let diff = (got.iter().zip(want))
            .map(|(&a, b)| (f64::from(a) - b).abs() / (1.0 + b.abs()))
            .fold(0f64, f64::max);
        assert!(diff <= 0.5, "{case}: row {r} differs by {diff}");
        off += usize::from(diff > 1e-4);
    }
    assert!(
        off * 3 <= got.len(),
        "{case}: {off} rows of {} off",
        got.len()
    );
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The step's passes of a tiny model of each architecture (Qwen2's biases, Qwen3's head
/// norms and wider heads, Llama's interleaved rotary pairs; projections fused and apart)
/// with each family of mat-vec kernels: the 13 tokens' logits and last hidden states in
/// one pass are the reference's (`reference::forward`) within f32's rounding, the logits
/// bit for bit those of passes of 4 rows and of 1 row; every pass's greedy summaries
/// choose what the host chooses from its rows.
#[test]
fn the_step_gives_the_reference_logits_and_a_rows_bits_in_every_pass() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (Architecture::Qwen2, true),
        (Architecture::Qwen2, false),
        (Architecture::Qwen3, true),
        (Architecture::Llama, true),
    ];
    for (architecture, fuse) in cases {
        let model = tiny(dir.path(), architecture, fuse);
        let want = reference::forward(&model, &TOKENS);
        for choice in choices() {
            let case = format!("{architecture:?}, fused {fuse}, {}", named(choice));
            let scripts = tempfile::tempdir().unwrap();
            let mut step = StepOnCpu::new(scripts.path(), &model, choice);
            let [whole, fours, ones] = [0; 3].map(|_| step.sequence(TOKENS.len()));
            let all = |rows: &[Row]| vec![true; rows.len()];
            let rows = chain(whole, 0, &TOKENS);
            let whole_pass = step.pass(&rows, &all(&rows));
            let mut passes = Vec::new();
            for (seq, size) in [(fours, 4), (ones, 1)] {
                let mut at = 0;
                let mut some = Vec::new();
                for part in TOKENS.chunks(size) {
                    let rows = chain(seq, at, part);
                    some.push(step.pass(&rows, &all(&rows)));
                    at += part.len();
                }
                passes.push(some);
            }
            step.run();
            let got = step.logits(whole_pass);
            assert_close(&got, &want.logits, &case);
            let hidden = step.hidden(whole_pass, TOKENS.len());
            assert_close(&hidden, &want.hidden, &format!("{case}, hidden states"));
            for some in passes {
                let rows: Vec<Vec<f32>> = some.into_iter().flat_map(|p| step.logits(p)).collect();
                assert_eq!(bits(&rows), bits(&got), "{case}");
            }
        }
    }
}

/// A tree's rows (after a prefix, in one pass with another sequence's chain and with
/// rows that want no logits) get bit for bit the logits of their paths run as chains on
/// their own, and the other sequence goes on as it does alone, with either family of
/// mat-vec kernels; the passes that want only their last row's logits give the
/// reference's for it.
#[test]
fn a_trees_rows_and_a_shared_pass_give_each_row_its_own_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path(), Architecture::Qwen2, true);
    let (prefix, nodes) = (&TOKENS[..10], [7u32, 42, 3, 99, 150, 17]);
    // r; a after r; b after a; c after r; d after c; e after b.
    let parents = [0, 0, 1, 0, 3, 2];
    let leaves: [&[usize]; 2] = [&[0, 1, 2, 5], &[0, 3, 4]];
    let want = reference::forward(&model, &[&TOKENS[..], &[9]].concat()).logits;
    for choice in choices() {
        let scripts = tempfile::tempdir().unwrap();
        let mut step = StepOnCpu::new(scripts.path(), &model, choice);
        let [treed, other] = [0; 2].map(|_| step.sequence(TOKENS.len() + nodes.len()));
        // The prefix with logits for its last row only.
        let last = |n: usize| (0..n).map(|i| i + 1 == n).collect::<Vec<_>>();
        let prefix_pass = step.pass(&chain(treed, 0, prefix), &last(prefix.len()));
        let other_pass = step.pass(&chain(other, 0, &TOKENS[..8]), &last(8));
        // The tree beside the other sequence's next 5 tokens, which want no logits.
        let mut rows = tree(treed, prefix.len(), &nodes, &parents);
        rows.extend(chain(other, 8, &TOKENS[8..]));
        let mut wanted = vec![true; nodes.len()];
        wanted.extend([false; 5]);
        let shared = step.pass(&rows, &wanted);
        // Each leaf's path as a chain after the prefix, and the other sequence alone.
        let alone: Vec<(usize, Vec<usize>)> = (leaves.iter())
            .map(|path| {
                let seq = step.sequence(TOKENS.len() + nodes.len());
                step.pass(&chain(seq, 0, prefix), &last(prefix.len()));
                let tokens: Vec<u32> = path.iter().map(|&i| nodes[i]).collect();
                let rows = chain(seq, prefix.len(), &tokens);
                (step.pass(&rows, &vec![true; rows.len()]), path.to_vec())
            })
            .collect();
        // The other sequence's next row after the shared pass, and after its tokens alone.
        let after = step.pass(&chain(other, TOKENS.len(), &[9]), &[true]);
        let seq = step.sequence(TOKENS.len() + 1);
        let seq_pass = step.pass(&chain(seq, 0, &TOKENS), &last(TOKENS.len()));
        let alone_after = step.pass(&chain(seq, TOKENS.len(), &[9]), &[true]);
        step.run();
        let tree_rows = step.logits(shared);
        for (pass, path) in alone {
            for (row, &node) in step.logits(pass).iter().zip(&path) {
                let (got, want) = (
                    bits(&tree_rows[node..node + 1]),
                    bits(std::slice::from_ref(row)),
                );
                assert_eq!(got, want, "{}: node {node}", named(choice));
            }
        }
        let after = step.logits(after);
        assert_eq!(
            bits(&after),
            bits(&step.logits(alone_after)),
            "{}",
            named(choice)
        );
        let lasts = [(prefix_pass, 9), (other_pass, 7), (seq_pass, 12)];
        let mut got: Vec<Vec<f32>> = lasts.iter().flat_map(|&(p, _)| step.logits(p)).collect();
        let mut rows: Vec<Vec<f64>> = lasts.iter().map(|&(_, r)| want[r].clone()).collect();
        got.extend(after);
        rows.push(want[TOKENS.len()].clone());
        assert_close(&got, &rows, named(choice));
    }
}

/// A pass's draws as the step launches them after its greedy summaries (`project`):
/// draws on rows 1, 3 and 5 (from the whole row, after a lookup's draft, after a draft
/// model's draft whose distribution the step copies into the row's place), a proposal on
/// row 4. Each draws what the sampler draws from its own row's logits (but at an edge),
/// a proposal keeps what `proposal_distribution` keeps, and rows 0 and 2 keep their
/// greedy summaries.
#[test]
fn a_passs_draws_take_their_own_rows_logits() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path(), Architecture::Qwen2, true);
    let scripts = tempfile::tempdir().unwrap();
    let mut step = StepOnCpu::new(scripts.path(), &model, choices()[0]);
    let seq = step.sequence(6);
    let pass = step.pass(&chain(seq, 0, &TOKENS[..6]), &[true; 6]);
    // The draws need the rows' logits, which the script gives once it has run: a first
    // run for them, then the same script with the draws after the pass.
    step.run();
    let rows = step.logits(pass);
    let params = draw_settings()[0];
    let q = proposal_distribution(&rows[0], &params).unwrap();
    let drafted = Excluded {
        token: q.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0,
        from: Some(Arc::new(q)),
    };
    let draw = |from| Draw {
        params,
        uniform: 0.6,
        from,
    };
    let draws = [
        (1, draw(DrawFrom::Row)),
        (
            3,
            draw(DrawFrom::After(Excluded::point(argmax(&rows[3]).unwrap()))),
        ),
        (4, draw(DrawFrom::Proposal)),
        (5, draw(DrawFrom::After(drafted))),
    ];
    for (row, draw) in &draws {
        let [_, _, ids, probs] = step.ptrs.drawing_row(*row);
        if let Some(q) = draw.excluded().and_then(|x| x.from.as_deref()) {
            let id_bytes: Vec<u8> = q.ids().iter().flat_map(|id| id.to_le_bytes()).collect();
            step.script.write(ids, &format!("q_ids{row}.in"), &id_bytes);
            step.script
                .write(probs, &format!("q_probs{row}.in"), &f32_bytes(q.probs()));
        }
        let launch = match draw.is_proposal() {
            true => step.ptrs.propose(*row, draw),
            false => step.ptrs.draw(*row, draw),
        };
        step.script.launches(&[launch]);
    }
    step.script.save_as("summaries", "drawn");
    step.script.save_as("drafted", "drafted");
    step.run();
    let (out, greedy) = (
        step.script.floats("drawn"),
        step.script.floats(&format!("summaries{pass}")),
    );
    assert_eq!(out[..3], greedy[..3], "row 0 keeps its greedy summary");
    assert_eq!(out[6..9], greedy[6..9], "row 2 keeps its greedy summary");
    for (row, draw) in &draws {
        let at = format!("row {row}, {draw:?}");
        let [token, probability, excluded] = [0, 1, 2].map(|i| out[3 * row + i]);
        if draw.is_proposal() {
            let kept = token.to_bits() as usize;
            let slot = &step.script.floats("drafted")[row * 2 * DRAFTED_MAX..];
            let entries = (slot[..kept].iter().map(|v| v.to_bits()))
                .zip(slot[DRAFTED_MAX..][..kept].iter().map(|&w| f64::from(w)));
            let got = Distribution::from_sorted_weights(entries.collect()).unwrap();
            let want = proposal_distribution(&rows[*row], &draw.params).unwrap();
            check_proposal(&got, &want, 1e-6, &at);
            continue;
        }
        let got = Drawn {
            token: token.to_bits(),
            probability,
            excluded,
            proposal: None,
        };
        check_drawn(&rows[*row], draw, got, 1e-6, &at);
    }
}

/// Rows of sessions of two adapters (one changing every projection, one of another rank
/// changing q, v and down only) and of none share a pass: each adapted row's logits are
/// the reference's with its adapter's deltas, within f32's rounding, and bit for bit those
/// of its tokens fed four at a time on their own; the session without an adapter gets bit
/// for bit the logits of a pass that adds no deltas at all. On Qwen2 (biases after the
/// deltas) and Llama (q's and k's rows interleaved), with candle's mat-vec and the tensor
/// cores'.
#[test]
fn adapted_rows_take_their_own_deltas_in_a_shared_pass() {
    let dir = tempfile::tempdir().unwrap();
    let specs = [
        TinyAdapter::default(),
        TinyAdapter {
            rank: 8,
            modules: vec!["q_proj", "v_proj", "down_proj"],
            seed: 3,
            ..TinyAdapter::default()
        },
    ];
    for architecture in [Architecture::Qwen2, Architecture::Llama] {
        let model = tiny(dir.path(), architecture, true);
        let adapters = specs.each_ref().map(|spec| {
            let path = dir.path().join(format!("{architecture:?}{}", spec.seed));
            spec.write(&path, model.config()).unwrap();
            Adapter::load("a", &path, model.config()).unwrap()
        });
        let (n, short) = (8, &TOKENS[..4]);
        let tokens = &TOKENS[..n];
        let [first, second] = adapters
            .each_ref()
            .map(|a| reference::forward_adapted(&model, tokens, Some(a)));
        let plain = reference::forward(&model, tokens);
        for choice in [choices()[0], choices()[2]] {
            let case = format!("{architecture:?}, {}", named(choice));
            let scripts = tempfile::tempdir().unwrap();
            let mut step = StepOnCpu::new(scripts.path(), &model, choice);
            let tables = adapters.each_ref().map(|a| step.adapter(a));
            let [one, two, none, alone, unadapted] = [0; 5].map(|_| step.sequence(n));
            let mut rows = adapted_chain(one, 0, tokens, tables[0]);
            rows.extend(adapted_chain(two, 0, short, tables[1]));
            rows.extend(chain(none, 0, short));
            let shared = step.pass(&rows, &vec![true; rows.len()]);
            let fours: Vec<usize> = (tokens.chunks(4).enumerate())
                .map(|(i, part)| {
                    let rows = adapted_chain(alone, 4 * i, part, tables[0]);
                    step.pass(&rows, &[true; 4][..part.len()])
                })
                .collect();
            let without = step.pass(&chain(unadapted, 0, short), &[true; 4]);
            step.run();
            let got = step.logits(shared);
            assert_close(
                &got[..n],
                &first.logits[..n],
                &format!("{case}, first adapter"),
            );
            let (two_rows, none_rows) = got[n..].split_at(4);
            assert_close(
                two_rows,
                &second.logits[..4],
                &format!("{case}, second adapter"),
            );
            assert_close(
                none_rows,
                &plain.logits[..4],
                &format!("{case}, no adapter"),
            );
            let fours: Vec<Vec<f32>> = fours.into_iter().flat_map(|p| step.logits(p)).collect();
            assert_eq!(bits(&fours), bits(&got[..n]), "{case}");
            assert_eq!(bits(&step.logits(without)), bits(none_rows), "{case}");
        }
        let pairs = (first.logits.iter().flatten()).zip(plain.logits.iter().flatten());
        let moved = pairs.map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
        assert!(
            moved > 0.1,
            "{architecture:?}: the adapter moves the logits by {moved}"
        );
    }
}
