//! Device selection by name ("cpu", "cuda", "cuda:N"). A GPU that was asked for but is not
//! there is an error, never a silent fall back to CPU.

use crate::error::{EngineError, Result};
use candle_core::Device;

/// Opens the device called `name`: `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn select_device(name: &str) -> Result<Device> {
    let fail = |reason: String| EngineError::Device(name.to_string(), reason);
    match name.split_once(':').unwrap_or((name, "0")) {
        ("cpu", "0") => Ok(Device::Cpu),
        ("cuda", ordinal) => {
            let ordinal: usize = ordinal
                .parse()
                .map_err(|_| fail(format!("`{ordinal}` is not a GPU number")))?;
            open_cuda(ordinal).map_err(fail)
        }
        _ => Err(fail("expected `cpu`, `cuda` or `cuda:N`".to_string())),
    }
}

/// The kind of `device` without its number: `cpu`, `cuda` or `metal`.
pub fn device_kind(device: &Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> std::result::Result<Device, String> {
    Device::new_cuda(ordinal).map_err(|e| {
        let e = e.to_string();
        format!(
            "no usable CUDA GPU {ordinal} ({}): is the NVIDIA driver installed and the GPU \
             visible here (`nvidia-smi`; in Kubernetes, a `nvidia.com/gpu` limit)?",
            e.trim_end()
        )
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> std::result::Result<Device, String> {
    Err("this build has no CUDA support (build with `--features cuda`)".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(select_device("cpu").unwrap().is_cpu());
        assert_eq!(device_kind(&select_device("cpu").unwrap()), "cpu");
        assert!(select_device("tpu").is_err());
        assert!(select_device("cuda:x").is_err());
        #[cfg(not(feature = "cuda"))]
        {
            let err = select_device("cuda:1").unwrap_err().to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
}
