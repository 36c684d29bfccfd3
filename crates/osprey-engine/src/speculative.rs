//! Greedy decoding that verifies a drafted token a step, on the CPU: the reference for running
//! more than one token a step. Drafts come from the checkpoint's MTP head (model-spec §7) or
//! from the context by prompt lookup (n-grams).
//!
//! Each step runs the main model over two tokens at once, the token chosen last and the
//! drafter's guess of the one after it. The first row's logits choose the true next token; when it
//! equals the guess, the second row's logits are valid too and choose one more, so the step
//! yields two tokens. When it does not, the second row was computed on a wrong token: the
//! attention caches could drop it, but the Gated DeltaNet state has already absorbed it and cannot
//! be rewound, so the state is restored from a copy taken before the step and the accepted token
//! is run again. The output is the plain greedy sequence: the rows are computed with the
//! recurrent form of the delta rule, which is what one-token steps use, so each row's logits
//! are the ones a one-token step would give.
//!
//! The MTP head runs once a step over the (hidden state, next token) pairs the step accepted, in
//! order, so its own KV cache never holds a rejected position.

use anyhow::{bail, Result};

use crate::cpu::forward::{CpuModel, GdnForm, LogitsFor, MtpCache};
use crate::sampler::argmax;
use crate::session::SessionState;

/// What a speculative run produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpeculativeRun {
    /// The generated tokens, as plain greedy decoding would give them.
    pub tokens: Vec<u32>,
    /// Steps that verified a draft token.
    pub steps: usize,
    /// Drafts the main model agreed with.
    pub accepted: usize,
}

impl SpeculativeRun {
    /// The share of drafts the main model agreed with.
    pub fn acceptance(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.accepted as f64 / self.steps as f64
        }
    }
}

/// Greedy choice over the ids below `valid` of row `i` of `rows`.
fn choose(rows: &[f32], vocab: usize, i: usize, valid: usize) -> u32 {
    argmax(&rows[i * vocab..i * vocab + valid]) as u32
}

/// Proposes the token after next.
pub trait Drafter {
    /// Takes the pairs the main model has accepted since the last call, in order: row i of
    /// `hidden` (`[n, hidden]`) is a position's final-normed hidden state and `followers[i]` the
    /// token chosen after it; returns a guess of the token after the last follower, or none
    /// (the next step then runs one token).
    fn draft(&mut self, hidden: &[f32], followers: &[u32]) -> Result<Option<u32>>;
}

/// Drafts with the checkpoint's MTP head, keeping its KV cache.
pub struct MtpDrafter<'a> {
    model: &'a CpuModel,
    cache: MtpCache,
    valid: usize,
}

impl<'a> MtpDrafter<'a> {
    pub fn new(model: &'a CpuModel, valid: usize) -> Self {
        MtpDrafter {
            model,
            cache: MtpCache::default(),
            valid: valid.min(model.config().vocab_size),
        }
    }
}

impl Drafter for MtpDrafter<'_> {
    fn draft(&mut self, hidden: &[f32], followers: &[u32]) -> Result<Option<u32>> {
        let last = self
            .model
            .mtp_forward(&mut self.cache, hidden, followers, LogitsFor::Last)?;
        let vocab = self.model.config().vocab_size;
        Ok(Some(choose(&last, vocab, 0, self.valid)))
    }
}

/// Drafts by prompt lookup: the token that followed the latest earlier occurrence of the
/// sequence's last `n` tokens (the longest `n` up to `max_n` that occurs), none when no suffix
/// recurs. Costs no model work and needs no extra weights, so it runs on any checkpoint; it
/// pays where a reply copies its context (code edits, quoted tool output, repeated names).
pub struct NgramDrafter {
    tokens: Vec<u32>,
    max_n: usize,
}

impl NgramDrafter {
    /// `first`: the prompt's first token (later tokens arrive as the followers of the first
    /// call).
    pub fn new(first: u32, max_n: usize) -> Self {
        NgramDrafter {
            tokens: vec![first],
            max_n: max_n.max(1),
        }
    }

    fn lookup(&self) -> Option<u32> {
        let t = &self.tokens;
        (1..=self.max_n.min(t.len().saturating_sub(1)))
            .rev()
            .find_map(|n| {
                let suffix = &t[t.len() - n..];
                // latest start before the suffix's own, whose match has a token after it
                (0..t.len() - n)
                    .rev()
                    .find(|&s| &t[s..s + n] == suffix)
                    .map(|s| t[s + n])
            })
    }
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, _hidden: &[f32], followers: &[u32]) -> Result<Option<u32>> {
        self.tokens.extend_from_slice(followers);
        Ok(self.lookup())
    }
}

/// Never drafts: every step runs one token (the baseline a drafter is measured against).
pub struct NoDraft;

impl Drafter for NoDraft {
    fn draft(&mut self, _hidden: &[f32], _followers: &[u32]) -> Result<Option<u32>> {
        Ok(None)
    }
}

/// Drafts a known answer (the greedy tokens of an earlier run): every draft is right, so each
/// step yields two tokens; the best case of the two-row step, for tests and benchmarks.
pub struct KnownAnswer {
    answer: Vec<u32>,
    /// pairs seen so far, counted from the prompt's first (which has none)
    seen: usize,
    prompt: usize,
}

impl KnownAnswer {
    pub fn new(answer: Vec<u32>, prompt_len: usize) -> Self {
        KnownAnswer {
            answer,
            seen: 1,
            prompt: prompt_len,
        }
    }
}

impl Drafter for KnownAnswer {
    fn draft(&mut self, _hidden: &[f32], followers: &[u32]) -> Result<Option<u32>> {
        self.seen += followers.len();
        // `seen - prompt` answer tokens are known to the model: the next is the draft
        Ok(self.answer.get(self.seen - self.prompt).copied())
    }
}

/// Fails, saying where to find one, unless the model has an MTP head.
pub fn require_mtp(model: &CpuModel) -> Result<()> {
    if model.weights.mtp.is_none() {
        bail!("the checkpoint has no MTP head (mtp.*): MLX conversions drop it; the original bf16 checkpoint, or `osprey synth --mtp`, has one");
    }
    Ok(())
}

/// Generates up to `max_tokens` greedy tokens after `prompt` from a fresh state with drafts
/// from the checkpoint's MTP head; each token goes to `on_token` as it is chosen, and the run
/// ends after a token for which it returns false. `valid` bounds the ids chosen (the
/// tokenizer's vocabulary).
pub fn mtp_greedy(
    model: &CpuModel,
    prompt: &[u32],
    max_tokens: usize,
    valid: usize,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<SpeculativeRun> {
    require_mtp(model)?;
    let mut drafter = MtpDrafter::new(model, valid);
    speculative_greedy(model, &mut drafter, prompt, max_tokens, valid, on_token)
}

/// [`mtp_greedy`] with any drafter.
pub fn speculative_greedy(
    model: &CpuModel,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    max_tokens: usize,
    valid: usize,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<SpeculativeRun> {
    let c = model.config();
    let (vocab, h) = (c.vocab_size, c.hidden_size);
    let valid = valid.min(vocab);
    if prompt.is_empty() {
        bail!("speculative decoding needs a prompt of at least one token");
    }
    let mut run = SpeculativeRun {
        tokens: Vec::new(),
        steps: 0,
        accepted: 0,
    };
    if max_tokens == 0 {
        return Ok(run);
    }
    // hands a token on; whether the run goes on after it
    let mut emit = |run: &mut SpeculativeRun, t: u32| {
        run.tokens.push(t);
        on_token(t) && run.tokens.len() < max_tokens
    };
    let mut state = SessionState::new(c);
    let (last, hidden) =
        model.forward_hidden(&mut state, prompt, GdnForm::Auto, LogitsFor::Last)?;
    let mut next = choose(&last, vocab, 0, valid);
    let mut go = emit(&mut run, next);
    let mut draft = None;
    if go {
        // the prompt's pairs: the hidden state at t with the token at t + 1
        let followers: Vec<u32> = prompt[1..].iter().copied().chain([next]).collect();
        draft = drafter.draft(&hidden, &followers)?;
    }
    while go {
        let Some(guess) = draft else {
            // no draft: a plain one-token step
            let (rows, hidden) =
                model.forward_hidden(&mut state, &[next], GdnForm::Recurrent, LogitsFor::All)?;
            next = choose(&rows, vocab, 0, valid);
            go = emit(&mut run, next);
            if go {
                draft = drafter.draft(&hidden, &[next])?;
            }
            continue;
        };
        let before = state.clone();
        let (rows, hidden) = model.forward_hidden(
            &mut state,
            &[next, guess],
            GdnForm::Recurrent,
            LogitsFor::All,
        )?;
        run.steps += 1;
        let first = choose(&rows, vocab, 0, valid);
        let agreed = first == guess;
        run.accepted += usize::from(agreed);
        go = emit(&mut run, first);
        if agreed && go {
            let second = choose(&rows, vocab, 1, valid);
            go = emit(&mut run, second);
            if go {
                draft = drafter.draft(&hidden, &[first, second])?;
            }
            next = second;
        } else if go {
            // the state ran the wrong draft too: back to before the step, then the token
            state = before;
            model.forward(&mut state, &[next], GdnForm::Recurrent, LogitsFor::None)?;
            draft = drafter.draft(&hidden[..h], &[first])?;
            next = first;
        }
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use osprey_model::synth::{write_checkpoint, Preset, SynthOptions};
    use osprey_model::ModelWeights;

    fn tiny_with_mtp(layers: usize) -> (tempfile::TempDir, CpuModel) {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(
            dir.path(),
            &SynthOptions {
                preset: Preset::Tiny,
                layers: Some(layers),
                seed: 5,
                show_progress: false,
                mtp: true,
            },
        )
        .unwrap();
        let model = CpuModel::new(ModelWeights::load(dir.path()).unwrap());
        (dir, model)
    }

    /// One token a step, as the engine's greedy decoding runs.
    fn plain_greedy(model: &CpuModel, prompt: &[u32], n: usize, valid: usize) -> Vec<u32> {
        let vocab = model.config().vocab_size;
        let mut state = SessionState::new(model.config());
        let mut logits = model
            .forward(&mut state, prompt, GdnForm::Auto, LogitsFor::Last)
            .unwrap();
        let mut out = Vec::new();
        while out.len() < n {
            let t = choose(&logits, vocab, 0, valid);
            out.push(t);
            logits = model
                .forward(&mut state, &[t], GdnForm::Auto, LogitsFor::Last)
                .unwrap();
        }
        out
    }

    #[test]
    fn drafts_leave_the_greedy_sequence_unchanged() {
        let (_dir, model) = tiny_with_mtp(4);
        let prompt = [11u32, 4012, 77, 9001, 3, 150_000, 42];
        let valid = model.config().vocab_size;
        let want = plain_greedy(&model, &prompt, 24, valid);
        let mut handed = Vec::new();
        let got = mtp_greedy(&model, &prompt, 24, valid, &mut |t| {
            handed.push(t);
            true
        })
        .unwrap();
        assert_eq!(got.tokens, want);
        assert_eq!(handed, want, "each token handed on once, in order");
        assert!(got.steps > 0 && got.accepted <= got.steps);
    }

    #[test]
    fn drafts_that_are_always_right_yield_two_tokens_a_step() {
        let (_dir, model) = tiny_with_mtp(4);
        let prompt = [5u32, 6, 7];
        let valid = model.config().vocab_size;
        let want = plain_greedy(&model, &prompt, 9, valid);
        let mut oracle = KnownAnswer::new(want.clone(), prompt.len());
        let run =
            speculative_greedy(&model, &mut oracle, &prompt, 9, valid, &mut |_| true).unwrap();
        assert_eq!(run.tokens, want);
        assert_eq!((run.steps, run.accepted), (4, 4));
    }

    /// Drafts a token the model does not choose: every draft is wrong.
    struct Contrarian;

    impl Drafter for Contrarian {
        fn draft(&mut self, _hidden: &[f32], _followers: &[u32]) -> Result<Option<u32>> {
            Ok(Some(0))
        }
    }

    #[test]
    fn drafts_that_are_always_wrong_still_give_the_greedy_sequence() {
        let (_dir, model) = tiny_with_mtp(4);
        let prompt = [5u32, 6, 7];
        let valid = model.config().vocab_size;
        let want = plain_greedy(&model, &prompt, 8, valid);
        assert!(!want.contains(&0), "the contrarian's draft must be wrong");
        let run =
            speculative_greedy(&model, &mut Contrarian, &prompt, 8, valid, &mut |_| true).unwrap();
        assert_eq!(run.tokens, want);
        assert_eq!((run.steps, run.accepted), (7, 0));
    }

    #[test]
    fn steps_without_a_draft_run_one_token() {
        let (_dir, model) = tiny_with_mtp(2);
        let prompt = [9u32, 8, 7, 6];
        let valid = model.config().vocab_size;
        let want = plain_greedy(&model, &prompt, 6, valid);
        let run =
            speculative_greedy(&model, &mut NoDraft, &prompt, 6, valid, &mut |_| true).unwrap();
        assert_eq!(run.tokens, want);
        assert_eq!((run.steps, run.accepted), (0, 0));
    }

    #[test]
    fn ngram_drafts_give_the_greedy_sequence() {
        let (_dir, model) = tiny_with_mtp(2);
        let valid = model.config().vocab_size;
        // a prompt that already holds the first token the model answers with (random weights
        // seldom repeat themselves): prepend the answer until it stops changing
        let mut prompt = vec![40u32, 41, 42, 43, 40, 41];
        let mut first = plain_greedy(&model, &prompt, 1, valid)[0];
        for _ in 0..4 {
            prompt.insert(0, first);
            let again = plain_greedy(&model, &prompt, 1, valid)[0];
            if again == first {
                break;
            }
            prompt.remove(0);
            first = again;
        }
        let want = plain_greedy(&model, &prompt, 12, valid);
        assert_eq!(want[0], prompt[0], "a prompt holding its own answer");
        let mut drafter = NgramDrafter::new(prompt[0], 3);
        let run =
            speculative_greedy(&model, &mut drafter, &prompt, 12, valid, &mut |_| true).unwrap();
        assert_eq!(run.tokens, want);
        assert!(
            run.steps > 0,
            "the answer's first token recurs, so it is drafted after"
        );
    }

    #[test]
    fn ngram_lookup_takes_the_longest_recurring_suffix_latest_first() {
        let drafted = |tokens: &[u32], max_n| {
            let mut d = NgramDrafter::new(tokens[0], max_n);
            d.draft(&[], &tokens[1..]).unwrap()
        };
        assert_eq!(drafted(&[1, 2, 3, 4, 1, 2], 3), Some(3));
        // [1, 2] recurs (then 9) though [2] recurs later (then 7)
        assert_eq!(drafted(&[1, 2, 9, 2, 7, 1, 2], 2), Some(9));
        assert_eq!(drafted(&[1, 2, 9, 2, 7, 1, 2], 1), Some(7));
        // the latest of two earlier matches
        assert_eq!(drafted(&[5, 1, 5, 2, 5], 1), Some(2));
        assert_eq!(drafted(&[5, 6, 7], 3), None);
        assert_eq!(drafted(&[5], 3), None);
    }

    #[test]
    fn stops_after_a_stop_token_and_at_max_tokens() {
        let (_dir, model) = tiny_with_mtp(2);
        let prompt = [100u32, 200, 300];
        let valid = model.config().vocab_size;
        let want = plain_greedy(&model, &prompt, 12, valid);
        for n in [1, 2, 5, 12] {
            let run = mtp_greedy(&model, &prompt, n, valid, &mut |_| true).unwrap();
            assert_eq!(run.tokens, want[..n]);
        }
        let at = want[3];
        let end = want.iter().position(|&t| t == at).unwrap();
        let run = mtp_greedy(&model, &prompt, 12, valid, &mut |t| t != at).unwrap();
        assert_eq!(run.tokens, want[..=end]);
    }

    #[test]
    fn a_checkpoint_without_the_head_is_named() {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(
            dir.path(),
            &SynthOptions {
                preset: Preset::Tiny,
                layers: Some(1),
                seed: 1,
                show_progress: false,
                mtp: false,
            },
        )
        .unwrap();
        let model = CpuModel::new(ModelWeights::load(dir.path()).unwrap());
        let err = mtp_greedy(&model, &[1, 2], 4, 1000, &mut |_| true).unwrap_err();
        assert!(err.to_string().contains("no MTP head"), "{err}");
    }
}
