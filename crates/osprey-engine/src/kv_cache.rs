//! How the attention layers keep their keys and values between steps.

use std::fmt;
use std::str::FromStr;

/// Storage of the attention layers' K/V cache (`--kv-cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCache {
    /// The values as computed: bf16 on the GPU, f32 on the CPU backend.
    #[default]
    Bf16,
    /// One signed byte per value and one f32 scale per row (a position of one KV head), the
    /// largest magnitude of the row mapping to 127: half the bytes a decode step reads at long
    /// context, at most half a step (amax/254) off each value.
    Int8,
}

impl FromStr for KvCache {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(KvCache::Bf16),
            "int8" => Ok(KvCache::Int8),
            other => Err(format!(
                "unknown KV cache format {other:?}: expected bf16 or int8"
            )),
        }
    }
}

impl fmt::Display for KvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvCache::Bf16 => "bf16",
            KvCache::Int8 => "int8",
        })
    }
}

/// A row's int8 codes and scale, as the CUDA kernels store them (common.cuh `store_int8_row`):
/// q = round_ties_even(x · 127/amax), scale = amax/127; a zero row has codes 0 and scale 0.
pub fn quantize_int8_row(row: &[f32]) -> (Vec<i8>, f32) {
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let codes = row
        .iter()
        .map(|v| (v * inv).round_ties_even() as i8)
        .collect();
    (codes, amax / 127.0)
}

/// Replaces a row by what an int8 cache gives back for it (codes times scale).
pub fn round_through_int8(row: &mut [f32]) {
    let (codes, scale) = quantize_int8_row(row);
    for (v, q) in row.iter_mut().zip(codes) {
        *v = q as f32 * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_comes_back_within_half_a_step() {
        let row: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (codes, scale) = quantize_int8_row(&row);
        assert_eq!(scale, amax / 127.0);
        assert!(codes.iter().any(|&q| q.unsigned_abs() == 127));
        let mut back = row.clone();
        round_through_int8(&mut back);
        for (a, b) in row.iter().zip(&back) {
            assert!((a - b).abs() <= scale * 0.5 * (1.0 + 1e-5), "{a} -> {b}");
        }
        assert_ne!(row, back);
    }

    #[test]
    fn a_zero_row_stays_zero() {
        let (codes, scale) = quantize_int8_row(&[0.0; 8]);
        assert_eq!((codes, scale), (vec![0i8; 8], 0.0));
    }

    #[test]
    fn formats_parse_and_print() {
        for kv in [KvCache::Bf16, KvCache::Int8] {
            assert_eq!(kv.to_string().parse::<KvCache>(), Ok(kv));
        }
        let err = "fp8".parse::<KvCache>().unwrap_err();
        assert!(err.contains("fp8") && err.contains("int8"), "{err}");
    }
}
