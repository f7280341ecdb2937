//! The eviction order of a pool's evictable blocks: least recently accessed first, among equal
//! access times the block holding more hashed tokens (the tail of a sequence) first, and among
//! equal keys the block released first.
//!
//! Two sorted structures hold the blocks. A block released with a key no smaller than the last
//! one on the *run* (the usual case: blocks are released in access order, a sequence's tail
//! first) is appended to the run, an intrusive doubly linked list: O(1), no allocation. Any other
//! block goes into a B-tree: O(log k). The next victim is the smaller of the two heads, so every
//! operation is O(1) in the usual case and O(log k) at worst (k evictable blocks).
//!
//! A block's key is its access time and hashed-token count, read from the pool's own arrays
//! ([`Fields`]; only the release number is stored here, 8 bytes per block instead of a 24-byte
//! key), so the pool never changes either of an evictable block (`touch` refuses it), and
//! `check` verifies the order against them.

use std::cmp::Reverse;
use std::collections::BTreeSet;

const NIL: u32 = u32::MAX;

/// `(access time as order-preserving bits, hashed tokens reversed, release number)`.
type Key = (u64, Reverse<u32>, u64);

/// f64 -> u64 with the same order (for finite values; -0.0 and 0.0 map alike).
fn time_bits(t: f64) -> u64 {
    let bits = (t + 0.0).to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Place {
    Out,
    Run,
    Tree,
}

/// The pool's per-block access times and hashed-token counts, the first two parts of a key.
#[derive(Clone, Copy)]
pub struct Fields<'a> {
    pub time: &'a [f64],
    pub hashed_tokens: &'a [u32],
}

impl Fields<'_> {
    fn key(&self, b: u32, released: u64) -> Key {
        let i = b as usize;
        (
            time_bits(self.time[i]),
            Reverse(self.hashed_tokens[i]),
            released,
        )
    }
}

#[derive(Clone)]
pub struct EvictionOrder {
    /// The release number of each evictable block (the last part of its key).
    released_at: Vec<u64>,
    place: Vec<Place>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    tree: BTreeSet<(Key, u32)>,
    len: usize,
    released: u64,
}

impl EvictionOrder {
    pub fn new(num_blocks: usize) -> Self {
        EvictionOrder {
            released_at: vec![0; num_blocks],
            place: vec![Place::Out; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            head: NIL,
            tail: NIL,
            tree: BTreeSet::new(),
            len: 0,
            released: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes: the per-block arrays, and the B-tree's entries (blocks released out of
    /// access order; its node overhead is not counted).
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::vec_bytes;
        vec_bytes(&self.released_at)
            + vec_bytes(&self.place)
            + vec_bytes(&self.prev)
            + vec_bytes(&self.next)
            + self.tree.len() * std::mem::size_of::<(Key, u32)>()
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, b: u32) -> bool {
        self.place[b as usize] != Place::Out
    }

    /// Make `b` evictable with its access time and hashed-token count now (in `f`).
    pub fn insert(&mut self, b: u32, f: Fields<'_>) {
        debug_assert!(!self.contains(b));
        self.released += 1;
        let key = f.key(b, self.released);
        let i = b as usize;
        self.released_at[i] = self.released;
        if self.tail == NIL || key > self.key(self.tail, f) {
            self.prev[i] = self.tail;
            self.next[i] = NIL;
            match self.tail {
                NIL => self.head = b,
                t => self.next[t as usize] = b,
            }
            self.tail = b;
            self.place[i] = Place::Run;
        } else {
            self.tree.insert((key, b));
            self.place[i] = Place::Tree;
        }
        self.len += 1;
    }

    fn key(&self, b: u32, f: Fields<'_>) -> Key {
        f.key(b, self.released_at[b as usize])
    }

    /// Take `b` out of the order (it was revived or evicted). No-op if it is not in it.
    pub fn remove(&mut self, b: u32, f: Fields<'_>) {
        let i = b as usize;
        match self.place[i] {
            Place::Out => return,
            Place::Tree => {
                let key = self.key(b, f);
                self.tree.remove(&(key, b));
            }
            Place::Run => {
                let (p, n) = (self.prev[i], self.next[i]);
                match p {
                    NIL => self.head = n,
                    p => self.next[p as usize] = n,
                }
                match n {
                    NIL => self.tail = p,
                    n => self.prev[n as usize] = p,
                }
                self.prev[i] = NIL;
                self.next[i] = NIL;
            }
        }
        self.place[i] = Place::Out;
        self.len -= 1;
    }

    /// The next victim, if any.
    pub fn first(&self, f: Fields<'_>) -> Option<u32> {
        if self.is_empty() {
            return None;
        }
        let run = (self.head != NIL).then(|| (self.key(self.head, f), self.head));
        match (run, self.tree.first().copied()) {
            (Some(r), Some(t)) => Some(r.min(t).1),
            (r, t) => r.or(t).map(|(_, b)| b),
        }
    }

    /// Remove and return the next victim.
    pub fn pop_first(&mut self, f: Fields<'_>) -> Option<u32> {
        let b = self.first(f)?;
        self.remove(b, f);
        Some(b)
    }

    /// Every evictable block, next victim first (O(k)).
    pub fn order(&self, f: Fields<'_>) -> Vec<u32> {
        let mut run = Vec::with_capacity(self.len);
        let mut cur = self.head;
        while cur != NIL {
            run.push((self.key(cur, f), cur));
            cur = self.next[cur as usize];
        }
        let mut all: Vec<(Key, u32)> = run;
        all.extend(self.tree.iter().copied());
        all.sort_unstable();
        all.into_iter().map(|(_, b)| b).collect()
    }

    /// The structure agrees with itself and with the keys `f` gives: the run in order, every
    /// tree entry under its block's key now.
    pub fn check(&self, f: Fields<'_>) -> Result<(), String> {
        let mut run_len = 0;
        let mut cur = self.head;
        let mut last: Option<Key> = None;
        while cur != NIL {
            if self.place[cur as usize] != Place::Run {
                return Err(format!("block {cur} is on the run but not marked so"));
            }
            let k = self.key(cur, f);
            if last.is_some_and(|l| l >= k) {
                return Err(format!("eviction run out of order at block {cur}"));
            }
            last = Some(k);
            run_len += 1;
            if run_len > self.len {
                return Err("eviction run has a cycle".into());
            }
            cur = self.next[cur as usize];
        }
        for &(k, b) in &self.tree {
            if self.place[b as usize] != Place::Tree || self.key(b, f) != k {
                return Err(format!("block {b} in the eviction tree under a stale key"));
            }
        }
        if run_len + self.tree.len() != self.len
            || self.place.iter().filter(|&&p| p != Place::Out).count() != self.len
        {
            return Err("evictable count mismatch".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_bits_keep_order() {
        let ts = [f64::MIN, -3.5, -1.0, -0.0, 0.0, 1e-300, 1.0, 2.5, f64::MAX];
        for w in ts.windows(2) {
            assert!(time_bits(w[0]) <= time_bits(w[1]), "{w:?}");
        }
        assert_eq!(time_bits(-0.0), time_bits(0.0));
    }

    #[test]
    fn in_order_releases_stay_on_the_run() {
        let time = [3.0, 2.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0];
        let f = Fields {
            time: &time,
            hashed_tokens: &[4; 8],
        };
        let mut e = EvictionOrder::new(8);
        for b in [3, 1, 5, 0] {
            e.insert(b, f);
        }
        assert!(e.tree.is_empty(), "no B-tree node for in-order releases");
        assert_eq!(e.order(f), vec![3, 1, 5, 0]);
        e.check(f).unwrap();
        let later = [3.0, 9.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0];
        let changed = Fields { time: &later, ..f };
        assert!(e.check(changed).is_err(), "a key changed under the order");
    }

    #[test]
    fn out_of_order_releases_are_merged() {
        let time = [5.0, 6.0, 1.0, 5.0, 6.0, 0.0, 0.0, 0.0];
        let nht = [4, 4, 4, 8, 4, 4, 4, 4];
        let f = Fields {
            time: &time,
            hashed_tokens: &nht,
        };
        let mut e = EvictionOrder::new(8);
        e.insert(0, f);
        e.insert(1, f);
        e.insert(2, f); // older: into the tree
        e.insert(3, f); // same time, more hashed tokens: before block 0
        e.insert(4, f); // equal key to block 1: after it (released later)
        assert_eq!(e.order(f), vec![2, 3, 0, 1, 4]);
        e.check(f).unwrap();
        assert_eq!(e.pop_first(f), Some(2));
        e.remove(0, f);
        assert_eq!(e.order(f), vec![3, 1, 4]);
        assert_eq!(e.pop_first(f), Some(3));
        assert_eq!(
            (e.pop_first(f), e.pop_first(f), e.pop_first(f)),
            (Some(1), Some(4), None)
        );
        assert!(e.is_empty());
    }
}
