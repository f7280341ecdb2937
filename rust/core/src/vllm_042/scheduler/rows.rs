//! Stable rows for the batch step (opt-in; `docs/scheduler.md`, "Stable rows").
//!
//! By default a batch's rows follow `schedule()`'s group order, so when a sequence ahead
//! leaves the batch every later row shifts (`ROW_MOVED`), and a persistent block-table
//! buffer pays O(table) per shifted row. [`StableRows`] instead keeps a sequence in the row
//! it had, as vLLM v1's persistent batch does. A buffer row keeps what was last written to
//! it until another sequence takes it, so a sequence that sits out a step (vLLM 0.4.2's
//! default policy runs prompts alone, so every prefill step leaves the decodes out; a
//! chunked prefill can run out of token budget) finds its row again if the batch reaches it.
//!
//! Rows stay dense `0..n`. A sequence whose row is below `n` keeps it; the rows left free
//! (their sequence left: finished, preempted, or not in this step) are filled first by the
//! sequences whose rows are at or past `n` (the last rows first: they move, `ROW_MOVED`),
//! then by sequences new to the buffer (admitted, swapped in, forked, or whose row another
//! sequence took), in schedule order. So only as many rows move as sequences left, and only
//! the scheduler's placement changes: its decisions, and the order samples are applied in,
//! stay `schedule()`'s.
//!
//! Invariant: `seqs[row_of[s]] == s` for every `s` in `row_of`; a row not in `row_of`'s
//! values holds `NONE`.

use super::{Batch, IdMap, Row};
use crate::vllm_042::manager::SeqId;

/// `place` entry of a row not yet placed.
const UNPLACED: usize = usize::MAX;
/// `seqs` entry of a row that belongs to no sequence.
const NONE: SeqId = SeqId::MAX;

/// Which sequence each buffer row belongs to, kept across steps.
#[derive(Clone, Debug, Default)]
pub struct StableRows {
    /// Row -> the sequence it was last written for (`NONE`: none, or it moved elsewhere).
    seqs: Vec<SeqId>,
    row_of: IdMap<SeqId, usize>,
    /// Scratch, kept across steps: rows below `n` kept by their sequence this step; the
    /// sequences past `n` (their row, schedule index) and those new to the buffer (schedule
    /// index); the rows in their new order.
    taken: Vec<bool>,
    displaced: Vec<(usize, usize)>,
    fresh: Vec<usize>,
    rows: Vec<Row>,
}

impl StableRows {
    /// Reorder `batch.rows` (given in schedule order, `place` empty) into stable rows and set
    /// `batch.place`. O(rows of this batch + moved rows * log); returns how many sequences
    /// moved from another row of the buffer (at most the rows below `n` they left free).
    pub fn arrange(&mut self, batch: &mut Batch) -> usize {
        debug_assert!(batch.place.is_empty(), "rows already placed");
        let n = batch.rows.len();
        if self.seqs.len() < n {
            self.seqs.resize(n, NONE);
        }
        let mut taken = std::mem::take(&mut self.taken);
        taken.clear();
        taken.resize(n, false);
        let mut place = std::mem::take(&mut batch.place);
        place.resize(n, UNPLACED);
        let (mut displaced, mut fresh) = (
            std::mem::take(&mut self.displaced),
            std::mem::take(&mut self.fresh),
        );
        displaced.clear();
        fresh.clear();
        for (j, r) in batch.rows.iter().enumerate() {
            match self.row_of.get(&r.seq) {
                Some(&i) if i < n => {
                    place[j] = i;
                    taken[i] = true;
                }
                Some(&i) => displaced.push((i, j)),
                None => fresh.push(j),
            }
        }
        displaced.sort_unstable_by_key(|d| std::cmp::Reverse(d.0)); // the last rows first
        let moved = displaced.len();
        let holes = (0..n).filter(|&h| !taken[h]);
        let movers = displaced
            .iter()
            .map(|&(_, j)| j)
            .chain(fresh.iter().copied());
        for (h, j) in holes.zip(movers) {
            place[j] = h;
            self.assign(h, batch.rows[j].seq);
        }
        // every entry is overwritten: a permutation
        let mut rows = std::mem::take(&mut self.rows);
        rows.clone_from(&batch.rows);
        for (j, r) in batch.rows.iter().enumerate() {
            rows[place[j]] = *r;
        }
        std::mem::swap(&mut batch.rows, &mut rows);
        (self.rows, self.displaced, self.fresh, self.taken) = (rows, displaced, fresh, taken);
        batch.place = place;
        moved
    }

    /// Row `row` now belongs to `seq`: its former sequence loses it, and `seq` its old row.
    fn assign(&mut self, row: usize, seq: SeqId) {
        let old = self.seqs[row];
        if old != NONE && self.row_of.get(&old) == Some(&row) {
            self.row_of.remove(&old);
        }
        if let Some(prev) = self.row_of.insert(seq, row) {
            self.seqs[prev] = NONE;
        }
        self.seqs[row] = seq;
    }

    /// Forget every placement (the next batch is placed in schedule order).
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.row_of.clear();
    }

    /// The sequence each row of the buffer belongs to (`None`: no sequence), up to the
    /// widest batch arranged.
    pub fn row_seqs(&self) -> impl Iterator<Item = Option<SeqId>> + '_ {
        self.seqs.iter().map(|&s| (s != NONE).then_some(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(ids: &[SeqId]) -> Batch {
        let rows = ids.iter().map(|&seq| Row {
            key: seq as u32,
            seq,
            samples: 1,
            cached_blocks: 0,
            chunk: 1,
        });
        Batch {
            groups: Vec::new(),
            rows: rows.collect(),
            place: Vec::new(),
        }
    }

    /// Arrange `ids` (schedule order); the rows' sequences and how many moved.
    fn arrange(s: &mut StableRows, ids: &[SeqId]) -> (Vec<SeqId>, usize) {
        let mut b = batch(ids);
        let moved = s.arrange(&mut b);
        let got: Vec<SeqId> = b.rows.iter().map(|r| r.seq).collect();
        let owners: Vec<Option<SeqId>> = s.row_seqs().collect();
        for (j, &id) in ids.iter().enumerate() {
            assert_eq!(
                b.rows[b.place[j]].seq, id,
                "place maps schedule order to rows"
            );
        }
        for (i, &id) in got.iter().enumerate() {
            assert_eq!((s.row_of[&id], owners[i]), (i, Some(id)));
        }
        for (&id, &i) in &s.row_of {
            assert_eq!(owners[i], Some(id), "row_of and seqs agree");
        }
        assert_eq!(s.row_of.len(), owners.iter().flatten().count());
        (got, moved)
    }

    #[test]
    fn first_batch_is_in_schedule_order_and_new_rows_go_last() {
        let mut s = StableRows::default();
        assert_eq!(arrange(&mut s, &[5, 3, 9]), (vec![5, 3, 9], 0));
        // a new sequence scheduled first still goes last; the others keep their rows
        assert_eq!(arrange(&mut s, &[7, 9, 5, 3]), (vec![5, 3, 9, 7], 0));
    }

    #[test]
    fn the_last_rows_fill_the_holes() {
        let mut s = StableRows::default();
        arrange(&mut s, &[1, 2, 3, 4, 5, 6]);
        // 2 and 4 leave: rows 1 and 3 are holes, filled by the last kept rows (6, then 5)
        assert_eq!(arrange(&mut s, &[1, 3, 5, 6]), (vec![1, 6, 3, 5], 2));
        // the last row leaves: nothing moves
        assert_eq!(arrange(&mut s, &[1, 6, 3]), (vec![1, 6, 3], 0));
        // a hole and a newcomer: the newcomer takes the hole, nothing moves
        assert_eq!(arrange(&mut s, &[1, 3, 8]), (vec![1, 8, 3], 0));
        // 1 and 3 finish: 8 keeps row 1, the newcomer takes row 0
        assert_eq!(arrange(&mut s, &[8, 10]), (vec![10, 8], 0));
        // 8 finishes: 10 keeps row 0
        assert_eq!(arrange(&mut s, &[10]), (vec![10], 0));
        // nothing scheduled: the rows keep their sequences, who find them again
        assert_eq!(arrange(&mut s, &[]), (vec![], 0));
        assert_eq!(arrange(&mut s, &[10, 12]), (vec![10, 12], 0));
    }

    #[test]
    fn a_sequence_that_sits_out_a_step_finds_its_row_again() {
        let mut s = StableRows::default();
        arrange(&mut s, &[1, 2, 3, 4]);
        // a prefill step runs two new prompts alone: they take rows 0 and 1
        assert_eq!(arrange(&mut s, &[5, 6]), (vec![5, 6], 0));
        // the decodes come back: 3 and 4 still own rows 2 and 3; 1 and 2 lost theirs
        // and take new rows at the end
        assert_eq!(
            arrange(&mut s, &[1, 2, 3, 4, 5, 6]),
            (vec![5, 6, 3, 4, 1, 2], 0)
        );
        // 5 and 6 finish: 2 and 1 (the last rows first) move into their rows 0 and 1
        assert_eq!(arrange(&mut s, &[1, 2, 3, 4]), (vec![2, 1, 3, 4], 2));
        // 1, 3 and 4 sit out; a newcomer takes 1's row (which the batch needs), while
        // 3 and 4 keep theirs, past the batch
        assert_eq!(arrange(&mut s, &[2, 7]), (vec![2, 7], 0));
        assert_eq!((s.row_of.get(&1), s.row_of[&3], s.row_of[&4]), (None, 2, 3));
        // 4 is back in a batch of three: its row 3 is past it, so it moves into row 2
        assert_eq!(arrange(&mut s, &[2, 7, 4]), (vec![2, 7, 4], 1));
        assert_eq!(s.row_of.get(&3), None);
    }

    #[test]
    fn moves_never_exceed_the_rows_left_free() {
        let mut rng = crate::rng::Rng::new(7);
        let mut s = StableRows::default();
        let mut live: Vec<SeqId> = Vec::new();
        // what each buffer row was last written for (None: a sequence moved out of it)
        let mut owner: Vec<Option<SeqId>> = Vec::new();
        let mut next = 0;
        for _ in 0..1000 {
            live.retain(|_| rng.below(6) != 0);
            for _ in 0..rng.below(4) {
                live.push(next);
                next += 1;
            }
            // schedule order is not row order; and some steps leave some sequences out
            let mut order: Vec<SeqId> = live.iter().copied().filter(|_| !rng.chance(10)).collect();
            if rng.chance(20) {
                order.truncate(rng.below(order.len() + 1));
            }
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            let n = order.len();
            let freed = (0..n)
                .filter(|&h| {
                    owner
                        .get(h)
                        .copied()
                        .flatten()
                        .is_none_or(|o| !order.contains(&o))
                })
                .count();
            let (rows, moved) = arrange(&mut s, &order);
            assert!(moved <= freed, "{moved} moved, {freed} rows left free");
            for (i, id) in rows.iter().enumerate() {
                if let Some(h) = owner.iter().position(|&o| o == Some(*id)) {
                    if h < n {
                        assert_eq!(h, i, "a sequence whose row is in the batch keeps it");
                    } else {
                        owner[h] = None;
                    }
                }
            }
            owner.resize(owner.len().max(n), None);
            for (i, &id) in rows.iter().enumerate() {
                owner[i] = Some(id);
            }
            let model: Vec<Option<SeqId>> = s.row_seqs().collect();
            assert_eq!(model, owner[..model.len()]);
        }
    }
}
