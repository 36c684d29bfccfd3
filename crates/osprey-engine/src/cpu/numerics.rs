//! How far bf16 arithmetic moves a model: the same tokens through the f32 reference and through
//! a run that rounds activations to bf16 at every matrix product, norm and residual add. On a
//! well-conditioned model the gap stays at the size of one rounding and grows slowly with depth;
//! on a chaotic one it compounds layer after layer, and GPU-vs-CPU checks become meaningless.

use anyhow::Result;

use super::forward::{CpuModel, GdnForm, LogitsFor};
use crate::sampler::argmax;
use crate::session::SessionState;

#[derive(Clone, Debug, serde::Serialize)]
pub struct Divergence {
    /// ‖x_bf16 − x_f32‖ / ‖x_f32‖ of the residual stream after the embedding and each layer.
    pub per_layer: Vec<f32>,
    /// RMS of the residual stream (f32 run) at the same points.
    pub residual_rms: Vec<f32>,
    /// ‖logits_bf16 − logits_f32‖ / ‖logits_f32‖ over all positions.
    pub logits_relative_rms: f32,
    /// The same for each position's logits (a discrete flip, such as a different expert chosen
    /// at a near-tie of the router, shows as one position far above the others).
    pub per_position: Vec<f32>,
    /// Standard deviation of the f32 logits (non-degenerate outputs have it well above 0).
    pub logits_std: f32,
    /// Fraction of positions where both runs pick the same top token.
    pub top1_agreement: f32,
}

fn relative(a: &[f32], b: &[f32]) -> f32 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt() as f32
}

pub fn bf16_divergence(model: &mut CpuModel, tokens: &[u32]) -> Result<Divergence> {
    let run = |m: &CpuModel| -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let mut trace = Vec::new();
        let mut state = SessionState::new(m.config());
        let logits = m.forward_traced(
            &mut state,
            tokens,
            GdnForm::Auto,
            LogitsFor::All,
            Some(&mut trace),
        )?;
        Ok((logits, trace))
    };
    model.bf16_activations = false;
    let (l32, t32) = run(model)?;
    model.bf16_activations = true;
    let bf16 = run(model);
    model.bf16_activations = false;
    let (l16, t16) = bf16?;
    let vocab = model.config().vocab_size;
    let rows = tokens.len();
    let agree = (0..rows)
        .filter(|&r| {
            argmax(&l32[r * vocab..(r + 1) * vocab]) == argmax(&l16[r * vocab..(r + 1) * vocab])
        })
        .count();
    let mean = l32.iter().map(|&x| x as f64).sum::<f64>() / l32.len() as f64;
    let var = l32.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / l32.len() as f64;
    Ok(Divergence {
        per_layer: t16.iter().zip(&t32).map(|(a, b)| relative(a, b)).collect(),
        residual_rms: t32
            .iter()
            .map(|x| (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt())
            .collect(),
        logits_relative_rms: relative(&l16, &l32),
        per_position: l16
            .chunks_exact(vocab)
            .zip(l32.chunks_exact(vocab))
            .map(|(a, b)| relative(a, b))
            .collect(),
        logits_std: var.sqrt() as f32,
        top1_agreement: agree as f32 / rows as f32,
    })
}
