//! The hybrid coordinator's prefix-cache lookup: [`Hybrid::find_longest_cache_hit`] (vLLM's
//! `HybridKVCacheCoordinator.find_longest_cache_hit`, or with one group its
//! `UnitaryKVCacheCoordinator`'s, or with caching off no hit), and the one-attention-group
//! lookup each pass makes through [`find_longest_cache_hit_eagle`].
//!
//! The rules are the parent module's ([`super`]): full groups first, then the others, each
//! group's lookup capped by the candidate and replacing it, passes repeated until the candidate
//! is stable (one pass for a "simple hybrid"), full-attention hits cut to the final length;
//! an attention group that drops EAGLE's block ([`crate::vllm_v1::eagle`]) looks one of its
//! blocks past the candidate (at most the hashes' tokens; no margin for a Mamba group) and
//! drops once per candidate length. Nothing changes: the pool and the managers are only read.
//!
//! Costs: at most a few passes (each pass that does not stop shortens the candidate) of every
//! non-full attention group's lookup, plus one lookup of each full group.

use super::{is_full, is_mamba, Hit, Hybrid, SpecGroup};
use crate::error::Result;
use crate::vllm_v1::eagle;
use crate::vllm_v1::manager::HashSource;
use crate::vllm_v1::single_type::find_longest_cache_hit_eagle;

impl Hybrid {
    /// vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`; with caching off, vLLM's
    /// no-prefix-cache coordinator: no hit. An attention group that drops EAGLE's block looks
    /// one of its blocks past the candidate (at most the hashes' length) and drops once per
    /// candidate length: a lookup that shortens the candidate without dropping makes every
    /// such group drop again.
    pub fn find_longest_cache_hit(
        &self,
        hashes: &mut dyn HashSource,
        max_cache_hit_length: u64,
    ) -> Result<Hit> {
        let n = self.managers.len();
        if !self.cfg.enable_caching {
            return Ok(Hit {
                blocks: vec![Vec::new(); n],
                ..Default::default()
            });
        }
        if self.unitary() {
            return self.unitary_hit(hashes, max_cache_hit_length);
        }
        let mut hit_length = max_cache_hit_length;
        let mut longest = 0u64;
        let mut by_group: Vec<Option<Vec<u32>>> = vec![None; n];
        let mut len_by_group = vec![0u64; n];
        let simple = self.attention_groups.len() == 2 && is_full(&self.attention_groups[0].spec);
        let hashed = self.eagle_lookup_limit(hashes)?;
        let mut verified = vec![false; self.attention_groups.len()];
        loop {
            let mut curr = hit_length;
            for (idx, g) in self.attention_groups.iter().enumerate() {
                let first = g.ids[0] as usize;
                if is_full(&g.spec) && by_group[first].is_some() {
                    // Full attention's hits are prefix-closed: looked up once.
                    curr = curr.min(len_by_group[first]);
                    continue;
                }
                let drop = g.eagle && !verified[idx];
                let (blocks, len) = self.lookup(g, curr, drop, hashed, hashes)?;
                if drop {
                    verified[idx] = true;
                } else if len < curr {
                    verified.iter_mut().for_each(|v| *v = false);
                }
                curr = len;
                for (&id, b) in g.ids.iter().zip(blocks) {
                    by_group[id as usize] = Some(b);
                    len_by_group[id as usize] = len;
                }
                longest = longest.max(curr);
            }
            if curr >= hit_length {
                break;
            }
            hit_length = curr;
            if simple {
                break;
            }
        }
        for g in self.attention_groups.iter().filter(|g| is_full(&g.spec)) {
            let keep = hit_length.div_ceil(u64::from(g.spec.block_size)) as usize;
            for &id in &g.ids {
                if let Some(b) = by_group[id as usize].as_mut() {
                    b.truncate(keep);
                }
            }
        }
        Ok(Hit {
            blocks: by_group
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
            num_tokens: hit_length,
            num_uncached_common_prefix_tokens: longest.saturating_sub(hit_length),
        })
    }

    /// `UnitaryKVCacheCoordinator.find_longest_cache_hit`: the group's own lookup capped at
    /// `max_cache_hit_length` (no EAGLE margin past it), aligned to its block size; nothing is
    /// uncached in common (no other group lags it).
    fn unitary_hit(&self, hashes: &mut dyn HashSource, max_len: u64) -> Result<Hit> {
        let g = &self.attention_groups[0];
        let args = (
            self.cfg.hash_block_size,
            max_len,
            u64::from(g.spec.block_size),
        );
        let (blocks, len) =
            find_longest_cache_hit_eagle(&g.spec, &g.ids, &self.pool, hashes, args, g.eagle)?;
        Ok(Hit {
            blocks,
            num_tokens: len,
            num_uncached_common_prefix_tokens: 0,
        })
    }

    /// The hashes' length in tokens when some attention group drops EAGLE's block (the cap of
    /// its one-block-further lookup), else 0 (unread).
    fn eagle_lookup_limit(&self, hashes: &mut dyn HashSource) -> Result<u64> {
        if !self.attention_groups.iter().any(|g| g.eagle) {
            return Ok(0);
        }
        Ok((hashes.count()? as u64).saturating_mul(u64::from(self.cfg.hash_block_size)))
    }

    /// One attention group's lookup within a candidate of `curr` tokens; dropping EAGLE's
    /// block (`drop`), it looks one of its blocks further, at most `hashed` tokens.
    fn lookup(
        &self,
        g: &SpecGroup,
        curr: u64,
        drop: bool,
        hashed: u64,
        hashes: &mut dyn HashSource,
    ) -> Result<(Vec<Vec<u32>>, u64)> {
        // No margin for a Mamba group: its finder never drops (draft models have no Mamba
        // layers), so the hit would grow past the candidate.
        let max_len = match drop && !is_mamba(&g.spec) {
            true => curr
                .saturating_add(eagle::margin(g.spec.block_size))
                .min(hashed),
            false => curr,
        };
        let alignment = u64::from(self.cfg.scheduler_block_size);
        let args = (self.cfg.hash_block_size, max_len, alignment);
        find_longest_cache_hit_eagle(&g.spec, &g.ids, &self.pool, hashes, args, drop)
    }
}
