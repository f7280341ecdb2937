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
//! A block's key is taken when it becomes evictable; the pool never changes the access time or
//! hashed-token count of an evictable block (`touch` refuses it), and `check` verifies that.

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

#[derive(Clone)]
pub struct EvictionOrder {
    keys: Vec<Key>,
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
            keys: vec![(0, Reverse(0), 0); num_blocks],
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
        vec_bytes(&self.keys)
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

    /// Make `b` evictable with its access time and hashed-token count.
    pub fn insert(&mut self, b: u32, time: f64, hashed_tokens: u32) {
        debug_assert!(!self.contains(b));
        self.released += 1;
        let key = (time_bits(time), Reverse(hashed_tokens), self.released);
        let i = b as usize;
        self.keys[i] = key;
        if self.tail == NIL || key > self.keys[self.tail as usize] {
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

    /// Take `b` out of the order (it was revived or evicted). No-op if it is not in it.
    pub fn remove(&mut self, b: u32) {
        let i = b as usize;
        match self.place[i] {
            Place::Out => return,
            Place::Tree => {
                self.tree.remove(&(self.keys[i], b));
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
    pub fn first(&self) -> Option<u32> {
        if self.is_empty() {
            return None;
        }
        let run = (self.head != NIL).then(|| (self.keys[self.head as usize], self.head));
        match (run, self.tree.first().copied()) {
            (Some(r), Some(t)) => Some(r.min(t).1),
            (r, t) => r.or(t).map(|(_, b)| b),
        }
    }

    /// Remove and return the next victim.
    pub fn pop_first(&mut self) -> Option<u32> {
        let b = self.first()?;
        self.remove(b);
        Some(b)
    }

    /// Every evictable block, next victim first (O(k)).
    pub fn order(&self) -> Vec<u32> {
        let mut run = Vec::with_capacity(self.len);
        let mut cur = self.head;
        while cur != NIL {
            run.push((self.keys[cur as usize], cur));
            cur = self.next[cur as usize];
        }
        let mut all: Vec<(Key, u32)> = run;
        all.extend(self.tree.iter().copied());
        all.sort_unstable();
        all.into_iter().map(|(_, b)| b).collect()
    }

    /// The structure agrees with itself, and block `b`'s key with `fields(b)` (its access
    /// time and hashed tokens now).
    pub fn check(&self, fields: impl Fn(u32) -> (f64, u32)) -> Result<(), String> {
        let mut run_len = 0;
        let mut cur = self.head;
        let mut last: Option<Key> = None;
        while cur != NIL {
            if self.place[cur as usize] != Place::Run {
                return Err(format!("block {cur} is on the run but not marked so"));
            }
            let k = self.keys[cur as usize];
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
            if self.place[b as usize] != Place::Tree || self.keys[b as usize] != k {
                return Err(format!("block {b} in the eviction tree under a stale key"));
            }
        }
        if run_len + self.tree.len() != self.len
            || self.place.iter().filter(|&&p| p != Place::Out).count() != self.len
        {
            return Err("evictable count mismatch".into());
        }
        for (b, &p) in self.place.iter().enumerate() {
            if p != Place::Out {
                let (t, nht) = fields(b as u32);
                let (bits, Reverse(n), _) = self.keys[b];
                if bits != time_bits(t) || n != nht {
                    return Err(format!("evictable block {b} changed its key"));
                }
            }
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
        let mut e = EvictionOrder::new(8);
        for (b, t) in [(3, 1.0), (1, 2.0), (5, 2.0), (0, 3.0)] {
            e.insert(b, t, 4);
        }
        assert!(e.tree.is_empty(), "no B-tree node for in-order releases");
        assert_eq!(e.order(), vec![3, 1, 5, 0]);
        e.check(|b| ([3.0, 2.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0][b as usize], 4))
            .unwrap();
    }

    #[test]
    fn out_of_order_releases_are_merged() {
        let mut e = EvictionOrder::new(8);
        e.insert(0, 5.0, 4);
        e.insert(1, 6.0, 4);
        e.insert(2, 1.0, 4); // older: into the tree
        e.insert(3, 5.0, 8); // same time, more hashed tokens: before block 0
        e.insert(4, 6.0, 4); // equal key to block 1: after it (released later)
        assert_eq!(e.order(), vec![2, 3, 0, 1, 4]);
        assert_eq!(e.pop_first(), Some(2));
        e.remove(0);
        assert_eq!(e.order(), vec![3, 1, 4]);
        assert_eq!(e.pop_first(), Some(3));
        assert_eq!(
            (e.pop_first(), e.pop_first(), e.pop_first()),
            (Some(1), Some(4), None)
        );
        assert!(e.is_empty());
    }
}
