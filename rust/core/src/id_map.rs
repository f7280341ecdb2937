//! Hash maps and sets keyed by small engine-assigned integers (sequence ids, group keys,
//! block numbers).
//!
//! Their hasher is one multiply: SipHash costs several times more, and these maps are probed
//! several times per running sequence per step. The keys are counters the engine assigns, not
//! strings a client chooses, so keyed mixing buys nothing here.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;

/// The multiplicative hasher of [`IdMap`] and [`IdSet`].
#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (x ^ (x >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
}

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
pub type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;
