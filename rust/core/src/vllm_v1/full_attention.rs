//! vLLM v1's full attention (`FullAttentionManager`, `FullAttentionSpec`) as a kind of
//! [`super::single_type::GroupManager`]: every token attends to every earlier one, so nothing
//! is ever skipped and a request keeps every block until it ends.
//!
//! ```text
//!   hashes:  [h0][h1][h2][h3][h4]        cached in the group: h0 h1 h2 . h4
//!   hit:     [ 7][ 3][12]                 the cached run from block 0 (h4 is unreachable)
//! ```
//!
//! Rules: `get_num_skipped_tokens` is 0; no admission cap; the lookup is the cached prefix
//! from block 0 in every group of the spec, then EAGLE's dropped block
//! ([`super::eagle`]), then rounded down to the coordinator's alignment.
//!
//! Invariants: a hit is a prefix of the request's blocks with no null block; its length in
//! tokens is a multiple of the alignment. Costs: the lookup reads at most
//! `max_length / block_size` hashes and does one cache probe per hash and group.

use super::manager::HashSource;
use super::single_type::{cached_prefix, HitSearch};
use crate::error::Result;

impl HitSearch<'_> {
    /// Full attention: the cached prefix from the left, rounded down to the alignment.
    pub(super) fn full(
        mut self,
        hashes: &mut dyn HashSource,
        scale: usize,
    ) -> Result<(Vec<Vec<u32>>, u64)> {
        let (bs, alignment) = (self.bs, self.alignment);
        let n = cached_prefix(
            self.pool,
            self.groups,
            hashes,
            scale,
            self.max_blocks,
            &mut self.out,
        )?;
        // EAGLE drops one block; round down to the alignment, then drop the blocks past the
        // new tail.
        let mut hit = n as u64 * bs;
        if self.drop_eagle && hit > 0 {
            hit -= alignment.min(bs);
        }
        hit -= hit % alignment;
        let keep = hit.div_ceil(bs) as usize;
        for o in &mut self.out {
            o.truncate(keep);
        }
        Ok((self.out, hit))
    }
}
