//! Stable rows for the batch step (opt-in; `docs/scheduler.md`, "Stable rows").
//!
//! By default a batch's rows follow `schedule()`'s group order, so when a sequence ahead
//! leaves the batch every later row shifts (`ROW_MOVED`), and a persistent block-table
//! buffer pays O(table) per shifted row. [`StableRows`] instead keeps a running sequence in
//! the row it had, as vLLM v1's persistent batch does: rows stay dense `0..n`; the rows of
//! sequences that left (finished, preempted, or not scheduled this step) become holes that
//! the last rows fill (so only as many rows move as sequences left), and sequences new to
//! the batch take rows at the end, in schedule order. Only the placement changes: the
//! scheduler's decisions, and the order samples are applied in, stay `schedule()`'s.
//!
//! Invariant: `seqs[row_of[s]] == s` for every `s` in `row_of`, and `row_of` holds exactly
//! the sequences of `seqs` (the last arranged batch).

use super::{Batch, IdMap, Row};
use crate::manager::SeqId;

/// `place` entry of a row not yet placed.
const UNPLACED: usize = usize::MAX;

/// Where each sequence of the last batch sat, kept across steps.
#[derive(Clone, Debug, Default)]
pub struct StableRows {
    /// Row -> sequence, of the last arranged batch.
    seqs: Vec<SeqId>,
    row_of: IdMap<SeqId, usize>,
    /// Scratch, per row of the last batch: its row in the new batch (`UNPLACED`: it left).
    dest: Vec<usize>,
}

impl StableRows {
    /// Reorder `batch.rows` (given in schedule order, `place` empty) into stable rows and set
    /// `batch.place`. O(rows of this batch and the last one); returns how many kept rows
    /// moved (at most the number of rows that left).
    pub fn arrange(&mut self, batch: &mut Batch) -> usize {
        debug_assert!(batch.place.is_empty(), "rows already placed");
        let n = batch.rows.len();
        self.dest.clear();
        self.dest.resize(self.seqs.len(), UNPLACED);
        let mut place = vec![UNPLACED; n];
        let mut kept = 0;
        for (j, r) in batch.rows.iter().enumerate() {
            if let Some(&i) = self.row_of.get(&r.seq) {
                self.dest[i] = i; // for now: kept in place
                place[j] = i;
                kept += 1;
            }
        }
        let moved = self.fill_holes(kept);
        for (j, r) in batch.rows.iter().enumerate() {
            if place[j] != UNPLACED {
                place[j] = self.dest[place[j]];
            } else {
                place[j] = self.row_of.len();
                self.row_of.insert(r.seq, place[j]);
            }
        }
        let mut rows: Vec<Row> = batch.rows.clone(); // every entry is overwritten: a permutation
        self.seqs.clear();
        self.seqs.resize(n, 0);
        for (j, r) in batch.rows.iter().enumerate() {
            rows[place[j]] = *r;
            self.seqs[place[j]] = r.seq;
        }
        batch.rows = rows;
        batch.place = place;
        moved
    }

    /// Forget the rows that left (`dest` still `UNPLACED`) and move the last kept rows, those
    /// at or past `kept`, into the holes below it (lowest hole first). `row_of` ends up
    /// holding the kept sequences at their new rows; returns how many moved.
    fn fill_holes(&mut self, kept: usize) -> usize {
        for (i, d) in self.dest.iter().enumerate() {
            if *d == UNPLACED {
                self.row_of.remove(&self.seqs[i]);
            }
        }
        let mut moved = 0;
        let mut src = self.dest.len();
        for hole in 0..kept.min(self.dest.len()) {
            if self.dest[hole] != UNPLACED {
                continue;
            }
            // the last kept row past `kept`: there is one for every hole below `kept`
            src -= 1;
            while self.dest[src] == UNPLACED {
                src -= 1;
            }
            debug_assert!(src >= kept);
            self.dest[src] = hole;
            self.row_of.insert(self.seqs[src], hole);
            moved += 1;
        }
        moved
    }

    /// Forget every placement (the next batch is placed in schedule order).
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.row_of.clear();
    }

    /// The sequence in each row of the last arranged batch.
    pub fn seqs(&self) -> &[SeqId] {
        &self.seqs
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
        assert_eq!(got, s.seqs());
        for (j, &id) in ids.iter().enumerate() {
            assert_eq!(b.rows[b.place[j]].seq, id, "place maps schedule order to rows");
        }
        for (i, &id) in got.iter().enumerate() {
            assert_eq!(s.row_of[&id], i);
        }
        assert_eq!(s.row_of.len(), got.len());
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
        // a hole and a newcomer: the hole is filled by the last row, the newcomer goes last
        assert_eq!(arrange(&mut s, &[1, 3, 8]), (vec![1, 3, 8], 1));
        // everything leaves but the last row, which moves to row 0
        assert_eq!(arrange(&mut s, &[8, 10]), (vec![8, 10], 1));
        // nothing scheduled, then the same sequence again: a new row (it left the batch)
        assert_eq!(arrange(&mut s, &[]), (vec![], 0));
        assert_eq!(arrange(&mut s, &[8]), (vec![8], 0));
    }

    #[test]
    fn moves_never_exceed_the_rows_that_left() {
        let mut rng = crate::rng::Rng::new(7);
        let mut s = StableRows::default();
        let mut live: Vec<SeqId> = Vec::new();
        let (mut next, mut before) = (0, Vec::new());
        for _ in 0..500 {
            live.retain(|_| rng.below(5) != 0);
            for _ in 0..rng.below(4) {
                live.push(next);
                next += 1;
            }
            // schedule order is not row order: shuffle it
            let mut order = live.clone();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i + 1));
            }
            let left = before.iter().filter(|id| !live.contains(id)).count();
            let (rows, moved) = arrange(&mut s, &order);
            assert!(moved <= left, "{moved} moved, {left} left");
            let stayed = before
                .iter()
                .enumerate()
                .filter(|(i, id)| rows.get(*i) == Some(id))
                .count();
            assert_eq!(stayed + moved, before.len() - left, "the rest kept their rows");
            before = rows;
        }
    }
}
