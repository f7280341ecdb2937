//! EAGLE/MTP speculative decoding's rules in vLLM v1's KV cache manager (`use_eagle`, the
//! groups flagged `is_eagle_group`): which groups drop the last matched block of a prefix-cache
//! hit, and what that changes in caching.
//!
//! ```text
//!   hit without EAGLE:  [b0][b1][b2][b3]          -> 4 blocks
//!   hit with EAGLE:     [b0][b1][b2][b3] drop b3  -> 3 blocks (b3 recomputed: the drafter
//!                                                    needs its hidden states)
//! ```
//!
//! The drop set (vLLM's coordinator): the groups flagged `is_eagle_group`, or every group when
//! `use_eagle` is set and none is flagged. Releases differ on what `use_eagle = False` means:
//! 0.32 still drops for the flagged groups (its drop set is that set, whatever `use_eagle`
//! says); 0.33 drops for none (its `drop_eagle_group_ids` is empty then). [`drop_groups`]
//! answers for either release.
//!
//! What a dropping group changes (every piece is applied where vLLM applies it):
//! * lookup: full attention drops one block after its scan; a sliding window needs one more
//!   block in a row and pops it after; chunked local attention refuses (vLLM asserts);
//! * the hybrid coordinator's lookup looks one block further ([`margin`]; not for a Mamba
//!   group, whose finder never drops) and drops at most once per candidate length;
//! * hybrid caching: such a group caches one block past the aligned boundary
//!   ([`cacheable_tokens`]); a sliding window's retention mask keeps the peek block
//!   ([`GroupEagle`]) and, with any group dropping, two replay boundaries
//!   ([`replay_boundaries`]); 0.33 also keeps the tail one block below a shared-prefix
//!   junction (a Mamba group too, without the window's peek shift);
//! * Mamba "align" checkpoints sit one unit below the aligned end whenever the manager's
//!   `use_eagle` is set ([`super::mamba_align::AlignRules::checkpoint_at`]).
//!
//! Costs: every function O(1) (or O(groups)); nothing here holds state.

use super::engine::Release;
use crate::error::{Error, Result};

/// Per KV cache group, whether its prefix-cache hits drop the last matched block, under
/// `release`, given `use_eagle` and each group's `is_eagle_group` flag (in group order).
pub fn drop_groups(release: Release, use_eagle: bool, flagged: &[bool]) -> Vec<bool> {
    let any_flagged = flagged.iter().any(|&f| f);
    let eagle = |f: bool| f || (use_eagle && !any_flagged);
    match release {
        Release::V032 => flagged.iter().map(|&f| eagle(f)).collect(),
        Release::V033 => flagged.iter().map(|&f| use_eagle && eagle(f)).collect(),
    }
}

/// What a hybrid group's caching needs to know about EAGLE (vLLM reads the group manager's
/// `use_eagle` and the coordinator's drop set at each `cache_blocks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupEagle {
    /// The group's `use_eagle`: set on every member of an attention group (equal specs) that
    /// holds a dropping group.
    pub group: bool,
    /// Any group drops (`replay_boundaries(..., use_eagle=bool(drop set))`).
    pub replay: bool,
    /// 0.33 with `group`: a junction also keeps the tail one block below it.
    pub junction_peek: bool,
}

impl GroupEagle {
    pub fn new(release: Release, group: bool, replay: bool) -> Self {
        GroupEagle {
            group,
            replay,
            junction_peek: group && release == Release::V033,
        }
    }
}

/// vLLM's `replay_boundaries`: the positions (tokens) a later request replaying a prompt of
/// `num_prompt_tokens` can resume at, at most two, 0 standing for none only without EAGLE.
/// Without EAGLE, one token before the prompt's end; with it, one scheduler block below the
/// resend's and the extension's aligned ends (a sorted, deduplicated pair: `second` is `None`
/// when equal).
pub fn replay_boundaries(num_prompt_tokens: u64, sbs: u64, eagle: bool) -> (u64, Option<u64>) {
    if !eagle {
        return (num_prompt_tokens.saturating_sub(1), None);
    }
    let resend = num_prompt_tokens.saturating_sub(1) / sbs * sbs;
    let extension = num_prompt_tokens / sbs * sbs;
    let (a, b) = (resend.saturating_sub(sbs), extension.saturating_sub(sbs));
    (a.min(b), (a != b).then_some(a.max(b)))
}

/// vLLM's `eagle_proof_margin` without fine-grained hits: a dropping group looks one of its
/// blocks past the candidate length (`block_size` tokens).
pub fn margin(block_size: u32) -> u64 {
    u64::from(block_size)
}

/// vLLM's hybrid `get_num_cacheable_tokens`: the computed tokens rounded down to `sbs`, or,
/// for a group with `use_eagle` (`eagle`) once that rounding is positive, the finalized tokens
/// (the computed ones less the `reprefillable` that multi-module MTP may re-prefill) rounded
/// down plus one `block_size`, at most the finalized tokens.
pub fn cacheable_tokens(
    num_computed_tokens: u64,
    sbs: u64,
    block_size: u32,
    eagle: bool,
    reprefillable: u64,
) -> u64 {
    let aligned = num_computed_tokens / sbs * sbs;
    if !(eagle && aligned > 0) {
        return aligned;
    }
    let finalized = num_computed_tokens.saturating_sub(reprefillable);
    finalized.min(finalized / sbs * sbs + u64::from(block_size))
}

/// vLLM's coordinator's `num_prefill_lookahead` check: with prefix caching and an EAGLE group
/// (`applies`), a multi-module MTP lookahead above the scheduler block size is refused (the
/// excluded tail is one scheduler block). Returns `num_reprefillable_tokens`, `max(0, n - 1)`.
pub fn reprefillable_tokens(num_prefill_lookahead: u64, sbs: u32, applies: bool) -> Result<u64> {
    if applies && u64::from(sbs) < num_prefill_lookahead {
        return Err(Error::invalid(format!(
            "Multi-module MTP with prefix caching requires scheduler_block_size (={sbs}) >= \
             num_speculative_tokens (={num_prefill_lookahead})"
        )));
    }
    Ok(num_prefill_lookahead.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_set_follows_each_release() {
        let none = [false, false];
        let second = [false, true];
        for r in [Release::V032, Release::V033] {
            assert_eq!(drop_groups(r, false, &none), [false, false]);
            assert_eq!(drop_groups(r, true, &none), [true, true]);
            assert_eq!(drop_groups(r, true, &second), [false, true]);
        }
        // A flagged group without use_eagle: 0.32 still drops, 0.33 does not.
        assert_eq!(drop_groups(Release::V032, false, &second), [false, true]);
        assert_eq!(drop_groups(Release::V033, false, &second), [false, false]);
    }

    #[test]
    fn replay_boundaries_with_and_without_eagle() {
        assert_eq!(replay_boundaries(43, 8, false), (42, None));
        // 43: resend 40, extension 40 -> both one block lower.
        assert_eq!(replay_boundaries(43, 8, true), (32, None));
        // 40 (aligned): resend 32, extension 40 -> 24 and 32.
        assert_eq!(replay_boundaries(40, 8, true), (24, Some(32)));
        assert_eq!(replay_boundaries(8, 8, true), (0, None));
        assert_eq!(replay_boundaries(0, 8, true), (0, None));
    }

    #[test]
    fn an_eagle_group_caches_one_block_past_the_boundary() {
        assert_eq!(cacheable_tokens(21, 8, 4, false, 0), 16);
        assert_eq!(cacheable_tokens(21, 8, 4, true, 0), 20);
        assert_eq!(cacheable_tokens(18, 8, 4, true, 0), 18);
        assert_eq!(cacheable_tokens(7, 8, 4, true, 0), 0);
        // Multi-module MTP (3 modules: 2 re-prefillable tokens): only an EAGLE group's
        // finalized tokens count; the others round the computed tokens down as before.
        assert_eq!(cacheable_tokens(21, 8, 4, false, 2), 16);
        assert_eq!(cacheable_tokens(21, 8, 4, true, 2), 19);
        assert_eq!(cacheable_tokens(17, 8, 4, true, 2), 12);
        assert_eq!(cacheable_tokens(9, 8, 4, true, 2), 4);
        assert_eq!(cacheable_tokens(7, 8, 4, true, 2), 0);
    }

    #[test]
    fn a_prefill_lookahead_above_the_scheduler_block_is_refused_with_eagle_and_caching() {
        assert_eq!(reprefillable_tokens(3, 4, true).unwrap(), 2);
        assert_eq!(reprefillable_tokens(4, 4, true).unwrap(), 3);
        assert_eq!(reprefillable_tokens(0, 4, true).unwrap(), 0);
        assert_eq!(reprefillable_tokens(9, 4, false).unwrap(), 8);
        let e = reprefillable_tokens(5, 4, true).unwrap_err().to_string();
        assert!(
            e.contains("scheduler_block_size (=4) >= num_speculative_tokens (=5)"),
            "{e}"
        );
        assert_eq!(
            GroupEagle::new(Release::V032, true, true),
            GroupEagle {
                group: true,
                replay: true,
                junction_peek: false
            }
        );
        assert!(GroupEagle::new(Release::V033, true, true).junction_peek);
    }
}
