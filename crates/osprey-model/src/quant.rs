//! MLX affine quantisation, exactly as `mlx/ops.cpp` computes it (model-spec §5.5).

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

    #[test]
    fn eight_bit_bytes_in_order() {
        let words = [0x0403_0201u32];
        let mut out = [0.0f32; 4];
        dequantize_words(8, &words, |_| 2.0, |_| -1.0, 4, &mut out);
        assert_eq!(out, [1.0, 3.0, 5.0, 7.0]);
    }
}
