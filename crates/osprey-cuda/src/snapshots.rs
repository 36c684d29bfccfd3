//! Which session state the device resumes from. The device holds one session's state: every
//! attention layer's K/V rows and every Gated DeltaNet layer's conv and recurrent state. The GDN
//! state cannot be rewound, so a call for a sequence that does not extend what the device holds
//! (the next turn of a chat whose template dropped the earlier reply's reasoning, a retry,
//! another conversation) would have to prefill from the first token. Copies kept at chosen points
//! (`keep`) avoid that. A copy holds the GDN state (~63 MB at full size); its K/V rows stay in the
//! cache, which later tokens only append to, until a call is about to write different tokens
//! over them: then those rows are first copied into the copy's stash (`before_writing`). So a
//! chat's next turn costs one GDN copy, and returning to another conversation also copies its
//! rows back. Everything kept fits a byte budget, least recently used out first. The book is
//! generic over the saved state so that it is tested without a GPU.

/// What the device runs from for a call that needs the state after `target`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// What the device holds is a prefix of the target: run the rest.
    Held,
    /// Restore copy `id`, the state after the target's first `len` tokens, writing its stashed
    /// K/V rows from `rows_from` to `len` back into the cache; then run the rest.
    Restore {
        id: u64,
        len: usize,
        rows_from: usize,
    },
    /// Nothing usable (or nothing held): clear the state and run the target from its first
    /// token.
    Empty,
}

/// K/V rows `from..to` to copy from the cache into the front of copy `id`'s stash before the
/// call writes over them.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Stash {
    pub id: u64,
    pub from: usize,
    pub to: usize,
}

struct Kept<S> {
    id: u64,
    tokens: Vec<u32>,
    saved: S,
    used: u64,
    /// Rows `stashed_from..tokens.len()` are in the copy's stash; the rows below, in the cache.
    stashed_from: usize,
}

/// The longest common prefix of two token sequences.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

pub(crate) struct StateBook<S> {
    /// Tokens whose state the device holds.
    held: Vec<u32>,
    /// Tokens whose K/V rows the cache holds: `held`, then the rows of an abandoned branch that
    /// stay valid until a different token is written below them.
    rows: Vec<u32>,
    kept: Vec<Kept<S>>,
    /// Bytes all copies may take; one copy's GDN state; one position's K/V rows.
    budget: usize,
    copy_bytes: usize,
    row_bytes: usize,
    clock: u64,
    next_id: u64,
}

impl<S> StateBook<S> {
    /// A book keeping copies of `copy_bytes` each plus their stashed rows of `row_bytes` a
    /// position within `budget` bytes (0: none, every other branch is rebuilt).
    pub fn new(budget: usize, copy_bytes: usize, row_bytes: usize) -> Self {
        StateBook {
            held: Vec::new(),
            rows: Vec::new(),
            kept: Vec::new(),
            budget,
            copy_bytes,
            row_bytes,
            clock: 0,
            next_id: 0,
        }
    }

    pub fn held(&self) -> &[u32] {
        &self.held
    }

    pub fn saved(&self, id: u64) -> Option<&S> {
        self.kept.iter().find(|k| k.id == id).map(|k| &k.saved)
    }

    pub fn saved_mut(&mut self, id: u64) -> Option<&mut S> {
        self.kept
            .iter_mut()
            .find(|k| k.id == id)
            .map(|k| &mut k.saved)
    }

    fn bytes_of(&self, k: &Kept<S>) -> usize {
        self.copy_bytes + (k.tokens.len() - k.stashed_from) * self.row_bytes
    }

    fn bytes(&self) -> usize {
        self.kept.iter().map(|k| self.bytes_of(k)).sum()
    }

    /// Whether a copy's rows are all still somewhere: in the cache up to its stash, then stashed.
    fn usable(rows: &[u32], k: &Kept<S>) -> bool {
        common(rows, &k.tokens) >= k.stashed_from
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// How to reach the state after `target` with at least `min_run` of its tokens still to run
    /// (1 when the caller needs the last token's logits, which a copy does not carry): the
    /// longer of what the device holds and the longest usable copy that is a prefix of the
    /// target.
    pub fn start(&mut self, target: &[u32], min_run: usize) -> Start {
        let limit = target.len().saturating_sub(min_run);
        // an empty hold is not continued: after a failure the device's state is unknown, and
        // clearing it costs a memset
        let held =
            (!self.held.is_empty() && target.starts_with(&self.held) && self.held.len() <= limit)
                .then_some(self.held.len());
        let rows = &self.rows;
        let best = self
            .kept
            .iter()
            .filter(|k| {
                k.tokens.len() <= limit && target.starts_with(&k.tokens) && Self::usable(rows, k)
            })
            .max_by_key(|k| k.tokens.len())
            .map(|k| {
                (
                    k.id,
                    k.tokens.len(),
                    common(rows, &k.tokens).min(k.tokens.len()),
                )
            });
        match (held, best) {
            (Some(h), Some((_, len, _))) if h >= len => Start::Held,
            (_, Some((id, len, rows_from))) => {
                let now = self.tick();
                if let Some(k) = self.kept.iter_mut().find(|k| k.id == id) {
                    k.used = now;
                }
                Start::Restore { id, len, rows_from }
            }
            (Some(_), None) => Start::Held,
            (None, None) => Start::Empty,
        }
    }

    /// Before a call leaves the cache holding the rows of `target` and nothing valid past them
    /// (decoding on may write any row past it): the rows other copies need that it will write
    /// over, to be stashed first, most recently used copy first. A copy whose rows are gone, or
    /// whose stash would not fit the budget even with less recently used copies dropped, is
    /// dropped; `restoring` (the copy the call starts from) is never dropped.
    pub fn before_writing(&mut self, target: &[u32], restoring: Option<u64>) -> Vec<Stash> {
        let rows = &self.rows;
        self.kept.retain(|k| Self::usable(rows, k));
        let mut order: Vec<(u64, u64)> = self.kept.iter().map(|k| (k.used, k.id)).collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        let mut stashes: Vec<Stash> = Vec::new();
        for (_, id) in order {
            let Some(k) = self.kept.iter().find(|k| k.id == id) else {
                continue;
            };
            let keep_from = common(target, &k.tokens);
            if keep_from >= k.stashed_from {
                continue;
            }
            let need = (k.stashed_from - keep_from) * self.row_bytes;
            let used = k.used;
            while self.bytes() + need > self.budget {
                let victim = self
                    .kept
                    .iter()
                    .filter(|v| v.id != id && Some(v.id) != restoring && v.used < used)
                    .min_by_key(|v| v.used)
                    .map(|v| v.id);
                let Some(victim) = victim else { break };
                self.kept.retain(|v| v.id != victim);
                stashes.retain(|s| s.id != victim);
            }
            if self.bytes() + need > self.budget && Some(id) != restoring {
                self.kept.retain(|v| v.id != id);
                continue;
            }
            if let Some(k) = self.kept.iter_mut().find(|k| k.id == id) {
                stashes.push(Stash {
                    id,
                    from: keep_from,
                    to: k.stashed_from,
                });
                k.stashed_from = keep_from;
            }
        }
        stashes
    }

    /// The device now holds the state after `tokens` (a restore or a reset).
    pub fn holds(&mut self, tokens: &[u32]) {
        self.held.clear();
        self.held.extend_from_slice(tokens);
        if !self.rows.starts_with(&self.held) {
            self.rows_replaced();
        }
    }

    /// Extends what the device holds by `tokens` it just ran (and wrote the rows of). `held` is
    /// always a prefix of `rows`, so only the new tokens' rows need comparing: a step costs
    /// nothing in the length of the session.
    pub fn ran(&mut self, tokens: &[u32]) {
        let at = self.held.len();
        self.held.extend_from_slice(tokens);
        if self.rows.len() <= at {
            // the rows ended with what the device held: they grow with it, no copy loses any
            self.rows.extend_from_slice(tokens);
        } else if self.rows.get(at..self.held.len()) != Some(tokens) {
            self.rows_replaced();
        }
    }

    /// Rows past the longest prefix `held` shares with `rows` were written: the rows beyond
    /// them no longer hold, nor do the copies whose rows were there and not stashed.
    fn rows_replaced(&mut self) {
        self.rows.clone_from(&self.held);
        let rows = &self.rows;
        self.kept.retain(|k| Self::usable(rows, k));
    }

    /// Whether the device holds exactly `history` and the cache no rows past it: a call that
    /// runs at most `min_run` tokens after it then has nothing to restore or stash (a longer
    /// usable copy would have to leave fewer than `min_run` to run), so it continues.
    pub fn continues(&self, history: &[u32]) -> bool {
        !self.held.is_empty() && self.rows.len() == self.held.len() && self.held == history
    }

    /// Drops copy `id` (its stash could not be made).
    pub fn forget(&mut self, id: u64) {
        self.kept.retain(|k| k.id != id);
    }

    /// The device state is unknown (a failed run): nothing it holds, no row and no copy is
    /// trusted.
    pub fn lost(&mut self) {
        self.held.clear();
        self.rows.clear();
        self.kept.clear();
    }

    /// Whether a copy of the state after what the device holds now should be made: the device
    /// holds something, a copy fits the budget and none of these tokens is kept yet.
    pub fn wants_copy(&self) -> bool {
        self.copy_bytes <= self.budget
            && !self.held.is_empty()
            && !self.kept.iter().any(|k| k.tokens == self.held)
    }

    /// Records `saved` as the state after what the device holds now (its rows all in the cache),
    /// dropping the least recently used copies until everything fits the budget.
    pub fn keep(&mut self, saved: S) {
        let now = self.tick();
        self.next_id += 1;
        self.kept.push(Kept {
            id: self.next_id,
            tokens: self.held.clone(),
            saved,
            used: now,
            stashed_from: self.held.len(),
        });
        while self.bytes() > self.budget {
            let Some(oldest) = self.kept.iter().min_by_key(|k| k.used).map(|k| k.id) else {
                break;
            };
            self.kept.retain(|k| k.id != oldest);
        }
    }

    #[cfg(test)]
    fn copies(&self) -> Vec<(usize, usize)> {
        self.kept
            .iter()
            .map(|k| (k.tokens.len(), k.stashed_from))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each test copy costs 10 bytes, each stashed row 1.
    const COPY: usize = 10;

    /// A book whose device ran `tokens` and kept a copy (saved as its length) after each of `at`.
    fn book_with(tokens: &[u32], at: &[usize], budget: usize) -> StateBook<usize> {
        let mut b = StateBook::new(budget, COPY, 1);
        let mut from = 0;
        for &n in at {
            b.ran(&tokens[from..n]);
            from = n;
            assert!(b.wants_copy());
            b.keep(n);
        }
        b.ran(&tokens[from..]);
        b
    }

    /// What the backend does for `target`: plan the start and the stashes, then run it all.
    fn call(b: &mut StateBook<usize>, target: &[u32], min_run: usize) -> (Start, Vec<Stash>) {
        let start = b.start(target, min_run);
        let restoring = match start {
            Start::Restore { id, .. } => Some(id),
            _ => None,
        };
        let stashes = b.before_writing(target, restoring);
        let from = match start {
            Start::Held => b.held().len(),
            Start::Restore { len, .. } => {
                b.holds(&target[..len]);
                len
            }
            Start::Empty => {
                b.holds(&[]);
                0
            }
        };
        b.ran(&target[from..]);
        (start, stashes)
    }

    #[test]
    fn a_prefix_the_device_holds_is_continued() {
        let mut b = book_with(&[1, 2, 3], &[], 100);
        assert_eq!(b.start(&[1, 2, 3, 4], 1), Start::Held);
        // what it holds exactly, when the caller only runs from it (decode from `first`)
        assert_eq!(b.start(&[1, 2, 3], 0), Start::Held);
    }

    #[test]
    fn the_next_turn_resumes_from_the_kept_point_with_no_rows_to_copy() {
        // turn one: prompt 1..=3 kept at the reply's start, reply 7, 8 with reasoning
        let mut b = book_with(&[1, 2, 3, 7, 8], &[3], 100);
        // turn two re-templates the reply without it: 1, 2, 3, 9, ...
        let (start, stashes) = call(&mut b, &[1, 2, 3, 9, 10], 1);
        assert_eq!(
            start,
            Start::Restore {
                id: 1,
                len: 3,
                rows_from: 3
            }
        );
        assert_eq!(stashes, vec![]);
        assert_eq!(b.saved(1), Some(&3));
        assert_eq!(
            b.start(&[1, 2, 3, 5], 1),
            Start::Restore {
                id: 1,
                len: 3,
                rows_from: 3
            }
        );
    }

    #[test]
    fn another_conversation_stashes_the_rows_it_overwrites_and_they_come_back() {
        // conversation A (shares the first token with B), kept at 4
        let mut b = book_with(&[1, 2, 3, 4], &[4], 100);
        // B writes rows 1.. first: A's rows 1..4 are stashed
        let (start, stashes) = call(&mut b, &[1, 5, 6, 7, 8, 9], 1);
        assert_eq!(start, Start::Empty);
        assert_eq!(
            stashes,
            vec![Stash {
                id: 1,
                from: 1,
                to: 4
            }]
        );
        assert_eq!(b.copies(), vec![(4, 1)]);
        // back to A: restore the copy and write its stashed rows 1..4 back
        let (start, stashes) = call(&mut b, &[1, 2, 3, 4, 10], 1);
        assert_eq!(
            start,
            Start::Restore {
                id: 1,
                len: 4,
                rows_from: 1
            }
        );
        assert_eq!(stashes, vec![]);
        assert_eq!(b.held(), &[1, 2, 3, 4, 10]);
    }

    #[test]
    fn a_copy_whose_stash_failed_is_forgotten() {
        let mut b = book_with(&[1, 2, 3, 4], &[4], 100);
        let (_, stashes) = call(&mut b, &[1, 5, 6], 1);
        assert_eq!(stashes.len(), 1);
        b.forget(stashes[0].id);
        assert_eq!(b.start(&[1, 2, 3, 4, 10], 1), Start::Empty);
    }

    #[test]
    fn the_longest_usable_copy_wins_over_a_shorter_held_prefix() {
        let mut b = book_with(&[1, 2, 3, 4, 5, 6], &[2, 4], 100);
        b.holds(&[1, 2]);
        // held (2 tokens) extends the target, but the copy at 4 is longer and its rows are intact
        assert_eq!(
            b.start(&[1, 2, 3, 4, 9], 1),
            Start::Restore {
                id: 2,
                len: 4,
                rows_from: 4
            }
        );
        // a held state at least as long as any copy is continued
        b.holds(&[1, 2, 3, 4, 5]);
        assert_eq!(b.start(&[1, 2, 3, 4, 5, 6], 1), Start::Held);
    }

    #[test]
    fn a_copy_is_used_only_with_tokens_left_to_run() {
        let mut b = book_with(&[1, 2, 3, 4], &[3], 100);
        // the kept prompt's last-token logits are not in the copy: a call that needs them cannot
        // start from it (the server keeps those logits on the host for a retry)
        assert_eq!(b.start(&[1, 2, 3], 1), Start::Empty);
        // decoding from it (the caller runs `first` next) may start right at the copy
        assert_eq!(
            b.start(&[1, 2, 3], 0),
            Start::Restore {
                id: 1,
                len: 3,
                rows_from: 3
            }
        );
    }

    #[test]
    fn rows_written_without_a_plan_drop_the_copies_that_needed_them() {
        let mut b = book_with(&[1, 2, 3, 4], &[2, 3], 100);
        assert_eq!(b.copies().len(), 2);
        b.holds(&[]);
        b.ran(&[1, 5, 6]);
        assert_eq!(b.copies(), vec![]);
        assert_eq!(b.start(&[1, 2, 3, 4, 9], 1), Start::Empty);
    }

    #[test]
    fn steps_after_exactly_what_is_held_continue_without_a_plan() {
        let mut b = book_with(&[1, 2, 3], &[2], 100);
        assert!(b.continues(&[1, 2, 3]));
        // what the general path would decide for a step after it
        assert_eq!(b.start(&[1, 2, 3, 4], 1), Start::Held);
        assert_eq!(b.before_writing(&[1, 2, 3, 4], None), vec![]);
        assert!(!b.continues(&[1, 2]));
        assert!(!StateBook::<usize>::new(100, COPY, 1).continues(&[]));
        // rows of another branch past what is held: the general path decides
        b.holds(&[1, 2]);
        assert!(!b.continues(&[1, 2]));
        // a step that rewrites the same token keeps the rows; another token replaces them
        b.ran(&[3]);
        assert_eq!(b.copies(), vec![(2, 2)]);
        b.holds(&[1]);
        b.ran(&[7]);
        assert!(b.continues(&[1, 7]));
        assert_eq!(b.copies(), vec![]);
    }

    #[test]
    fn a_reset_keeps_the_rows_and_their_copies() {
        let mut b = book_with(&[1, 2, 3, 4], &[3], 100);
        b.holds(&[]);
        assert_eq!(
            b.start(&[1, 2, 3, 8], 1),
            Start::Restore {
                id: 1,
                len: 3,
                rows_from: 3
            }
        );
    }

    #[test]
    fn the_budget_drops_the_least_recently_used() {
        // room for two copies and 5 stashed rows: copies at 1 and 2
        let mut b = book_with(&[1, 2, 3, 4, 5], &[1, 2], 2 * COPY + 5);
        // back to the copy at 1 (used now): the copy at 2 stashes its row 1
        let (_, stashes) = call(&mut b, &[1, 7], 1);
        assert_eq!(
            stashes,
            vec![Stash {
                id: 2,
                from: 1,
                to: 2
            }]
        );
        assert_eq!(b.copies(), vec![(1, 1), (2, 1)]);
        // a third copy does not fit: the least recently used (at 2) goes
        b.keep(2);
        assert_eq!(b.copies(), vec![(1, 1), (2, 2)]);
    }

    #[test]
    fn a_stash_that_does_not_fit_drops_the_copy() {
        // one copy and 2 stashed rows
        let mut b = book_with(&[1, 2, 3, 4, 5], &[5], COPY + 2);
        let (_, stashes) = call(&mut b, &[1, 9], 1);
        assert_eq!(stashes, vec![]);
        assert_eq!(b.copies(), vec![]);
    }

    #[test]
    fn less_recently_used_copies_make_room_for_a_stash() {
        // A kept at 3, then B (its own first token) kept at 2: A is older
        let mut b = book_with(&[1, 2, 3], &[3], 2 * COPY + 3);
        call(&mut b, &[8, 9], 1);
        assert_eq!(b.copies(), vec![(3, 0)]);
        b.keep(2);
        // C overwrites B's rows: B's stash needs 2 rows, and A (less recently used, 3 stashed
        // rows) goes to make room
        let (_, stashes) = call(&mut b, &[7, 7, 7], 1);
        assert_eq!(
            stashes,
            vec![Stash {
                id: 2,
                from: 0,
                to: 2
            }]
        );
        assert_eq!(b.copies(), vec![(2, 0)]);
    }

    #[test]
    fn no_copies_without_budget_and_none_after_a_failure() {
        let b = book_with(&[1, 2, 3], &[], COPY - 1);
        assert!(!b.wants_copy());
        let mut b = book_with(&[1, 2, 3, 4], &[2], 100);
        b.lost();
        assert_eq!((b.held(), b.copies()), (&[] as &[u32], vec![]));
        assert_eq!(b.start(&[1, 2, 3], 1), Start::Empty);
    }
}
