//! Which session state the device resumes from. The device holds one session's state: every
//! attention layer's K/V rows and every Gated DeltaNet layer's conv and recurrent state. The GDN
//! state cannot be rewound, so a call for a sequence that does not extend what the device holds
//! (the next turn of a chat whose template dropped the earlier reply's reasoning, a retry, another
//! branch) would have to prefill from the first token. Copies of the GDN state kept at chosen
//! points (`keep`, ~63 MB each at full size) avoid that: the K/V rows are only ever appended to,
//! so the rows below a kept point still hold that point's keys and values as long as nothing
//! since has written a different token below it. Restoring is then a device-to-device copy of the
//! GDN state and a new position. The book is generic over the saved state so that it is tested
//! without a GPU.

/// What the device runs from for a call that needs the state after `target`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// What the device holds is a prefix of the target: run the rest.
    Held,
    /// Restore kept copy `index` (the state after the target's first `len` tokens), then run
    /// the rest.
    Restore { index: usize, len: usize },
    /// Nothing usable (or nothing held): clear the state and run the target from its first
    /// token.
    Empty,
}

struct Kept<S> {
    tokens: Vec<u32>,
    saved: S,
    used: u64,
}

pub(crate) struct StateBook<S> {
    /// Tokens whose state the device holds.
    held: Vec<u32>,
    /// Tokens whose K/V rows the cache holds: `held`, then the rows of an abandoned branch that
    /// stay valid until a different token is written below them.
    rows: Vec<u32>,
    kept: Vec<Kept<S>>,
    capacity: usize,
    clock: u64,
}

impl<S> StateBook<S> {
    /// A book keeping at most `capacity` copies (0: none, every other branch is rebuilt).
    pub fn new(capacity: usize) -> Self {
        StateBook {
            held: Vec::new(),
            rows: Vec::new(),
            kept: Vec::new(),
            capacity,
            clock: 0,
        }
    }

    pub fn held(&self) -> &[u32] {
        &self.held
    }

    pub fn saved(&self, index: usize) -> Option<&S> {
        self.kept.get(index).map(|k| &k.saved)
    }

    /// How to reach the state after `target` with at least `min_run` of its tokens still to run
    /// (1 when the caller needs the last token's logits, which a restored copy does not carry):
    /// the longer of what the device holds and the longest kept copy that is a prefix of both the
    /// target and the cache's rows.
    pub fn start(&mut self, target: &[u32], min_run: usize) -> Start {
        let limit = target.len().saturating_sub(min_run);
        // an empty hold is not continued: after a failure the device's state is unknown, and
        // clearing it costs a memset
        let held =
            (!self.held.is_empty() && target.starts_with(&self.held) && self.held.len() <= limit)
                .then_some(self.held.len());
        let best = self
            .kept
            .iter()
            .enumerate()
            .filter(|(_, k)| {
                k.tokens.len() <= limit
                    && target.starts_with(&k.tokens)
                    && self.rows.starts_with(&k.tokens)
            })
            .max_by_key(|(_, k)| k.tokens.len())
            .map(|(i, k)| (i, k.tokens.len()));
        match (held, best) {
            (Some(h), Some((_, len))) if h >= len => Start::Held,
            (_, Some((index, len))) => {
                self.clock += 1;
                self.kept[index].used = self.clock;
                Start::Restore { index, len }
            }
            (Some(_), None) => Start::Held,
            (None, None) => Start::Empty,
        }
    }

    /// The device now holds the state after `tokens` (a restore or a reset: a prefix of what
    /// the rows hold, so no row changed).
    pub fn holds(&mut self, tokens: &[u32]) {
        self.held.clear();
        self.held.extend_from_slice(tokens);
        self.rows_written();
    }

    /// Extends what the device holds by `tokens` it just ran (and wrote the rows of).
    pub fn ran(&mut self, tokens: &[u32]) {
        self.held.extend_from_slice(tokens);
        self.rows_written();
    }

    /// The rows past the longest prefix `held` shares with `rows` were just written: the rows
    /// beyond them, and the copies that relied on any of them, no longer hold.
    fn rows_written(&mut self) {
        if !self.rows.starts_with(&self.held) {
            self.rows.clone_from(&self.held);
            let rows = &self.rows;
            self.kept.retain(|k| rows.starts_with(&k.tokens));
        }
    }

    /// The device state is unknown (a failed run): nothing it holds, no row and no copy is
    /// trusted.
    pub fn lost(&mut self) {
        self.held.clear();
        self.rows.clear();
        self.kept.clear();
    }

    /// Whether a copy of the state after what the device holds now should be made: the device
    /// holds something, copies are allowed and none of these tokens is kept yet.
    pub fn wants_copy(&self) -> bool {
        self.capacity > 0
            && !self.held.is_empty()
            && !self.kept.iter().any(|k| k.tokens == self.held)
    }

    /// A copy's buffers to overwrite when the book is full (the least recently used copy,
    /// removed), so a new copy allocates nothing.
    pub fn evict_for_copy(&mut self) -> Option<S> {
        if self.kept.len() < self.capacity {
            return None;
        }
        let oldest = (0..self.kept.len()).min_by_key(|&i| self.kept[i].used)?;
        Some(self.kept.remove(oldest).saved)
    }

    /// Records `saved` as the state after what the device holds now.
    pub fn keep(&mut self, saved: S) {
        self.clock += 1;
        self.kept.push(Kept {
            tokens: self.held.clone(),
            saved,
            used: self.clock,
        });
    }

    #[cfg(test)]
    fn copies(&self) -> usize {
        self.kept.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A book whose device ran `tokens` and kept a copy (saved as `id`) after each of `at`.
    fn book_with(tokens: &[u32], at: &[usize], capacity: usize) -> StateBook<u32> {
        let mut b = StateBook::new(capacity);
        let mut from = 0;
        for &n in at {
            b.ran(&tokens[from..n]);
            from = n;
            assert!(b.wants_copy());
            let _ = b.evict_for_copy();
            b.keep(n as u32);
        }
        b.ran(&tokens[from..]);
        b
    }

    #[test]
    fn a_prefix_the_device_holds_is_continued() {
        let mut b = book_with(&[1, 2, 3], &[], 4);
        assert_eq!(b.start(&[1, 2, 3, 4], 1), Start::Held);
        // what it holds exactly, when the caller only runs from it (decode from `first`)
        assert_eq!(b.start(&[1, 2, 3], 0), Start::Held);
    }

    #[test]
    fn another_branch_resumes_from_the_kept_point() {
        // turn one: prompt 1..=3 kept at the reply's start (3 tokens), reply 7, 8 with reasoning
        let mut b = book_with(&[1, 2, 3, 7, 8], &[3], 4);
        // turn two re-templates the reply without it: 1, 2, 3, 9, ...
        assert_eq!(
            b.start(&[1, 2, 3, 9, 10], 1),
            Start::Restore { index: 0, len: 3 }
        );
        assert_eq!(b.saved(0), Some(&3));
        b.holds(&[1, 2, 3]);
        b.ran(&[9, 10]);
        // the abandoned branch's rows past 3 are overwritten: the copy at 3 stays usable
        assert_eq!(b.copies(), 1);
        assert_eq!(
            b.start(&[1, 2, 3, 5], 1),
            Start::Restore { index: 0, len: 3 }
        );
    }

    #[test]
    fn the_longest_usable_copy_wins_over_a_shorter_held_prefix() {
        let mut b = book_with(&[1, 2, 3, 4, 5, 6], &[2, 4], 4);
        b.holds(&[1, 2]);
        // held (2 tokens) extends the target, but the copy at 4 is longer and its rows are intact
        assert_eq!(
            b.start(&[1, 2, 3, 4, 9], 1),
            Start::Restore { index: 1, len: 4 }
        );
        // a held state at least as long as any copy is continued
        b.holds(&[1, 2, 3, 4, 5]);
        assert_eq!(b.start(&[1, 2, 3, 4, 5, 6], 1), Start::Held);
    }

    #[test]
    fn a_copy_is_used_only_with_tokens_left_to_run() {
        let mut b = book_with(&[1, 2, 3, 4], &[3], 4);
        // the kept prompt's last-token logits are not in the copy: a call that needs them cannot
        // start from it (the server keeps those logits on the host for a retry)
        assert_eq!(b.start(&[1, 2, 3], 1), Start::Empty);
        // decoding from it (the caller runs `first` next) may start right at the copy
        assert_eq!(b.start(&[1, 2, 3], 0), Start::Restore { index: 0, len: 3 });
    }

    #[test]
    fn copies_whose_rows_were_overwritten_are_dropped() {
        let mut b = book_with(&[1, 2, 3, 4], &[2, 3], 4);
        assert_eq!(b.copies(), 2);
        // another conversation writes row 1 with a different token: both copies are gone
        b.holds(&[]);
        b.ran(&[1, 5, 6]);
        assert_eq!(b.copies(), 0);
        assert_eq!(b.start(&[1, 2, 3, 4, 9], 1), Start::Empty);
    }

    #[test]
    fn a_reset_keeps_the_rows_and_their_copies() {
        let mut b = book_with(&[1, 2, 3, 4], &[3], 4);
        b.holds(&[]);
        assert_eq!(b.copies(), 1);
        assert_eq!(
            b.start(&[1, 2, 3, 8], 1),
            Start::Restore { index: 0, len: 3 }
        );
    }

    #[test]
    fn the_least_recently_used_copy_is_overwritten_when_full() {
        let mut b = book_with(&[1, 2, 3, 4, 5], &[1, 2], 2);
        // the copy at 1 was used since: the copy at 2 goes
        assert_eq!(b.start(&[1, 7], 1), Start::Restore { index: 0, len: 1 });
        b.ran(&[]);
        b.holds(&[1, 2, 3]);
        assert!(b.wants_copy());
        assert_eq!(b.evict_for_copy(), Some(2));
        b.keep(3);
        assert_eq!(b.copies(), 2);
        assert!(!b.wants_copy());
    }

    #[test]
    fn no_copies_with_no_capacity_and_none_after_a_failure() {
        let b = book_with(&[1, 2, 3], &[], 0);
        assert!(!b.wants_copy());
        let mut b = book_with(&[1, 2, 3, 4], &[2], 4);
        b.lost();
        assert_eq!((b.held(), b.copies()), (&[] as &[u32], 0));
        assert_eq!(b.start(&[1, 2, 3], 1), Start::Empty);
    }
}
