//! Token choice: greedy or sampled with temperature, top-k, top-p, min-p and presence /
//! frequency / repetition penalties; seeded, so the same seed gives the same output.

use std::collections::HashMap;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// OpenAI semantics: subtracted once from a token that has appeared in the output.
    pub presence_penalty: f32,
    /// OpenAI semantics: subtracted per occurrence in the output.
    pub frequency_penalty: f32,
    /// transformers semantics over prompt and output: logits divided (if > 0) or multiplied by it.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether the penalties change any logit (presence, frequency or repetition).
    pub fn penalises(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Rejects values outside their meaningful ranges, naming the field.
    pub fn validate(&self) -> Result<()> {
        let p = self;
        if !(p.temperature.is_finite() && p.temperature >= 0.0) {
            bail!(
                "temperature must be a finite number >= 0, got {}",
                p.temperature
            );
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", p.top_p);
        }
        if !(0.0..=1.0).contains(&p.min_p) {
            bail!("min_p must be in [0, 1], got {}", p.min_p);
        }
        if !(p.presence_penalty.is_finite() && (-2.0..=2.0).contains(&p.presence_penalty)) {
            bail!(
                "presence_penalty must be in [-2, 2], got {}",
                p.presence_penalty
            );
        }
        if !(p.frequency_penalty.is_finite() && (-2.0..=2.0).contains(&p.frequency_penalty)) {
            bail!(
                "frequency_penalty must be in [-2, 2], got {}",
                p.frequency_penalty
            );
        }
        if !(p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0) {
            bail!(
                "repetition_penalty must be > 0, got {}",
                p.repetition_penalty
            );
        }
        Ok(())
    }
}

/// What prompt log-probabilities take of one position's logits (over the ids a reply may hold):
/// the log of the softmax's normaliser, the logit of the token that follows the position (none
/// after the last; -inf for an id past the valid ones) and the `top` largest finite logits, best
/// first (of equal ones the lower id first, as `top_k_indices` orders them).
#[derive(Clone, Debug, PartialEq)]
pub struct PositionLogprobs {
    pub log_normaliser: f32,
    pub next: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

impl PositionLogprobs {
    /// Summarises `logits` (cut to the valid ids) on the host.
    pub fn of(logits: &[f32], next: Option<u32>, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // summed in f64: 248K f32 terms added in turn drift by ~1e-4 of the sum
        let sum: f64 = logits.iter().map(|x| f64::from((x - max).exp())).sum();
        PositionLogprobs {
            log_normaliser: max + sum.ln() as f32,
            next: next.map(|t| logits.get(t as usize).copied().unwrap_or(f32::NEG_INFINITY)),
            top: top_k_indices(logits, top)
                .into_iter()
                .map(|i| (i, logits[i as usize]))
                .collect(),
        }
    }

    /// How far `other` (the same position summarised elsewhere, e.g. on a device) is from this
    /// one: the largest difference of the log normaliser, the next token's logit and the top
    /// logits rank by rank (infinite where one has a value the other lacks, or for a NaN), and
    /// whether a top id differs other than at a near-tie (a neighbouring rank within `tie`).
    pub fn difference(&self, other: &Self, tie: f32) -> (f32, bool) {
        let gap = |a: f32, b: f32| match (a == b, (a - b).abs()) {
            (true, _) => 0.0,
            (false, d) if d.is_nan() => f32::INFINITY,
            (false, d) => d,
        };
        let mut worst = gap(self.log_normaliser, other.log_normaliser);
        worst = worst.max(match (self.next, other.next) {
            (Some(a), Some(b)) => gap(a, b),
            (None, None) => 0.0,
            _ => f32::INFINITY,
        });
        if self.top.len() != other.top.len() {
            worst = f32::INFINITY;
        }
        let near_tie = |r: usize| {
            let v = self.top[r].1;
            [r.wrapping_sub(1), r + 1]
                .iter()
                .filter_map(|&n| self.top.get(n))
                .any(|&(_, w)| (v - w).abs() <= tie)
        };
        let mut ids_differ = false;
        for (r, (&(i, v), &(j, w))) in self.top.iter().zip(&other.top).enumerate() {
            worst = worst.max(gap(v, w));
            ids_differ |= i != j && !near_tie(r);
        }
        (worst, ids_differ)
    }
}

/// Largest k that `top_k_indices` serves; a larger top-k takes a partial selection.
const TOP_K_BY_PASS: usize = 64;

/// The indices of the `k` largest finite values of `v`, largest first (of equal values the
/// lower index first), in one pass: a sorted list that most values fail to enter. Over the
/// vocabulary this takes ~0.15 ms where a partial selection of its indices took ~0.55 (top-k
/// sampling on the host, a position's top log-probabilities).
pub fn top_k_indices(v: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &x) in v.iter().enumerate() {
        if !x.is_finite() || (best.len() == k && x <= best[k - 1].0) {
            continue;
        }
        let at = best.partition_point(|&(y, _)| y >= x);
        best.insert(at, (x, i as u32));
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

/// Index of the largest value (the first one on ties), the greedy choice.
pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| {
            if x > best.1 {
                (i, x)
            } else {
                best
            }
        })
        .0
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Tokens of prompt and output (repetition penalty).
    seen: HashMap<u32, u32>,
    /// Tokens of the output only (presence / frequency penalties).
    output: HashMap<u32, u32>,
    /// Ids at or above this are padding rows of the vocabulary and never chosen.
    valid_vocab: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams, valid_vocab: usize, prompt: &[u32]) -> Self {
        let mut seen = HashMap::new();
        for &t in prompt {
            *seen.entry(t).or_insert(0) += 1;
        }
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            seen,
            output: HashMap::new(),
            valid_vocab,
        }
    }

    /// Records a generated token (for the penalties).
    pub fn observe(&mut self, token: u32) {
        *self.seen.entry(token).or_insert(0) += 1;
        *self.output.entry(token).or_insert(0) += 1;
    }

    /// Logits after the penalties and the vocabulary mask.
    pub fn adjusted(&self, logits: &[f32]) -> Vec<f32> {
        let p = &self.params;
        let mut l: Vec<f32> = logits[..self.valid_vocab.min(logits.len())].to_vec();
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                if let Some(x) = l.get_mut(t as usize) {
                    *x = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.output {
                if let Some(x) = l.get_mut(t as usize) {
                    *x -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        l
    }

    /// The distribution the next token is drawn from: candidates (best first) and their
    /// probabilities after temperature, top-k, top-p and min-p (summing to 1); a single
    /// candidate with probability 1 when the choice is greedy.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        let l = self.adjusted(logits);
        let greedy = || vec![(argmax(&l) as u32, 1.0)];
        if p.temperature == 0.0 || p.top_k == 1 {
            return greedy();
        }
        // candidates sorted by logit (ties: the lower id first), cut by top-k
        let idx = if (1..=TOP_K_BY_PASS).contains(&p.top_k) {
            top_k_indices(&l, p.top_k)
        } else {
            let mut idx: Vec<u32> = (0..l.len() as u32)
                .filter(|&i| l[i as usize].is_finite())
                .collect();
            let by_logit =
                |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b));
            // top-k first (a partial selection), so only k candidates are sorted
            if p.top_k > 0 && idx.len() > p.top_k {
                idx.select_nth_unstable_by(p.top_k - 1, by_logit);
                idx.truncate(p.top_k);
            }
            idx.sort_unstable_by(by_logit);
            idx
        };
        if idx.is_empty() {
            return greedy();
        }
        let max = l[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((l[i as usize] - max) / p.temperature).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        // top-p: smallest prefix whose mass reaches top_p
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, &x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        // min-p: drop tokens below min_p × the top probability
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        idx.into_iter()
            .zip(probs)
            .map(|(i, x)| (i, x / total))
            .collect()
    }

    /// Chooses the next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let dist = self.distribution(logits);
        if dist.len() == 1 {
            return dist[0].0;
        }
        let mut r = self.rng.random::<f32>();
        for &(i, x) in &dist {
            if r < x {
                return i;
            }
            r -= x;
        }
        dist[dist.len() - 1].0
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Prompt and output counts of each token seen so far (repetition penalty), and output
    /// counts (presence and frequency penalties).
    pub fn counts(&self) -> (&HashMap<u32, u32>, &HashMap<u32, u32>) {
        (&self.seen, &self.output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 0.5, -1.0, 2.9, 0.0, 10.0]
    }

    #[test]
    fn a_position_summary_is_the_log_softmax_and_its_top() {
        let l = logits();
        let p = PositionLogprobs::of(&l, Some(2), 3);
        let lse = l.iter().map(|x| x.exp()).sum::<f32>().ln();
        assert!((p.log_normaliser - lse).abs() < 1e-5);
        assert_eq!(p.next, Some(2.0));
        assert_eq!(p.top, vec![(7, 10.0), (1, 3.0), (5, 2.9)]);
        assert_eq!(PositionLogprobs::of(&l, None, 0).next, None);
        // an id past the valid ones has no probability
        assert_eq!(
            PositionLogprobs::of(&l, Some(99), 0).next,
            Some(f32::NEG_INFINITY)
        );

        // differences: none against itself; a shifted logit, a NaN, a missing next, a swapped id
        assert_eq!(p.difference(&p, 1e-3), (0.0, false));
        let mut q = p.clone();
        q.top[2].1 += 0.5;
        assert_eq!(p.difference(&q, 1e-3).0, 0.5);
        q = p.clone();
        q.log_normaliser = f32::NAN;
        assert_eq!(p.difference(&q, 1e-3).0, f32::INFINITY);
        q = p.clone();
        q.next = None;
        assert_eq!(p.difference(&q, 1e-3).0, f32::INFINITY);
        q = p.clone();
        q.top[1].0 = 4;
        assert_eq!(p.difference(&q, 1e-3), (0.0, true));
        // at a near-tie the order of two ids may differ
        let tied = PositionLogprobs::of(&[1.0, 2.0, 2.0005], None, 3);
        let mut swapped = tied.clone();
        swapped.top.swap(0, 1);
        assert!(!tied.difference(&swapped, 1e-3).1);
        assert!(tied.difference(&swapped, 1e-4).1);
    }

    #[test]
    fn greedy_takes_argmax_within_valid_vocab() {
        let mut s = Sampler::new(SamplingParams::default(), 7, &[]);
        assert_eq!(s.sample(&logits()), 1, "id 7 is padding and must be masked");
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let p = SamplingParams {
            temperature: 1.5,
            seed: 42,
            ..Default::default()
        };
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 7, &[]);
            (0..64).map(|_| s.sample(&logits())).collect::<Vec<_>>()
        };
        assert_eq!(run(&p), run(&p));
        assert_ne!(
            run(&p),
            run(&SamplingParams {
                seed: 43,
                ..p.clone()
            })
        );
    }

    #[test]
    fn distribution_applies_top_k_top_p_and_min_p_in_order() {
        // valid logits (id 7 is padding) 3 (id 1), 2.9 (5), 2 (2), 1 (0), 0.5, 0, -1: at
        // temperature 1 their probabilities are .391 .354 .144 .053 ..., so top-p 0.9 keeps
        // the first four (cumulative .889 < .9 after three)
        let dist = |p: SamplingParams| Sampler::new(p, 7, &[]).distribution(&logits());
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        };
        let d = dist(p);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 5, 2, 0]);
        assert!((d[0].1 - 0.391 / 0.942).abs() < 2e-3, "{d:?}");
        // hotter: the candidates come best first, cut at k, and sum to one
        let hot = SamplingParams {
            temperature: 4.0,
            top_k: 3,
            ..Default::default()
        };
        let d = dist(hot.clone());
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 5, 2]);
        assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(d[0].1 > d[1].1 && d[1].1 > d[2].1);
        // min-p drops candidates below min_p x the top probability (renormalised after)
        let floor = d[2].1 / d[0].1;
        let d2 = dist(SamplingParams {
            min_p: floor * 1.01,
            ..hot
        });
        assert_eq!(d2.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 5]);
        assert!((d2.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        // greedy is one candidate with all the mass
        assert_eq!(dist(SamplingParams::default()), vec![(1, 1.0)]);
    }

    #[test]
    fn top_k_by_one_pass_is_the_sorted_selection() {
        let mut v: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 613) as f32 * 0.01)
            .collect();
        v[17] = f32::NEG_INFINITY;
        v[4000] = f32::NAN;
        v[123] = 99.0;
        for k in [1, 3, 20, 64] {
            let mut idx: Vec<u32> = (0..v.len() as u32)
                .filter(|&i| v[i as usize].is_finite())
                .collect();
            idx.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b)));
            idx.truncate(k);
            assert_eq!(top_k_indices(&v, k), idx, "k = {k}");
        }
        assert_eq!(top_k_indices(&[f32::NEG_INFINITY, 1.0], 5), vec![1]);
        assert!(top_k_indices(&v, 0).is_empty());
    }

    #[test]
    fn top_k_limits_choices() {
        let p = SamplingParams {
            temperature: 5.0,
            top_k: 2,
            seed: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p, 7, &[]);
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits()), 1 | 5));
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                top_p: 0.5,
                seed: 3,
                ..Default::default()
            },
            7,
            &[],
        );
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits()), 1 | 5));
        }
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                min_p: 0.5,
                seed: 3,
                ..Default::default()
            },
            7,
            &[],
        );
        for _ in 0..200 {
            // p(2)/p(1) = e^-1 < 0.5, p(5)/p(1) = e^-0.1 >= 0.5
            assert!(matches!(s.sample(&logits()), 1 | 5));
        }
    }

    #[test]
    fn penalties_change_the_choice() {
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 0.5,
                ..Default::default()
            },
            7,
            &[],
        );
        s.observe(1);
        assert_eq!(s.sample(&logits()), 5);
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 0.06,
                ..Default::default()
            },
            7,
            &[],
        );
        s.observe(1);
        assert_eq!(
            s.sample(&logits()),
            1,
            "one occurrence at 0.06 keeps 3.0 - 0.06 > 2.9"
        );
        s.observe(1);
        assert_eq!(s.sample(&logits()), 5);
        let s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            7,
            &[1, 4],
        );
        let l = s.adjusted(&logits());
        assert_eq!((l[1], l[4]), (1.5, -2.0));
    }

    #[test]
    fn invalid_params_are_named() {
        let e = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("top_p"));
        let e = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("temperature"));
    }
}
