//! vLLM v1's Mamba (state-space / linear-attention) KV cache groups (`MambaManager` in
//! `single_type_kv_cache_manager.py`, `MambaSpec` in `kv_cache_interface.py`), as a kind of
//! [`super::single_type::GroupManager`] ([`AttentionKind::Mamba`]), and the block zeroing a
//! Mamba layer turns on for the attention groups beside it ([`ZeroList`]).
//!
//! ```text
//!   mamba_cache_mode "none" (prefix caching off; block_size = max_model_len):
//!     group 0 (full, 16):      [ 7][ 3][12][ 9]     one block per 16 tokens
//!     group 1 (mamba, 4096):   [ 5]                 one state block per request (+ one per
//!                                                   speculative block), never freed early
//! ```
//!
//! Mirrored: mode `"none"`, vLLM's default and the only mode without prefix caching (vLLM's
//! model config turns `"none"` into `"align"` when prefix caching is on, and back when it is
//! off). There a Mamba group is the base single-type manager with two rules of its own:
//! * `get_num_skipped_tokens(n) = n - 1`: only the last computed token's state is needed, so
//!   with the state block spanning `max_model_len` tokens nothing is ever skipped in practice
//!   (a smaller block size, as tests use, frees the blocks wholly before the last token);
//! * `num_speculative_blocks` (MTP/EAGLE with linear attention) extra blocks' worth of tokens
//!   added to every count and allocation (`get_num_blocks_to_allocate`,
//!   `allocate_new_blocks`);
//!
//! and no admission cap (`MambaSpec` declares none). The coordinator then is vLLM's
//! `KVCacheCoordinatorNoPrefixCache`: no hits, no caching, no hash lookups.
//!
//! Mode `"align"` (a Mamba group with prefix caching on) is its own kind,
//! [`AttentionKind::MambaAlign`], with its rules in [`super::mamba_align`]. A mode-`"none"`
//! group with caching on is refused by [`check`] (and by `pagedkv.vllm_v1`'s scope before
//! it): vLLM 0.33 asserts against it; 0.32 would cache state blocks as full attention does.
//!
//! Zeroing: a Mamba layer makes vLLM's `KVCacheConfig.needs_kv_cache_zeroing` true; every
//! attention group (full, sliding window, chunked local: `AttentionSpec`s; not the Mamba
//! group) then records the ids of the blocks `allocate_new_blocks` hands out, and the
//! scheduler drains them each step into `SchedulerOutput.new_block_ids_to_zero`, group by
//! group (`take_new_block_ids`). 0.32 and 0.33 agree on all of this.
//!
//! Invariants: a Mamba group's table holds its blocks in token order, null blocks only as a
//! prefix (as every group's, [`super::single_type`]); [`ZeroList`] holds, per group and in
//! allocation order, exactly the blocks handed out to attention groups since the last drain.
//!
//! Costs: the rules are O(1); zeroing adds 4 B per block handed out until the next drain.

use super::single_type::AttentionKind;
use crate::error::{Error, Result};

/// vLLM's `MambaManager.get_num_skipped_tokens`: every token but the last computed one
/// (`n - 1`; vLLM's `-1` for `n = 0` skips nothing, as 0 does).
pub fn num_skipped_tokens(num_computed_tokens: u64) -> u64 {
    num_computed_tokens.saturating_sub(1)
}

/// The token slots a Mamba group counts and allocates for `num_tokens`: `num_speculative_blocks`
/// whole blocks more (mode `"none"`).
pub fn slot_tokens(num_tokens: u64, block_size: u32, num_speculative_blocks: u32) -> u64 {
    num_tokens.saturating_add(u64::from(block_size) * u64::from(num_speculative_blocks))
}

/// Whether a group of `kind` may be built with caching `enable_caching`: a mode-`"none"`
/// Mamba group only without prefix caching (with it, vLLM uses mode `"align"`:
/// [`AttentionKind::MambaAlign`]).
pub fn check(kind: AttentionKind, enable_caching: bool) -> Result<()> {
    if matches!(kind, AttentionKind::Mamba { .. }) && enable_caching {
        return Err(Error::invalid(
            "a Mamba KV cache group in mamba_cache_mode \"none\" with prefix caching is not \
             mirrored by pagedkv: with prefix caching vLLM uses mode \"align\"",
        ));
    }
    Ok(())
}

/// Whether vLLM's manager for `kind` records its new blocks for zeroing (an `AttentionSpec`:
/// every kind here but Mamba).
pub fn records_new_blocks(kind: AttentionKind) -> bool {
    !matches!(
        kind,
        AttentionKind::Mamba { .. } | AttentionKind::MambaAlign { .. }
    )
}

/// The blocks handed out since the last drain, per group, to be zeroed by the worker
/// (`new_block_ids` of each single-type manager).
#[derive(Clone, Debug, Default)]
pub struct ZeroList {
    per_group: Vec<Vec<u32>>,
}

impl ZeroList {
    pub fn new(num_groups: usize) -> Self {
        ZeroList {
            per_group: vec![Vec::new(); num_groups],
        }
    }

    /// Note `blocks`, just handed out to `group` of `kind`.
    pub fn record(&mut self, group: usize, kind: AttentionKind, blocks: &[u32]) {
        if records_new_blocks(kind) {
            if let Some(g) = self.per_group.get_mut(group) {
                g.extend_from_slice(blocks);
            }
        }
    }

    /// vLLM's `KVCacheManager.take_new_block_ids`: every group's list in group order, drained.
    pub fn take(&mut self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.per_group.iter().map(Vec::len).sum());
        for g in &mut self.per_group {
            out.append(g);
        }
        out
    }

    /// Heap bytes held (memory accounting).
    pub fn heap_bytes(&self) -> usize {
        use crate::mem::vec_bytes;
        vec_bytes(&self.per_group) + self.per_group.iter().map(vec_bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAMBA: AttentionKind = AttentionKind::Mamba {
        num_speculative_blocks: 0,
    };

    #[test]
    fn only_the_last_token_state_is_kept() {
        assert_eq!(num_skipped_tokens(0), 0);
        assert_eq!(num_skipped_tokens(1), 0);
        assert_eq!(num_skipped_tokens(17), 16);
    }

    #[test]
    fn speculative_blocks_add_whole_blocks_of_slots() {
        assert_eq!(slot_tokens(10, 16, 0), 10);
        assert_eq!(slot_tokens(10, 16, 2), 42);
        assert_eq!(slot_tokens(u64::MAX, 16, 2), u64::MAX);
    }

    #[test]
    fn mode_none_is_refused_with_caching_accepted_without() {
        assert!(check(MAMBA, true).is_err());
        assert!(check(MAMBA, false).is_ok());
        assert!(check(AttentionKind::Full, true).is_ok());
    }

    #[test]
    fn zeroing_records_attention_groups_only_and_drains_in_group_order() {
        let mut z = ZeroList::new(3);
        z.record(2, AttentionKind::Full, &[9]);
        z.record(1, MAMBA, &[5]);
        z.record(0, AttentionKind::Full, &[3, 4]);
        z.record(2, AttentionKind::Full, &[7]);
        assert_eq!(z.take(), vec![3, 4, 9, 7]);
        assert!(z.take().is_empty());
    }
}
