//! Elementwise and normalisation operations of the model (model-spec §3.2–§3.5), in f32.

/// RMSNorm with an effective scale (`1 + w` already applied for zero-centred norms):
/// `x · rsqrt(mean(x²) + eps) · scale`, for every `scale.len()`-wide row of `x`.
pub fn rms_norm(x: &mut [f32], scale: &[f32], eps: f32) {
    for row in x.chunks_mut(scale.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, s) in row.iter_mut().zip(scale) {
            *v = *v * inv * s;
        }
    }
}

/// `rms_norm` into a new buffer.
pub fn rms_normed(x: &[f32], scale: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm(&mut y, scale, eps);
    y
}

/// `x · rsqrt(Σx² + eps)` (eps inside the sum, as the GDN kernels do).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    x.iter_mut().for_each(|v| *v /= sum);
}

/// Rotary embedding tables for partial RoPE, rotate-half style (model-spec §3.5): pairs (f, f+half)
/// of the first `rotary_dim` dims of a head turn by `pos · θ^(-2f/rotary_dim)`.
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(rotary_dim: usize, theta: f64) -> Self {
        // as transformers: 1 / θ^(arange(0, dim, 2) / dim) in float32
        let inv_freq = (0..rotary_dim / 2)
            .map(|f| {
                let e = (2 * f) as f32 / rotary_dim as f32;
                1.0 / (theta as f32).powf(e)
            })
            .collect();
        Rope { inv_freq }
    }

    /// Rotates the first `rotary_dim` dims of `head` in place for position `pos`.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (f, inv) in self.inv_freq.iter().enumerate() {
            let angle = pos as f32 * inv;
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[f], head[f + half]);
            head[f] = a * cos - b * sin;
            head[f + half] = b * cos + a * sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rms() {
        let mut x = vec![3.0, -4.0, 0.0, 5.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_is_a_rotation_and_identity_at_zero() {
        let r = Rope::new(8, 1e7);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut h = orig.clone();
        r.apply(&mut h, 0);
        assert_eq!(h, orig);
        r.apply(&mut h, 37);
        let n0: f32 = orig[..8].iter().map(|v| v * v).sum();
        let n1: f32 = h[..8].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        assert_eq!(&h[8..], &orig[8..], "dims past rotary_dim untouched");
        // pair (0, 4) turns by 37 rad at inv_freq 1
        let (s, c) = 37f32.sin_cos();
        assert!((h[0] - (orig[0] * c - orig[4] * s)).abs() < 1e-5);
    }

    #[test]
    fn softplus_matches_definition() {
        for x in [-5.0f32, 0.0, 3.0, 25.0] {
            let want = if x > 20.0 { x } else { (1.0 + x.exp()).ln() };
            assert!((softplus(x) - want).abs() < 1e-5);
        }
    }
}
