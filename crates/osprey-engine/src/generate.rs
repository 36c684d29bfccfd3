//! The generation loop: prefill the prompt, then sample and decode until a stop id, a stop
//! string or the token limit; text is streamed through a callback as it becomes final (text that
//! could still turn into a stop string is held back, and stop strings never reach the output).

use std::ops::ControlFlow;
use std::time::Instant;

use anyhow::Result;

use crate::sampler::{Sampler, SamplingParams};
use crate::{Engine, Session, Timing};

/// Turns tokens into text incrementally (implemented by the tokenizer crate).
pub trait TokenText {
    /// Appends a token and returns the text that became final.
    fn push(&mut self, token: u32) -> String;
    /// Text still held back (an incomplete UTF-8 sequence) at the end.
    fn flush(&mut self) -> String;
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    pub sampling: SamplingParams,
    /// Ids at or above this are vocabulary padding and never sampled.
    pub valid_vocab: usize,
    pub reasoning_budget: Option<ReasoningBudget>,
}

/// A limit on the reply's reasoning (its `<think>` block): once `tokens` have been chosen inside
/// the block, `close` (the tokens that end it) is put in and the model goes on with its answer.
/// The budget is of the whole reply's reasoning, not of each block it may open; 0 closes the
/// block before the model writes in it. Whether the reply starts inside the block is read from
/// the session (the chat template opens it at the end of the prompt when thinking is on).
#[derive(Clone, Debug)]
pub struct ReasoningBudget {
    pub tokens: usize,
    /// The single tokens that open and close the block.
    pub open_id: u32,
    pub close_id: u32,
    pub close: Vec<u32>,
}

/// A reply's reasoning budget as it is spent, by whichever loop generates the reply: the tokens
/// chosen inside the reasoning block count against it, and it runs out once (the budget is of
/// the reply's reasoning, not of each block the reply may open).
#[derive(Clone, Copy, Debug)]
pub struct ReasoningCountdown {
    left: Option<usize>,
}

impl ReasoningCountdown {
    /// `budget`: the reasoning tokens allowed (None: no limit).
    pub fn new(budget: Option<usize>) -> Self {
        ReasoningCountdown { left: budget }
    }

    /// Before the first token: whether the block the prompt leaves open must be closed at once
    /// (a budget of 0). Outside the block a budget of 0 stays, and closes any block the reply
    /// opens right after its opening token.
    pub fn close_at_start(&mut self, in_reasoning: bool) -> bool {
        let close = in_reasoning && self.left == Some(0);
        if close {
            self.left = None;
        }
        close
    }

    /// After a chosen token that leaves the reply inside the block (`in_reasoning`) or not:
    /// whether the budget has just run out, so that the block's closing goes in now.
    pub fn spend(&mut self, in_reasoning: bool) -> bool {
        match self.left.as_mut() {
            Some(left) if in_reasoning => {
                *left = left.saturating_sub(1);
                let out = *left == 0;
                if out {
                    self.left = None;
                }
                out
            }
            _ => false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop (client went away).
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The reply's tokens: those chosen and those put in (a reasoning budget's closing).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prompt: Timing,
    pub decode: Timing,
}

/// What the reply needs after a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Continue,
    /// The reasoning budget is spent: the block's closing goes in before the next choice.
    CloseReasoning,
    Finished,
}

/// The reply so far: tokens, streamed text, and why it ended.
struct Reply<'a> {
    opts: &'a GenerateOptions,
    stream: StopScanner,
    detok: &'a mut dyn TokenText,
    on_text: &'a mut dyn FnMut(&str) -> ControlFlow<()>,
    tokens: Vec<u32>,
    /// Of `tokens`, those the model chose (what `max_tokens` limits).
    chosen: usize,
    /// Whether the last token left the reply inside the reasoning block.
    in_reasoning: bool,
    reasoning: ReasoningCountdown,
    finish: FinishReason,
}

impl Reply<'_> {
    /// Takes one chosen token and says what comes next: the reply is over at a stop id or string,
    /// when the callback cancels, or at the token limit.
    fn accept(&mut self, next: u32) -> Next {
        self.chosen += 1;
        if !self.take(next) || self.chosen >= self.opts.max_tokens {
            return Next::Finished;
        }
        if self.reasoning.spend(self.in_reasoning) {
            Next::CloseReasoning
        } else {
            Next::Continue
        }
    }

    /// Appends a token to the reply and streams its text; false once the reply is over.
    fn take(&mut self, token: u32) -> bool {
        self.tokens.push(token);
        if self.opts.stop_ids.contains(&token) {
            self.finish = FinishReason::Stop;
            return false;
        }
        if let Some(b) = &self.opts.reasoning_budget {
            if token == b.open_id {
                self.in_reasoning = true;
            } else if token == b.close_id {
                self.in_reasoning = false;
            }
        }
        let (piece, stopped) = self.stream.push(&self.detok.push(token));
        if !piece.is_empty() && (self.on_text)(&piece).is_break() {
            self.finish = FinishReason::Cancelled;
            return false;
        }
        if stopped {
            self.finish = FinishReason::Stop;
            return false;
        }
        true
    }

    /// Puts the reasoning block's closing into the reply and the session (after `unrun`, chosen
    /// tokens the model has not run yet) and returns the logits to choose the next token from;
    /// None when the closing ended the reply (a stop string in it, or a cancelled stream).
    fn close_reasoning(
        &mut self,
        engine: &Engine,
        session: &mut Session,
        unrun: Option<u32>,
    ) -> Result<Option<Vec<f32>>> {
        let opts = self.opts;
        let close = opts.reasoning_budget.as_ref().map_or(&[][..], |b| &b.close);
        for &t in close {
            if !self.take(t) {
                return Ok(None);
            }
        }
        let feed: Vec<u32> = unrun.into_iter().chain(close.iter().copied()).collect();
        Ok(Some(engine.prefill(session, &feed)?.0))
    }
}

/// Generates a reply to `prompt` (appended to the session). `on_text` receives each final piece
/// of text and may return `Break` to cancel. Each token the host chooses is sampled from logits
/// (the prompt's first); after it, a backend that chooses tokens itself (the GPU) runs on
/// without handing logits back until the reply ends or its reasoning budget is spent (the
/// block's closing is then put in and the host chooses again), else the host samples every
/// token.
pub fn generate(
    engine: &Engine,
    session: &mut Session,
    prompt: &[u32],
    opts: &GenerateOptions,
    detok: &mut dyn TokenText,
    on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Result<Generation> {
    opts.sampling.validate()?;
    let (logits, prompt_timing) = engine.prefill(session, prompt)?;
    let mut sampler = Sampler::new(opts.sampling.clone(), opts.valid_vocab, &session.tokens);
    let in_reasoning = opts.reasoning_budget.as_ref().is_some_and(|b| {
        let last = |id| session.tokens.iter().rposition(|&t| t == id);
        last(b.open_id) > last(b.close_id)
    });
    let mut reply = Reply {
        opts,
        stream: StopScanner::new(&opts.stop_strings),
        detok,
        on_text,
        tokens: Vec::new(),
        chosen: 0,
        in_reasoning,
        reasoning: ReasoningCountdown::new(opts.reasoning_budget.as_ref().map(|b| b.tokens)),
        finish: FinishReason::Length,
    };
    let started = Instant::now();
    // the logits the host chooses the next token from; None once the reply is over
    let mut logits = (opts.max_tokens > 0).then_some(logits);
    if logits.is_some() && reply.reasoning.close_at_start(in_reasoning) {
        logits = reply.close_reasoning(engine, session, None)?;
    }
    while let Some(from) = logits.take() {
        let token = sampler.sample(&from);
        sampler.observe(token);
        let mut next = reply.accept(token);
        // the last chosen token, and whether the model has run it (the device runs each token
        // as it hands over the next, so all but possibly its last have run)
        let (mut last, mut last_ran) = (token, false);
        if next == Next::Continue {
            let remaining = opts.max_tokens - reply.chosen;
            let mut chosen = Vec::new();
            let run = crate::DeviceRun {
                first: token,
                sampler: &sampler,
                max_steps: remaining,
                logprobs: None,
            };
            let ran = engine.decode_on_device(session, &run, &mut |t, _| {
                chosen.push(t);
                next = reply.accept(t);
                next == Next::Continue
            })?;
            let Some(ran) = ran else {
                logits = Some(engine.decode(session, token)?);
                continue;
            };
            chosen.iter().for_each(|&t| sampler.observe(t));
            last = chosen.last().copied().unwrap_or(token);
            last_ran = ran == 1 + chosen.len();
        }
        if next == Next::CloseReasoning {
            logits = reply.close_reasoning(engine, session, (!last_ran).then_some(last))?;
        }
    }
    let Reply {
        mut stream,
        detok,
        on_text,
        tokens,
        chosen,
        finish,
        ..
    } = reply;
    if finish != FinishReason::Cancelled {
        let (piece, _) = stream.push(&detok.flush());
        let rest = piece + &stream.finish();
        if !rest.is_empty() {
            let _ = on_text(&rest);
        }
    }
    // on the host path the last sampled token was never run through the model: the session
    // ends at the last token whose logits were used, so a follow-up turn feeds it first (the
    // device path may have run it already; the session records what ran). A reasoning
    // budget's closing is prefilled, not decoded.
    let decode = Timing {
        tokens: chosen.saturating_sub(1),
        seconds: started.elapsed().as_secs_f64(),
    };
    Ok(Generation {
        text: stream.text,
        tokens,
        finish,
        prompt: prompt_timing,
        decode,
    })
}

/// Finds stop strings in streamed text, releasing only text that cannot be part of one.
pub struct StopScanner {
    stops: Vec<String>,
    /// All text accepted so far (without the stop string).
    pub text: String,
    emitted: usize,
    /// Text before this byte was passed through unsearched (`pass`): no stop begins in it.
    floor: usize,
    done: bool,
    /// The stop string that ended the text, once one has.
    matched: Option<usize>,
}

impl StopScanner {
    pub fn new(stops: &[String]) -> Self {
        StopScanner {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            emitted: 0,
            floor: 0,
            done: false,
            matched: None,
        }
    }

    /// Adds text that no stop string may begin in (what a reply writes before it may end:
    /// vLLM's `min_tokens`) and releases it with whatever was held back.
    pub fn pass(&mut self, delta: &str) -> String {
        if self.done {
            return String::new();
        }
        self.text.push_str(delta);
        self.floor = self.text.len();
        self.finish()
    }

    /// The stop string that ended the text (the earliest in it; of two at one place, the first
    /// given), once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Adds text; returns the newly releasable text and whether a stop string was hit.
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        if self.done {
            return (String::new(), true);
        }
        // a stop string may have begun in text already released (held back no longer than the
        // longest stop), so search from that far back, at a character's start
        let mut search_from = self
            .emitted
            .saturating_sub(self.stops.iter().map(|s| s.len()).max().unwrap_or(0));
        while !self.text.is_char_boundary(search_from) {
            search_from -= 1;
        }
        let search_from = search_from.max(self.floor);
        self.text.push_str(delta);
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(k, s)| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| (search_from + i, k))
            })
            .min();
        if let Some((at, k)) = hit {
            self.text.truncate(at);
            self.done = true;
            self.matched = Some(k);
            let out = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            return (out, true);
        }
        // hold back the longest suffix that is a prefix of some stop string
        let mut hold = 0;
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= self.text.len()
                    && self.text.is_char_boundary(self.text.len() - k)
                    && s.is_char_boundary(k)
                    && self.text.ends_with(&s[..k])
                {
                    hold = hold.max(k);
                    break;
                }
            }
        }
        let upto = (self.text.len() - hold).max(self.emitted);
        let out = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        (out, false)
    }

    /// Releases whatever was held back.
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backend, LogitsFor, SessionState};
    use osprey_model::config::ModelConfig;

    /// A deterministic "model": the next token is a function of the sequence. `device`: it also
    /// chooses tokens itself, with the GPU backend's contract (`crate::decode_by_steps`).
    struct Counting {
        config: ModelConfig,
        device: bool,
    }

    fn next_after(seq: &[u32]) -> u32 {
        (seq.last().copied().unwrap_or(0) * 7 + seq.len() as u32) % 50
    }

    /// Its logits after `seq`: the next token far ahead of the rest.
    fn logits_after(seq: &[u32]) -> Vec<f32> {
        let mut logits = vec![0.0; 64];
        logits[next_after(seq) as usize] = 10.0;
        logits
    }

    impl Backend for Counting {
        fn name(&self) -> &'static str {
            "counting"
        }
        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn new_state(&self) -> SessionState {
            SessionState {
                layers: Vec::new(),
                position: 0,
            }
        }
        fn forward(
            &self,
            state: &mut SessionState,
            history: &[u32],
            tokens: &[u32],
            _want: LogitsFor,
        ) -> Result<Vec<f32>> {
            state.position += tokens.len();
            let seq: Vec<u32> = history.iter().chain(tokens).copied().collect();
            Ok(logits_after(&seq))
        }
        fn decode_on_device(
            &self,
            state: &mut SessionState,
            history: &[u32],
            run: &crate::DeviceRun,
            on_token: &mut crate::OnToken,
        ) -> Result<Option<Vec<u32>>> {
            if !self.device {
                return Ok(None);
            }
            let ran = crate::decode_by_steps(history, run, &next_after, &logits_after, on_token);
            state.position += ran.len();
            Ok(Some(ran))
        }
    }

    #[test]
    fn reasoning_countdown_runs_out_once() {
        // two tokens inside the block, one outside between them: out at the second inside
        let mut c = ReasoningCountdown::new(Some(2));
        assert!(!c.close_at_start(true));
        assert!(!c.spend(true));
        assert!(!c.spend(false));
        assert!(c.spend(true));
        // spent: a block the reply opens later runs free
        assert!(!c.spend(true) && !c.spend(true));
        // a zero budget closes the prompt's open block at once, and only once
        let mut zero = ReasoningCountdown::new(Some(0));
        assert!(zero.close_at_start(true));
        assert!(!zero.spend(true));
        // outside the block a zero budget closes the first block the reply opens
        let mut later = ReasoningCountdown::new(Some(0));
        assert!(!later.close_at_start(false));
        assert!(!later.spend(false));
        assert!(later.spend(true));
        // no budget never closes
        let mut free = ReasoningCountdown::new(None);
        assert!(!free.close_at_start(true) && !free.spend(true));
    }

    struct Names;
    impl TokenText for Names {
        fn push(&mut self, token: u32) -> String {
            format!("t{token} ")
        }
        fn flush(&mut self) -> String {
            String::new()
        }
    }

    /// An engine on `Counting` (with the real model's config), host-only or choosing on a device.
    fn engine(device: bool) -> Engine {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.6-35b-a3b");
        Engine::new(Box::new(Counting {
            config: ModelConfig::from_dir(&dir).unwrap(),
            device,
        }))
    }

    #[test]
    fn device_decoding_gives_the_host_replies() {
        let (host, device) = (engine(false), engine(true));
        let prompt = [3u32, 1, 4, 1, 5];
        // the path without a stop first, to pick stops that do occur in it
        let free = |stop_ids: Vec<u32>, stop_strings: Vec<String>, max_tokens| GenerateOptions {
            max_tokens,
            stop_ids,
            stop_strings,
            sampling: SamplingParams::default(),
            valid_vocab: 64,
            reasoning_budget: None,
        };
        let run = |e: &Engine, o: &GenerateOptions| {
            let mut s = e.new_session();
            let mut streamed = String::new();
            let g = generate(e, &mut s, &prompt, o, &mut Names, &mut |t| {
                streamed.push_str(t);
                ControlFlow::Continue(())
            })
            .unwrap();
            (g.tokens, g.text, g.finish, streamed, s.tokens)
        };
        let reference = run(&host, &free(Vec::new(), Vec::new(), 40));
        let seventh = reference.0[6];
        let cases = [
            free(Vec::new(), Vec::new(), 40),
            free(Vec::new(), Vec::new(), 1),
            free(vec![seventh], Vec::new(), 40),
            free(Vec::new(), vec![format!("t{seventh} ")], 40),
        ];
        for o in &cases {
            let (h, d) = (run(&host, o), run(&device, o));
            assert_eq!((&h.0, &h.1, h.2, &h.3), (&d.0, &d.1, d.2, &d.3), "{o:?}");
            // the device may have run the last token already; never less than the host
            assert!(d.4.starts_with(&h.4) && d.4.len() <= h.4.len() + 1, "{o:?}");
        }
    }

    #[test]
    fn a_spent_reasoning_budget_closes_the_block_for_the_model() {
        // the model never chooses 60 or 61 (next_after is below 50): they stand for <think>
        // and </think>, and the closing put in is "61 62"
        let (open, close) = (60u32, 61u32);
        let opts = |tokens, max_tokens| GenerateOptions {
            max_tokens,
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
            sampling: SamplingParams::default(),
            valid_vocab: 64,
            reasoning_budget: Some(ReasoningBudget {
                tokens,
                open_id: open,
                close_id: close,
                close: vec![close, 62],
            }),
        };
        let run = |e: &Engine, prompt: &[u32], o: &GenerateOptions| {
            let mut s = e.new_session();
            let g = generate(e, &mut s, prompt, o, &mut Names, &mut |_| {
                ControlFlow::Continue(())
            })
            .unwrap();
            (g.tokens, g.text, s.tokens)
        };
        let thinking = [3u32, 1, 4, open];
        for device in [false, true] {
            let e = engine(device);
            for budget in [0, 1, 5] {
                let (tokens, text, session) = run(&e, &thinking, &opts(budget, 12));
                // `budget` chosen tokens, the closing, then chosen tokens that follow the model
                // over a sequence that holds the closing
                assert_eq!(tokens[budget..budget + 2], [close, 62], "{budget} {device}");
                assert_eq!(
                    tokens.len(),
                    12 + 2,
                    "the closing is not counted against max_tokens"
                );
                let mut seq = thinking.to_vec();
                for &t in &tokens {
                    if t < 50 {
                        assert_eq!(t, next_after(&seq), "{budget} {device}");
                    }
                    seq.push(t);
                }
                assert!(session.starts_with(&seq[..thinking.len() + budget + 2]));
                assert!(text.contains("t61 t62 "));
            }
            // a prompt whose block is already closed (thinking off): nothing is put in
            let closed = [3u32, open, close, 1];
            let (tokens, _, _) = run(&e, &closed, &opts(2, 8));
            assert!(tokens.iter().all(|&t| t < 50), "{tokens:?}");
            // the budget ends with the reply's token limit: no closing past it
            let (tokens, _, _) = run(&e, &thinking, &opts(5, 5));
            assert_eq!(tokens.len(), 5);
        }
        let host = run(&engine(false), &thinking, &opts(3, 20));
        let device = run(&engine(true), &thinking, &opts(3, 20));
        assert_eq!((&host.0, &host.1), (&device.0, &device.1));
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut sc = StopScanner::new(&stops);
        let mut out = String::new();
        let mut stopped = false;
        for p in pieces {
            let (o, s) = sc.push(p);
            out += &o;
            if s {
                stopped = true;
                break;
            }
        }
        if !stopped {
            out += &sc.finish();
        }
        (out, sc.text.clone(), stopped)
    }

    #[test]
    fn stop_string_split_across_pieces_is_not_leaked() {
        let (out, text, stopped) = run(&["STOP"], &["hello S", "TO", "P world"]);
        assert_eq!(out, "hello ");
        assert_eq!(text, "hello ");
        assert!(stopped);
    }

    #[test]
    fn partial_match_is_released_when_it_turns_out_not_to_be_a_stop() {
        let (out, _, stopped) = run(&["STOP"], &["a ST", "ay"]);
        assert_eq!(out, "a STay");
        assert!(!stopped);
    }

    #[test]
    fn the_stop_string_that_ended_the_text_is_named() {
        let stops = vec![
            "cd".to_string(),
            String::new(),
            "b".to_string(),
            "bc".to_string(),
        ];
        let mut sc = StopScanner::new(&stops);
        assert_eq!(sc.push("a"), ("a".to_string(), false));
        assert_eq!(sc.matched(), None);
        assert_eq!(sc.push("bcd"), (String::new(), true));
        assert_eq!(sc.matched(), Some("b"), "earliest, then first given");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, _, stopped) = run(&["cd", "b"], &["abcd"]);
        assert_eq!(out, "a");
        assert!(stopped);
    }

    #[test]
    fn multibyte_text_before_a_stop_is_searched_from_a_character_start() {
        // a one-byte stop after a three-byte character: the search went back one byte, into it
        let (out, _, stopped) = run(&["\n"], &["漫长", "_ste", "p\nmore"]);
        assert_eq!(out, "漫长_step");
        assert!(stopped);
        let (out, _, stopped) = run(&["é!"], &["caf", "é", "é", "!x"]);
        assert_eq!(out, "café");
        assert!(stopped);
    }

    #[test]
    fn text_passed_through_is_released_and_never_starts_a_stop() {
        let stops = vec!["ab".to_string(), "e".to_string()];
        let mut sc = StopScanner::new(&stops);
        assert_eq!(sc.pass("xea"), "xea");
        // "ab" would begin in the passed text; "e" was in it
        assert_eq!(sc.push("b"), ("b".to_string(), false));
        assert_eq!(sc.push("cea"), ("c".to_string(), true));
        assert_eq!(sc.text, "xeabc");
        assert_eq!(sc.matched(), Some("e"));
    }

    #[test]
    fn no_stops_streams_everything() {
        let (out, _, _) = run(&[], &["x", "yz"]);
        assert_eq!(out, "xyz");
    }
}
