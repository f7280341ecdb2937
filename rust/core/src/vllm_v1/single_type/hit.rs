//! The single-type managers' lookup driver: vLLM's `find_longest_cache_hit` for one spec over
//! the groups sharing it ([`find_longest_cache_hit`]; with EAGLE's last-block drop,
//! [`find_longest_cache_hit_eagle`]), its arguments checked, then dispatched to the kind's own
//! search ([`HitSearch`], whose methods live beside each kind's other rules:
//! [`crate::vllm_v1::full_attention`], [`crate::vllm_v1::sliding_window`],
//! [`crate::vllm_v1::chunked_local`], [`crate::vllm_v1::mamba_align`]); and the pieces those
//! searches share: the hashes viewed at a group's block size ([`View`]), one position's lookup
//! in every group ([`cached_in_all`]) and the full-attention prefix scan ([`cached_prefix`],
//! which the single-group [`crate::vllm_v1::manager::Manager`] calls too).
//!
//! Costs: a lookup scans at most `max_length / block_size` hashes per group (the sliding
//! window scans from the right and stops at its first run). Nothing changes: the pool is only
//! read.

use super::{AttentionKind, GroupSpec};
use crate::error::{Error, Result};
use crate::vllm_v1::mamba;
use crate::vllm_v1::manager::HashSource;
use crate::vllm_v1::pool::{HashKey, Pool};

/// The hashes viewed at `scale` hash blocks per block (`BlockHashListWithBlockSize`: a block's
/// hash is the hash at its last hash-block boundary, chained over the whole prefix).
pub(in crate::vllm_v1) struct View<'a> {
    pub(in crate::vllm_v1) hashes: &'a mut dyn HashSource,
    pub(in crate::vllm_v1) scale: usize,
}

impl View<'_> {
    pub(in crate::vllm_v1) fn count(&mut self) -> Result<usize> {
        Ok(self.hashes.count()? / self.scale)
    }

    pub(in crate::vllm_v1) fn key(&mut self, i: usize) -> Result<HashKey> {
        self.hashes.key((i + 1) * self.scale - 1)
    }
}

/// vLLM's `BlockPool.get_cached_block(hash, group_ids)`: the first block cached under `key`
/// in each group, into `out`; `false` (and `out` unspecified) when any group misses.
pub(in crate::vllm_v1) fn cached_in_all(
    pool: &Pool,
    key: &HashKey,
    groups: &[u32],
    out: &mut Vec<u32>,
) -> bool {
    out.clear();
    for &g in groups {
        match pool.get_cached_in(key, g) {
            Some(b) => out.push(b),
            None => return false,
        }
    }
    true
}

/// The full-attention scan: the longest run of blocks from block 0 cached in every group of
/// `groups`, at most `max_blocks` long, appended to `out[j]` for `groups[j]` (the hashes
/// viewed at `scale` hash blocks per block). Returns the run's length in blocks.
pub(crate) fn cached_prefix(
    pool: &Pool,
    groups: &[u32],
    hashes: &mut dyn HashSource,
    scale: usize,
    max_blocks: usize,
    out: &mut [Vec<u32>],
) -> Result<usize> {
    let mut view = View { hashes, scale };
    let n = max_blocks.min(view.count()?);
    for i in 0..n {
        let key = view.key(i)?;
        for (j, &g) in groups.iter().enumerate() {
            match pool.get_cached_in(&key, g) {
                Some(b) => out[j].push(b),
                None => {
                    // A miss in any group ends the run for all (no scratch list needed).
                    for o in &mut out[..j] {
                        o.pop();
                    }
                    return Ok(i);
                }
            }
        }
    }
    Ok(n)
}

/// vLLM's `find_longest_cache_hit` of the manager for `spec`, over the groups `groups`
/// (all of that spec): per group the hit's blocks (skipped positions as the null block), and
/// the hit in tokens. `max_length` caps the hit; `alignment` (the coordinator's
/// `cache_hit_alignment_tokens`) is what the hit's length must be a multiple of; the hashes
/// are at `hash_block_size` tokens each.
pub fn find_longest_cache_hit(
    spec: &GroupSpec,
    groups: &[u32],
    pool: &Pool,
    hashes: &mut dyn HashSource,
    hash_block_size: u32,
    max_length: u64,
    alignment: u64,
) -> Result<(Vec<Vec<u32>>, u64)> {
    let args = (hash_block_size, max_length, alignment);
    find_longest_cache_hit_eagle(spec, groups, pool, hashes, args, false)
}

/// [`find_longest_cache_hit`] with vLLM's `drop_eagle_block` ([`crate::vllm_v1::eagle`]): full
/// attention drops the last matched block, a sliding window needs one more block in a row and
/// pops it, chunked local attention refuses (vLLM asserts). `args` is `(hash_block_size,
/// max_length, alignment)`.
pub fn find_longest_cache_hit_eagle(
    spec: &GroupSpec,
    groups: &[u32],
    pool: &Pool,
    hashes: &mut dyn HashSource,
    (hash_block_size, max_length, alignment): (u32, u64, u64),
    drop_eagle: bool,
) -> Result<(Vec<Vec<u32>>, u64)> {
    spec.check()?;
    let bs = u64::from(spec.block_size);
    if hash_block_size == 0 || spec.block_size % hash_block_size != 0 || alignment == 0 {
        return Err(Error::invalid(format!(
            "block size {} must be a positive multiple of the hash block size \
             {hash_block_size}, the alignment ({alignment}) positive",
            spec.block_size
        )));
    }
    let scale = (spec.block_size / hash_block_size) as usize;
    let search = HitSearch {
        pool,
        groups,
        bs,
        max_blocks: usize::try_from(max_length / bs).unwrap_or(usize::MAX),
        alignment,
        drop_eagle,
        out: vec![Vec::new(); groups.len()],
    };
    match spec.kind {
        AttentionKind::Full => search.full(hashes, scale),
        AttentionKind::SlidingWindow { sliding_window, .. } => {
            let need = GroupSpec::contiguous_blocks_for_hit(sliding_window, spec.block_size)
                + usize::from(drop_eagle);
            search.sliding_window(View { hashes, scale }, need)
        }
        AttentionKind::ChunkedLocal { .. } if drop_eagle => Err(Error::invalid(
            "EAGLE with chunked local attention is not supported (vLLM asserts the same)",
        )),
        AttentionKind::ChunkedLocal {
            attention_chunk_size,
        } => search.chunked_local(
            View { hashes, scale },
            u64::from(attention_chunk_size),
            max_length,
        ),
        // Mode "none" has no prefix caching, hence no hits.
        AttentionKind::Mamba { .. } => mamba::check(spec.kind, true).map(|()| (Vec::new(), 0)),
        // Align mode's finder never drops EAGLE's block (draft models have no Mamba layers).
        AttentionKind::MambaAlign { .. } => search.mamba_align(View { hashes, scale }),
    }
}

/// One `find_longest_cache_hit` once its arguments are checked: a method per attention kind,
/// each returning the groups' tables (`out`) and the hit in tokens.
/// The kinds' own searches live beside their other rules: [`crate::vllm_v1::full_attention`],
/// [`crate::vllm_v1::sliding_window`], [`crate::vllm_v1::chunked_local`].
pub(in crate::vllm_v1) struct HitSearch<'a> {
    pub(in crate::vllm_v1) pool: &'a Pool,
    pub(in crate::vllm_v1) groups: &'a [u32],
    /// The group's block size in tokens.
    pub(in crate::vllm_v1) bs: u64,
    /// `max_length // block_size`.
    pub(in crate::vllm_v1) max_blocks: usize,
    pub(in crate::vllm_v1) alignment: u64,
    /// vLLM's `drop_eagle_block`.
    pub(in crate::vllm_v1) drop_eagle: bool,
    pub(in crate::vllm_v1) out: Vec<Vec<u32>>,
}
