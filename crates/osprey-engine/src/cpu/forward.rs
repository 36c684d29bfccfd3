//! The Qwen3.5/3.6-MoE forward pass on the CPU, written to read like model-spec.md §3:
//! embedding → 40 × (pre-norm mixer [Gated DeltaNet or gated attention] + pre-norm sparse MoE)
//! → final norm → lm_head. Everything is f32; weights stay quantised and are dequantised one row
//! at a time inside the matrix products. This is the exact reference every GPU path is checked
//! against.

use anyhow::{bail, Result};
use osprey_model::config::ModelConfig;
use osprey_model::weights::{
    AttentionWeights, GdnProjections, GdnWeights, Mixer, ModelWeights, Moe,
};
use rayon::prelude::*;

use super::gdn::{self, HeadInputs};
use super::linear::{dot, matmul, row};
use super::ops::{l2_normalize, rms_norm, rms_normed, sigmoid, silu, softmax, softplus, Rope};
use crate::kv_cache::{round_through_int8, KvCache};
use crate::session::{LayerCache, SessionState};

/// Which form of the gated delta rule a multi-token call uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnForm {
    /// Chunked for more than one token, recurrent for one (what transformers does).
    Auto,
    Recurrent,
    Chunked,
}

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    None,
    Last,
    All,
}

/// The MTP layer's own KV cache: one (hidden state, next token) pair a position.
#[derive(Clone, Debug, Default)]
pub struct MtpCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub position: usize,
}

pub struct CpuModel {
    pub weights: ModelWeights,
    rope: Rope,
    /// Round activations to bf16 after every matrix product, norm and residual add, as a bf16
    /// engine would; used to measure how much bf16 arithmetic moves a model's outputs.
    pub bf16_activations: bool,
    /// How the attention layers keep K/V (int8: rows rounded through the int8 format).
    pub kv_cache: KvCache,
}

impl CpuModel {
    pub fn new(weights: ModelWeights) -> Self {
        let c = &weights.config;
        let rope = Rope::new(c.rotary_dim, c.rope_theta);
        CpuModel {
            weights,
            rope,
            bf16_activations: false,
            kv_cache: KvCache::Bf16,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Runs `tokens` through the model at the session's position, extending its state.
    /// Returns logits `[positions, vocab]` for the requested positions.
    pub fn forward(
        &self,
        state: &mut SessionState,
        tokens: &[u32],
        gdn_form: GdnForm,
        want: LogitsFor,
    ) -> Result<Vec<f32>> {
        self.forward_traced(state, tokens, gdn_form, want, None)
    }

    /// [`forward`](Self::forward) that also records the residual stream `[T, hidden]` after the
    /// embedding and after every layer.
    pub fn forward_traced(
        &self,
        state: &mut SessionState,
        tokens: &[u32],
        gdn_form: GdnForm,
        want: LogitsFor,
        trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let x = self.residual(state, tokens, gdn_form, trace)?;
        let rows = self.wanted(&x, want);
        Ok(self.lm_head(&self.norm(rows, &self.weights.final_norm)))
    }

    /// Runs `tokens` as [`forward`](Self::forward) does and returns every position's
    /// final-normed hidden state `[T, hidden]` (the lm_head's input, and the MTP head's) with
    /// the logits of the positions `want` names.
    pub fn forward_hidden(
        &self,
        state: &mut SessionState,
        tokens: &[u32],
        gdn_form: GdnForm,
        want: LogitsFor,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let x = self.residual(state, tokens, gdn_form, None)?;
        let normed = self.norm(&x, &self.weights.final_norm);
        Ok((self.lm_head(self.wanted(&normed, want)), normed))
    }

    /// The rows of `[T, hidden]` that `want` names.
    fn wanted<'a>(&self, rows: &'a [f32], want: LogitsFor) -> &'a [f32] {
        match want {
            LogitsFor::None => &[],
            LogitsFor::Last => &rows[rows.len() - self.config().hidden_size..],
            LogitsFor::All => rows,
        }
    }

    /// `lm_head` over final-normed rows (none: no logits).
    fn lm_head(&self, normed: &[f32]) -> Vec<f32> {
        let n = normed.len() / self.config().hidden_size;
        if n == 0 {
            return Vec::new();
        }
        self.mm(&self.weights.lm_head, normed, n)
    }

    /// The residual stream `[T, hidden]` after the last layer.
    fn residual(
        &self,
        state: &mut SessionState,
        tokens: &[u32],
        gdn_form: GdnForm,
        mut trace: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>> {
        let t = tokens.len();
        let mut x = self.embed(tokens)?;
        if let Some(tr) = trace.as_deref_mut() {
            tr.push(x.clone());
        }
        let w = &self.weights;
        for (layer, cache) in w.layers.iter().zip(state.layers.iter_mut()) {
            let u = self.norm(&x, &layer.input_norm);
            let mixed = match (&layer.mixer, cache) {
                (Mixer::GatedDeltaNet(g), LayerCache::GatedDeltaNet { conv, recurrent }) => {
                    self.gated_deltanet(g, &u, t, conv, recurrent, gdn_form)
                }
                (Mixer::Attention(a), LayerCache::Attention { k, v }) => {
                    self.attention(a, &u, t, state.position, k, v)
                }
                _ => bail!("session state does not match the model's layer types"),
            };
            add(&mut x, &mixed);
            self.round(&mut x);
            let u = self.norm(&x, &layer.post_attention_norm);
            add(&mut x, &self.moe(&layer.moe, &u, t));
            self.round(&mut x);
            if let Some(tr) = trace.as_deref_mut() {
                tr.push(x.clone());
            }
        }
        state.position += t;
        Ok(x)
    }

    /// x0 = embed_tokens[ids], `[T, hidden]`.
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let c = self.config();
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if let Some(bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                c.vocab_size
            );
        }
        let mut x = Vec::with_capacity(tokens.len() * c.hidden_size);
        for &id in tokens {
            x.extend(row(&self.weights.embed_tokens, id as usize));
        }
        self.round(&mut x);
        Ok(x)
    }

    /// The MTP head (model-spec §7) over pairs: row i takes a final-normed hidden state of the
    /// main model (`hidden`, `[T, hidden]`) and the token that followed it (`next[i]`), at the
    /// draft layer's position `cache.position + i` (advanced by T, every row entering its KV
    /// cache); returns the logits, for the token after `next[i]`, of the rows `want` names.
    pub fn mtp_forward(
        &self,
        cache: &mut MtpCache,
        hidden: &[f32],
        next: &[u32],
        want: LogitsFor,
    ) -> Result<Vec<f32>> {
        let Some(m) = &self.weights.mtp else {
            bail!("the checkpoint has no MTP head (mtp.*)");
        };
        let (t, h) = (next.len(), self.config().hidden_size);
        if hidden.len() != t * h {
            bail!("MTP input: {} hidden rows for {t} tokens", hidden.len() / h);
        }
        let e = self.norm(&self.embed(next)?, &m.norm_embedding);
        let hh = self.norm(hidden, &m.norm_hidden);
        let mut both = Vec::with_capacity(2 * t * h);
        for i in 0..t {
            both.extend_from_slice(&e[i * h..(i + 1) * h]);
            both.extend_from_slice(&hh[i * h..(i + 1) * h]);
        }
        let mut x = self.mm(&m.fc, &both, t);
        let Mixer::Attention(a) = &m.layer.mixer else {
            bail!("the MTP layer must be an attention layer");
        };
        let u = self.norm(&x, &m.layer.input_norm);
        add(
            &mut x,
            &self.attention(a, &u, t, cache.position, &mut cache.k, &mut cache.v),
        );
        self.round(&mut x);
        let u = self.norm(&x, &m.layer.post_attention_norm);
        add(&mut x, &self.moe(&m.layer.moe, &u, t));
        self.round(&mut x);
        cache.position += t;
        Ok(self.lm_head(&self.norm(self.wanted(&x, want), &m.norm)))
    }

    fn round(&self, x: &mut [f32]) {
        if self.bf16_activations {
            x.iter_mut()
                .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        }
    }

    fn mm(&self, lin: &osprey_model::tensor::Linear, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = matmul(lin, x, t);
        self.round(&mut y);
        y
    }

    fn norm(&self, x: &[f32], scale: &[f32]) -> Vec<f32> {
        let mut y = rms_normed(x, scale, self.config().rms_norm_eps);
        self.round(&mut y);
        y
    }

    /// `down(silu(gate(x)) · up(x))` for `n` rows.
    fn swiglu(&self, e: &osprey_model::weights::Expert, x: &[f32], n: usize) -> Vec<f32> {
        let gate = self.mm(&e.gate, x, n);
        let up = self.mm(&e.up, x, n);
        let mut act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        self.round(&mut act);
        self.mm(&e.down, &act, n)
    }

    /// Gated DeltaNet mixer (model-spec §3.3).
    fn gated_deltanet(
        &self,
        g: &GdnWeights,
        u: &[f32],
        t: usize,
        conv_state: &mut [f32],
        rec: &mut [f32],
        form: GdnForm,
    ) -> Vec<f32> {
        let c = self.config();
        let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd, cd) = (c.linear_key_dim(), c.linear_value_dim(), c.conv_dim());

        let (mut qkv, z, b, a) = match &g.projections {
            GdnProjections::Split { qkv, z, b, a } => (
                self.mm(qkv, u, t),
                self.mm(z, u, t),
                self.mm(b, u, t),
                self.mm(a, u, t),
            ),
            GdnProjections::Fused { qkvz, ba } => {
                split_fused(c, &self.mm(qkvz, u, t), &self.mm(ba, u, t), t)
            }
        };

        // causal depthwise conv over q|k|v with the cached K−1 previous inputs, then SiLU
        let k_taps = c.conv_kernel;
        let mut history = conv_state.to_vec();
        history.extend_from_slice(&qkv);
        for tt in 0..t {
            for ch in 0..cd {
                let mut s = 0.0;
                for j in 0..k_taps {
                    s += g.conv[ch * k_taps + j] * history[(tt + j) * cd + ch];
                }
                qkv[tt * cd + ch] = silu(s);
            }
        }
        conv_state.copy_from_slice(&history[t * cd..]);

        // per value head j (key head j / (hv/hk)): l2-normalised q (scaled), k; β; g
        let rep = hv / hk;
        let scale = 1.0 / (dk as f32).sqrt();
        let heads: Vec<Vec<f32>> = rec
            .par_chunks_mut(dk * dv)
            .enumerate()
            .map(|(head, state)| {
                let kh = head / rep;
                let (mut q, mut k, mut v) = (
                    Vec::with_capacity(t * dk),
                    Vec::with_capacity(t * dk),
                    Vec::with_capacity(t * dv),
                );
                let (mut gs, mut betas) = (Vec::with_capacity(t), Vec::with_capacity(t));
                for tt in 0..t {
                    let r = &qkv[tt * cd..(tt + 1) * cd];
                    let mut qh = r[kh * dk..(kh + 1) * dk].to_vec();
                    let mut kh_ = r[kd + kh * dk..kd + (kh + 1) * dk].to_vec();
                    l2_normalize(&mut qh, 1e-6);
                    l2_normalize(&mut kh_, 1e-6);
                    q.extend(qh.iter().map(|x| x * scale));
                    k.extend(kh_);
                    v.extend_from_slice(&r[2 * kd + head * dv..2 * kd + (head + 1) * dv]);
                    betas.push(sigmoid(b[tt * hv + head]));
                    gs.push(-g.a_log[head].exp() * softplus(a[tt * hv + head] + g.dt_bias[head]));
                }
                let x = HeadInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    g: &gs,
                    beta: &betas,
                    dk,
                    dv,
                };
                let mut out = vec![0.0; t * dv];
                let chunked = match form {
                    GdnForm::Auto => t > 1,
                    GdnForm::Chunked => true,
                    GdnForm::Recurrent => false,
                };
                if chunked {
                    gdn::chunked(&x, state, &mut out);
                } else {
                    gdn::recurrent(&x, state, &mut out);
                }
                out
            })
            .collect();

        // gated RMSNorm per head: w · norm(o) · silu(z)
        let mut y = vec![0.0f32; t * vd];
        for (head, o) in heads.iter().enumerate() {
            for tt in 0..t {
                let dst = &mut y[tt * vd + head * dv..tt * vd + (head + 1) * dv];
                dst.copy_from_slice(&o[tt * dv..(tt + 1) * dv]);
                rms_norm(dst, &g.norm, c.rms_norm_eps);
                for (yv, zv) in dst.iter_mut().zip(&z[tt * vd + head * dv..]) {
                    *yv *= silu(*zv);
                }
            }
        }
        self.round(&mut y);
        self.mm(&g.out_proj, &y, t)
    }

    /// Gated full attention (model-spec §3.5), appending this call's K/V to the cache.
    fn attention(
        &self,
        a: &AttentionWeights,
        u: &[f32],
        t: usize,
        past: usize,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
    ) -> Vec<f32> {
        let c = self.config();
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let qg = self.mm(&a.q_proj, u, t);
        let mut k = self.mm(&a.k_proj, u, t);
        let mut v = self.mm(&a.v_proj, u, t);

        let mut q = vec![0.0f32; t * hq * d];
        let mut gate = vec![0.0f32; t * hq * d];
        for tt in 0..t {
            for head in 0..hq {
                let src = &qg[(tt * hq + head) * 2 * d..];
                let qh = &mut q[(tt * hq + head) * d..(tt * hq + head + 1) * d];
                qh.copy_from_slice(&src[..d]);
                rms_norm(qh, &a.q_norm, c.rms_norm_eps);
                self.rope.apply(qh, past + tt);
                gate[(tt * hq + head) * d..(tt * hq + head + 1) * d]
                    .copy_from_slice(&src[d..2 * d]);
            }
            for head in 0..hkv {
                let kh = &mut k[(tt * hkv + head) * d..(tt * hkv + head + 1) * d];
                rms_norm(kh, &a.k_norm, c.rms_norm_eps);
                self.rope.apply(kh, past + tt);
            }
        }
        if self.kv_cache == KvCache::Int8 {
            k.chunks_mut(d).for_each(round_through_int8);
            v.chunks_mut(d).for_each(round_through_int8);
        }
        k_cache.extend_from_slice(&k);
        v_cache.extend_from_slice(&v);

        // softmax(q kᵀ / √d + causal mask) v, query head h reading kv head h / (hq/hkv)
        let group = hq / hkv;
        let scale = 1.0 / (d as f32).sqrt();
        let mut o = vec![0.0f32; t * hq * d];
        o.par_chunks_mut(d).enumerate().for_each(|(idx, out)| {
            let (tt, head) = (idx / hq, idx % hq);
            let kvh = head / group;
            let qh = &q[idx * d..(idx + 1) * d];
            let visible = past + tt + 1;
            let mut scores: Vec<f32> = (0..visible)
                .map(|p| dot(qh, &k_cache[(p * hkv + kvh) * d..(p * hkv + kvh + 1) * d]) * scale)
                .collect();
            softmax(&mut scores);
            for (p, s) in scores.iter().enumerate() {
                for (ov, vv) in out
                    .iter_mut()
                    .zip(&v_cache[(p * hkv + kvh) * d..(p * hkv + kvh + 1) * d])
                {
                    *ov += s * vv;
                }
            }
            let gt = &gate[idx * d..(idx + 1) * d];
            for (ov, gv) in out.iter_mut().zip(gt) {
                *ov *= sigmoid(*gv);
            }
        });
        self.round(&mut o);
        self.mm(&a.o_proj, &o, t)
    }

    /// Sparse MoE block with shared expert (model-spec §3.6).
    fn moe(&self, m: &Moe, u: &[f32], t: usize) -> Vec<f32> {
        let c = self.config();
        let (h, e, top) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let logits = self.mm(&m.router, u, t);

        // softmax → top-k → renormalise; rows grouped by expert
        let mut assigned: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for tt in 0..t {
            let mut p = logits[tt * e..(tt + 1) * e].to_vec();
            softmax(&mut p);
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&i, &j| p[j].total_cmp(&p[i]).then(i.cmp(&j)));
            let chosen = &idx[..top];
            let norm: f32 = if c.norm_topk_prob {
                chosen.iter().map(|&i| p[i]).sum()
            } else {
                1.0
            };
            for &i in chosen {
                assigned[i].push((tt, p[i] / norm));
            }
        }

        let mut y = vec![0.0f32; t * h];
        for (expert, rows) in m.experts.iter().zip(&assigned) {
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let xe: Vec<f32> = rows
                .iter()
                .flat_map(|&(tt, _)| u[tt * h..(tt + 1) * h].iter().copied())
                .collect();
            let out = self.swiglu(expert, &xe, n);
            for (r, &(tt, wgt)) in rows.iter().enumerate() {
                for (yv, ov) in y[tt * h..(tt + 1) * h]
                    .iter_mut()
                    .zip(&out[r * h..(r + 1) * h])
                {
                    *yv += wgt * ov;
                }
            }
        }

        let shared = self.swiglu(&m.shared, u, t);
        let gate = self.mm(&m.shared_gate, u, t);
        for tt in 0..t {
            let s = sigmoid(gate[tt]);
            for (yv, sv) in y[tt * h..(tt + 1) * h]
                .iter_mut()
                .zip(&shared[tt * h..(tt + 1) * h])
            {
                *yv += s * sv;
            }
        }
        y
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// Qwen3-Next's fused projections to the split q|k|v, z, b, a layout (model-spec §4): per key
/// head g, `qkvz` holds `[q_g | k_g | v (r heads) | z (r heads)]` and `ba` holds `[b (r) | a (r)]`.
fn split_fused(
    c: &ModelConfig,
    qkvz: &[f32],
    ba: &[f32],
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    let r = hv / hk;
    let per = 2 * dk + 2 * r * dv;
    let (kd, vd) = (c.linear_key_dim(), c.linear_value_dim());
    let (mut qkv, mut z) = (vec![0.0; t * c.conv_dim()], vec![0.0; t * vd]);
    let (mut b, mut a) = (vec![0.0; t * hv], vec![0.0; t * hv]);
    for tt in 0..t {
        let dst = &mut qkv[tt * c.conv_dim()..(tt + 1) * c.conv_dim()];
        for g in 0..hk {
            let src = &qkvz[tt * hk * per + g * per..][..per];
            dst[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
            dst[kd + g * dk..kd + (g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
            dst[2 * kd + g * r * dv..2 * kd + (g + 1) * r * dv]
                .copy_from_slice(&src[2 * dk..2 * dk + r * dv]);
            z[tt * vd + g * r * dv..tt * vd + (g + 1) * r * dv]
                .copy_from_slice(&src[2 * dk + r * dv..]);
            let bsrc = &ba[tt * hk * 2 * r + g * 2 * r..][..2 * r];
            b[tt * hv + g * r..tt * hv + (g + 1) * r].copy_from_slice(&bsrc[..r]);
            a[tt * hv + g * r..tt * hv + (g + 1) * r].copy_from_slice(&bsrc[r..]);
        }
    }
    (qkv, z, b, a)
}
