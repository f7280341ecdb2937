//! vLLM v1's chunked local attention (`ChunkedLocalAttentionManager`,
//! `ChunkedLocalAttentionSpec`, Llama 4) as a kind of [`super::single_type::GroupManager`]: a
//! token attends to the tokens of its own `attention_chunk_size` chunk, so every block of an
//! earlier chunk is freed (replaced by the null block).
//!
//! ```text
//!   chunk 8, block 4, 17 tokens computed:  [ 0][ 0][ 0][ 0][ 6]
//!   skipped: 17 / 8 * 8 = 16 tokens -> 4 blocks null
//! ```
//!
//! Rules: `get_num_skipped_tokens(n) = n / chunk * chunk`; the admission cap is
//! `ceil(min(chunk + max_in_flight_tokens, max_model_len) / block_size)`; the lookup counts the
//! blocks wholly before the next token's chunk as null hits, then the cached blocks from the
//! chunk's start. Groups of other block sizes beside it are refused, as vLLM asserts.
//!
//! Invariants: null blocks only lead a hit or a table. Costs: the lookup reads at most the
//! hashes of one chunk.

use super::pool::NULL_BLOCK;
use super::single_type::{cached_in_all, HitSearch, View};
use crate::error::{Error, Result};

/// `get_num_skipped_tokens` of chunks of `chunk` tokens: every token before the current one.
pub fn num_skipped_tokens(chunk: u32, num_computed_tokens: u64) -> u64 {
    let c = u64::from(chunk);
    num_computed_tokens / c * c
}

/// `max_admission_blocks_per_request` of chunked local attention.
pub fn max_admission_blocks(chunk: u32, bs: u64, in_flight: u64, max_len: u64) -> u64 {
    (u64::from(chunk) + in_flight).min(max_len).div_ceil(bs)
}

impl HitSearch<'_> {
    /// Chunked local attention: the blocks wholly before the next token's chunk are null
    /// hits, then the cached blocks from the chunk's start.
    pub(super) fn chunked_local(
        mut self,
        mut view: View<'_>,
        chunk: u64,
        max_length: u64,
    ) -> Result<(Vec<Vec<u32>>, u64)> {
        let bs = self.bs;
        if bs != self.alignment {
            // vLLM asserts this (AssertionError) in the same place.
            return Err(Error::invalid(
                "KV cache groups with different block sizes are not compatible with \
                 chunked local attention (vLLM asserts the same)",
            ));
        }
        // Blocks wholly before the chunk the next token is in count as hits (null).
        let start = max_length / chunk * chunk;
        let start_block = (start / bs) as usize;
        for o in &mut self.out {
            o.resize(start_block, NULL_BLOCK);
        }
        let mut hit = Vec::with_capacity(self.groups.len());
        for i in start_block..self.max_blocks.min(view.count()?) {
            if !cached_in_all(self.pool, &view.key(i)?, self.groups, &mut hit) {
                break;
            }
            for (o, &b) in self.out.iter_mut().zip(&hit) {
                o.push(b);
            }
        }
        let hit = self.out[0].len() as u64 * bs;
        Ok((self.out, hit))
    }
}
