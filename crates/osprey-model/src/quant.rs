//! MLX affine quantisation, exactly as `mlx/ops.cpp` computes it (model-spec §5.5).

use half::bf16;

/// Quantises one row MLX's way (`mlx/ops.cpp` affine_quantize, model-spec §5.5): per group of
/// `group` elements, in f32, the larger-magnitude edge becomes the bias and is exactly
/// representable, 0.0 too where possible before the scale is rounded (the scale is negative when
/// the maximum is the larger edge); codes from the f32 scale and bias, which are then rounded to bf16. Writes
/// `row.len() * bits / 32` packed words (element 8m + n of a 4-bit row in word m, bits 4n..),
/// and a scale and a bias per group. The same bytes as `mlx_lm convert` (checked in CI).
pub fn quantize_row(
    row: &[f32],
    bits: u32,
    group: usize,
    words: &mut [u32],
    scales: &mut [bf16],
    biases: &mut [bf16],
) {
    let levels = ((1u32 << bits) - 1) as f32;
    let per_word = (32 / bits) as usize;
    for ((x, ws), (s_out, b_out)) in row
        .chunks(group)
        .zip(words.chunks_mut(group / per_word))
        .zip(scales.iter_mut().zip(biases.iter_mut()))
    {
        let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
        for &v in x {
            w_min = w_min.min(v);
            w_max = w_max.max(v);
        }
        let mut s = ((w_max - w_min) / levels).max(1e-7);
        let (s_signed, edge) = if w_min.abs() > w_max.abs() {
            (s, w_min)
        } else {
            (-s, w_max)
        };
        s = s_signed;
        let q0 = (edge / s).round_ties_even();
        let b = if q0 != 0.0 {
            s = edge / q0;
            edge
        } else {
            0.0
        };
        for (w, xs) in ws.iter_mut().zip(x.chunks(per_word)) {
            *w = xs.iter().enumerate().fold(0u32, |acc, (n, &v)| {
                let q = ((v - b) / s).round_ties_even().clamp(0.0, levels) as u32;
                acc | q << (bits as usize * n)
            });
        }
        *s_out = bf16::from_f32(s);
        *b_out = bf16::from_f32(b);
    }
}

/// Unpacks `words` (one row, or a slice of one) and writes `scale(g) * q + bias(g)` per element;
/// the inner loops are specialised for 4 and 8 bits so they vectorise (the CPU backend's hot path).
pub fn dequantize_words(
    bits: u32,
    words: &[u32],
    scale: impl Fn(usize) -> f32,
    bias: impl Fn(usize) -> f32,
    group: usize,
    out: &mut [f32],
) {
    let per_word = (32 / bits) as usize;
    let words_per_group = group / per_word;
    for (g, (ws, o)) in words
        .chunks(words_per_group)
        .zip(out.chunks_mut(group))
        .enumerate()
    {
        let (s, b) = (scale(g), bias(g));
        if bits == 4 {
            for (w, o8) in ws.iter().zip(o.chunks_exact_mut(8)) {
                for (n, v) in o8.iter_mut().enumerate() {
                    *v = s * ((w >> (4 * n)) & 0xF) as f32 + b;
                }
            }
        } else {
            for (w, o4) in ws.iter().zip(o.chunks_exact_mut(4)) {
                for (n, v) in o4.iter_mut().enumerate() {
                    *v = s * ((w >> (8 * n)) & 0xFF) as f32 + b;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_order_is_little_endian_low_bits_first() {
        // element 8m+n lives in word m, bits [4n, 4n+4)
        let words = [0x7654_3210u32, 0xFEDC_BA98];
        let mut out = [0.0f32; 16];
        dequantize_words(4, &words, |_| 1.0, |_| 0.0, 16, &mut out);
        let expect: Vec<f32> = (0..16).map(|i| i as f32).collect();
        assert_eq!(out.to_vec(), expect);
    }

    /// Quantises and dequantises one row; returns the codes' words and the values back.
    fn round_trip(row: &[f32], bits: u32, group: usize) -> (Vec<u32>, Vec<f32>, Vec<bf16>) {
        let groups = row.len() / group;
        let mut words = vec![0u32; row.len() * bits as usize / 32];
        let (mut s, mut b) = (vec![bf16::ZERO; groups], vec![bf16::ZERO; groups]);
        quantize_row(row, bits, group, &mut words, &mut s, &mut b);
        let mut back = vec![0.0; row.len()];
        dequantize_words(
            bits,
            &words,
            |g| s[g].to_f32(),
            |g| b[g].to_f32(),
            group,
            &mut back,
        );
        (words, back, s)
    }

    #[test]
    fn quantised_rows_come_back_within_half_a_step() {
        let mut x = 0x1234_5678u32;
        let row: Vec<f32> = (0..256)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 8) as f32 / (1u32 << 24) as f32 - 0.4
            })
            .collect();
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                let (_, back, s) = round_trip(&row, bits, group);
                for (g, (a, b)) in row.chunks(group).zip(back.chunks(group)).enumerate() {
                    let step = s[g].to_f32().abs();
                    for (u, v) in a.iter().zip(b) {
                        // half a step, plus the scale's bf16 rounding over up to 2^bits steps
                        let tol = 0.5 * step + (1u32 << bits) as f32 * step / 256.0;
                        assert!(
                            (u - v).abs() <= tol,
                            "{bits}-bit g{group}: {u} -> {v} (step {step})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_larger_edge_and_zero_are_exact() {
        // max is the larger edge: negative scale, bias = max, code 0 = max
        let mut row = vec![0.0f32; 64];
        row[0] = 1.0;
        row[1] = -0.5;
        let (words, back, s) = round_trip(&row, 4, 64);
        assert!(s[0].to_f32() < 0.0);
        assert_eq!(words[0] & 0xF, 0, "the maximum is code 0");
        assert_eq!(back[0], 1.0);
        // zero is a code's value exactly in f32; only the scale's bf16 rounding moves it
        let step = s[0].to_f32().abs();
        assert!(
            back[2..].iter().all(|&v| v.abs() <= 16.0 * step / 256.0),
            "{back:?}"
        );
        // min is the larger edge: positive scale, bias = min
        let neg: Vec<f32> = row.iter().map(|v| -v).collect();
        let (_, back, s) = round_trip(&neg, 4, 64);
        assert!(s[0].to_f32() > 0.0);
        assert_eq!(back[0], -1.0);
        // a constant group: scale floored at 1e-7, every value back
        let (_, back, _) = round_trip(&[0.25f32; 64], 8, 64);
        assert!(back.iter().all(|&v| (v - 0.25).abs() < 1e-6), "{back:?}");
        // all zeros: bias 0
        let (words, back, _) = round_trip(&[0.0f32; 64], 4, 64);
        assert!(words.iter().all(|&w| w == 0) && back.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn eight_bit_bytes_in_order() {
        let words = [0x0403_0201u32];
        let mut out = [0.0f32; 4];
        dequantize_words(8, &words, |_| 2.0, |_| -1.0, 4, &mut out);
        assert_eq!(out, [1.0, 3.0, 5.0, 7.0]);
    }
}
