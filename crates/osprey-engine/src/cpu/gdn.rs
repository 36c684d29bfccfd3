//! The gated delta rule (model-spec §3.4) for one value head, in f32, in both forms:
//! recurrent (one token at a time, used for decode) and chunked (64-token chunks, used for
//! prefill). Both carry the state `S[Dk][Dv]` (HF layout: key index major).

/// One head's inputs for `T` tokens: `q`, `k` are `[T, Dk]` (already l2-normalised, q scaled),
/// `v` is `[T, Dv]`, `g` the log-decay and `beta` the write strength per token.
pub struct HeadInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub dk: usize,
    pub dv: usize,
}

/// Token-by-token recurrence. Writes `[T, Dv]` outputs and updates `state`.
pub fn recurrent(x: &HeadInputs, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (x.dk, x.dv);
    let mut mem = vec![0.0f32; dv];
    for t in 0..x.g.len() {
        let (q, k, v) = (
            &x.q[t * dk..][..dk],
            &x.k[t * dk..][..dk],
            &x.v[t * dv..][..dv],
        );
        let decay = x.g[t].exp();
        state.iter_mut().for_each(|s| *s *= decay);
        mem.iter_mut().for_each(|m| *m = 0.0);
        for (i, ki) in k.iter().enumerate() {
            for (m, s) in mem.iter_mut().zip(&state[i * dv..][..dv]) {
                *m += s * ki;
            }
        }
        for (m, vj) in mem.iter_mut().zip(v) {
            *m = x.beta[t] * (vj - *m);
        }
        for (i, ki) in k.iter().enumerate() {
            for (s, d) in state[i * dv..][..dv].iter_mut().zip(&mem) {
                *s += ki * d;
            }
        }
        let o = &mut out[t * dv..][..dv];
        o.iter_mut().for_each(|v| *v = 0.0);
        for (i, qi) in q.iter().enumerate() {
            for (ov, s) in o.iter_mut().zip(&state[i * dv..][..dv]) {
                *ov += s * qi;
            }
        }
    }
}

pub const CHUNK: usize = 64;

/// Chunked form (chunk 64, as transformers' `torch_chunk_gated_delta_rule`): within a chunk the
/// recurrence becomes a unit-lower-triangular solve plus matrix products; the state is carried
/// between chunks. Equal to [`recurrent`] in exact arithmetic.
pub fn chunked(x: &HeadInputs, state: &mut [f32], out: &mut [f32]) {
    let (dk, dv) = (x.dk, x.dv);
    let total = x.g.len();
    let mut start = 0;
    while start < total {
        let n = CHUNK.min(total - start);
        let q = &x.q[start * dk..(start + n) * dk];
        let k = &x.k[start * dk..(start + n) * dk];
        let v = &x.v[start * dv..(start + n) * dv];
        let beta = &x.beta[start..start + n];
        // cumulative log-decay inside the chunk
        let gc: Vec<f32> = x.g[start..start + n]
            .iter()
            .scan(0.0f32, |acc, g| {
                *acc += g;
                Some(*acc)
            })
            .collect();
        let kk = |a: usize, b: usize| -> f32 {
            k[a * dk..][..dk]
                .iter()
                .zip(&k[b * dk..][..dk])
                .map(|(x, y)| x * y)
                .sum()
        };
        // (I + A) U = β V and (I + A) W = β e^G K by forward substitution,
        // A[t][s] = β_t (k_t·k_s) e^{G_t − G_s} for s < t.
        let mut u = vec![0.0f32; n * dv];
        let mut w = vec![0.0f32; n * dk];
        for t in 0..n {
            let eg = gc[t].exp();
            for j in 0..dv {
                u[t * dv + j] = beta[t] * v[t * dv + j];
            }
            for i in 0..dk {
                w[t * dk + i] = beta[t] * eg * k[t * dk + i];
            }
            for s in 0..t {
                let a = beta[t] * kk(t, s) * (gc[t] - gc[s]).exp();
                let (us, ws) = (u[s * dv..][..dv].to_vec(), w[s * dk..][..dk].to_vec());
                for (ut, us) in u[t * dv..][..dv].iter_mut().zip(&us) {
                    *ut -= a * us;
                }
                for (wt, ws) in w[t * dk..][..dk].iter_mut().zip(&ws) {
                    *wt -= a * ws;
                }
            }
        }
        // V' = U − W S
        let mut vp = u;
        for t in 0..n {
            for i in 0..dk {
                let wti = w[t * dk + i];
                for (vpj, s) in vp[t * dv..][..dv].iter_mut().zip(&state[i * dv..][..dv]) {
                    *vpj -= wti * s;
                }
            }
        }
        // O = (e^G ⊙ Q) S + ((Q Kᵀ) ⊙ Γ) V', Γ[t][s] = e^{G_t − G_s} for s ≤ t
        for t in 0..n {
            let o = &mut out[(start + t) * dv..][..dv];
            o.iter_mut().for_each(|v| *v = 0.0);
            let eg = gc[t].exp();
            for i in 0..dk {
                let qi = q[t * dk + i] * eg;
                for (ov, s) in o.iter_mut().zip(&state[i * dv..][..dv]) {
                    *ov += qi * s;
                }
            }
            for s in 0..=t {
                let qk: f32 = q[t * dk..][..dk]
                    .iter()
                    .zip(&k[s * dk..][..dk])
                    .map(|(a, b)| a * b)
                    .sum();
                let c = qk * (gc[t] - gc[s]).exp();
                for (ov, vs) in o.iter_mut().zip(&vp[s * dv..][..dv]) {
                    *ov += c * vs;
                }
            }
        }
        // S = e^{G_last} S + (e^{G_last − G} ⊙ K)ᵀ V'
        let last = gc[n - 1];
        let el = last.exp();
        state.iter_mut().for_each(|s| *s *= el);
        for t in 0..n {
            let c = (last - gc[t]).exp();
            for i in 0..dk {
                let kc = k[t * dk + i] * c;
                for (s, vpj) in state[i * dv..][..dv].iter_mut().zip(&vp[t * dv..][..dv]) {
                    *s += kc * vpj;
                }
            }
        }
        start += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// q, k, v, g, beta of a deterministic test sequence.
    type Sequence = [Vec<f32>; 5];

    fn inputs(t: usize, dk: usize, dv: usize) -> Sequence {
        let f = |i: usize, m: f32| (i as f32 * 0.7123).sin() * m;
        let mut q: Vec<f32> = (0..t * dk).map(|i| f(i, 1.0)).collect();
        let mut k: Vec<f32> = (0..t * dk).map(|i| f(i + 991, 1.0)).collect();
        for x in q.chunks_mut(dk).chain(k.chunks_mut(dk)) {
            crate::cpu::ops::l2_normalize(x, 1e-6);
        }
        let v = (0..t * dv).map(|i| f(i + 17, 2.0)).collect();
        let g = (0..t).map(|i| -0.05 - 0.4 * f(i + 5, 1.0).abs()).collect();
        let beta = (0..t)
            .map(|i| crate::cpu::ops::sigmoid(f(i + 3, 2.0)))
            .collect();
        [q, k, v, g, beta]
    }

    #[test]
    fn chunked_equals_recurrent_across_chunks_and_with_initial_state() {
        let (dk, dv) = (16, 24);
        for t in [1usize, 5, 64, 100, 130] {
            let [q, k, v, g, beta] = inputs(t, dk, dv);
            let x = HeadInputs {
                q: &q,
                k: &k,
                v: &v,
                g: &g,
                beta: &beta,
                dk,
                dv,
            };
            let init: Vec<f32> = (0..dk * dv)
                .map(|i| (i as f32 * 0.37).cos() * 0.3)
                .collect();
            let (mut s1, mut s2) = (init.clone(), init);
            let (mut o1, mut o2) = (vec![0.0; t * dv], vec![0.0; t * dv]);
            recurrent(&x, &mut s1, &mut o1);
            chunked(&x, &mut s2, &mut o2);
            let err = o1
                .iter()
                .zip(&o2)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let serr = s1
                .iter()
                .zip(&s2)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                err < 1e-4 && serr < 1e-4,
                "T={t}: output err {err}, state err {serr}"
            );
        }
    }

    #[test]
    fn single_token_matches_closed_form() {
        // S = e^g S0 + k ⊗ β(v − (e^g S0)ᵀ k); o = Sᵀ q, with S0 = 0: o = β (q·k) v
        let (dk, dv) = (4, 3);
        let q = [0.5, 0.5, 0.5, 0.5];
        let k = [1.0, 0.0, 0.0, 0.0];
        let v = [1.0, 2.0, 3.0];
        let x = HeadInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &[-0.3],
            beta: &[0.25],
            dk,
            dv,
        };
        let mut s = vec![0.0; 12];
        let mut o = vec![0.0; 3];
        recurrent(&x, &mut s, &mut o);
        for j in 0..3 {
            assert!((o[j] - 0.25 * 0.5 * v[j]).abs() < 1e-6);
        }
    }
}
