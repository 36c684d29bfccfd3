//! The model as data: its configuration, the checkpoint files that hold its weights, and the
//! in-memory weight layout every backend reads.
//!
//! Two checkpoint layouts are accepted (model-spec.md §2 and §5) and normalised into one
//! [`weights::ModelWeights`]: MLX affine-quantised safetensors (4/8 bit, codes stay packed) and the
//! original Hugging Face layout (bf16/f16/f32, fused experts). Big tensors stay in the memory map.

pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod quant;
pub mod shards;
pub mod synth;
pub mod tensor;
pub mod weights;

pub use config::{ModelConfig, QuantSpec};
pub use weights::ModelWeights;
