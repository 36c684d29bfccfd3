//! The CPU backend: the exact f32 reference and the engine's fallback.

pub mod forward;
pub mod gdn;
pub mod linear;
pub mod numerics;
pub mod ops;
