//! vLLM v1's block-aligned prefill split for Mamba "align" mode
//! (`Scheduler._mamba_block_aligned_split`, 0.32 and 0.33): where a prefill chunk must end so
//! that the Mamba state the manager caches sits at a position a later request can reuse.
//!
//! Sources: `vllm/v1/core/sched/scheduler.py` (`_mamba_block_aligned_split` and the
//! `mamba_*` attributes `Scheduler.__init__` derives) and `vllm/v1/kv_cache_interface.py`
//! (`get_mamba_prefill_checkpoint_position`, `is_mamba_prefill_checkpoint_valid`, here
//! [`checkpoint_position`] and [`checkpoint_valid`]). 0.33 adds the hash lookahead to the
//! two checkpoint positions (0 on 0.32, where it does not exist).
//!
//! Invariants: the result never exceeds the tokens asked for; a request past its prefill
//! (`start >= max(num_prompt_tokens, num_tokens - 1)`) keeps them all; a chunk that ends
//! before the prefill's end ends on a block boundary, except where a block is wider than
//! the largest chunk the scheduler may schedule (it then advances sub-block); the chunk never
//! runs past a mandatory stop (the next block boundary of a chunk starting mid-block, the last
//! cacheable position, the prompt's checkpoint tail, the shared-prefix junction).
//!
//! Cost: O(1) per call, no allocation; the walk calls it once per scheduled prefill chunk.

use super::mamba_align::{checkpoint_position, checkpoint_valid};

/// What `Scheduler.__init__` derives for the split (`need_mamba_block_aligned_split`: a
/// Mamba group in "align" mode); read by the bindings each call, as vLLM's tests may change
/// them after construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MambaSplit {
    /// `cache_config.block_size` (the Mamba block).
    pub block_size: u64,
    /// `hash_block_size`.
    pub hash_block_size: u64,
    /// `mamba_partial_cache_hit`: fine-grained hits; the prompt's hash-aligned checkpoint.
    pub partial_cache_hit: bool,
    /// `mamba_shared_prefix_checkpoint`: stop exactly at the shared-prefix junction.
    pub shared_prefix_checkpoint: bool,
    /// `use_eagle_block_drop`.
    pub drop_eagle_block: bool,
    /// `num_hash_lookahead_tokens` (0.33; 0 on 0.32).
    pub num_hash_lookahead_tokens: u64,
    /// `mamba_has_prefill_checkpoint_blocks`.
    pub has_checkpoint_blocks: bool,
    /// `mamba_prefill_checkpoint_alignment` (0: `None`).
    pub checkpoint_alignment: u64,
    /// `max_num_scheduled_tokens`, capped by the configured (not the step's adaptive)
    /// `long_prefill_token_threshold` when that is positive.
    pub max_prefill_tokens: u64,
}

/// The request's fields the split reads. `start` is `num_computed_tokens` plus the tokens a
/// prefix lookup found this step (`num_new_local_computed_tokens`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SplitRow {
    pub start: u64,
    pub num_prompt_tokens: u64,
    pub num_tokens: u64,
    /// `request.shared_prefix_boundary` (0: none).
    pub shared_prefix_boundary: u64,
}

impl MambaSplit {
    /// `_mamba_block_aligned_split`: how many of `num_new_tokens` the chunk keeps.
    pub fn tokens(&self, r: &SplitRow, num_new_tokens: u64) -> u64 {
        let start = r.start;
        let prefill_end = r.num_prompt_tokens.max(r.num_tokens.saturating_sub(1));
        let bs = self.block_size;
        if start >= prefill_end || bs == 0 {
            return num_new_tokens;
        }
        let mut end = start.saturating_add(num_new_tokens);
        let internal = self.internal_checkpoint(start, end, prefill_end);
        let last_cache_position = match internal {
            true => 0,
            false => self.position(r.num_tokens, bs),
        };
        if end < prefill_end {
            let aligned_end = end / bs * bs;
            if aligned_end > start || bs <= self.max_prefill_tokens {
                end = aligned_end;
            }
        }
        let stops = [
            match start % bs != 0 && !internal {
                true => (start / bs + 1).saturating_mul(bs),
                false => 0,
            },
            last_cache_position,
            self.tail_stop(r, internal, last_cache_position),
            self.junction_stop(r, end),
        ];
        let end = stops
            .into_iter()
            .filter(|&s| start < s && s < end)
            .min()
            .unwrap_or(end);
        end.saturating_sub(start)
    }

    /// `get_mamba_prefill_checkpoint_position(num_tokens, unit, use_eagle_block_drop,
    /// num_hash_lookahead_tokens)`.
    fn position(&self, num_tokens: u64, unit: u64) -> u64 {
        checkpoint_position(
            num_tokens,
            unit,
            self.drop_eagle_block,
            self.num_hash_lookahead_tokens,
        )
    }

    /// `use_internal_checkpoint`: the backend saves the prompt's checkpoint inside this final
    /// chunk, so the chunk need not stop there.
    fn internal_checkpoint(&self, start: u64, end: u64, prefill_end: u64) -> bool {
        let unit = match self.partial_cache_hit {
            true => self.hash_block_size,
            false => self.block_size,
        };
        let cp = self.position(prefill_end, unit);
        self.has_checkpoint_blocks
            && end >= prefill_end
            && checkpoint_valid(
                start,
                end,
                cp,
                self.hash_block_size,
                self.block_size,
                self.checkpoint_alignment,
            )
    }

    /// The prompt's partial-tail checkpoint (fine-grained hits only), when it lies past the
    /// last cacheable position and inside the prompt.
    fn tail_stop(&self, r: &SplitRow, internal: bool, last_cache_position: u64) -> u64 {
        if !self.partial_cache_hit || internal {
            return 0;
        }
        let tail = self.position(r.num_prompt_tokens, self.hash_block_size);
        match last_cache_position < tail && tail < r.num_prompt_tokens {
            true => tail,
            false => 0,
        }
    }

    /// The shared-prefix junction strictly inside the chunk: exactly there with
    /// `shared_prefix_checkpoint` (inside the prompt), else floored to a block past `start`.
    fn junction_stop(&self, r: &SplitRow, end: u64) -> u64 {
        let (start, junction) = (r.start, r.shared_prefix_boundary);
        if !(start < junction && junction < end) {
            return 0;
        }
        if self.shared_prefix_checkpoint && junction <= r.num_prompt_tokens {
            return junction;
        }
        let bs = self.block_size;
        start + (junction - start) / bs * bs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(bs: u64) -> MambaSplit {
        MambaSplit {
            block_size: bs,
            hash_block_size: bs,
            max_prefill_tokens: 1 << 20,
            ..MambaSplit::default()
        }
    }

    fn row(start: u64, prompt: u64, tokens: u64) -> SplitRow {
        SplitRow {
            start,
            num_prompt_tokens: prompt,
            num_tokens: tokens,
            shared_prefix_boundary: 0,
        }
    }

    #[test]
    fn a_decode_keeps_every_token() {
        // Past the prefill (start >= num_tokens - 1), drafts included.
        assert_eq!(split(16).tokens(&row(40, 30, 41), 5), 5);
        assert_eq!(split(16).tokens(&row(30, 30, 30), 1), 1);
    }

    #[test]
    fn a_middle_chunk_ends_on_a_block_boundary() {
        // 100-token prompt, 50 tokens asked from 0: the chunk ends at 48.
        assert_eq!(split(16).tokens(&row(0, 100, 100), 50), 48);
        // Fewer than a block asked: nothing (the walk skips the request this step).
        assert_eq!(split(16).tokens(&row(0, 100, 100), 10), 0);
    }

    #[test]
    fn the_last_chunk_stops_at_the_last_cacheable_position() {
        // The whole 100-token prompt asked: it stops at 96 (the last multiple of 16 below
        // 100), so the state there is cached; the last 4 tokens follow next step.
        assert_eq!(split(16).tokens(&row(0, 100, 100), 100), 96);
        assert_eq!(split(16).tokens(&row(96, 100, 100), 4), 4);
        // A block-multiple prompt stops one block early (the last token is recomputed).
        assert_eq!(split(16).tokens(&row(0, 64, 64), 64), 48);
    }

    #[test]
    fn a_chunk_starting_mid_block_stops_at_the_next_boundary() {
        // A prefix hit ended mid-block (not with hash block = block), or a resumed request.
        assert_eq!(split(16).tokens(&row(20, 100, 100), 80), 12);
    }

    #[test]
    fn a_block_wider_than_any_chunk_advances_sub_block() {
        let mut s = split(64);
        s.max_prefill_tokens = 32;
        assert_eq!(s.tokens(&row(0, 200, 200), 32), 32);
        // ... and re-aligns at the next boundary.
        assert_eq!(s.tokens(&row(32, 200, 200), 48), 32);
        // Where a chunk of a block fits the scheduler's limit, it waits for one.
        assert_eq!(split(64).tokens(&row(0, 200, 200), 32), 0);
    }

    #[test]
    fn the_junction_is_floored_to_a_block_unless_checkpointed() {
        let mut r = row(0, 100, 100);
        r.shared_prefix_boundary = 40;
        assert_eq!(split(16).tokens(&r, 100), 32);
        let mut s = split(16);
        s.shared_prefix_checkpoint = true;
        assert_eq!(s.tokens(&r, 100), 40);
    }

    #[test]
    fn eagle_and_hash_lookahead_move_the_last_cacheable_position() {
        let mut s = split(16);
        s.drop_eagle_block = true;
        assert_eq!(s.tokens(&row(0, 100, 100), 100), 80);
        let mut s = split(16);
        s.num_hash_lookahead_tokens = 5;
        assert_eq!(s.tokens(&row(0, 100, 100), 100), 80);
    }

    #[test]
    fn an_internal_checkpoint_lets_the_last_chunk_run_to_the_end() {
        let mut s = split(16);
        s.has_checkpoint_blocks = true;
        s.checkpoint_alignment = 1;
        assert_eq!(s.tokens(&row(0, 100, 100), 100), 100);
        // Not valid from a start whose state column is too close to the end.
        assert_eq!(s.tokens(&row(96, 100, 100), 4), 4);
    }

    #[test]
    fn huge_counts_saturate_without_panicking() {
        let s = split(16);
        assert_eq!(
            s.tokens(&row(0, u64::MAX, u64::MAX), u64::MAX),
            u64::MAX / 16 * 16
        );
        assert_eq!(s.tokens(&row(u64::MAX - 1, u64::MAX, u64::MAX), 7), 1);
        assert_eq!(split(0).tokens(&row(0, 100, 100), 50), 50);
    }
}
