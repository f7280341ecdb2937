//! Chained block hash.
//!
//! Block `i` of a sequence hashes to `h_i = H(h_{i-1} || extra_i || tokens[i*bs..(i+1)*bs])`,
//! with `h_{-1} = ROOT`. `extra_i` is the LoRA id, and on block 0 only the optional cache salt,
//! so that two tenants (or two adapters) never share a block. Every field has a fixed width or
//! a length prefix, so two different inputs never encode to the same bytes.
//!
//! `H` is xxh3-128 keyed with a seed (random per process unless given), or SHA-256 truncated to
//! 128 bits where hashes must agree across processes. A cache hit is always confirmed against
//! the stored token ids (see `pool.rs`), so the hash only has to be fast and hard to attack.

use sha2::{Digest, Sha256};
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher as _};
use std::sync::OnceLock;
use xxhash_rust::xxh3::xxh3_128_with_seed;

pub type BlockHash = u128;

/// Parent of block 0.
pub const ROOT: BlockHash = 0x7061_6765_646b_765f_726f_6f74_5f68_6173; // "pagedkv_root_has"

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    Xxh3,
    Sha256,
    /// xxh3 truncated to 3 bits: for tests only, to make hash collisions common and show that
    /// the cache never shares a block whose stored key differs.
    WeakForTesting,
}

impl HashAlgo {
    /// A public algorithm by name (the test-only `WeakForTesting` has no name to parse).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "xxh3" | "xxh3_128" | "xxh3-128" => Some(HashAlgo::Xxh3),
            "sha256" | "sha-256" => Some(HashAlgo::Sha256),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Xxh3 => "xxh3",
            HashAlgo::Sha256 => "sha256",
            HashAlgo::WeakForTesting => "weak-for-testing",
        }
    }
}

/// A hash function plus its key. Two hashers are interchangeable iff they compare equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hasher {
    pub algo: HashAlgo,
    pub seed: u64,
}

/// Random per-process seed, drawn once (std's RandomState is seeded from the OS).
pub fn process_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(0x9e37_79b9_7f4a_7c15);
        h.finish()
    })
}

/// What besides the tokens goes into a block's hash.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HashExtra {
    pub lora_id: i64,
    pub salt: Option<Box<[u8]>>,
}

impl HashExtra {
    /// A 128-bit digest of the extras, stored with each cached block so that a hit is also
    /// confirmed to come from the same LoRA and salt (independent of the block hash function).
    pub fn key(&self) -> u128 {
        let mut buf = Vec::with_capacity(16 + self.salt.as_ref().map_or(0, |s| s.len()));
        buf.extend_from_slice(&self.lora_id.to_le_bytes());
        if let Some(s) = &self.salt {
            buf.push(1);
            buf.extend_from_slice(s);
        }
        xxh3_128_with_seed(&buf, 0x6578_7472_615f_6b65)
    }
}

impl Hasher {
    pub fn new(algo: HashAlgo, seed: Option<u64>) -> Self {
        Hasher {
            algo,
            seed: seed.unwrap_or_else(process_seed),
        }
    }

    /// Hash one full block. `parent` is `None` for block 0. `scratch` is reused between calls
    /// so that hashing allocates nothing once it has grown to one block's size.
    pub fn hash_block(
        &self,
        parent: Option<BlockHash>,
        tokens: &[u32],
        extra: &HashExtra,
        scratch: &mut Vec<u8>,
    ) -> BlockHash {
        scratch.clear();
        scratch.extend_from_slice(&parent.unwrap_or(ROOT).to_le_bytes());
        scratch.extend_from_slice(&extra.lora_id.to_le_bytes());
        match (&extra.salt, parent) {
            (Some(salt), None) => {
                scratch.push(1);
                scratch.extend_from_slice(&(salt.len() as u64).to_le_bytes());
                scratch.extend_from_slice(salt);
            }
            _ => scratch.push(0),
        }
        for t in tokens {
            scratch.extend_from_slice(&t.to_le_bytes());
        }
        match self.algo {
            HashAlgo::Xxh3 => xxh3_128_with_seed(scratch, self.seed),
            HashAlgo::WeakForTesting => xxh3_128_with_seed(scratch, self.seed) & 0b111,
            HashAlgo::Sha256 => {
                let mut d = Sha256::new();
                d.update(self.seed.to_le_bytes());
                d.update(&scratch[..]);
                let out = d.finalize();
                let mut first = [0u8; 16];
                first.copy_from_slice(&out[..16]);
                u128::from_le_bytes(first)
            }
        }
    }
}

/// Incremental chained hasher: feed tokens as they arrive, get back the hashes of the blocks
/// that just became full. Keeps only the unfinished block's tokens.
#[derive(Clone, Debug)]
pub struct ChainHasher {
    hasher: Hasher,
    block_size: usize,
    extra: HashExtra,
    parent: Option<BlockHash>,
    pending: Vec<u32>,
    num_blocks: usize,
    scratch: Vec<u8>,
}

impl ChainHasher {
    pub fn new(hasher: Hasher, block_size: usize, extra: HashExtra) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        ChainHasher {
            hasher,
            block_size,
            extra,
            parent: None,
            pending: Vec::with_capacity(block_size),
            num_blocks: 0,
            scratch: Vec::new(),
        }
    }

    /// Number of full blocks hashed so far (each exactly once).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_pending_tokens(&self) -> usize {
        self.pending.len()
    }

    /// Feed tokens; append the hashes of newly completed blocks to `out`.
    pub fn feed(&mut self, mut tokens: &[u32], out: &mut Vec<BlockHash>) {
        while !tokens.is_empty() {
            if self.pending.is_empty() && tokens.len() >= self.block_size {
                // Whole block straight from the input, no copy into `pending`.
                let (block, rest) = tokens.split_at(self.block_size);
                self.finish_block(block, out);
                tokens = rest;
                continue;
            }
            let take = (self.block_size - self.pending.len()).min(tokens.len());
            self.pending.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if self.pending.len() == self.block_size {
                let block = std::mem::take(&mut self.pending);
                self.finish_block(&block, out);
                self.pending = block;
                self.pending.clear();
            }
        }
    }

    fn finish_block(&mut self, block: &[u32], out: &mut Vec<BlockHash>) {
        let h = self
            .hasher
            .hash_block(self.parent, block, &self.extra, &mut self.scratch);
        self.parent = Some(h);
        self.num_blocks += 1;
        out.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h() -> Hasher {
        Hasher::new(HashAlgo::Xxh3, Some(42))
    }

    fn chain(hasher: Hasher, bs: usize, toks: &[u32], extra: HashExtra) -> Vec<BlockHash> {
        let mut c = ChainHasher::new(hasher, bs, extra);
        let mut out = vec![];
        c.feed(toks, &mut out);
        out
    }

    #[test]
    fn incremental_equals_one_shot() {
        let toks: Vec<u32> = (0..100).collect();
        let whole = chain(h(), 16, &toks, HashExtra::default());
        assert_eq!(whole.len(), 6);
        let mut c = ChainHasher::new(h(), 16, HashExtra::default());
        let mut out = vec![];
        for t in &toks {
            let before = out.len();
            c.feed(std::slice::from_ref(t), &mut out);
            // a block's hash appears exactly when its last token arrives
            assert_eq!(out.len() - before, usize::from((*t as usize + 1) % 16 == 0));
        }
        assert_eq!(out, whole);
        assert_eq!(c.num_blocks(), 6);
        assert_eq!(c.num_pending_tokens(), 4);
    }

    #[test]
    fn change_propagates_to_later_blocks_only() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 999; // block 1
        let ha = chain(h(), 16, &a, HashExtra::default());
        let hb = chain(h(), 16, &b, HashExtra::default());
        assert_eq!(ha[0], hb[0]);
        for i in 1..4 {
            assert_ne!(ha[i], hb[i]);
        }
    }

    #[test]
    fn extras_and_seeds_separate_hashes() {
        let a: Vec<u32> = (0..32).collect();
        let base = chain(h(), 16, &a, HashExtra::default());
        let lora = chain(
            h(),
            16,
            &a,
            HashExtra {
                lora_id: 3,
                salt: None,
            },
        );
        let salt = chain(
            h(),
            16,
            &a,
            HashExtra {
                lora_id: 0,
                salt: Some(b"t1".to_vec().into()),
            },
        );
        let seed = chain(
            Hasher::new(HashAlgo::Xxh3, Some(43)),
            16,
            &a,
            HashExtra::default(),
        );
        let sha = chain(
            Hasher::new(HashAlgo::Sha256, Some(42)),
            16,
            &a,
            HashExtra::default(),
        );
        for other in [&lora, &salt, &seed, &sha] {
            assert_ne!(base[0], other[0]);
            assert_ne!(base[1], other[1]);
        }
        // sha256 is deterministic for a given seed
        assert_eq!(
            sha,
            chain(
                Hasher::new(HashAlgo::Sha256, Some(42)),
                16,
                &a,
                HashExtra::default()
            )
        );
    }

    #[test]
    fn salt_and_tokens_cannot_alias() {
        // salt "ab" + tokens vs. no salt: the length prefix keeps them apart
        let a: Vec<u32> = (0..16).collect();
        let x = chain(
            h(),
            16,
            &a,
            HashExtra {
                lora_id: 0,
                salt: Some(Box::from(&b""[..])),
            },
        );
        let y = chain(h(), 16, &a, HashExtra::default());
        assert_ne!(x, y);
    }
}
