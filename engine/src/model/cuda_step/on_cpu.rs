//! The step's kernels run on the CPU, where no GPU is: `on_cpu/cuda_on_cpu.h` stands in for
//! the CUDA device language (each thread a fiber, the blocks one after another, warp
//! shuffles and the int8 MMA by the PTX ISA's layouts), the host's C++ compiler builds a
//! kernel source as the step assembles it (`source_for`) with a driver behind it
//! (`on_cpu/script_main.cpp`, which runs a [`Script`] of buffers and launches), and the
//! tests hold the kernels' results to the host's (candle's dequantized weights, the
//! sampler, attention in f64) and to each other, bit for bit where the step relies on it;
//! `step` runs the step's own launches, whole passes of them, candle's mat-vec kernel
//! among them, against the model in f64 (`reference`). What only a GPU can say (speed, the
//! compiler's and the hardware's own behaviour) stays with `scripts/gpu-check`.

use super::launch::{Arg, Launch, grid};
use crate::model::cuda::{MAT_VEC_TYPES, type_name};
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::quantized::GgmlDType;
use std::fmt::Display;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod draws;
mod layer;
mod mat_vec;
mod reference;
mod step;

const SHIM: &str = include_str!("on_cpu/cuda_on_cpu.h");
const SCRIPT_MAIN: &str = include_str!("on_cpu/script_main.cpp");

/// Builds `source` (a kernel source as the step compiles it) after the shim and before the
/// script driver, which may launch `kernels`, with the host's C++ compiler (`CXX`, else
/// `c++`), into a folder of the system's temporary one under a name of the whole text's
/// and the compiler's hash: a source built before, by this test process or an earlier one,
/// is not built again.
fn build(name: &str, source: &str, kernels: &[String]) -> PathBuf {
    let table: String = (kernels.iter())
        .map(|k| {
            format!("        {{\"{k}\", [](const auto& a) {{ return bind_kernel({k}, a); }}}},\n")
        })
        .collect();
    let text = format!(
        "{SHIM}\n#line 1 \"{name}.cu\"\n{source}\n#line 1 \"script_main.cpp\"\n{SCRIPT_MAIN}\n\
         std::map<std::string, Binder> duet_kernels() {{\n    return {{\n{table}    }};\n}}\n"
    );
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut hasher = std::hash::DefaultHasher::new();
    (&compiler, FLAGS, &text).hash(&mut hasher);
    let dir = std::env::temp_dir().join("duet-cuda-on-cpu");
    let binary = dir.join(format!("{name}-{:016x}", hasher.finish()));
    if binary.is_file() {
        return binary;
    }
    std::fs::create_dir_all(&dir).unwrap();
    // Built under a name of this process's, then renamed: a test process beside this one
    // building the same text finds the whole binary or none.
    let partial = binary.with_extension(format!("{}.partial", std::process::id()));
    let file = partial.with_extension("cpp");
    std::fs::write(&file, text).unwrap();
    let output = Command::new(&compiler)
        .args(FLAGS)
        .arg("-o")
        .arg(&partial)
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler `{compiler}`: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "building {name} on the CPU:\n{stderr}"
    );
    std::fs::rename(&partial, &binary).unwrap();
    std::fs::remove_file(&file).unwrap();
    binary
}

/// The host compiler's flags: C++20, no contraction of a multiply and an add into one
/// rounding (the kernels' order of rounding is what the tests hold).
const FLAGS: [&str; 4] = ["-std=c++20", "-O1", "-ffp-contract=off", "-w"];

/// The step's own kernels (`kernels.cu`) built for the CPU, once a process.
fn step_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let source = super::source(super::KERNELS);
        build("step", &source, &global_kernels(&source))
    })
}

/// The kernels `source` defines by name (not those a macro names): each `__global__`
/// function's.
fn global_kernels(source: &str) -> Vec<String> {
    let name = |rest: &str| -> Option<String> {
        let rest = rest.trim_start().strip_prefix("void")?.trim_start();
        let rest = match rest.strip_prefix("__launch_bounds__(") {
            Some(bounded) => bounded.split_once(')')?.1.trim_start(),
            None => rest,
        };
        let name: String = (rest.chars())
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        (!name.is_empty()).then_some(name)
    };
    source
        .split("__global__")
        .skip(1)
        .filter_map(name)
        .collect()
}

/// Buffers and launches for the script driver, in order; `run` runs them and reads back
/// what `save` named. Each buffer lies at an address of the script's choosing (and
/// returned), so a launch may name it as the step's launches do, by address.
struct Script<'a> {
    dir: &'a Path,
    lines: String,
    /// Where the next buffer's region starts.
    next: u64,
}

/// Where a script's buffers start: far above a process's heap and below its libraries'
/// mappings, in every 64-bit Linux process's address space.
const FIRST_ADDRESS: u64 = 0x2000_0000_0000;
/// A buffer's region: it ends at a multiple of this (a multiple of every page size), and
/// an inaccessible page follows before the next region.
const REGION: u64 = 64 << 10;

impl<'a> Script<'a> {
    fn new(dir: &'a Path) -> Self {
        Self {
            dir,
            lines: String::new(),
            next: FIRST_ADDRESS,
        }
    }

    /// The address of a buffer of `bytes`: the end of its region.
    fn place(&mut self, bytes: usize) -> u64 {
        let size = bytes.next_multiple_of(8) as u64;
        let region = size.next_multiple_of(REGION);
        let at = self.next + region - size;
        self.next += region + REGION;
        at
    }

    /// A buffer holding `bytes`; its address.
    fn load(&mut self, name: &str, bytes: &[u8]) -> u64 {
        std::fs::write(self.dir.join(format!("{name}.in")), bytes).unwrap();
        let at = self.place(bytes.len());
        self.lines += &format!("load {name} {at} {name}.in\n");
        at
    }

    fn load_f32(&mut self, name: &str, values: &[f32]) -> u64 {
        self.load(name, &f32_bytes(values))
    }

    /// `bytes` into a buffer from address `at`, at this point of the script (as `file`, in
    /// the script's folder).
    fn write(&mut self, at: u64, file: &str, bytes: &[u8]) {
        std::fs::write(self.dir.join(file), bytes).unwrap();
        self.lines += &format!("write {at} {file}\n");
    }

    /// A buffer of `bytes`, each 0xFF (NaN as f32), so that what a kernel leaves unwritten
    /// shows; its address.
    fn alloc(&mut self, name: &str, bytes: usize) -> u64 {
        let at = self.place(bytes);
        self.lines += &format!("alloc {name} {at} {bytes}\n");
        at
    }

    /// A buffer of `bytes` zero bytes (as the GPU's buffers are allocated); its address.
    fn zeros(&mut self, name: &str, bytes: usize) -> u64 {
        let at = self.place(bytes);
        self.lines += &format!("zeros {name} {at} {bytes}\n");
        at
    }

    /// A buffer of addresses: each a buffer's name, or `name+bytes` into it.
    fn table(&mut self, name: &str, refs: &[String]) {
        let at = self.place(8 * refs.len());
        self.lines += &format!("table {name} {at} {}\n", refs.join(" "));
    }

    /// The step's launches (`launch`), their buffers by address; candle's mat-vec by its
    /// launcher, which the script's binary must have (`candle_mat_vec_source`).
    fn launches(&mut self, launches: &[Launch]) {
        for launch in launches {
            let Some((kernel, config, args)) = launch.ours() else {
                self.candle_mat_vec(launch);
                continue;
            };
            let text: Vec<String> = args.iter().map(Arg::to_string).collect();
            let args: Vec<&dyn Display> = text.iter().map(|t| t as &dyn Display).collect();
            self.launch(&kernel.name(), config, &args);
        }
    }

    /// A `Launch::Candle`: the call `CudaStep::run` makes (`Launch::candle`), to candle's
    /// launcher for the weight's type.
    fn candle_mat_vec(&mut self, launch: &Launch) {
        let (Launch::Candle { weight, .. }, Some((_, ptrs, ints))) = (launch, launch.candle())
        else {
            unreachable!("ours are launched")
        };
        let args: Vec<String> = (ptrs.iter().map(u64::to_string))
            .chain(ints.iter().map(i32::to_string))
            .collect();
        let name = candle_launcher(weight.dtype);
        self.lines += &format!("call {name} {} 0\n", args.join(" "));
    }

    /// `kernel` over `config`'s grid with `args` (buffers by name, `null`, numbers).
    fn launch(&mut self, kernel: &str, config: LaunchConfig, args: &[&dyn Display]) {
        let (g, b) = (config.grid_dim, config.block_dim);
        self.lines += &format!(
            "launch {kernel} {} {} {} {} {}",
            g.0, g.1, g.2, b.0, config.shared_mem_bytes
        );
        for arg in args {
            self.lines += &format!(" {arg}");
        }
        self.lines.push('\n');
    }

    /// The buffer written out once the script has run (`floats` reads it back).
    fn save(&mut self, name: &str) {
        self.save_as(name, name);
    }

    /// The buffer as it is at this point of the script, written out as `file`
    /// (`floats(file)` reads it back).
    fn save_as(&mut self, name: &str, file: &str) {
        self.lines += &format!("save {name} {file}.out\n");
    }

    /// Runs the script with `binary`; then `floats(name)` reads what it saved.
    fn run(&self, binary: &Path) {
        std::fs::write(self.dir.join("script.txt"), &self.lines).unwrap();
        let output = Command::new(binary).arg(self.dir).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        // A kernel reading or writing past a buffer's end stops at its guard page (SIGSEGV).
        let status = output.status;
        assert!(
            status.success(),
            "{} ({status}): {stderr}",
            binary.display()
        );
    }

    /// A saved buffer, as f32.
    fn floats(&self, name: &str) -> Vec<f32> {
        let bytes = std::fs::read(self.dir.join(format!("{name}.out"))).unwrap();
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

/// candle's mat-vec launcher for weights of `dtype` (`cuda::mat_vec`'s, by name).
fn candle_launcher(dtype: GgmlDType) -> String {
    let name =
        type_name(dtype).unwrap_or_else(|| panic!("candle has no mat-vec kernel for {dtype:?}"));
    format!("launch_mmvq_gguf_{name}_f32_plain")
}

/// The f32 launchers of candle's mat-vec source, every weight type's.
fn candle_launchers() -> Vec<String> {
    (MAT_VEC_TYPES.iter())
        .map(|(dtype, ..)| candle_launcher(*dtype))
        .collect()
}

/// candle's mat-vec kernels (`mmvq_gguf.cu` of the candle-kernels the workspace locks, from
/// cargo's registry, where the CUDA build fetched it), for the CPU: its CUDA headers left
/// out (the stand-in has what it takes of them) and its `<<<...>>>` launches rewritten as
/// the stand-in's `emu::Launcher`.
fn candle_mat_vec_source() -> String {
    let lock = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"));
    let (_, after) = lock
        .split_once("name = \"candle-kernels\"\nversion = \"")
        .expect("candle-kernels in Cargo.lock");
    let version = after.split('"').next().unwrap();
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cargo"));
    let registry = home.join("registry/src");
    let path = std::fs::read_dir(&registry)
        .unwrap_or_else(|e| panic!("{}: {e}", registry.display()))
        .map(|index| index.unwrap().path())
        .map(|index| index.join(format!("candle-kernels-{version}/src/mmvq_gguf.cu")))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("no candle-kernels-{version} in {}", registry.display()));
    let text = std::fs::read_to_string(&path).unwrap();
    let text: String = (text.lines())
        .filter(|line| !line.starts_with("#include \"cuda_"))
        .map(|line| format!("{line}\n"))
        .collect();
    rewrite_launches(&text)
}

/// `kernel<<<config>>>(` as `emu::Launcher{config}.run(kernel, ` (a kernel's name may be
/// pasted together in a macro: `##`).
fn rewrite_launches(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("<<<") {
        let before = &rest[..at];
        let name_at = before
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '#'))
            .map_or(0, |i| i + 1);
        let (config, after) = rest[at + 3..].split_once(">>>(").expect("a launch");
        out += &before[..name_at];
        out += &format!("emu::Launcher{{{config}}}.run({}, ", &before[name_at..]);
        rest = after;
    }
    out + rest
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// An argument as the driver reads it: an address as a number.
impl Display for Arg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Arg::Ptr(v) => write!(f, "{v}"),
            Arg::I32(v) => write!(f, "{v}"),
            Arg::F32(v) => write!(f, "{v}"),
            Arg::F64(v) => write!(f, "{v}"),
        }
    }
}
