//! The step's host-side checks that need no GPU: what a draw takes to the GPU, and every
//! kernel source compiling with NVRTC and assembling with ptxas.

use super::*;
use candle_core::cuda_backend::cudarc::nvrtc;

/// A draw goes to the GPU with the distribution of the draft it corrects only where that
/// fits the row's place (`DRAFTED_MAX` entries); a lookup's point mass always does.
#[test]
fn a_drafts_distribution_is_drawn_on_the_gpu_where_it_fits() {
    use crate::sampling::{DrawFrom, Excluded, SamplingParams};
    let draw = |from: DrawFrom| Draw {
        params: SamplingParams::default(),
        uniform: 0.5,
        from,
    };
    let spread = |n: u32| {
        let q = Distribution::from_pairs((0..n).map(|id| (id, 1.0))).unwrap();
        DrawFrom::After(Excluded {
            token: 0,
            from: Some(std::sync::Arc::new(q)),
        })
    };
    assert!(drafted_fits(&draw(DrawFrom::Row)));
    assert!(drafted_fits(&draw(DrawFrom::After(Excluded::point(7)))));
    assert!(drafted_fits(&draw(spread(DRAFTED_MAX as u32))));
    assert!(!drafted_fits(&draw(spread(DRAFTED_MAX as u32 + 1))));
}

/// Every kernel source of ours compiles with NVRTC (no GPU needed) for Ampere and
/// Hopper, and the toolkit's `ptxas` (on PATH under `scripts/cuda-env`) assembles the
/// PTX for each: a kernel that does not build fails here, not at a worker's first pass.
#[test]
fn kernels_compile_with_nvrtc_and_assemble_with_ptxas() {
    // The mat-vec's source also with every kernel a shape may ask for.
    let widest = matvec::MmaShape {
        tiles: 8,
        warps: 16,
        unroll: 2,
        iterations: 4,
    };
    let sources = [
        ("cuda_step", source(KERNELS)),
        ("matvec", source(matvec::SOURCE)),
        (
            "matvec-widest",
            source_for(
                matvec::SOURCE,
                widest,
                matvec::FewForm {
                    rows: matvec::MAX_FEW_ROWS,
                    lanes: 1,
                },
            ),
        ),
        ("attention", super::super::cuda::attention_source()),
    ];
    let ptxas = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("ptxas"))
            .find(|p| p.is_file())
    });
    let dir = tempfile::tempdir().unwrap();
    for (name, source) in sources {
        for arch in ["80", "90"] {
            let options = nvrtc::CompileOptions {
                arch: Some(if arch == "80" {
                    "compute_80"
                } else {
                    "compute_90"
                }),
                ..Default::default()
            };
            let ptx = nvrtc::compile_ptx_with_opts(&source, options)
                .unwrap_or_else(|e| panic!("{name} for compute_{arch}: {e}"));
            let Some(ptxas) = &ptxas else {
                eprintln!("no ptxas on PATH: {name} compiled, not assembled");
                continue;
            };
            let file = dir.path().join(format!("{name}-{arch}.ptx"));
            std::fs::write(&file, ptx.to_src()).unwrap();
            let status = std::process::Command::new(ptxas)
                .args([&format!("-arch=sm_{arch}"), "-o"])
                .arg(dir.path().join(format!("{name}-{arch}.cubin")))
                .arg(&file)
                .status()
                .unwrap();
            assert!(status.success(), "ptxas refused {name} for sm_{arch}");
        }
    }
}
