//! LoRA adapters: a fine-tune's low-rank deltas beside the model's quantized weights, chosen
//! per session. A projection `y = x W^T` of a layer the adapter changes becomes
//! `y + B (scale · A x)`, with `A` (`rank × inputs`) and `B` (`outputs × rank`) held in
//! bf16 (as vLLM holds them in the model's 16-bit type: an f32 file's values are rounded;
//! a bf16 file's are kept as they are) and summed in f32.
//!
//! Adapters are read in PEFT's format (what vLLM, TGI and Hugging Face's trainers use): a
//! directory with `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`) and
//! `adapter_model.safetensors` (`…layers.N.self_attn.q_proj.lora_A.weight` and so on, for
//! `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`).
//!
//! A row's delta is summed in one fixed order whatever rows share its pass (eight lanes,
//! then the lanes in order; then each rank's share in rank order), so a session with an
//! adapter keeps batch invariance: greedy speculation gives the adapted target's own text,
//! and a prompt's rows are the same from any chunking (the prefix cache, where each load of
//! an adapter salts its blocks apart: [`Adapter::salt`]).
//!
//! On a GPU the deltas are copied there at load ([`Adapter::placed`]): a prompt's prefill
//! adds them with candle's matmuls, and the CUDA step's passes with kernels of its own
//! (`cuda_step`'s `duet_lora_shrink` and `duet_lora_expand`), which read each row's adapter
//! from a table of the copies' addresses (`Adapter::step_table`), each row's sums in
//! one order as here.

use super::config::ModelConfig;
use crate::error::{EngineError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;
use wide::f32x8;

/// The projections an adapter may change, in a layer's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Module {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Module {
    const ALL: [Module; 7] = [
        Self::Q,
        Self::K,
        Self::V,
        Self::O,
        Self::Gate,
        Self::Up,
        Self::Down,
    ];

    /// PEFT's name of the projection (Hugging Face's module name).
    fn peft_name(self) -> &'static str {
        match self {
            Self::Q => "self_attn.q_proj",
            Self::K => "self_attn.k_proj",
            Self::V => "self_attn.v_proj",
            Self::O => "self_attn.o_proj",
            Self::Gate => "mlp.gate_proj",
            Self::Up => "mlp.up_proj",
            Self::Down => "mlp.down_proj",
        }
    }

    /// `(inputs, outputs)` of the projection in a model of `c`.
    fn shape(self, c: &ModelConfig) -> (usize, usize) {
        let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        match self {
            Self::Q => (c.hidden, q),
            Self::K | Self::V => (c.hidden, kv),
            Self::O => (q, c.hidden),
            Self::Gate | Self::Up => (c.hidden, c.ffn_hidden),
            Self::Down => (c.ffn_hidden, c.hidden),
        }
    }
}

/// One projection's delta: `(scale · x A^T) B^T`.
#[derive(Debug)]
struct Delta {
    inputs: usize,
    outputs: usize,
    /// `rank × inputs`, row-major, bf16.
    a: Vec<u16>,
    /// `B^T`: `rank × outputs`, row-major, bf16 (a rank's share is one pass over a row).
    b: Vec<u16>,
    scale: f32,
}

/// Rows a core takes together, `B`'s tiles read once for all of them.
const ROWS_A_TASK: usize = 8;
/// Outputs a tile: `rank` rows of `B^T` this wide stay in cache across a task's rows.
const TILE: usize = 256;

impl Delta {
    fn rank(&self) -> usize {
        self.a.len() / self.inputs
    }

    /// Adds the delta of each row of `x` (`rows × inputs`) to the row of `y` (`rows ×
    /// outputs`): one row where it is called (handing it to other threads costs more than
    /// it saves), groups of rows on the kernels' threads (a pool of its own would contend
    /// with them for the cores). Each output's sum runs in the same order either way (rank
    /// by rank).
    fn add(&self, x: &[f32], y: &mut [f32]) {
        if x.len() <= self.inputs {
            return self.add_rows(x, y);
        }
        let (rows_in, rows_out) = (ROWS_A_TASK * self.inputs, ROWS_A_TASK * self.outputs);
        super::kernels::chunks_parallel(y, rows_out, |i, y| {
            let from = i * rows_in;
            self.add_rows(&x[from..(from + rows_in).min(x.len())], y);
        });
    }

    /// A few rows' deltas, a tile of outputs at a time.
    fn add_rows(&self, x: &[f32], y: &mut [f32]) {
        let t: Vec<Vec<f32>> = x.chunks_exact(self.inputs).map(|x| self.down(x)).collect();
        for from in (0..self.outputs).step_by(TILE) {
            let to = (from + TILE).min(self.outputs);
            for (t, y) in t.iter().zip(y.chunks_exact_mut(self.outputs)) {
                self.up(t, &mut y[from..to], from);
            }
        }
    }

    /// `scale · x A^T`: the row in the adapter's rank.
    fn down(&self, x: &[f32]) -> Vec<f32> {
        self.a
            .chunks_exact(self.inputs)
            .map(|a| dot(a, x) * self.scale)
            .collect()
    }

    /// Adds `t B^T` to the outputs `from..` of a row, which `y` holds.
    fn up(&self, t: &[f32], y: &mut [f32], from: usize) {
        for (&t, b) in t.iter().zip(self.b.chunks_exact(self.outputs)) {
            axpy(t, &b[from..from + y.len()], y);
        }
    }
}

/// A bf16 value's f32 (exact: bf16 is f32's upper half).
fn widen(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Eight bf16 values as f32 lanes.
fn widen8(bits: &[u16]) -> f32x8 {
    let bits: &[u16; 8] = bits.try_into().expect("eight lanes");
    f32x8::new(bits.map(widen))
}

/// `a · x` in eight lane sums, then the lanes in order, then the tail.
fn dot(a: &[u16], x: &[f32]) -> f32 {
    let lanes = |s: &[f32]| f32x8::new(s.try_into().expect("eight lanes"));
    let (a8, x8) = (a.chunks_exact(8), x.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(x8.remainder())
        .map(|(&a, x)| widen(a) * x)
        .sum();
    let sum = a8.zip(x8).fold(f32x8::splat(0.0), |s, (a, x)| {
        widen8(a).mul_add(lanes(x), s)
    });
    sum.to_array().into_iter().sum::<f32>() + tail
}

/// `y += t · b`.
fn axpy(t: f32, b: &[u16], y: &mut [f32]) {
    let t8 = f32x8::splat(t);
    let mut b8 = b.chunks_exact(8);
    let mut y8 = y.chunks_exact_mut(8);
    for (b, y) in (&mut b8).zip(&mut y8) {
        let sum = widen8(b).mul_add(t8, f32x8::new((&*y).try_into().expect("eight lanes")));
        y.copy_from_slice(&sum.to_array());
    }
    for (&b, y) in b8.remainder().iter().zip(y8.into_remainder()) {
        *y = widen(b).mul_add(t, *y);
    }
}

/// Adapters' `names` for a message: the first 16, then how many more.
pub fn name_list(names: &[String]) -> String {
    const SHOWN: usize = 16;
    let mut list = names[..names.len().min(SHOWN)].join(", ");
    if names.len() > SHOWN {
        list += &format!(" and {} more", names.len() - SHOWN);
    }
    list
}

/// A loaded adapter: its name and each layer's deltas.
#[derive(Debug)]
pub struct Adapter {
    name: String,
    /// Distinct for every load in the process: a name read again (its files changed, or
    /// it was given up and asked for again) is another adapter to the caches, whose rows
    /// of the earlier load it does not share.
    load: u64,
    /// Per layer, per [`Module`] (in `Module::ALL`'s order).
    layers: Vec<[Option<Delta>; 7]>,
    /// Its deltas on the GPU of the model it was loaded for ([`Adapter::placed`]); `None`
    /// on the CPU, where the host's values serve.
    device: Option<OnDevice>,
}

/// An adapter's deltas on a GPU: each delta's `A` and `B^T` as bf16 tensors there (candle's
/// matmuls take them for a prompt's prefill) and, where the CUDA step runs, the table of
/// their addresses its kernels read (`Adapter::step_table`).
#[derive(Debug)]
struct OnDevice {
    device: Device,
    /// Per layer, per [`Module`]: `[A, B^T]`.
    deltas: Vec<[Option<[Tensor; 2]>; 7]>,
    /// The table and its address (read by every pass of its sessions).
    #[cfg(feature = "cuda")]
    table: (Tensor, u64),
}

impl Drop for Adapter {
    /// On CUDA, the deltas are freed with the device's context current on this thread (an
    /// adapter is given up on whichever thread drops its last session).
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(OnDevice {
            device: Device::Cuda(device),
            ..
        }) = &self.device
        {
            super::cuda::make_current_before_free(device);
        }
    }
}

/// The bytes of a delta's entry in the CUDA step's table ([`Adapter::step_table`]), as
/// `kernels.cu`'s `LoraDelta` reads them: `A`'s and `B^T`'s addresses (0: the projection
/// unchanged), the rank (i32), the scale (f32).
#[cfg(feature = "cuda")]
pub(crate) const TABLE_ENTRY: usize = 24;

/// What `adapter_config.json` says that the deltas need (a delta's rank is its tensors':
/// `r`, or its module's in `rank_pattern`).
#[derive(Debug, serde::Deserialize)]
struct PeftConfig {
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    alpha_pattern: HashMap<String, serde_json::Value>,
}

impl PeftConfig {
    /// What this adapter asks that the deltas alone do not give.
    fn unsupported(&self) -> Option<String> {
        let saved = self.modules_to_save.as_ref().filter(|m| !m.is_empty());
        if self.use_dora {
            Some("DoRA (use_dora)".into())
        } else if self.fan_in_fan_out {
            Some("fan_in_fan_out (GPT-2's transposed weights)".into())
        } else if let Some(bias) = self.bias.as_deref().filter(|&b| b != "none") {
            Some(format!("trained biases (bias = {bias:?})"))
        } else if let Some(modules) = saved {
            Some(format!(
                "whole modules saved beside it (modules_to_save: {modules:?})"
            ))
        } else if !self.alpha_pattern.is_empty() {
            Some("alpha_pattern (an alpha per module)".into())
        } else {
            None
        }
    }

    /// The factor of a delta of `rank` (PEFT's: `alpha / r`, or `alpha / sqrt(r)` with
    /// rsLoRA; a `rank_pattern` module's own rank is its tensors').
    fn scale(&self, rank: usize) -> f32 {
        let r = rank as f64;
        (self.lora_alpha / if self.use_rslora { r.sqrt() } else { r }) as f32
    }
}

impl Adapter {
    /// Reads the PEFT adapter at `path` (its directory, or its `adapter_model.safetensors`
    /// beside `adapter_config.json`) for a model of `config`.
    pub fn load(name: &str, path: &Path, config: &ModelConfig) -> Result<Self> {
        let (dir, weights) = match path.is_dir() {
            true => (path, path.join("adapter_model.safetensors")),
            false => (path.parent().unwrap_or(Path::new(".")), path.into()),
        };
        let bad = |reason: String| EngineError::Adapter {
            path: path.to_path_buf(),
            reason,
        };
        let json = std::fs::read(dir.join("adapter_config.json"))
            .map_err(|e| bad(format!("adapter_config.json: {e}")))?;
        let peft: PeftConfig =
            serde_json::from_slice(&json).map_err(|e| bad(format!("adapter_config.json: {e}")))?;
        if let Some(what) = peft.unsupported() {
            return Err(bad(format!("{what} is not supported")));
        }
        let tensors = candle_core::safetensors::load(&weights, &Device::Cpu)
            .map_err(|e| bad(format!("{}: {e}", weights.display())))?;
        let mut layers: Vec<[Option<Delta>; 7]> =
            (0..config.n_layers).map(|_| Default::default()).collect();
        let mut any = false;
        for (key, layer, module) in lora_a_names(&tensors).map_err(&bad)? {
            let b_key = key.replace("lora_A", "lora_B");
            let (a, b) = (&tensors[&key], tensors.get(&b_key));
            let b = b.ok_or_else(|| bad(format!("{key} has no {b_key}")))?;
            let slot = layers
                .get_mut(layer)
                .ok_or_else(|| bad(format!("{key}: the model has {} layers", config.n_layers)))?;
            let delta =
                delta(a, b, module, config, &peft).map_err(|e| bad(format!("{key}: {e}")))?;
            slot[module as usize] = Some(delta);
            any = true;
        }
        if !any {
            return Err(bad(
                "no lora_A/lora_B tensors of a projection it knows".into()
            ));
        }
        static LOADS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Self {
            name: name.to_string(),
            load: LOADS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            layers,
            device: None,
        })
    }

    /// The adapter with its deltas copied to `device` where that is not the CPU (on CUDA,
    /// with the step's table of them).
    pub(crate) fn placed(mut self, device: &Device) -> Result<Self> {
        if device.is_cpu() {
            return Ok(self);
        }
        let deltas = self.copies(device)?;
        #[cfg(feature = "cuda")]
        let table = {
            let bytes = self.step_table(|layer, module, _, _| {
                let [a, b] = deltas[layer][module as usize].as_ref().expect("a delta");
                Ok([super::cuda::device_addr(a)?, super::cuda::device_addr(b)?])
            })?;
            let n = bytes.len();
            let table = Tensor::from_vec(bytes, n, device)?;
            let addr = super::cuda::device_addr(&table)?;
            (table, addr)
        };
        self.device = Some(OnDevice {
            device: device.clone(),
            deltas,
            #[cfg(feature = "cuda")]
            table,
        });
        Ok(self)
    }

    /// Each delta's `[A, B^T]` as bf16 tensors on `device`.
    fn copies(&self, device: &Device) -> Result<Vec<[Option<[Tensor; 2]>; 7]>> {
        let mut deltas = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut on = [const { None }; 7];
            for (slot, delta) in on.iter_mut().zip(layer) {
                if let Some(d) = delta {
                    let bf16 = |v: &[u16], cols| -> Result<Tensor> {
                        let values = v.iter().map(|&b| half::bf16::from_bits(b)).collect();
                        Ok(Tensor::from_vec(values, (d.rank(), cols), device)?)
                    };
                    *slot = Some([bf16(&d.a, d.inputs)?, bf16(&d.b, d.outputs)?]);
                }
            }
            deltas.push(on);
        }
        Ok(deltas)
    }

    /// Whether its deltas are where passes on `device` read them: the host's for the CPU,
    /// else a copy on that device.
    pub(crate) fn runs_on(&self, device: &Device) -> bool {
        device.is_cpu() || (self.device.as_ref()).is_some_and(|on| on.device.same_device(device))
    }

    /// Its copies on the GPU it was placed on ([`Adapter::placed`]).
    fn on_gpu(&self) -> Result<&OnDevice> {
        let missing =
            || candle_core::Error::Msg(format!("adapter {} is not on the GPU", self.name));
        Ok(self.device.as_ref().ok_or_else(missing)?)
    }

    /// The address of its table for the CUDA step's kernels (where it was placed on a GPU).
    #[cfg(feature = "cuda")]
    pub(crate) fn step_table_addr(&self) -> Result<u64> {
        Ok(self.on_gpu()?.table.1)
    }

    /// The CUDA step's table of its deltas: for each layer, for each projection in
    /// [`Module::ALL`]'s order, an entry of [`TABLE_ENTRY`] bytes; `place` gives the
    /// addresses of a delta's `A` (`rank × inputs`) and `B^T` (`rank × outputs`) bf16
    /// values, which it is given with their layer and projection.
    #[cfg(feature = "cuda")]
    pub(crate) fn step_table(
        &self,
        mut place: impl FnMut(usize, Module, &[u16], &[u16]) -> Result<[u64; 2]>,
    ) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(self.layers.len() * 7 * TABLE_ENTRY);
        for (index, layer) in self.layers.iter().enumerate() {
            for (module, delta) in Module::ALL.into_iter().zip(layer) {
                let Some(d) = delta else {
                    bytes.extend([0; TABLE_ENTRY]);
                    continue;
                };
                let [a, b] = place(index, module, &d.a, &d.b)?;
                bytes.extend(a.to_le_bytes());
                bytes.extend(b.to_le_bytes());
                bytes.extend((d.rank() as i32).to_le_bytes());
                bytes.extend(d.scale.to_le_bytes());
            }
        }
        Ok(bytes)
    }

    /// The largest rank of its deltas.
    #[cfg(feature = "cuda")]
    pub(crate) fn max_rank(&self) -> usize {
        let deltas = self.layers.iter().flatten().flatten();
        deltas.map(Delta::rank).max().unwrap_or(0)
    }

    /// A delta's values as loaded (`A`, `B^T` as bf16 bits, the rank, the scale), for the
    /// tests' models written apart from the kernels.
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn delta_values(
        &self,
        layer: usize,
        module: Module,
    ) -> Option<(&[u16], &[u16], usize, f32)> {
        let d = self.layers[layer][module as usize].as_ref()?;
        Some((&d.a, &d.b, d.rank(), d.scale))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// This load's number (rows of two sessions hold the same deltas only where their
    /// adapters' loads are one).
    pub(crate) fn load_number(&self) -> u64 {
        self.load
    }

    /// The prefix cache's salt of this load's sessions, from the request's `salt`: no
    /// other adapter's, nor another load's of this one, shares it.
    pub fn salt(&self, salt: u64) -> u64 {
        crate::adapter_salt(salt, Some(&format!("{}#{}", self.name, self.load)))
    }

    /// Whether it changes `module` of layer `layer`.
    pub(crate) fn changes(&self, layer: usize, module: Module) -> bool {
        self.layers[layer][module as usize].is_some()
    }

    /// Adds its delta of `module` in `layer` to `y` (`rows × outputs`), for the rows of `x`
    /// (`rows × inputs`); nothing where it does not change that projection.
    pub(crate) fn add(&self, layer: usize, module: Module, x: &[f32], y: &mut [f32]) {
        if let Some(delta) = &self.layers[layer][module as usize] {
            delta.add(x, y);
        }
    }
}

/// A `lora_A` tensor's name, its layer and its projection.
type LoraA = (String, usize, Module);

/// Each `lora_A` tensor with its layer and projection; an error for a tensor that is not a
/// projection's `lora_A` or `lora_B` (an embedding's or the head's delta, say).
fn lora_a_names(tensors: &HashMap<String, candle_core::Tensor>) -> Result<Vec<LoraA>, String> {
    let mut found = Vec::new();
    for key in tensors.keys() {
        let parsed = key.split_once("layers.").and_then(|(_, rest)| {
            let (layer, rest) = rest.split_once('.')?;
            let module = Module::ALL
                .into_iter()
                .find(|m| rest.starts_with(m.peft_name()))?;
            let tail = &rest[module.peft_name().len()..];
            Some((layer.parse::<usize>().ok()?, module, tail))
        });
        match parsed {
            Some((layer, module, ".lora_A.weight")) => found.push((key.clone(), layer, module)),
            Some((_, _, ".lora_B.weight")) => {}
            _ => {
                return Err(format!(
                    "tensor {key} is not a projection's lora_A or lora_B (supported: {})",
                    supported()
                ));
            }
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

fn supported() -> String {
    let names: Vec<_> = Module::ALL.iter().map(|m| m.peft_name()).collect();
    names.join(", ")
}

/// The delta of `a` (`rank × inputs`) and `b` (`outputs × rank`) for `module`, its rows in
/// the model file's order.
fn delta(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
    module: Module,
    config: &ModelConfig,
    peft: &PeftConfig,
) -> std::result::Result<Delta, String> {
    let (inputs, outputs) = module.shape(config);
    let dims = |t: &candle_core::Tensor| t.dims2().map_err(|e| e.to_string());
    let ((rank, a_inputs), (b_outputs, b_rank)) = (dims(a)?, dims(b)?);
    if a_inputs != inputs || b_outputs != outputs || b_rank != rank || rank == 0 {
        return Err(format!(
            "lora_A is {rank}x{a_inputs} and lora_B {b_outputs}x{b_rank}; this model's \
             projection takes {inputs} inputs to {outputs} outputs"
        ));
    }
    let bf16s = |t: &candle_core::Tensor| -> std::result::Result<Vec<u16>, String> {
        let t = t.to_dtype(DType::BF16).and_then(|t| t.flatten_all());
        let values = t.and_then(|t| t.to_vec1::<half::bf16>());
        values
            .map(|v| v.into_iter().map(half::bf16::to_bits).collect())
            .map_err(|e| e.to_string())
    };
    let (a, b) = (bf16s(a)?, bf16s(b)?);
    let mut b_rows: Vec<&[u16]> = b.chunks_exact(rank).collect();
    if config.architecture.interleaved_rope() && matches!(module, Module::Q | Module::K) {
        let heads = if module == Module::Q {
            config.n_heads
        } else {
            config.n_kv_heads
        };
        b_rows = interleave_rows(&b_rows, heads);
    }
    let mut b_t = vec![0u16; rank * outputs];
    for (o, row) in b_rows.iter().enumerate() {
        for (r, &v) in row.iter().enumerate() {
            b_t[r * outputs + o] = v;
        }
    }
    Ok(Delta {
        inputs,
        outputs,
        a,
        b: b_t,
        scale: peft.scale(rank),
    })
}

/// A q or k projection's output rows as llama.cpp's converter writes a Llama model's
/// weights (each head's two halves interleaved, for its rotary embedding on pairs): within
/// a head of `d` rows, row `2i + j` is Hugging Face's row `j·d/2 + i`.
fn interleave_rows<'a>(rows: &[&'a [u16]], heads: usize) -> Vec<&'a [u16]> {
    let d = rows.len() / heads;
    (0..rows.len())
        .map(|out| {
            let (head, within) = (out / d, out % d);
            rows[head * d + (within % 2) * (d / 2) + within / 2]
        })
        .collect()
}

/// The rows of a pass that belong to a sequence with an adapter: its first row, its row
/// count, its adapter.
pub(crate) type AdaptedRows<'a> = [(usize, usize, &'a Adapter)];

/// Each projection's output `y` of layer `layer` (all the pass's rows) with the deltas of
/// the adapters of `rows` added to their rows; `x` is the projections' input. Outputs no
/// adapter changes come back as they are.
pub(crate) fn with_deltas<const N: usize>(
    rows: &AdaptedRows<'_>,
    layer: usize,
    x: &candle_core::Tensor,
    outputs: [(Module, candle_core::Tensor); N],
) -> Result<[candle_core::Tensor; N]> {
    let changed = |m: Module| rows.iter().any(|(_, _, a)| a.changes(layer, m));
    if !outputs.iter().any(|(m, _)| changed(*m)) {
        return Ok(outputs.map(|(_, y)| y));
    }
    if !x.device().is_cpu() {
        return on_device(rows, layer, x, outputs);
    }
    // Row-major whatever their shape: a row's values one after another.
    let inputs = x.elem_count() / x.dim(0)?;
    let x = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(N);
    for (module, y) in outputs {
        if !changed(module) {
            out.push(y);
            continue;
        }
        let width = y.elem_count() / y.dim(0)?;
        let (shape, device) = (y.shape().clone(), y.device().clone());
        let mut data = y.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        for &(row, len, adapter) in rows {
            let x = &x[row * inputs..(row + len) * inputs];
            adapter.add(
                layer,
                module,
                x,
                &mut data[row * width..(row + len) * width],
            );
        }
        out.push(candle_core::Tensor::from_vec(data, shape, &device)?);
    }
    Ok(out.try_into().expect("one output a projection"))
}

/// [`with_deltas`] on a GPU: each adapted sequence's rows through candle's matmuls with the
/// adapter's copies there (a prompt's prefill; the CUDA step adds the deltas of its passes
/// itself).
fn on_device<const N: usize>(
    rows: &AdaptedRows<'_>,
    layer: usize,
    x: &Tensor,
    outputs: [(Module, Tensor); N],
) -> Result<[Tensor; N]> {
    let total = x.dim(0)?;
    let x = x.reshape((total, x.elem_count() / total))?;
    let mut out = Vec::with_capacity(N);
    for (module, y) in outputs {
        let shape = y.shape().clone();
        let mut y = y.reshape((total, y.elem_count() / total))?;
        for &(row, len, adapter) in rows {
            let on = adapter.on_gpu()?;
            let (Some([a, b_t]), Some(d)) = (
                &on.deltas[layer][module as usize],
                &adapter.layers[layer][module as usize],
            ) else {
                continue;
            };
            let [a, b_t] = [a, b_t].map(|t| t.to_dtype(DType::F32));
            let t = (x.narrow(0, row, len)?.matmul(&a?.t()?)? * f64::from(d.scale))?;
            let sum = (y.narrow(0, row, len)? + t.matmul(&b_t?)?)?;
            y = y.slice_assign(&[row..row + len, 0..y.dim(1)?], &sum)?;
        }
        out.push(y.reshape(shape)?);
    }
    Ok(out.try_into().expect("one output a projection"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{TinyAdapter, TinyModel};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap();
        d.flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// The deltas through candle's matmuls (a prompt's prefill on a GPU; here candle's CPU
    /// ops, with the adapters' copies made on the CPU) are the host's within f32's
    /// rounding: each adapted sequence's rows get their own adapter's, a projection it does
    /// not change and the rows of no adapter none.
    #[test]
    fn candles_matmuls_add_the_deltas_the_host_adds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        TinyModel::default().write(&path).unwrap();
        let model = crate::Model::load(&path, &crate::LoadOptions::default()).unwrap();
        let c = model.config();
        let load = |spec: TinyAdapter, name: &str| {
            spec.write(&dir.path().join(name), c).unwrap();
            let mut adapter = Adapter::load(name, &dir.path().join(name), c).unwrap();
            adapter.device = Some(OnDevice {
                device: Device::Cpu,
                deltas: adapter.copies(&Device::Cpu).unwrap(),
                #[cfg(feature = "cuda")]
                table: (Tensor::zeros(1, DType::U8, &Device::Cpu).unwrap(), 0),
            });
            adapter
        };
        let first = load(TinyAdapter::default(), "first");
        let modules = vec!["q_proj", "down_proj"];
        let second = TinyAdapter {
            rank: 8,
            modules,
            seed: 5,
            ..TinyAdapter::default()
        };
        let second = load(second, "second");
        // Rows 0-2 of the first adapter, 3-4 of none, 5-6 of the second.
        let rows = [(0, 3, &first), (5, 2, &second)];
        let random = |cols| Tensor::randn(0f32, 1.0, (7, cols), &Device::Cpu).unwrap();
        let (nq, nkv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let (x, q, k) = (random(c.hidden), random(nq), random(nkv));
        let outputs = || [(Module::Q, q.clone()), (Module::K, k.clone())];
        let host = with_deltas(&rows, 1, &x, outputs()).unwrap();
        let ops = on_device(&rows, 1, &x, outputs()).unwrap();
        assert!(
            max_diff(&host[0], &ops[0]) < 1e-4,
            "{}",
            max_diff(&host[0], &ops[0])
        );
        let rows_of = |t: &Tensor, from, n| t.narrow(0, from, n).unwrap();
        for got in [&host[0], &ops[0]] {
            assert!(max_diff(&rows_of(got, 0, 3), &rows_of(&q, 0, 3)) > 0.01);
            assert_eq!(max_diff(&rows_of(got, 3, 2), &rows_of(&q, 3, 2)), 0.0);
            assert!(max_diff(&rows_of(got, 5, 2), &rows_of(&q, 5, 2)) > 0.01);
        }
        // The second adapter leaves k as it is; the first changes it.
        assert!(max_diff(&host[1], &ops[1]) < 1e-4);
        assert_eq!(max_diff(&rows_of(&ops[1], 3, 4), &rows_of(&k, 3, 4)), 0.0);
        assert!(max_diff(&rows_of(&ops[1], 0, 3), &rows_of(&k, 0, 3)) > 0.01);
    }
}
