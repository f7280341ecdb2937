//! vLLM v1's prefix-cache retention for sliding-window groups (`CacheConfig.
//! prefix_cache_retention_interval`, resolved into `KVCacheConfig`): which of a request's newly
//! full blocks a sliding-window group puts in the prefix cache (`SlidingWindowManager.
//! reachable_block_mask`, called from `SingleTypeKVCacheManager.cache_blocks`). A block left out
//! goes back to the free queue uncached (to its head), so retention also decides later block ids.
//!
//! ```text
//!   a window needing 1 block, 4-token blocks, hits aligned to 8 tokens, a prompt of 43:
//!   block         0 1 2 3 4 5 6 7 8 9 10
//!   None (dense)    x   x   x   x   x   the tail before every alignment boundary
//!   0                               x   the replay boundary 42 -> 40: its tail only
//!   16                  x       x   x   and the tail before every 16 tokens
//! ```
//!
//! The three modes vLLM 0.32 and 0.33 offer (the same in both, for what is mirrored here):
//! * `None` ([`Retention::Dense`]): a window hit needs `need` blocks in a row ending on a
//!   hit-alignment boundary, so the `need` blocks before each boundary are cached, the rest not;
//! * `0` ([`Retention::Sparse`] with interval 0, vLLM's engine default): only the `need` blocks
//!   ending on the request's *boundaries*: its replay boundary (`num_prompt_tokens - 1`, where a
//!   resend of the same prompt stops; vLLM's `replay_boundaries` without EAGLE) and its
//!   shared-prefix junction (`request.shared_prefix_boundary`, set by the scheduler from
//!   `get_computed_blocks`: where another group's longer hit says a prefix is shared), each
//!   rounded down to the alignment;
//! * a positive multiple of the scheduler block size: those boundary tails plus the tail before
//!   every `interval`-token boundary.
//!
//! In the dense and periodic modes, when a hit needs at least a segment's blocks
//! (`need >= per_segment`), every block is cached (the boundaries are not consulted). Full-attention and chunked local groups
//! ignore retention (they cache every block). vLLM validates the interval when it builds a
//! coordinator, caching on or off ([`Retention::from_interval`]): a nonzero interval needs a
//! sliding-window (or Mamba) group, and must be non-negative and a multiple of the scheduler
//! block size. Mamba "align" groups ([`super::mamba_align`]) keep one state block per
//! boundary (a hit needs only the block ending on it: `need` 1, never an EAGLE shift) and
//! every block when dense; `final_segment_end_block` (passed only by offloading connectors)
//! is outside pagedkv's scope.
//! EAGLE ([`GroupEagle`], [`super::eagle`]): a dropping group's hit needs one more block and
//! ends one block past its boundary (the peek: `shift` 1); with any group dropping the replay
//! boundaries are vLLM's EAGLE pair; 0.33 adds the junction one block lower for a dropping
//! group.
//!
//! Invariants: [`Retained::contains`] answers exactly what vLLM's mask holds at that position
//! (for positions at or past the request's first uncached block); [`Retained::All`] is vLLM's
//! `None` mask.
//! Costs: [`Retained::new`] O(1), [`Retained::contains`] O(1); nothing allocated.

use super::eagle::{replay_boundaries, GroupEagle};
use super::single_type::{AttentionKind, GroupSpec};
use crate::error::{Error, Result};

/// vLLM's `prefix_cache_retention_interval`, as sliding-window groups read it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Retention {
    /// `None`: a tail before every hit-alignment boundary.
    #[default]
    Dense,
    /// `Some(interval)`: the tails ending on the request's boundaries, plus (interval > 0) the
    /// tail before every `interval`-token boundary.
    Sparse { interval: u64 },
}

impl Retention {
    /// vLLM's `_validate_prefix_cache_retention_interval`, checks in vLLM's order: `None` is
    /// dense; without a sliding-window group only 0 is allowed (and changes nothing); else a
    /// non-negative multiple of `scheduler_block_size`.
    pub fn from_interval(
        interval: Option<i64>,
        scheduler_block_size: u32,
        has_window: bool,
    ) -> Result<Self> {
        let Some(interval) = interval else {
            return Ok(Retention::Dense);
        };
        if !has_window && interval != 0 {
            return Err(Error::invalid(
                "prefix_cache_retention_interval is set but this model has no sliding-window \
                 or Mamba KV cache group, so retention has no effect; set it to 0 (it only \
                 applies to sliding-window and Mamba attention)",
            ));
        }
        let sbs = i64::from(scheduler_block_size);
        if interval < 0 || sbs == 0 || interval % sbs != 0 {
            return Err(Error::invalid(format!(
                "prefix_cache_retention_interval ({interval}) must be non-negative and a \
                 multiple of scheduler_block_size ({scheduler_block_size})"
            )));
        }
        Ok(Retention::Sparse {
            interval: interval as u64,
        })
    }

    /// The interval as vLLM spells it (`None`: dense).
    pub fn interval(&self) -> Option<i64> {
        match *self {
            Retention::Dense => None,
            Retention::Sparse { interval } => Some(i64::try_from(interval).unwrap_or(i64::MAX)),
        }
    }
}

/// The request's fields sparse retention reads when it caches (vLLM reads them off the
/// `Request` at each `cache_blocks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Boundaries {
    /// `request.num_prompt_tokens`: the replay boundary is one token before its end.
    pub num_prompt_tokens: u64,
    /// `request.shared_prefix_boundary` (0: none).
    pub shared_prefix_boundary: u64,
}

/// Where a call gets the request's [`Boundaries`]: given, or read when first needed. The
/// bindings read them off vLLM's request (two attribute reads); an `allocate_slots` call
/// needs them only to cache a block or for a Mamba align group, which most decode steps of
/// a model without one do not.
#[derive(Clone, Copy)]
pub enum BoundarySource<'a> {
    Given(Boundaries),
    Read(&'a dyn Fn() -> Result<Boundaries>),
}

impl BoundarySource<'_> {
    /// The boundaries (read now for [`BoundarySource::Read`]).
    pub fn get(&self) -> Result<Boundaries> {
        match self {
            BoundarySource::Given(b) => Ok(*b),
            BoundarySource::Read(read) => read(),
        }
    }
}

impl Default for BoundarySource<'_> {
    fn default() -> Self {
        BoundarySource::Given(Boundaries::default())
    }
}

impl From<Boundaries> for BoundarySource<'_> {
    fn from(b: Boundaries) -> Self {
        BoundarySource::Given(b)
    }
}

impl std::fmt::Debug for BoundarySource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BoundarySource::Given(b) => f.debug_tuple("Given").field(b).finish(),
            BoundarySource::Read(_) => f.write_str("Read(..)"),
        }
    }
}

/// Which blocks of a request one group caches: vLLM's `reachable_block_mask`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Retained {
    /// Every block (vLLM's `None` mask).
    #[default]
    All,
    /// Block `i` is cached iff `i >= shift` and `(i - shift) % per_segment >= per_segment -
    /// need` (when `per_segment` is set) or `ends[k] - need <= i < ends[k]` for a boundary
    /// tail `k` (0: no tail). `shift` is 1 for an EAGLE group (its run ends one block past
    /// the boundary: the peek block it drops), else 0.
    Tails {
        per_segment: Option<u64>,
        need: u64,
        shift: u64,
        ends: [u64; 4],
    },
}

impl Retained {
    /// The mask of group `spec` under `retention`, hits aligned to `alignment` tokens, for a
    /// request at `boundaries`, the group's EAGLE state `eagle` ([`GroupEagle`]).
    pub fn new(
        spec: &GroupSpec,
        retention: Retention,
        alignment: u64,
        boundaries: Boundaries,
        eagle: GroupEagle,
    ) -> Self {
        let bs = u64::from(spec.block_size);
        let need = match spec.kind {
            AttentionKind::SlidingWindow { sliding_window, .. } => {
                GroupSpec::contiguous_blocks_for_hit(sliding_window, spec.block_size) as u64
                    + u64::from(eagle.group)
            }
            // Mamba (align): a hit needs the one state block ending on the boundary; dense
            // retention keeps every block.
            AttentionKind::MambaAlign { .. } if retention != Retention::Dense => 1,
            _ => return Retained::All,
        };
        if alignment == 0 || alignment % bs != 0 {
            // A sub-block alignment cannot be masked by block: vLLM keeps every block.
            return Retained::All;
        }
        let segment = match retention {
            Retention::Dense => Some(alignment),
            Retention::Sparse { interval: 0 } => None,
            Retention::Sparse { interval } => Some(interval),
        };
        let per_segment = segment.map(|s| s / bs);
        if per_segment.is_some_and(|p| need >= p) {
            return Retained::All;
        }
        // A window's EAGLE hit peeks one block past the boundary; a Mamba hit is the one
        // state block ending on it (vLLM's Mamba mask takes no EAGLE shift).
        let is_window = matches!(spec.kind, AttentionKind::SlidingWindow { .. });
        let shift = u64::from(eagle.group && is_window);
        let ends = match retention {
            Retention::Dense => [0; 4],
            Retention::Sparse { .. } => {
                Self::boundary_ends(boundaries, alignment, bs, shift, eagle)
            }
        };
        Retained::Tails {
            per_segment,
            need,
            shift,
            ends,
        }
    }

    /// The (exclusive) end block of each boundary tail: the replay boundaries
    /// ([`super::eagle::replay_boundaries`]), the shared-prefix junction and (0.33, EAGLE
    /// group) the junction one block lower, each rounded down to the alignment, plus `shift`.
    fn boundary_ends(
        b: Boundaries,
        alignment: u64,
        bs: u64,
        shift: u64,
        e: GroupEagle,
    ) -> [u64; 4] {
        let end = |tokens: u64| tokens / alignment * alignment / bs + shift;
        let mut ends = [0; 4];
        let (first, second) = replay_boundaries(b.num_prompt_tokens, alignment, e.replay);
        ends[0] = end(first);
        ends[1] = second.map_or(0, end);
        let junction = b.shared_prefix_boundary;
        if junction > 0 {
            ends[2] = end(junction);
            if e.junction_peek && junction >= bs {
                ends[3] = end(junction - bs);
            }
        }
        ends
    }

    /// Whether the block at position `i` of the request's table is cached.
    pub fn contains(&self, i: usize) -> bool {
        let Retained::Tails {
            per_segment,
            need,
            shift,
            ends,
        } = *self
        else {
            return true;
        };
        let i = i as u64;
        per_segment.is_some_and(|p| i >= shift && (i - shift) % p >= p - need)
            || ends.iter().any(|&e| i < e && i + need >= e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swa(window: u32, bs: u32) -> GroupSpec {
        GroupSpec::new(
            AttentionKind::SlidingWindow {
                sliding_window: window,
                extra_retained_tokens: 0,
            },
            bs,
        )
    }

    fn at(prompt: u64, junction: u64) -> Boundaries {
        Boundaries {
            num_prompt_tokens: prompt,
            shared_prefix_boundary: junction,
        }
    }

    fn cached(r: Retained, n: usize) -> Vec<usize> {
        (0..n).filter(|&i| r.contains(i)).collect()
    }

    #[test]
    fn validation_follows_vllms_order() {
        // _validate_prefix_cache_retention_interval.
        let ok = |i, w| Retention::from_interval(i, 32, w);
        assert_eq!(ok(None, false).unwrap(), Retention::Dense);
        assert_eq!(
            ok(Some(0), false).unwrap(),
            Retention::Sparse { interval: 0 }
        );
        assert_eq!(
            ok(Some(64), true).unwrap(),
            Retention::Sparse { interval: 64 }
        );
        let msg = |i, w| ok(i, w).unwrap_err().to_string();
        // No window: any nonzero value is refused for that reason first, negative included.
        assert!(msg(Some(16), false).contains("no sliding-window or Mamba"));
        assert!(msg(Some(-32), false).contains("no sliding-window or Mamba"));
        assert!(msg(Some(33), true).contains("multiple of scheduler_block_size (32)"));
        // -32 % 32 == 0: refused as negative all the same.
        assert!(msg(Some(-32), true).contains("non-negative"));
        assert_eq!(Retention::Sparse { interval: 64 }.interval(), Some(64));
        assert_eq!(Retention::Dense.interval(), None);
    }

    #[test]
    fn dense_keeps_the_tail_before_every_alignment_boundary() {
        // reachable_block_mask(None): segment = alignment 16 over 4-token blocks -> 4 per
        // segment; window 5 needs 1 block -> i % 4 == 3. The boundaries are not consulted.
        let r = Retained::new(
            &swa(5, 4),
            Retention::Dense,
            16,
            at(43, 20),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 11), [3, 7]);
        // A window needing the whole segment (window 14: 4 blocks): every block.
        assert_eq!(
            Retained::new(
                &swa(14, 4),
                Retention::Dense,
                16,
                at(43, 0),
                GroupEagle::default()
            ),
            Retained::All
        );
    }

    #[test]
    fn zero_keeps_only_the_replay_tail_and_the_junction_tail() {
        // vLLM's test_pure_swa_retention_latest_only: block 16, window 16 (need 1), a prompt
        // of 256: the replay boundary 255 -> 240 -> block 15 ends there: block 14 only.
        let r = Retained::new(
            &swa(16, 16),
            Retention::Sparse { interval: 0 },
            16,
            at(256, 0),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 16), [14]);
        // test_hybrid_local_kv_retention_latest_only_reuses_replay_boundary: block 8, window
        // 8, alignment 32, prompt 128: 127 -> 96 -> block 12: block 11 only.
        let r = Retained::new(
            &swa(8, 8),
            Retention::Sparse { interval: 0 },
            32,
            at(128, 0),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 16), [11]);
        // Block 4, window 9 (need 2), alignment 16: the replay boundary 59 -> 48 -> blocks 10
        // and 11; the junction 70 -> 64 -> blocks 14 and 15.
        let r = Retained::new(
            &swa(9, 4),
            Retention::Sparse { interval: 0 },
            16,
            at(60, 70),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 20), [10, 11, 14, 15]);
    }

    #[test]
    fn a_positive_interval_adds_periodic_tails() {
        // test_pure_swa_retention_interval_caches_sparse_tails: interval 64 over 16-token
        // blocks -> 4 per segment, need 1 -> {3, 7, 11, 15}; replay 255 -> block 14.
        let r = Retained::new(
            &swa(16, 16),
            Retention::Sparse { interval: 64 },
            16,
            at(256, 0),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 16), [3, 7, 11, 14, 15]);
        // test_hybrid_local_kv_retention_interval_aligns_in_manager: alignment 32, interval
        // 64, block 8 -> 8 per segment: {7, 15}; replay 127 -> 96 -> block 11.
        let r = Retained::new(
            &swa(8, 8),
            Retention::Sparse { interval: 64 },
            32,
            at(128, 0),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 16), [7, 11, 15]);
        // A hit needing a whole segment caches every block, the boundaries unread.
        let r = Retained::new(
            &swa(64, 16),
            Retention::Sparse { interval: 64 },
            16,
            at(256, 0),
            GroupEagle::default(),
        );
        assert_eq!(r, Retained::All);
    }

    #[test]
    fn short_prompts_and_other_kinds_cache_what_vllm_caches() {
        // A replay boundary below one alignment unit (prompt of 1..=alignment tokens) has no
        // tail; no junction (0) has none.
        let r = Retained::new(
            &swa(5, 4),
            Retention::Sparse { interval: 0 },
            8,
            at(8, 0),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 4), Vec::<usize>::new());
        let r = Retained::new(
            &swa(5, 4),
            Retention::Sparse { interval: 0 },
            8,
            at(0, 0),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 4), Vec::<usize>::new());
        // Window 1 needs no block: nothing is ever cached, even at a boundary.
        let r = Retained::new(
            &swa(1, 4),
            Retention::Sparse { interval: 0 },
            4,
            at(40, 12),
            GroupEagle::default(),
        );
        assert_eq!(cached(r, 10), Vec::<usize>::new());
        // Full and chunked local attention ignore retention.
        let full = GroupSpec::new(AttentionKind::Full, 4);
        let chunk = GroupSpec::new(
            AttentionKind::ChunkedLocal {
                attention_chunk_size: 8,
            },
            4,
        );
        for spec in [full, chunk] {
            let r = Retained::new(
                &spec,
                Retention::Sparse { interval: 0 },
                4,
                at(40, 0),
                GroupEagle::default(),
            );
            assert_eq!(r, Retained::All);
        }
    }
}
