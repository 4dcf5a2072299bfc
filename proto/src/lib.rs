//! duet's gRPC API: the public `Generation` service and the internal worker protocol
//! (`proto/duet/v1/*.proto`, whose comments are the reference).

/// Package `duet.v1`.
pub mod v1 {
    #![allow(missing_debug_implementations, clippy::large_enum_variant)]
    tonic::include_proto!("duet.v1");
}

/// Encoded `FileDescriptorSet` of `duet.v1`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("duet_descriptor");
