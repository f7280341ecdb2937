//! The token ids of one sequence and the chained hashes of its full blocks.
//!
//! This is what `pagedkv.SequenceData` keeps natively. The block manager reads it directly
//! (no call back into Python): the length, the tokens of a block (to confirm a cache hit) and
//! the hash of each full block. Each block is hashed once, when its last token arrives, so a
//! sequence of `L` tokens costs `O(L)` hashing over its whole life and `push` is `O(1)`
//! amortised.

use crate::error::{Error, Result};
use crate::vllm_042::hash::{BlockHash, HashExtra, Hasher};

#[derive(Clone, Debug)]
pub struct TokenSeq {
    block_size: usize,
    tokens: Vec<u32>,
    /// `hashes[i]` is the hash of full block `i`; `hashes.len() == tokens.len() / block_size`.
    hashes: Vec<BlockHash>,
    extra: HashExtra,
    extra_key: u128,
    hasher: Hasher,
    /// How many block hashes this sequence computed in its life (a test hook: each block once,
    /// plus a full rehash whenever a manager with another hasher adopts the sequence).
    hash_calls: u64,
    scratch: Vec<u8>,
}

impl TokenSeq {
    pub fn new(
        block_size: usize,
        tokens: &[u32],
        extra: HashExtra,
        hasher: Hasher,
    ) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        let mut s = TokenSeq {
            block_size,
            tokens: Vec::with_capacity(tokens.len() + block_size),
            hashes: Vec::new(),
            extra_key: extra.key(),
            extra,
            hasher,
            hash_calls: 0,
            scratch: Vec::new(),
        };
        s.extend(tokens);
        Ok(s)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn extra(&self) -> &HashExtra {
        &self.extra
    }
    pub fn extra_key(&self) -> u128 {
        self.extra_key
    }
    /// The key a cached copy of full block `i` is stored and confirmed under; `parent` is the
    /// physical block holding block `i - 1` (`None` for block 0).
    pub fn block_key(
        &self,
        i: usize,
        parent: Option<crate::vllm_042::pool::BlockId>,
    ) -> Option<crate::vllm_042::pool::BlockKey<'_>> {
        let hash = self.block_hash(i)?;
        Some(crate::vllm_042::pool::BlockKey {
            hash,
            parent,
            extra: self.extra_key,
            tokens: self.block_tokens(i),
        })
    }
    pub fn hasher(&self) -> Hasher {
        self.hasher
    }
    pub fn hash_calls(&self) -> u64 {
        self.hash_calls
    }
    /// Number of blocks the tokens occupy (the last one may be partial).
    pub fn num_blocks(&self) -> usize {
        self.tokens.len().div_ceil(self.block_size)
    }
    pub fn num_full_blocks(&self) -> usize {
        self.hashes.len()
    }
    /// The tokens of logical block `i` (a partial last block gives fewer than `block_size`).
    pub fn block_tokens(&self, i: usize) -> &[u32] {
        // Saturating: any index past the tokens is an empty block, never a wrapped slice.
        let start = i.saturating_mul(self.block_size).min(self.tokens.len());
        let end = i
            .saturating_add(1)
            .saturating_mul(self.block_size)
            .min(self.tokens.len());
        &self.tokens[start..end]
    }
    /// Hash of full block `i`; `None` if block `i` is not full.
    pub fn block_hash(&self, i: usize) -> Option<BlockHash> {
        self.hashes.get(i).copied()
    }
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    pub fn push(&mut self, token: u32) {
        self.tokens.push(token);
        if self.tokens.len() % self.block_size == 0 {
            self.hash_new_full_blocks();
        }
    }

    pub fn extend(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.hash_new_full_blocks();
    }

    /// Re-key this sequence's hashes with another hasher (when a manager configured with a
    /// different hash function adopts it). A no-op when the hasher is already the same.
    pub fn adopt_hasher(&mut self, hasher: Hasher) {
        if hasher == self.hasher {
            return;
        }
        self.hasher = hasher;
        self.hashes.clear();
        self.hash_new_full_blocks();
    }

    fn hash_new_full_blocks(&mut self) {
        let full = self.tokens.len() / self.block_size;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied();
            let toks = &self.tokens[i * self.block_size..(i + 1) * self.block_size];
            let h = self
                .hasher
                .hash_block(parent, toks, &self.extra, &mut self.scratch);
            self.hashes.push(h);
            self.hash_calls += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm_042::hash::{ChainHasher, HashAlgo};

    #[test]
    fn hashes_each_block_once_and_matches_chain() {
        let hasher = Hasher::new(HashAlgo::Xxh3, Some(7));
        let mut s = TokenSeq::new(16, &[], HashExtra::default(), hasher).unwrap();
        let toks: Vec<u32> = (0..32_768).map(|i| (i * 31 % 50_000) as u32).collect();
        for &t in &toks {
            s.push(t);
        }
        assert_eq!(s.hash_calls(), 2048);
        let mut c = ChainHasher::new(hasher, 16, HashExtra::default());
        let mut out = vec![];
        c.feed(&toks, &mut out);
        assert_eq!(s.hashes(), &out[..]);
        assert_eq!(s.block_hash(2048), None);
        assert_eq!(s.block_tokens(1), &toks[16..32]);
    }

    #[test]
    fn adopt_rehashes_once() {
        let a = Hasher::new(HashAlgo::Xxh3, Some(1));
        let b = Hasher::new(HashAlgo::Sha256, Some(1));
        let toks: Vec<u32> = (0..40).collect();
        let mut s = TokenSeq::new(16, &toks, HashExtra::default(), a).unwrap();
        let before = s.hashes().to_vec();
        s.adopt_hasher(b);
        assert_ne!(before, s.hashes());
        assert_eq!(s.hash_calls(), 4);
        s.adopt_hasher(b);
        assert_eq!(s.hash_calls(), 4);
        let fresh = TokenSeq::new(16, &toks, HashExtra::default(), b).unwrap();
        assert_eq!(fresh.hashes(), s.hashes());
    }

    #[test]
    fn zero_block_size_is_an_error() {
        let h = Hasher::new(HashAlgo::Xxh3, Some(1));
        assert!(TokenSeq::new(0, &[1], HashExtra::default(), h).is_err());
    }
}
