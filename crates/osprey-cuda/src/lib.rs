//! The CUDA backend for Hopper (sm_90a): weights uploaded once as stored (4-bit codes, bf16
//! scales and biases; never a dequantised copy), and a decode step of a handful of fused kernels
//! per layer, captured once as a CUDA graph and replayed per token with the next token chosen on
//! the GPU. One `.cu` file per kernel family in `kernels/`, each with its shapes, launch geometry
//! and ceiling in a header comment.

mod args;
mod backend;
mod decoder;
mod snapshots;
pub mod timeline;

pub use backend::{CudaBackend, DEFAULT_CUDA_PREFILL_CHUNK};
pub use decoder::{
    CudaDecoder, Drafts, GdnPrefill, KernelTime, SessionCopy, SpecRun, KERNELS_DIR_ENV,
};

#[cfg(osprey_kernels)]
pub(crate) const CUBINS: &[(&str, &[u8])] = &[
    (
        "gemv",
        include_bytes!(concat!(env!("OUT_DIR"), "/gemv.cubin")),
    ),
    (
        "moe",
        include_bytes!(concat!(env!("OUT_DIR"), "/moe.cubin")),
    ),
    (
        "gdn",
        include_bytes!(concat!(env!("OUT_DIR"), "/gdn.cubin")),
    ),
    (
        "attention",
        include_bytes!(concat!(env!("OUT_DIR"), "/attention.cubin")),
    ),
    (
        "sample",
        include_bytes!(concat!(env!("OUT_DIR"), "/sample.cubin")),
    ),
    (
        "gemm",
        include_bytes!(concat!(env!("OUT_DIR"), "/gemm.cubin")),
    ),
    (
        "route",
        include_bytes!(concat!(env!("OUT_DIR"), "/route.cubin")),
    ),
    (
        "act",
        include_bytes!(concat!(env!("OUT_DIR"), "/act.cubin")),
    ),
    (
        "gdn_prefill",
        include_bytes!(concat!(env!("OUT_DIR"), "/gdn_prefill.cubin")),
    ),
    (
        "attention_prefill",
        include_bytes!(concat!(env!("OUT_DIR"), "/attention_prefill.cubin")),
    ),
    (
        "ceiling",
        include_bytes!(concat!(env!("OUT_DIR"), "/ceiling.cubin")),
    ),
    (
        "speculative",
        include_bytes!(concat!(env!("OUT_DIR"), "/speculative.cubin")),
    ),
];

#[cfg(not(osprey_kernels))]
pub(crate) const CUBINS: &[(&str, &[u8])] = &[];

/// Whether this build embedded compiled kernels (nvcc was found at build time).
pub fn kernels_built() -> bool {
    !CUBINS.is_empty()
}
