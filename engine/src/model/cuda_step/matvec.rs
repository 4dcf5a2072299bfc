//! The step's own quantized mat-vec (`matvec.cu`): every activation row of a pass in one
//! launch a matmul, a tile of rows sharing each weight load, each row's sums in a fixed
//! order. candle's mat-vec kernel keeps a row's order only up to four rows a launch and
//! re-reads the weights for every four rows.
//!
//! Experimental, off unless `DUET_CUDA_MATVEC` asks for them: where they stand against
//! candle's kernel (faster from a few rows on, slower for one) is in docs/benchmarks.md, "A
//! mat-vec kernel that scales with rows" and the entries after it.
//!
//! `tiled`: the warp-per-feature kernels, in two widths, one output feature a warp and four
//! (the activations read once for four features); both add every sum in the same order, so
//! a pass picks the width by its row count without changing a bit. `tiled1` and `tiled4` pin
//! the width, to compare them. `mma`: the tensor-core kernels (sm_80 and later), int8 MMAs
//! of 16 features by 8 rows, and for passes of a few rows ([`few_form`]) their few-row form,
//! the same sums in the same order without tensor cores, a warp a feature: their sums run in
//! another order than the tiled ones', so a process uses one family or the other. The
//! matmuls outside the step (a shortlisted draft's extra ids) take the same kernels
//! ([`for_stream`], loaded once for both), so an id's logit is the same in a shortlisted
//! model as in the whole one.

use super::launch::{Arg, Kernel, Launch, grid, launch_kernel};
use super::{Result, cu, load_module, shape_from_env};
use crate::model::step_plan::k_splits_fitting;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use candle_core::quantized::GgmlDType;
use std::sync::Arc;

pub(super) const SOURCE: &str = include_str!("matvec.cu");
/// Activation rows a warp takes at once (`TILE` in `matvec.cu`).
pub(super) const TILE: usize = 8;
/// Warps a block (`WARPS` in `matvec.cu`).
pub(super) const WARPS: usize = 4;
/// The tensor-core kernels' blocks: at most `tiles` tiles of 8 rows a block (1, 2, 4 or 8;
/// a pass takes the fewest that hold its rows), `warps` warps each taking every
/// `warps`-th unit of a row (`MMA_WARPS`), the unit loop unrolled `unroll` times
/// (`MMA_UNROLL`), and a row's units split into parts of about `iterations` units a warp
/// (`step_plan::k_splits`; 0: whole). 4, 16, 2 and 4 (the fastest measured: docs/
/// benchmarks.md, "Tensor cores for the mat-vec" for the first three, "Fewer launches a
/// layer" for splitting rows into parts of 4 units a warp) unless
/// `DUET_CUDA_MMA_SHAPE` says `TILESxWARPSxUNROLL[xITERATIONS]` (to compare shapes on a
/// GPU; the partial sums, one float per tile, cell, lane and warp, must fit
/// [`MMA_SHARED_MAX`] of shared memory).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct MmaShape {
    pub(super) tiles: usize,
    pub(super) warps: usize,
    pub(super) unroll: usize,
    pub(super) iterations: usize,
}

pub(super) fn mma_shape() -> MmaShape {
    static SHAPE: std::sync::OnceLock<MmaShape> = std::sync::OnceLock::new();
    *SHAPE.get_or_init(|| {
        let expected = "TILESxWARPSxUNROLL[xITERATIONS] with tiles 1, 2, 4 or 8, warps 1-32, \
                        unroll 1-8 and partial sums within 96 KB";
        let given = shape_from_env("DUET_CUDA_MMA_SHAPE", parse_mma_shape, expected);
        given.unwrap_or(MmaShape {
            tiles: 4,
            warps: 16,
            unroll: 2,
            iterations: 4,
        })
    })
}

/// `TILESxWARPSxUNROLL[xITERATIONS]` as a shape, where it is one the kernels take.
fn parse_mma_shape(v: &str) -> Option<MmaShape> {
    let mut parts = v.split('x').map(|p| p.parse::<usize>().ok());
    let shape = MmaShape {
        tiles: parts.next()??,
        warps: parts.next()??,
        unroll: parts.next()??,
        iterations: parts.next().unwrap_or(Some(0))?,
    };
    let fits = mma_parts_bytes(shape.tiles, shape.warps) <= MMA_SHARED_MAX;
    let valid = [1, 2, 4, 8].contains(&shape.tiles)
        && (1..=32).contains(&shape.warps)
        && (1..=8).contains(&shape.unroll);
    (fits && valid && parts.next().is_none()).then_some(shape)
}

/// The most shared memory a shape's blocks may take for their warps' sums: what every GPU
/// of compute capability 8.0 or later lets a block have once asked (sm_86 and sm_89: 99 KB).
const MMA_SHARED_MAX: usize = 96 << 10;
/// The shared memory a launch takes without asking.
const SHARED_DEFAULT: usize = 48 << 10;

/// The shared memory of a tensor-core block of `tiles` tiles and `warps` warps: each warp's
/// sum of each cell (4 a lane) of each tile, in f32.
fn mma_parts_bytes(tiles: usize, warps: usize) -> usize {
    warps * tiles * 4 * 32 * 4
}

/// Tiles of 8 rows a block of the tensor-core kernels of `shape` for a pass of `rows` rows.
pub(super) fn mma_tiles(rows: usize, shape: MmaShape) -> usize {
    rows.div_ceil(8).next_power_of_two().min(shape.tiles)
}

/// The tensor-core kernels' few-row form (`matvec_few`): their cells added in their order,
/// bit for bit, without blocks of 16 features and 8 rows that a pass of one row leaves
/// mostly idle (its one-row pass took 1.6 times candle's kernel's: docs/benchmarks.md,
/// "Tensor cores for the mat-vec"), for passes of up to `rows` rows (0: none), `lanes`
/// lanes of a warp taking each unit (1, 2 or 4: `FEW_LANES`). 4 and 2 unless
/// `DUET_CUDA_MMA_FEW` says `ROWS[xLANES]` (rows 0 to 8), to compare them on a GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct FewForm {
    pub(super) rows: usize,
    pub(super) lanes: usize,
}

pub(super) fn few_form() -> FewForm {
    static FORM: std::sync::OnceLock<FewForm> = std::sync::OnceLock::new();
    *FORM.get_or_init(|| {
        let expected = "ROWS[xLANES] with rows 0 to 8 and lanes 1, 2 or 4";
        let given = shape_from_env("DUET_CUDA_MMA_FEW", parse_few_form, expected);
        given.unwrap_or(FewForm { rows: 4, lanes: 2 })
    })
}

fn parse_few_form(v: &str) -> Option<FewForm> {
    let (rows, lanes) = v.split_once('x').unwrap_or((v, "2"));
    let form = FewForm {
        rows: rows.parse().ok()?,
        lanes: lanes.parse().ok()?,
    };
    (form.rows <= MAX_FEW_ROWS && [1, 2, 4].contains(&form.lanes)).then_some(form)
}

/// The most rows of the few-row form (a tile of 8 rows its widest kernel's).
pub(super) const MAX_FEW_ROWS: usize = 8;

/// Rows a tile of the few-row kernels for a pass of `rows` rows (`rows` <= 8): one of the
/// kernels the source compiles for up to [`few_form`]'s rows (`FEW_ROWS`: 1, 2, 4, 8).
pub(super) fn few_tile(rows: usize) -> usize {
    rows.next_power_of_two()
}

/// The few-row kernels' tiles the source compiles (`FEW_ROWS` in `matvec.cu`), where
/// `choice` asks for the tensor-core kernels.
fn few_tiles(choice: Choice) -> impl Iterator<Item = usize> {
    let rows = match choice.mode {
        "mma" => choice.few_rows,
        _ => 0,
    };
    [1, 2, 4, 8]
        .into_iter()
        .filter(move |&tile| rows > 0 && tile <= few_tile(rows))
}

/// Warps a block of the few-row kernels at most, a feature each.
const FEW_WARPS: usize = 4;

/// Shared memory the few-row kernels take a warp and row, in f32: a row's cells (one a
/// unit), the sums of the tensor-core kernel's (part, warp) sets (`warps` a part: its
/// blocks' warps), the parts' sums.
fn few_floats(units: usize, split: usize, warps: usize) -> usize {
    units + split * (warps + 1)
}

/// The few-row kernels' launch for `n` output features of `units` units a row split into
/// `split` parts of the tensor-core kernels' `mma_warps` warps, and `rows` rows: up to
/// [`FEW_WARPS`] warps a block, as many as the 48 KB of shared memory a launch may take
/// without asking holds; `None` where one warp's does not fit.
fn few_shape(
    n: usize,
    (units, split, mma_warps): (usize, usize, usize),
    rows: usize,
) -> Option<LaunchConfig> {
    let tile = few_tile(rows);
    let per_warp = few_floats(units, split, mma_warps) * tile * 4;
    let warps = (SHARED_DEFAULT / per_warp).min(FEW_WARPS);
    (warps > 0).then(|| LaunchConfig {
        grid_dim: (n.div_ceil(warps) as u32, rows.div_ceil(tile) as u32, 1),
        block_dim: ((32 * warps) as u32, 1, 1),
        shared_mem_bytes: (warps * per_warp) as u32,
    })
}

/// Output features a block of the tensor-core kernels (the MMA's 16 rows).
const MMA_FEATURES: usize = 16;
/// Output features a warp of the wide kernels (their `_x4` names).
const WIDE: usize = 4;
/// From this many rows a pass uses the wide kernels: the activation reads they save grow
/// with the rows, the parallelism they give up matters most at few rows.
const WIDE_FROM_ROWS: usize = 16;

/// The tiled kernels, for the step and the matmuls outside it: loaded on first use where
/// they are asked for (`None` where not). A process drives one GPU, so they are loaded once.
pub(crate) fn for_stream(stream: &Arc<CudaStream>) -> Result<Option<&'static Tiled>> {
    static TILED: std::sync::OnceLock<std::result::Result<Tiled, String>> =
        std::sync::OnceLock::new();
    let Some(choice) = Choice::from_env() else {
        return Ok(None);
    };
    match TILED.get_or_init(|| Tiled::load(stream, choice).map_err(|e| e.to_string())) {
        Ok(tiled) => Ok(Some(tiled)),
        Err(e) => Err(candle_core::Error::Msg(e.clone()).into()),
    }
}

/// Which kernels `DUET_CUDA_MATVEC` asks for, read once: `None` for candle's.
fn mode() -> Option<&'static str> {
    static MODE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    MODE.get_or_init(|| {
        std::env::var("DUET_CUDA_MATVEC")
            .ok()
            .filter(|v| matches!(v.as_str(), "tiled" | "tiled1" | "tiled4" | "mma"))
    })
    .as_deref()
}

/// The kernel family for a pass of `rows` rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Family {
    /// Warp per feature, one output feature a warp.
    Narrow,
    /// Warp per feature, `WIDE` output features a warp.
    Wide,
    /// Tensor cores.
    Mma,
    /// The tensor cores' sums, a warp a feature, for a few rows.
    Few,
}

/// Which tiled kernels a process takes: `DUET_CUDA_MATVEC`'s mode, the tensor cores' shape
/// and the most rows of their few-row form (the source is compiled for the same).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Choice {
    pub(super) mode: &'static str,
    pub(super) mma: MmaShape,
    pub(super) few_rows: usize,
}

impl Choice {
    /// The choice the environment makes (`None`: candle's kernels), read once.
    pub(super) fn from_env() -> Option<Self> {
        mode().map(|mode| Self {
            mode,
            mma: mma_shape(),
            few_rows: few_form().rows,
        })
    }

    /// A pass's launches for `rows` rows of Q8_1 input of `x_blocks` blocks each: the
    /// mat-vec of an `n x k` weight of `dtype` (as candle loaded it), and where the tensor
    /// cores split its rows into parts (in `partials`), the adding of them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launches(
        &self,
        dtype: GgmlDType,
        [weight, input, output]: [u64; 3],
        (n, k): (usize, usize),
        rows: usize,
        x_blocks: usize,
        partials: Partials,
    ) -> Vec<Launch> {
        let family = family_for(Some(self.mode), self.few_rows, rows);
        let Plan {
            family,
            config,
            split,
        } = Tiled::plan(family, self.mma, (n, k), rows, partials);
        let size = match family {
            Family::Mma => mma_tiles(rows, self.mma),
            Family::Few => few_tile(rows),
            Family::Narrow | Family::Wide => 0,
        };
        let scratch = partials.map_or(0, |(addr, _)| addr);
        let mut args = vec![Arg::Ptr(weight), Arg::Ptr(input), Arg::Ptr(output)];
        args.extend([k, n, rows, x_blocks].map(|x| Arg::I32(x as i32)));
        match family {
            Family::Mma => args.extend([Arg::I32(split as i32), Arg::Ptr(scratch)]),
            Family::Few => args.push(Arg::I32(split as i32)),
            Family::Narrow | Family::Wide => {}
        }
        let kernel = Kernel::MatVec {
            dtype,
            family,
            size,
        };
        let mut launches = vec![Launch::Ours {
            kernel,
            config,
            args,
        }];
        if family == Family::Mma && split > 1 {
            let count = rows * n;
            let args = vec![
                Arg::Ptr(scratch),
                Arg::Ptr(output),
                Arg::I32(count as i32),
                Arg::I32(split as i32),
            ];
            launches.push(Launch::Ours {
                kernel: Kernel::MatVecCombine,
                config: grid((count.div_ceil(256) as u32, 1, 1), 256),
                args,
            });
        }
        launches
    }
}

/// The kernel family `mode` (a `DUET_CUDA_MATVEC`) takes for `rows` rows, with the few-row
/// form up to `few_rows`.
pub(super) fn family_for(mode: Option<&str>, few_rows: usize, rows: usize) -> Family {
    match mode {
        Some("mma") if rows <= few_rows => Family::Few,
        Some("mma") => Family::Mma,
        Some("tiled1") => Family::Narrow,
        Some("tiled4") => Family::Wide,
        _ if rows >= WIDE_FROM_ROWS => Family::Wide,
        _ => Family::Narrow,
    }
}

/// A launch's grid, block and shared memory for `n` output features and `rows` rows, the
/// tensor cores' blocks of shape `mma` (the few-row kernels': [`few_shape`]).
fn launch_shape(family: Family, mma: MmaShape, n: usize, rows: usize) -> LaunchConfig {
    let (grid, warps) = match family {
        Family::Mma | Family::Few => {
            let tiles = mma_tiles(rows, mma);
            let y = rows.div_ceil(8 * tiles);
            ((n.div_ceil(MMA_FEATURES), y), mma.warps)
        }
        Family::Wide => ((n.div_ceil(WARPS * WIDE), rows.div_ceil(TILE)), WARPS),
        Family::Narrow => ((n.div_ceil(WARPS), rows.div_ceil(TILE)), WARPS),
    };
    let shared = match family {
        Family::Mma | Family::Few => mma_parts_bytes(mma_tiles(rows, mma), warps),
        Family::Wide | Family::Narrow => 0,
    };
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: ((32 * warps) as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// One launch of the mat-vec kernels as a pass makes it: the kernel family (the few-row
/// form's turned into the tensor cores' where its shared memory does not fit), the grid,
/// block and shared memory, and the parts a row's units split into (the tensor cores' grid
/// has one layer a part).
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) family: Family,
    pub(super) config: LaunchConfig,
    pub(super) split: usize,
}

/// Whether a weight type has a tiled kernel.
pub(crate) fn supports(dtype: GgmlDType) -> bool {
    matches!(
        dtype,
        GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q4K | GgmlDType::Q6K
    )
}

/// One width of the tiled kernels, one per weight type.
#[derive(Debug)]
struct Kernels {
    q8_0: CudaFunction,
    q5_0: CudaFunction,
    q4_k: CudaFunction,
    q6_k: CudaFunction,
}

impl Kernels {
    fn of(&self, dtype: GgmlDType) -> Option<&CudaFunction> {
        match dtype {
            GgmlDType::Q8_0 => Some(&self.q8_0),
            GgmlDType::Q5_0 => Some(&self.q5_0),
            GgmlDType::Q4K => Some(&self.q4_k),
            GgmlDType::Q6K => Some(&self.q6_k),
            _ => None,
        }
    }

    /// Lets each kernel's launches take `bytes` of dynamic shared memory, where that is
    /// more than a launch may take without asking.
    fn allow_shared(&self, bytes: usize) -> Result<()> {
        if bytes <= SHARED_DEFAULT {
            return Ok(());
        }
        let limit = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        for f in [&self.q8_0, &self.q5_0, &self.q4_k, &self.q6_k] {
            cu(
                f.set_attribute(limit, bytes as i32),
                "raising the tensor-core kernels' shared memory",
            )?;
        }
        Ok(())
    }
}

/// The step's mat-vec kernels: one output feature a warp, `WIDE`, tensor cores (by tiles a
/// block: 1, 2, 4, 8, up to the shape's) and their few-row form (by rows a tile: 1, 2, 4, 8,
/// up to [`few_form`]'s), and the adding of a split row's parts.
#[derive(Debug)]
pub(crate) struct Tiled {
    choice: Choice,
    narrow: Kernels,
    wide: Kernels,
    mma: Vec<Kernels>,
    few: Vec<Kernels>,
    combine: CudaFunction,
}

/// Scratch for the parts of rows split over blocks: its address and its size in f32. A
/// weight splits only where its parts for a full step's rows fit
/// (`step_plan::k_splits_fitting`), so whether it does depends on its shape alone; without
/// scratch nothing splits.
pub(crate) type Partials = Option<(u64, usize)>;

impl Tiled {
    fn load(stream: &Arc<CudaStream>, choice: Choice) -> Result<Self> {
        // The MMAs need PTX for sm_80 or later (NVRTC's default target is older).
        let (major, _) = cu(stream.context().compute_capability(), "compute capability")?;
        let arch = if major >= 9 {
            Some("compute_90")
        } else if major == 8 {
            Some("compute_80")
        } else if choice.mode == "mma" {
            return Err(candle_core::Error::Msg(format!(
                "DUET_CUDA_MATVEC=mma needs a GPU of compute capability 8.0 or later, not {major}.x"
            ))
            .into());
        } else {
            None
        };
        let module = load_module(stream, SOURCE, arch, "tiled mat-vec kernels")?;
        let function = |kernel: Kernel| cu(module.load_function(&kernel.name()), &kernel.name());
        let kernels = |family: Family, size: usize| -> Result<Kernels> {
            let f = |dtype| {
                function(Kernel::MatVec {
                    dtype,
                    family,
                    size,
                })
            };
            Ok(Kernels {
                q8_0: f(GgmlDType::Q8_0)?,
                q5_0: f(GgmlDType::Q5_0)?,
                q4_k: f(GgmlDType::Q4K)?,
                q6_k: f(GgmlDType::Q6K)?,
            })
        };
        let mma = choice.mma;
        Ok(Self {
            choice,
            narrow: kernels(Family::Narrow, 0)?,
            wide: kernels(Family::Wide, 0)?,
            mma: [1, 2, 4, 8]
                .into_iter()
                .filter(|&tiles| tiles <= mma.tiles)
                .map(|tiles| {
                    let kernels = kernels(Family::Mma, tiles)?;
                    kernels.allow_shared(mma_parts_bytes(tiles, mma.warps))?;
                    Ok(kernels)
                })
                .collect::<Result<_>>()?,
            few: few_tiles(choice)
                .map(|tile| kernels(Family::Few, tile))
                .collect::<Result<_>>()?,
            combine: function(Kernel::MatVecCombine)?,
        })
    }

    /// How many parts a pass splits each row of an `n x k` weight into (the few-row form as
    /// the tensor-core kernels of shape `mma`, whose sums it repeats).
    fn split(family: Family, mma: MmaShape, (n, k): (usize, usize), partials: Partials) -> usize {
        match (family, partials) {
            (Family::Mma | Family::Few, Some((_, floats))) => {
                k_splits_fitting(k / 32, (mma.warps, mma.iterations), n, floats)
            }
            _ => 1,
        }
    }

    /// A pass's launch of `family`'s kernels (the tensor cores' of shape `mma`) for an
    /// `n x k` weight and `rows` rows.
    pub(super) fn plan(
        family: Family,
        mma: MmaShape,
        (n, k): (usize, usize),
        rows: usize,
        partials: Partials,
    ) -> Plan {
        let split = Self::split(family, mma, (n, k), partials);
        let mut config = launch_shape(family, mma, n, rows);
        let family = match family {
            Family::Few => match few_shape(n, (k / 32, split, mma.warps), rows) {
                Some(few) => {
                    config = few;
                    Family::Few
                }
                // Rows too long for shared memory: the tensor cores, whose sums it repeats.
                None => Family::Mma,
            },
            other => other,
        };
        if family == Family::Mma {
            config.grid_dim.2 = split as u32;
        }
        Plan {
            family,
            config,
            split,
        }
    }

    /// `output = input W^T` for `rows` rows of Q8_1 input of `x_blocks` blocks each, one
    /// launch (two where rows split into parts, in `partials`). `weight`: `n x k` of
    /// `dtype`, as candle loaded it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch(
        &self,
        stream: &Arc<CudaStream>,
        dtype: GgmlDType,
        ptrs: [u64; 3],
        (n, k): (usize, usize),
        rows: usize,
        x_blocks: usize,
        partials: Partials,
    ) -> Result<()> {
        let launches = self
            .choice
            .launches(dtype, ptrs, (n, k), rows, x_blocks, partials);
        for launch in &launches {
            let Some((kernel, config, args)) = launch.ours() else {
                unreachable!("the tiled kernels are ours")
            };
            let f = self.function(kernel).ok_or_else(|| {
                candle_core::Error::Msg(format!("no tiled mat-vec kernel {}", kernel.name()))
            })?;
            launch_kernel(stream, f, kernel, config, args)?;
        }
        Ok(())
    }

    /// A mat-vec kernel's function (`None`: not loaded, or not a mat-vec kernel).
    pub(super) fn function(&self, kernel: Kernel) -> Option<&CudaFunction> {
        let (dtype, family, size) = match kernel {
            Kernel::MatVecCombine => return Some(&self.combine),
            Kernel::MatVec {
                dtype,
                family,
                size,
            } => (dtype, family, size),
            _ => return None,
        };
        let index = size.trailing_zeros() as usize;
        let kernels = match family {
            Family::Narrow => Some(&self.narrow),
            Family::Wide => Some(&self.wide),
            Family::Mma => self.mma.get(index),
            Family::Few => self.few.get(index),
        };
        kernels?.of(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_mma_shape_is_read_where_the_kernels_take_it() {
        let shape = |tiles, warps, unroll, iterations| MmaShape {
            tiles,
            warps,
            unroll,
            iterations,
        };
        assert_eq!(parse_mma_shape("4x16x2"), Some(shape(4, 16, 2, 0)));
        assert_eq!(parse_mma_shape("4x16x2x4"), Some(shape(4, 16, 2, 4)));
        // Past 48 KB of partial sums a shape asks for more (8 tiles of 16 warps: 64 KB).
        assert_eq!(parse_mma_shape("8x16x2x4"), Some(shape(8, 16, 2, 4)));
        // Not a shape, a tile count the kernels lack, partial sums past 96 KB, a fifth part.
        for bad in [
            "4x16",
            "4x16x2x",
            "3x16x2",
            "8x32x2",
            "4x16x9",
            "4x16x2x4x1",
            "fast",
        ] {
            assert_eq!(parse_mma_shape(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_few_row_form_takes_a_tile_it_has_and_fits_its_shared_memory() {
        assert_eq!([1, 2, 3, 4, 5, 8].map(few_tile), [1, 2, 4, 4, 8, 8]);
        let form = |rows, lanes| Some(FewForm { rows, lanes });
        assert_eq!(
            ["0", "4", "8x1", "2x4"].map(parse_few_form),
            [form(0, 2), form(4, 2), form(8, 1), form(2, 4)]
        );
        for bad in ["9", "-1", "4x3", "4x", "4x2x1", "four"] {
            assert_eq!(parse_few_form(bad), None, "{bad}");
        }
        // The 1.5B's down projection (8,960 values a row: 280 units, 5 parts) at 3 rows (a
        // tile of 4): cells, 16 warps' sums a part and the parts', 4 bytes each, a warp a
        // feature, four warps a block.
        let floats = 280 + 5 * (16 + 1);
        assert_eq!(few_floats(280, 5, 16), floats);
        let c = few_shape(1536, (280, 5, 16), 3).unwrap();
        assert_eq!((c.grid_dim, c.block_dim), ((384, 1, 1), (128, 1, 1)));
        assert_eq!(c.shared_mem_bytes as usize, 4 * 4 * floats * 4);
        // Longer rows take fewer warps a block, then none fit (the tensor cores run).
        let c = few_shape(100, (1400, 8, 16), 8).unwrap();
        assert_eq!((c.grid_dim, c.block_dim.0), ((100, 1, 1), 32));
        assert_eq!(c.shared_mem_bytes, 48 << 10);
        assert!(few_shape(100, (1401, 8, 16), 8).is_none());
        assert!(few_shape(100, (1401, 8, 16), 4).is_some());
    }
}
