//! vLLM v1's free-block queue, as an intrusive doubly linked list over block ids.
//!
//! ```text
//!   HEAD <-> b7 <-> b3 <-> b12 <-> ... <-> TAIL      (HEAD = n, TAIL = n + 1: sentinels)
//!   popleft takes from the HEAD end; freed blocks join at either end
//! ```
//!
//! Invariants: a block is *in* the queue iff `next[b] != NIL`; `len` counts the blocks in it;
//! the order is exactly the order vLLM's `FreeKVCacheBlockQueue` keeps, so the block ids a
//! request receives are the ids vLLM would hand out (v1's order is deterministic).
//!
//! Costs: every operation O(1) per block moved, no allocation after construction; 8 bytes per
//! block.

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    len: usize,
}

impl FreeQueue {
    /// All blocks `0..n`, in id order.
    /// Fails (nothing allocated for long) when the memory for `n` blocks cannot be had.
    pub fn new(n: u32) -> crate::error::Result<Self> {
        let size = n as usize + 2;
        let (head, tail) = (n, n + 1);
        let mut q = FreeQueue {
            prev: crate::mem::try_filled(NIL, size, "the free-block queue")?,
            next: crate::mem::try_filled(NIL, size, "the free-block queue")?,
            len: 0,
        };
        q.next[head as usize] = tail;
        q.prev[tail as usize] = head;
        for b in 0..n {
            q.link_before(tail, b);
        }
        q.len = n as usize;
        Ok(q)
    }

    fn head(&self) -> u32 {
        (self.prev.len() - 2) as u32
    }

    fn tail(&self) -> u32 {
        (self.prev.len() - 1) as u32
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn contains(&self, b: u32) -> bool {
        self.next[b as usize] != NIL
    }

    /// Insert `b` (not in the queue) right before `at`.
    fn link_before(&mut self, at: u32, b: u32) {
        let p = self.prev[at as usize];
        self.next[p as usize] = b;
        self.prev[b as usize] = p;
        self.next[b as usize] = at;
        self.prev[at as usize] = b;
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
    }

    /// The first block, taken out of the queue; `None` when empty.
    pub fn popleft(&mut self) -> Option<u32> {
        let first = self.next[self.head() as usize];
        if first == self.tail() {
            return None;
        }
        self.unlink(first);
        self.len -= 1;
        Some(first)
    }

    /// The first `n` blocks in order, appended to `out`. The caller checks `n <= len()`.
    pub fn popleft_n(&mut self, n: usize, out: &mut Vec<u32>) {
        debug_assert!(n <= self.len);
        for _ in 0..n {
            match self.popleft() {
                Some(b) => out.push(b),
                None => break,
            }
        }
    }

    /// Take `b` out from wherever it is (a cache hit on an evictable block).
    pub fn remove(&mut self, b: u32) {
        debug_assert!(self.contains(b));
        self.unlink(b);
        self.len -= 1;
    }

    /// Put `blocks` at the tail, in order (the last one is evicted last).
    pub fn append_n(&mut self, blocks: &[u32]) {
        let tail = self.tail();
        for &b in blocks {
            debug_assert!(!self.contains(b));
            self.link_before(tail, b);
        }
        self.len += blocks.len();
    }

    /// Put `blocks` at the head, in order (the first one is handed out first).
    pub fn prepend_n(&mut self, blocks: &[u32]) {
        let first = self.next[self.head() as usize];
        for &b in blocks {
            debug_assert!(!self.contains(b));
            self.link_before(first, b);
        }
        self.len += blocks.len();
    }

    /// Heap bytes held (the link arrays).
    pub fn heap_bytes(&self) -> usize {
        crate::mem::vec_bytes(&self.prev) + crate::mem::vec_bytes(&self.next)
    }

    /// The queue from head to tail (tests and introspection).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        let mut b = self.next[self.head() as usize];
        while b != self.tail() {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }
}
