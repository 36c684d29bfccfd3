//! Teacher-forced fidelity, as Lily measured itself: two sets of logits for the same token
//! sequence (each position predicting the next token from the same reference prefix) compared by
//! perplexity, top-1 agreement and logit error.

use anyhow::{bail, Result};

use crate::sampler::argmax;

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Fidelity {
    /// Positions scored (each predicts the following token).
    pub positions: usize,
    pub perplexity: f64,
    pub reference_perplexity: f64,
    /// (perplexity / reference − 1) × 100.
    pub perplexity_difference_percent: f64,
    /// Fraction of positions where both pick the same top token.
    pub top1_agreement: f64,
    pub max_abs_logit_error: f32,
    pub mean_abs_logit_error: f64,
}

/// −log softmax(row)[target], computed stably in f64.
fn nll(row: &[f32], target: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    lse - row[target] as f64
}

/// Compares `logits` with `reference` (both `[T, vocab]`) over `tokens` (length T): position t is
/// scored on `tokens[t + 1]`. Only the first `valid_vocab` columns count (the rest is padding).
pub fn compare(
    tokens: &[u32],
    logits: &[f32],
    reference: &[f32],
    vocab: usize,
    valid_vocab: usize,
) -> Result<Fidelity> {
    let t = tokens.len();
    if t < 2 {
        bail!("fidelity needs at least 2 tokens");
    }
    if logits.len() != t * vocab || reference.len() != t * vocab {
        bail!(
            "logits must be [{t}, {vocab}]: got {} and {} values",
            logits.len(),
            reference.len()
        );
    }
    let valid = valid_vocab.min(vocab);
    let (mut nll_ours, mut nll_ref, mut agree, mut max_err, mut sum_err) =
        (0f64, 0f64, 0usize, 0f32, 0f64);
    for p in 0..t - 1 {
        let ours = &logits[p * vocab..p * vocab + valid];
        let theirs = &reference[p * vocab..p * vocab + valid];
        let target = tokens[p + 1] as usize;
        if target >= valid {
            bail!(
                "token {target} at position {} is outside the vocabulary",
                p + 1
            );
        }
        nll_ours += nll(ours, target);
        nll_ref += nll(theirs, target);
        agree += usize::from(argmax(ours) == argmax(theirs));
        for (a, b) in ours.iter().zip(theirs) {
            let e = (a - b).abs();
            max_err = max_err.max(e);
            sum_err += e as f64;
        }
    }
    let n = (t - 1) as f64;
    let (ppl, ref_ppl) = ((nll_ours / n).exp(), (nll_ref / n).exp());
    Ok(Fidelity {
        positions: t - 1,
        perplexity: ppl,
        reference_perplexity: ref_ppl,
        perplexity_difference_percent: (ppl / ref_ppl - 1.0) * 100.0,
        top1_agreement: agree as f64 / n,
        max_abs_logit_error: max_err,
        mean_abs_logit_error: sum_err / (n * valid as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_logits_agree_exactly() {
        let tokens = [0u32, 1, 2];
        let logits = vec![1.0, 2.0, 0.5, 0.3, 0.1, 3.0, 0.0, 0.0, 0.0];
        let f = compare(&tokens, &logits, &logits, 3, 3).unwrap();
        assert_eq!(f.positions, 2);
        assert_eq!(f.top1_agreement, 1.0);
        assert_eq!(f.max_abs_logit_error, 0.0);
        assert!(f.perplexity_difference_percent.abs() < 1e-12);
        // position 0 predicts token 1 with p = e^2 / (e^1 + e^2 + e^0.5)
        let p0 = (2f64).exp() / (1f64.exp() + 2f64.exp() + 0.5f64.exp());
        let p1 = (3f64).exp() / (0.3f64.exp() + 0.1f64.exp() + 3f64.exp());
        assert!((f.perplexity - (-(p0.ln() + p1.ln()) / 2.0).exp()).abs() < 1e-9);
    }

    #[test]
    fn disagreement_and_errors_are_counted() {
        let tokens = [0u32, 0, 0];
        let a = vec![1.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        let b = vec![0.0, 1.0, 1.0, 0.0, 0.0, 0.0];
        let f = compare(&tokens, &a, &b, 2, 2).unwrap();
        assert_eq!(f.top1_agreement, 0.5);
        assert_eq!(f.max_abs_logit_error, 1.0);
        assert!(f.perplexity < f.reference_perplexity);
    }

    #[test]
    fn shape_errors_are_reported() {
        assert!(compare(&[1, 2], &[0.0; 3], &[0.0; 4], 2, 2).is_err());
        assert!(compare(&[1], &[0.0; 2], &[0.0; 2], 2, 2).is_err());
    }
}
