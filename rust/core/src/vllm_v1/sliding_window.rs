//! vLLM v1's sliding-window attention (`SlidingWindowManager`, `SlidingWindowSpec`) as a kind
//! of [`super::single_type::GroupManager`]: a token attends to the `sliding_window` tokens
//! ending at it, so blocks wholly before the window are freed (replaced by the null block).
//!
//! ```text
//!   window 8, block 4, 21 tokens computed:  [ 0][ 0][ 0][ 9][11][12]
//!   skipped: 21 + 1 - 8 = 14 tokens -> 3 whole blocks null
//! ```
//!
//! Rules, with `retained = sliding_window + extra_retained_tokens` (multi-module MTP's
//! `num_prefill_lookahead_tokens - 1` held below the window): `get_num_skipped_tokens(n) =
//! max(n + 1 - retained, 0)`; the admission cap is `ceil(min(retained - 1 +
//! max_in_flight_tokens, max_model_len) / block_size) + 1` (the window may start inside a
//! block). The lookup and the retention mask read the window alone: the lookup scans from the
//! right for the first run of `ceil((sliding_window - 1) / block_size)` cached blocks (one
//! more under EAGLE, popped after), null blocks before it, a shorter run reaching block 0
//! also a hit. What gets cached under each retention mode is [`super::retention`].
//!
//! Invariants: null blocks only lead a hit or a table; a hit's length is a multiple of the
//! alignment. Costs: the lookup reads at most `max_length / block_size` hashes, from the right,
//! and stops at its first run.

use super::pool::NULL_BLOCK;
use super::single_type::{cached_in_all, HitSearch, View};
use crate::error::Result;

/// `get_num_skipped_tokens` of a window holding `retained` tokens (the window plus its extra
/// retained tokens).
pub fn num_skipped_tokens(retained: u32, num_computed_tokens: u64) -> u64 {
    (num_computed_tokens + 1).saturating_sub(u64::from(retained))
}

/// `max_admission_blocks_per_request` of a window of `retained` tokens (the window plus its
/// extra retained tokens; one block more: the window may start inside one).
pub fn max_admission_blocks(retained: u32, bs: u64, in_flight: u64, max_len: u64) -> u64 {
    (u64::from(retained) - 1 + in_flight)
        .min(max_len)
        .div_ceil(bs)
        + 1
}

impl HitSearch<'_> {
    /// Sliding window: from the right, the first run of `need` cached blocks (null blocks
    /// before it); a run reaching block 0 is a hit even when shorter.
    pub(super) fn sliding_window(
        mut self,
        mut view: View<'_>,
        need: usize,
    ) -> Result<(Vec<Vec<u32>>, u64)> {
        let (bs, alignment) = (self.bs, self.alignment);
        // vLLM indexes the view for every block below max_length // block_size; the
        // request's hashes cover those (a hit is capped below its length).
        let max_blocks = self.max_blocks.min(view.count()?);
        for o in &mut self.out {
            o.resize(max_blocks, NULL_BLOCK);
        }
        let mut run = 0usize;
        let mut found = false;
        let mut hit = Vec::with_capacity(self.groups.len());
        // From the right; the first run of `need` cached blocks wins.
        for i in (0..max_blocks).rev() {
            if cached_in_all(self.pool, &view.key(i)?, self.groups, &mut hit) {
                // A run may only end where the hit length (after EAGLE's pop) stays aligned.
                let kept = i as u64 + u64::from(!self.drop_eagle);
                if run == 0 && bs != alignment && (kept * bs) % alignment != 0 {
                    continue;
                }
                for (o, &b) in self.out.iter_mut().zip(&hit) {
                    o[i] = b;
                }
                run += 1;
                if run >= need {
                    for o in &mut self.out {
                        o.truncate(i + run);
                    }
                    found = true;
                    break;
                }
            } else {
                run = 0;
            }
        }
        if !found {
            // The run reaching block 0 is a hit even when shorter than the window.
            for o in &mut self.out {
                o.truncate(run);
            }
            self.realign();
        }
        if self.drop_eagle && !self.out[0].is_empty() {
            // EAGLE's peek block goes; the pop may break the alignment.
            for o in &mut self.out {
                o.pop();
            }
            self.realign();
        }
        let hit = self.out[0].len() as u64 * bs;
        Ok((self.out, hit))
    }

    /// Pop blocks until the hit's length is a multiple of the alignment.
    pub(super) fn realign(&mut self) {
        let (bs, alignment) = (self.bs, self.alignment);
        while bs != alignment && (self.out[0].len() as u64 * bs) % alignment != 0 {
            for o in &mut self.out {
                o.pop();
            }
        }
    }
}
