//! Matrix products against stored weights: `y[t, r] = Σ_c W[r, c] · x[t, c]`.
//!
//! Quantised rows are dequantised once into an f32 buffer (inside the thread, never to memory
//! beyond one row) and reused for every token of the batch, so prefill reads each weight once.
//! Rows are split across threads; inner loops use independent accumulators so they vectorise.

use osprey_model::tensor::{Linear, MatrixData};
use rayon::prelude::*;

/// Rows handled by one task: enough work to amortise scheduling, small enough to balance.
fn block_rows(rows: usize, cols: usize, tokens: usize) -> usize {
    let per_row = cols * tokens.max(1);
    (65_536 / per_row.max(1))
        .clamp(1, 256)
        .min(rows.div_ceil(rayon::current_num_threads()).max(1))
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 16];
    let chunks = a.len() / 16;
    for i in 0..chunks {
        let (x, y) = (&a[i * 16..i * 16 + 16], &b[i * 16..i * 16 + 16]);
        for k in 0..16 {
            acc[k] = x[k].mul_add(y[k], acc[k]);
        }
    }
    let mut s = 0.0;
    for k in (chunks * 16)..a.len() {
        s += a[k] * b[k];
    }
    s + acc.iter().sum::<f32>()
}

/// Up to this many tokens, quantised rows are dotted straight from their codes (decode);
/// above it, each row is dequantised once and reused for every token (prefill).
const DIRECT_MAX_TOKENS: usize = 4;

/// `s · Σ q·x + b · Σ x` per group, straight from the packed codes of one row.
#[inline]
fn dot_codes(
    bits: u32,
    words: &[u32],
    x: &[f32],
    x_group_sums: &[f32],
    group: usize,
    scale_bias: impl Fn(usize) -> (f32, f32),
) -> f32 {
    let per_word = (32 / bits) as usize;
    let words_per_group = group / per_word;
    let mut total = 0.0f32;
    for (g, ws) in words.chunks_exact(words_per_group).enumerate() {
        let xs = &x[g * group..(g + 1) * group];
        let mut acc = [0.0f32; 8];
        if bits == 4 {
            for (w, x8) in ws.iter().zip(xs.chunks_exact(8)) {
                for n in 0..8 {
                    acc[n] = (((w >> (4 * n)) & 0xF) as f32).mul_add(x8[n], acc[n]);
                }
            }
        } else {
            for (w2, x8) in ws.chunks_exact(2).zip(xs.chunks_exact(8)) {
                for n in 0..8 {
                    acc[n] = (((w2[n / 4] >> (8 * (n % 4))) & 0xFF) as f32).mul_add(x8[n], acc[n]);
                }
            }
        }
        let (s, b) = scale_bias(g);
        total += s * acc.iter().sum::<f32>() + b * x_group_sums[g];
    }
    total
}

/// `x`: `[tokens, cols]`, returns `[tokens, rows]`.
pub fn matmul(lin: &Linear, x: &[f32], tokens: usize) -> Vec<f32> {
    let (rows, cols) = (lin.rows, lin.cols());
    assert_eq!(x.len(), tokens * cols, "matmul input shape");
    let mut by_row = vec![0.0f32; rows * tokens];
    let block = block_rows(rows, cols, tokens);
    match &lin.matrix.data {
        MatrixData::Quantized {
            bits,
            group,
            codes,
            scales,
            biases,
        } if tokens <= DIRECT_MAX_TOKENS => {
            let (bits, group) = (*bits, *group);
            let groups = cols / group;
            let sums: Vec<f32> = x.chunks_exact(group).map(|c| c.iter().sum()).collect();
            let wpr = lin.matrix.words_per_row();
            let codes = codes.as_slice();
            by_row
                .par_chunks_mut(block * tokens)
                .enumerate()
                .for_each(|(bi, out)| {
                    for (i, o) in out.chunks_mut(tokens).enumerate() {
                        let r = lin.row0 + bi * block + i;
                        let words = &codes[r * wpr..(r + 1) * wpr];
                        let sb =
                            |g: usize| (scales.get(r * groups + g), biases.get(r * groups + g));
                        for (t, y) in o.iter_mut().enumerate() {
                            let xt = &x[t * cols..(t + 1) * cols];
                            *y = dot_codes(
                                bits,
                                words,
                                xt,
                                &sums[t * groups..(t + 1) * groups],
                                group,
                                sb,
                            );
                        }
                    }
                });
        }
        _ => {
            by_row
                .par_chunks_mut(block * tokens)
                .enumerate()
                .for_each(|(bi, out)| {
                    let mut w = vec![0.0f32; cols];
                    for (i, o) in out.chunks_mut(tokens).enumerate() {
                        lin.dequantize_row(bi * block + i, &mut w);
                        for (t, y) in o.iter_mut().enumerate() {
                            *y = dot(&w, &x[t * cols..(t + 1) * cols]);
                        }
                    }
                });
        }
    }
    if tokens == 1 {
        return by_row;
    }
    let mut out = vec![0.0f32; rows * tokens];
    for r in 0..rows {
        for t in 0..tokens {
            out[t * rows + r] = by_row[r * tokens + t];
        }
    }
    out
}

/// One row of `lin` as f32 (embedding lookup).
pub fn row(lin: &Linear, r: usize) -> Vec<f32> {
    let mut v = vec![0.0; lin.cols()];
    lin.dequantize_row(r, &mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use osprey_model::tensor::{Buf, FloatBuf, Matrix};
    use std::sync::Arc;

    fn reference(lin: &Linear, x: &[f32], t: usize) -> Vec<f32> {
        let mut out = vec![0.0; t * lin.rows];
        let mut w = vec![0.0; lin.cols()];
        for r in 0..lin.rows {
            lin.dequantize_row(r, &mut w);
            for tt in 0..t {
                out[tt * lin.rows + r] = w
                    .iter()
                    .zip(&x[tt * lin.cols()..])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    fn quantized(bits: u32, group: usize, rows: usize, cols: usize) -> Linear {
        let words = rows * cols * bits as usize / 32;
        let codes: Vec<u32> = (0..words as u32)
            .map(|i| i.wrapping_mul(2654435761))
            .collect();
        let ng = rows * cols / group;
        let s: Vec<f32> = (0..ng).map(|i| 0.01 + (i % 7) as f32 * 0.003).collect();
        let b: Vec<f32> = (0..ng).map(|i| -0.05 + (i % 5) as f32 * 0.01).collect();
        let m = Matrix {
            rows,
            cols,
            data: MatrixData::Quantized {
                bits,
                group,
                codes: Buf::owned(codes),
                scales: FloatBuf::F32(Buf::owned(s)),
                biases: FloatBuf::F32(Buf::owned(b)),
            },
        };
        Linear {
            matrix: Arc::new(m),
            row0: 0,
            rows,
        }
    }

    #[test]
    fn quantised_matmul_matches_row_dequantisation() {
        for (bits, group) in [(4, 64), (8, 32), (4, 128), (8, 64)] {
            let full = quantized(bits, group, 96, 256);
            // a window of rows, as for one expert in a stack
            let lin = Linear::rows_of(&full.matrix, 32, 40);
            for t in [1, 3, 7] {
                let x: Vec<f32> = (0..t * 256)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
                    .collect();
                let got = matmul(&lin, &x, t);
                let want = reference(&lin, &x, t);
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{bits}-bit g{group}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn dense_bf16_matmul() {
        let vals: Vec<f32> = (0..64 * 48)
            .map(|i| ((i % 17) as f32 - 8.0) / 16.0)
            .collect();
        let bits: Vec<u16> = vals
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let m = Matrix {
            rows: 64,
            cols: 48,
            data: MatrixData::Dense(FloatBuf::Bf16(Buf::owned(bits))),
        };
        let lin = Linear {
            matrix: Arc::new(m),
            row0: 0,
            rows: 64,
        };
        let x: Vec<f32> = (0..2 * 48).map(|i| (i as f32).sin()).collect();
        let got = matmul(&lin, &x, 2);
        let want = reference(&lin, &x, 2);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()));
        }
    }
}
