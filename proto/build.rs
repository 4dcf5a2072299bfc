//! Compiles `duet/v1/*.proto` with a vendored protoc, so no system protoc is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .codec_path("crate::bounded::BoundedCodec")
        .file_descriptor_set_path(out.join("duet_descriptor.bin"))
        .compile_protos(
            &["duet/v1/generation.proto", "duet/v1/worker.proto"],
            &["."],
        )?;
    Ok(())
}
