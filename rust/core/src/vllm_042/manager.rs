//! vLLM's block space manager (v1 semantics) over a GPU and a CPU [`BlockPool`].
//!
//! The contract, including every ordering rule that decides block numbers, is written down in
//! `docs/block_manager.md`; the pure-Python reference implements the same document and the two
//! are compared step by step in the tests. In short:
//!
//! * each sequence id with a table holds one reference on each *distinct* block of its table;
//! * sliding-window tables are periodic (`table[i] == table[i % W]`), so their distinct blocks
//!   are `table[..W]`;
//! * a call that returns an error has changed nothing (every call checks before it mutates).
//!
//! Sequences are passed in as `(seq_id, &TokenSeq)`; resolving groups and statuses is the
//! caller's job (the Python bindings do it).

use crate::error::{Error, Result};
use crate::id_map::IdMap;
use crate::vllm_042::hash::Hasher;
use crate::vllm_042::pool::{BlockId, BlockPool};
use crate::vllm_042::token_seq::TokenSeq;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};

type SeqMap<V> = IdMap<SeqId, V>;

pub type SeqId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Gpu,
    Cpu,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Gpu => "gpu",
            Device::Cpu => "cpu",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocStatus {
    Ok,
    Later,
    Never,
}

/// Where a common computed-block prefix lies: the first `len` blocks of `seq`'s table at
/// table `version` (`Manager::common_computed_prefix`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputedPrefix {
    pub seq: SeqId,
    pub version: u64,
    pub len: usize,
}

#[derive(Clone, Debug)]
struct SeqEntry {
    table: Vec<BlockId>,
    device: Device,
    /// Tokens whose slots are already reserved.
    reserved: usize,
    /// Creation order (for `reset`).
    order: u64,
    /// Changes whenever the table does (unique across the manager's life), so that callers
    /// can cache a view of it.
    version: u64,
    /// Changes whenever the table changes other than by appending entries (created, an entry
    /// replaced by copy-on-write or a cached twin, moved to the other device): while it holds,
    /// the table is an extension of every earlier state with the same `layout`.
    layout: u64,
    /// The latest `access_all_blocks_in_seq` of this sequence, not yet written to its blocks.
    access: Option<PendingAccess>,
    /// `(version, k)`: while the table is at `version`, its first `k` blocks are known to be
    /// computed (a held block's computed mark only goes from false to true: it is cleared
    /// when the block is freed). Makes the per-step computed-prefix query O(new blocks).
    computed_hint: Cell<(u64, usize)>,
}

/// `access_all_blocks_in_seq` is O(1): it records the time on the sequence, and the blocks
/// get it only when it matters (a block's access time is read when its last holder releases
/// it and it becomes evictable). `upto` is how many leading table entries the call covered;
/// `stamp` orders calls, so that the latest call wins as if every block had been written at
/// once. Before a holder releases or replaces any block it writes its pending time out.
#[derive(Clone, Copy, Debug)]
struct PendingAccess {
    time: f64,
    stamp: u64,
    upto: usize,
}

/// Write a table's pending access time to its blocks (those the access call covered).
fn flush_access(pool: &mut BlockPool, stamps: &mut [u64], e: &mut SeqEntry) {
    if let Some(p) = e.access.take() {
        for &b in &e.table[..p.upto.min(e.table.len())] {
            if p.stamp > stamps[b as usize] {
                pool.set_last_accessed(b, p.time);
                stamps[b as usize] = p.stamp;
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ManagerConfig {
    pub block_size: usize,
    pub num_gpu_blocks: u32,
    pub num_cpu_blocks: u32,
    pub watermark: f64,
    pub sliding_window: Option<usize>,
    pub enable_caching: bool,
    pub strict: bool,
    pub hasher: Hasher,
}

/// Copy-on-write pairs `(src, dst)` in the order they were made.
pub type Copies = Vec<(BlockId, BlockId)>;

#[derive(Clone)]
pub struct Manager {
    cfg: ManagerConfig,
    /// Window in blocks.
    window: Option<usize>,
    watermark_blocks: usize,
    gpu: BlockPool,
    cpu: BlockPool,
    tables: SeqMap<SeqEntry>,
    next_order: u64,
    next_version: u64,
    /// Orders access calls; `*_stamps[b]` is the stamp of the call that set block b's time.
    access_clock: u64,
    gpu_stamps: Vec<u64>,
    cpu_stamps: Vec<u64>,
    prefix_lookups: u64,
    prefix_hits: u64,
}

/// The distinct blocks of a table (a periodic window table repeats its first `W` entries).
fn distinct(table: &[BlockId], window: Option<usize>) -> &[BlockId] {
    match window {
        Some(w) if table.len() > w => &table[..w],
        _ => table,
    }
}

/// Point logical block `i` at `b` (every periodic copy of it in a window table).
fn set_entry(table: &mut [BlockId], i: usize, b: BlockId, window: Option<usize>) {
    match window {
        Some(w) => {
            let mut j = i % w;
            while j < table.len() {
                table[j] = b;
                j += w;
            }
        }
        None => table[i] = b,
    }
}

impl Manager {
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        let bs = cfg.block_size;
        if bs == 0 {
            return Err(Error::invalid("block_size must be positive"));
        }
        crate::limits::check_gpu_slots(cfg.num_gpu_blocks, bs)?;
        if !(cfg.watermark >= 0.0 && cfg.watermark.is_finite()) {
            return Err(Error::invalid(format!(
                "watermark must be >= 0, got {}",
                cfg.watermark
            )));
        }
        let window = match cfg.sliding_window {
            None => None,
            Some(sw) => {
                if sw == 0 || sw % bs != 0 {
                    return Err(Error::invalid(format!(
                        "sliding_window ({sw}) must be a positive multiple of block_size ({bs})"
                    )));
                }
                if cfg.enable_caching {
                    return Err(Error::invalid(
                        "prefix caching cannot be combined with a sliding window",
                    ));
                }
                Some(sw / bs)
            }
        };
        Ok(Manager {
            window,
            watermark_blocks: (cfg.watermark * cfg.num_gpu_blocks as f64) as usize,
            gpu: BlockPool::new("gpu", cfg.num_gpu_blocks, bs, cfg.enable_caching)?,
            cpu: BlockPool::new("cpu", cfg.num_cpu_blocks, bs, cfg.enable_caching)?,
            tables: SeqMap::default(),
            next_order: 0,
            next_version: 0,
            access_clock: 0,
            gpu_stamps: vec![0; cfg.num_gpu_blocks as usize],
            cpu_stamps: vec![0; cfg.num_cpu_blocks as usize],
            prefix_lookups: 0,
            prefix_hits: 0,
            cfg,
        })
    }

    // ---- introspection -------------------------------------------------------------------

    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }
    pub fn window_blocks(&self) -> Option<usize> {
        self.window
    }
    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }
    pub fn pool(&self, d: Device) -> &BlockPool {
        match d {
            Device::Gpu => &self.gpu,
            Device::Cpu => &self.cpu,
        }
    }
    pub fn num_free_gpu_blocks(&self) -> usize {
        self.gpu.num_free()
    }
    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }
    /// Heap bytes of the two pools (per block: `pool.heap_bytes()`) and their access stamps.
    pub fn pool_heap_bytes(&self) -> usize {
        use crate::mem::vec_bytes;
        self.gpu.heap_bytes()
            + self.cpu.heap_bytes()
            + vec_bytes(&self.gpu_stamps)
            + vec_bytes(&self.cpu_stamps)
    }
    /// Heap bytes of the sequences' tables: the map's table and every table's entries.
    pub fn tables_heap_bytes(&self) -> usize {
        crate::mem::map_bytes(&self.tables)
            + self
                .tables
                .values()
                .map(|e| crate::mem::vec_bytes(&e.table))
                .sum::<usize>()
    }
    pub fn prefix_cache_stats(&self) -> (u64, u64) {
        (self.prefix_lookups, self.prefix_hits)
    }
    pub fn has_table(&self, id: SeqId) -> bool {
        self.tables.contains_key(&id)
    }
    pub fn num_tables(&self) -> usize {
        self.tables.len()
    }
    pub fn block_table(&self, id: SeqId) -> Result<&[BlockId]> {
        Ok(&self.entry(id)?.table)
    }
    /// A number that changes whenever the sequence's table (or its device) does.
    pub fn table_version(&self, id: SeqId) -> Result<u64> {
        Ok(self.entry(id)?.version)
    }
    /// `(version, layout)`: `layout` changes only when the table changes other than by
    /// appending (so a caller holding an earlier state with the same layout needs only the
    /// entries past its length). Both are unique across the manager's life.
    pub fn table_versions(&self, id: SeqId) -> Result<(u64, u64)> {
        let e = self.entry(id)?;
        Ok((e.version, e.layout))
    }
    pub fn device_of(&self, id: SeqId) -> Result<Device> {
        Ok(self.entry(id)?.device)
    }
    pub fn reserved_tokens(&self, id: SeqId) -> Result<usize> {
        Ok(self.entry(id)?.reserved)
    }

    fn entry(&self, id: SeqId) -> Result<&SeqEntry> {
        self.tables.get(&id).ok_or(Error::UnknownSequence(id))
    }

    /// Whether `seq` counts its blocks in the manager's own block size. The per-sequence calls
    /// accept any block size (vLLM counts a sequence's blocks in the sequence's own logical
    /// blocks); only sequences in the manager's units take part in the prefix cache, so cache
    /// entries made in different units are never shared.
    fn same_units(&self, seq: &TokenSeq) -> bool {
        seq.block_size() == self.cfg.block_size
    }

    /// Whether prefix-cache lookups and registrations apply to `seq`.
    fn caches(&self, seq: &TokenSeq) -> bool {
        self.cfg.enable_caching && self.same_units(seq)
    }

    /// The batch and slot-writing calls compute slot numbers `block * block_size + offset` in
    /// the manager's units, so they refuse a sequence counted in other units.
    pub fn check_slot_units(&self, seq: &TokenSeq) -> Result<()> {
        if !self.same_units(seq) {
            return Err(Error::invalid(format!(
                "sequence block_size {} does not match the manager's {}: slot numbers need the \
                 manager's units (the per-sequence calls accept it)",
                seq.block_size(),
                self.cfg.block_size
            )));
        }
        Ok(())
    }

    /// Strict mode refuses a sequence counted in other units than the manager's (the default
    /// mode counts its blocks in its own units, as vLLM does; docs/block_manager.md, "Strict
    /// mode").
    fn check_strict_units(&self, seq: &TokenSeq) -> Result<()> {
        if self.cfg.strict && !self.same_units(seq) {
            return Err(Error::invalid(format!(
                "sequence block_size {} does not match the manager's {} (strict mode)",
                seq.block_size(),
                self.cfg.block_size
            )));
        }
        Ok(())
    }

    /// Strict mode refuses to give a table to a sequence id that already holds one (the
    /// default mode releases the old table and replaces it; vLLM leaks it).
    fn check_strict_fresh(&self, id: SeqId) -> Result<()> {
        if self.cfg.strict && self.tables.contains_key(&id) {
            return Err(Error::invalid(format!(
                "sequence {id} already holds a block table (strict mode)"
            )));
        }
        Ok(())
    }

    fn out_of(&self, device: Device, needed: usize) -> Error {
        Error::OutOfBlocks {
            device: device.name(),
            needed,
            free: self.pool(device).num_free(),
        }
    }

    // ---- allocation ----------------------------------------------------------------------

    /// Blocks the prompt of `seq` occupies (capped by the window).
    fn prompt_blocks(&self, seq: &TokenSeq) -> usize {
        let n = seq.num_blocks();
        self.window.map_or(n, |w| n.min(w))
    }

    pub fn can_allocate(&self, first_waiting: &TokenSeq) -> Result<AllocStatus> {
        self.check_strict_units(first_waiting)?;
        let n = self.prompt_blocks(first_waiting);
        let total = self.cfg.num_gpu_blocks as usize;
        Ok(if total < n + self.watermark_blocks {
            AllocStatus::Never
        } else if self.gpu.num_free() >= n + self.watermark_blocks {
            AllocStatus::Ok
        } else {
            AllocStatus::Later
        })
    }

    /// Give every WAITING sequence of a group (all sharing `waiting[0]`'s prompt) one shared table.
    /// A sequence that already holds a table gets the new one (the old one is released; strict
    /// mode refuses it). Every check comes first, the free blocks included (`need`); the
    /// table is then built and handed out, which cannot fail.
    pub fn allocate(&mut self, waiting: &[(SeqId, &TokenSeq)]) -> Result<()> {
        let Some(&(_, seq)) = waiting.first() else {
            return Err(Error::invalid("the sequence group has no WAITING sequence"));
        };
        for &(id, s) in waiting {
            self.check_strict_units(s)?;
            self.check_strict_fresh(id)?;
        }
        let caching = self.caches(seq);
        let need = self.need(seq, caching);
        if need > self.gpu.num_free() {
            return Err(self.out_of(Device::Gpu, need));
        }
        let table = self.build_table(seq, waiting.len() as u32, caching);
        self.hand_out(waiting, &table, seq.len());
        Ok(())
    }

    /// The free GPU blocks allocating `seq`'s table takes. With caching, the chain is walked
    /// as [`Self::build_table`] will: block i can only hit if block i-1 did (a hit is confirmed
    /// by parent identity). Only hits on referenced blocks cost no free block; evictions
    /// cannot disturb those, since a referenced block's parents are referenced.
    fn need(&self, seq: &TokenSeq, caching: bool) -> usize {
        if !caching {
            return self.prompt_blocks(seq);
        }
        let mut need = 0;
        let mut parent = None;
        for i in 0..seq.num_blocks() {
            match seq.block_key(i, parent).and_then(|k| self.gpu.peek(&k)) {
                Some(b) => {
                    need += usize::from(self.gpu.ref_count(b) == 0);
                    parent = Some(b);
                }
                None => return need + seq.num_blocks() - i,
            }
        }
        need
    }

    /// `seq`'s table, each distinct block holding `refs` references: cached blocks reused
    /// (with caching), fresh ones registered, a window's entries repeating its first blocks.
    /// [`Self::need`] free blocks must be free (the caller checked): it cannot fail.
    fn build_table(&mut self, seq: &TokenSeq, refs: u32, caching: bool) -> Vec<BlockId> {
        const FITS: &str = "allocate checked the free blocks";
        let n = seq.num_blocks();
        let bs = seq.block_size();
        let mut table: Vec<BlockId> = Vec::with_capacity(n);
        for i in 0..n {
            let parent = if i > 0 { table.last().copied() } else { None };
            let b = match (
                self.window,
                caching.then(|| seq.block_key(i, parent)).flatten(),
            ) {
                (Some(w), _) if i >= w => table[i % w],
                (_, Some(key)) => {
                    self.prefix_lookups += 1;
                    if let Some(b) = self.gpu.lookup(&key) {
                        self.prefix_hits += 1;
                        // A cached block, held or evictable, and refs >= 1.
                        self.gpu
                            .acquire(b, refs)
                            .expect("a cached block can be shared");
                        b
                    } else {
                        let b = self.fresh_gpu_block(refs).expect(FITS);
                        // A fresh full block, its parent another held block.
                        self.gpu
                            .register(b, &key, ((i + 1) * bs) as u32)
                            .expect("a fresh full block can be cached");
                        b
                    }
                }
                _ => self.fresh_gpu_block(refs).expect(FITS),
            };
            table.push(b);
        }
        table
    }

    /// Give each WAITING sequence a copy of `table` with `reserved` slots. vLLM overwrites the
    /// table of a sequence id that already has one (leaking its references); we release it,
    /// after the new table is built so that the blocks chosen are vLLM's. A table holds one
    /// reference on each of its distinct blocks, so releasing it cannot fail.
    fn hand_out(&mut self, waiting: &[(SeqId, &TokenSeq)], table: &[BlockId], reserved: usize) {
        for &(id, _) in waiting {
            if let Some(mut old) = self.tables.remove(&id) {
                self.release_table(&mut old)
                    .expect("a table holds a reference on each of its blocks");
            }
            let order = self.next_order;
            self.next_order += 1;
            self.next_version += 1;
            self.tables.insert(
                id,
                SeqEntry {
                    table: table.to_vec(),
                    device: Device::Gpu,
                    reserved,
                    order,
                    version: self.next_version,
                    layout: self.next_version,
                    access: None,
                    computed_hint: Cell::new((u64::MAX, 0)),
                },
            );
        }
    }

    fn fresh_gpu_block(&mut self, refs: u32) -> Result<BlockId> {
        let b = self.gpu.allocate()?;
        if refs > 1 {
            self.gpu.acquire(b, refs - 1)?;
        }
        Ok(b)
    }

    // ---- appending -----------------------------------------------------------------------

    /// Upper bound on the free GPU blocks `append_slots` takes for this sequence (constant
    /// time in `lookahead`; a lookahead past the pool's tokens is counted, but only
    /// `append_slots` refuses it).
    pub fn append_need(&self, id: SeqId, seq: &TokenSeq, lookahead: usize) -> Result<usize> {
        self.check_strict_units(seq)?;
        let e = self.entry(id)?;
        Ok(self.need_of(e, seq.len().saturating_add(lookahead), seq.block_size()))
    }

    /// Lookahead slots beyond every token the GPU pool holds can never be reserved: refused
    /// up front, in constant time (an append walks its table up to the lookahead, and with a
    /// sliding window the table grows by one entry per block whatever the pool's size).
    fn check_lookahead(&self, lookahead: usize) -> Result<()> {
        let capacity = (self.cfg.num_gpu_blocks as usize).saturating_mul(self.cfg.block_size);
        if lookahead > capacity {
            return Err(Error::invalid(format!(
                "num_lookahead_slots ({lookahead}) is more than the GPU pool holds \
                 ({capacity} tokens)"
            )));
        }
        Ok(())
    }

    /// Free blocks an append to `target` slots takes at most (`bs`: the sequence's own block
    /// size, the unit its table is counted in): one per shared table block it writes (copy on
    /// write) and one per position past the table, except that with a sliding window `w` a
    /// position `i >= w` reuses entry `i - w` when that is unshared or itself past the table.
    /// Counted in time linear in the table, never in `target`: positions past the table are
    /// counted by arithmetic, and only those within `w` of the table read it.
    fn need_of(&self, e: &SeqEntry, target: usize, bs: usize) -> usize {
        let (first, last, len) = (e.reserved / bs, target.div_ceil(bs), e.table.len());
        let shared = |b: BlockId| self.gpu.ref_count(b) > 1;
        let mut need = (first..last.min(len))
            .filter(|&i| shared(e.table[i]))
            .count();
        let past = first.max(len)..last;
        if past.is_empty() {
            return need;
        }
        match self.window {
            None => need += past.len(),
            Some(w) => {
                need += (past.start.min(w)..past.end.min(w)).len();
                let (lo, hi) = (past.start.max(w), past.end.min(len.saturating_add(w)));
                need += (lo..hi)
                    .filter(|&i| self.gpu.ref_count(e.table[i - w]) != 1)
                    .count();
            }
        }
        need
    }

    /// [`Self::need_of`] by visiting every position (the walk it replaced; tests compare).
    #[cfg(test)]
    pub(crate) fn need_by_walk(&self, id: SeqId, seq: &TokenSeq, lookahead: usize) -> usize {
        let (e, bs) = (&self.tables[&id], seq.block_size());
        let mut need = 0;
        for i in e.reserved / bs..(seq.len() + lookahead).div_ceil(bs) {
            need += usize::from(match (e.table.get(i), self.window) {
                (Some(&b), _) => self.gpu.ref_count(b) > 1,
                (None, Some(w)) if i >= w => {
                    i - w < e.table.len() && self.gpu.ref_count(e.table[i - w]) != 1
                }
                (None, _) => true,
            });
        }
        need
    }

    /// vLLM's rule (one free block per running sequence) or the exact upper bound, whichever is
    /// larger.
    pub fn can_append_slots(
        &self,
        running: &[(SeqId, &TokenSeq)],
        lookahead: usize,
    ) -> Result<bool> {
        let mut need = 0;
        for &(id, seq) in running {
            need = self.append_need(id, seq, lookahead)?.saturating_add(need);
        }
        Ok(self.gpu.num_free() >= need.max(running.len()))
    }

    fn check_appendable(&self, id: SeqId, seq: &TokenSeq) -> Result<&SeqEntry> {
        self.check_strict_units(seq)?;
        let e = self.entry(id)?;
        if e.device != Device::Gpu {
            return Err(Error::invalid(format!(
                "sequence {id} is swapped out to the CPU; swap it in first"
            )));
        }
        if seq.len() < e.reserved {
            return Err(Error::invalid(format!(
                "sequence {id} has {} tokens but {} slots were already reserved (was it reset without being freed?)",
                seq.len(),
                e.reserved
            )));
        }
        Ok(e)
    }

    /// Reserve slots for every token appended since the last call (plus `lookahead`).
    /// Copy-on-write pairs are pushed onto `copies`.
    pub fn append_slots(
        &mut self,
        id: SeqId,
        seq: &TokenSeq,
        lookahead: usize,
        copies: &mut Copies,
    ) -> Result<()> {
        let one = [(id, seq)];
        self.check_append_many(&one, lookahead)?;
        self.append_checked(&one, lookahead, copies)
    }

    /// `append_slots` for many sequences: all checked first (the free-block need is summed),
    /// then all done, so an error leaves every sequence untouched. The batch step API: every
    /// sequence must count its blocks in the manager's units (see `check_slot_units`).
    pub fn append_slots_batch(
        &mut self,
        seqs: &[(SeqId, &TokenSeq)],
        lookahead: usize,
        copies: &mut Copies,
    ) -> Result<()> {
        self.check_append_batch(seqs, lookahead)?;
        self.append_checked(seqs, lookahead, copies)
    }

    /// The checks of `append_slots_batch` alone: `Ok` iff the batch would succeed now.
    pub fn check_append_batch(&self, seqs: &[(SeqId, &TokenSeq)], lookahead: usize) -> Result<()> {
        for &(_, seq) in seqs {
            self.check_slot_units(seq)?;
        }
        self.check_append_many(seqs, lookahead)
    }

    /// Appends after `check_append_many` (or `check_append_batch`) said yes.
    fn append_checked(
        &mut self,
        seqs: &[(SeqId, &TokenSeq)],
        lookahead: usize,
        copies: &mut Copies,
    ) -> Result<()> {
        for &(id, seq) in seqs {
            self.append_unchecked(id, seq, lookahead, copies)?;
        }
        Ok(())
    }

    /// Every sequence appendable and the summed free-block need met, in each sequence's units.
    fn check_append_many(&self, seqs: &[(SeqId, &TokenSeq)], lookahead: usize) -> Result<()> {
        self.check_lookahead(lookahead)?;
        let mut need = 0usize;
        for &(id, seq) in seqs {
            let e = self.check_appendable(id, seq)?;
            let target = seq.len().saturating_add(lookahead);
            need = need.saturating_add(self.need_of(e, target, seq.block_size()));
        }
        if need > self.gpu.num_free() {
            return Err(self.out_of(Device::Gpu, need));
        }
        Ok(())
    }

    fn append_unchecked(
        &mut self,
        id: SeqId,
        seq: &TokenSeq,
        lookahead: usize,
        copies: &mut Copies,
    ) -> Result<()> {
        let bs = seq.block_size();
        let caching = self.caches(seq);
        let window = self.window;
        let gpu = &mut self.gpu;
        let stamps = &mut self.gpu_stamps;
        let e = self.tables.get_mut(&id).ok_or(Error::UnknownSequence(id))?;
        let len = seq.len();
        let len_before = e.table.len();
        let mut replaced = false;
        let first = e.reserved / bs;
        // `check_append_many` bounded `lookahead` by the pool's tokens.
        let last = (len + lookahead).div_ceil(bs);
        for i in first..last {
            let parent = if i > 0 {
                e.table.get(i - 1).copied()
            } else {
                None
            };
            let key = if caching && (i + 1) * bs <= len {
                seq.block_key(i, parent)
            } else {
                None
            };
            let nht = ((i + 1) * bs) as u32;
            if i < e.table.len() {
                let mut b = e.table[i];
                if gpu.ref_count(b) > 1 {
                    // copy on write (or switch to an identical cached block, no copy needed)
                    if let Some(c) = key.as_ref().and_then(|k| gpu.lookup(k)).filter(|&c| c != b) {
                        flush_access(gpu, stamps, e);
                        gpu.acquire(c, 1)?;
                        gpu.release(b)?;
                        set_entry(&mut e.table, i, c, window);
                        replaced = true;
                        continue;
                    }
                    let n = gpu.allocate()?;
                    copies.push((b, n));
                    flush_access(gpu, stamps, e);
                    gpu.release(b)?;
                    set_entry(&mut e.table, i, n, window);
                    replaced = true;
                    b = n;
                }
                if let Some(k) = key.as_ref() {
                    if gpu.block_hash(b).is_none() {
                        match gpu.lookup(k).filter(|&c| c != b) {
                            // vLLM's _maybe_promote_last_block: an identical cached block exists
                            Some(c) => {
                                flush_access(gpu, stamps, e);
                                gpu.acquire(c, 1)?;
                                gpu.release(b)?;
                                set_entry(&mut e.table, i, c, window);
                                replaced = true;
                            }
                            None => {
                                gpu.register(b, k, nht)?;
                            }
                        }
                    }
                }
            } else if let Some(w) = window.filter(|&w| i >= w) {
                let old = e.table[i - w];
                if gpu.ref_count(old) == 1 {
                    e.table.push(old);
                } else {
                    let n = gpu.allocate()?;
                    copies.push((old, n));
                    flush_access(gpu, stamps, e);
                    gpu.release(old)?;
                    e.table.push(n);
                    set_entry(&mut e.table, i, n, window);
                    replaced = true; // the earlier periodic copies of entry i changed
                }
            } else {
                if let Some(c) = key.as_ref().and_then(|k| gpu.lookup(k)) {
                    gpu.acquire(c, 1)?;
                    e.table.push(c);
                    continue;
                }
                let n = gpu.allocate()?;
                e.table.push(n);
                if let Some(k) = key.as_ref() {
                    gpu.register(n, k, nht)?;
                }
            }
        }
        e.reserved = len;
        if replaced || e.table.len() != len_before {
            self.next_version += 1;
            e.version = self.next_version;
            if replaced {
                e.layout = self.next_version;
            }
        }
        Ok(())
    }

    // ---- fork and free -------------------------------------------------------------------

    /// The child gets a copy of the parent's table (one more reference on each distinct block).
    /// A parent without a table is `UnknownSequence` (vLLM's `KeyError`); a child that already
    /// holds a table has it released first (vLLM overwrites it, leaking its references; strict
    /// mode refuses it).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if parent == child {
            return Err(Error::invalid(format!(
                "cannot fork sequence {parent} into itself"
            )));
        }
        let Some(pe) = self.tables.get(&parent) else {
            return Err(Error::UnknownSequence(parent));
        };
        self.check_strict_fresh(child)?;
        let mut ce = pe.clone();
        ce.order = self.next_order;
        ce.access = None; // the parent's pending access covers the shared blocks
        if let Some(mut old) = self.tables.remove(&child) {
            // The parent still holds its own references, so no block it shares with the
            // child's old table is freed here.
            self.release_table(&mut old)?;
        }
        self.next_order += 1;
        self.next_version += 1;
        ce.version = self.next_version;
        ce.layout = self.next_version;
        let pool = match ce.device {
            Device::Gpu => &mut self.gpu,
            Device::Cpu => &mut self.cpu,
        };
        for &b in distinct(&ce.table, self.window) {
            pool.acquire(b, 1)?;
        }
        self.tables.insert(child, ce);
        Ok(())
    }

    pub fn free(&mut self, id: SeqId) -> Result<()> {
        let Some(mut e) = self.tables.remove(&id) else {
            return if self.cfg.strict {
                Err(Error::UnknownSequence(id))
            } else {
                Ok(())
            };
        };
        self.release_table(&mut e)
    }

    fn release_table(&mut self, e: &mut SeqEntry) -> Result<()> {
        let (pool, stamps) = match e.device {
            Device::Gpu => (&mut self.gpu, &mut self.gpu_stamps),
            Device::Cpu => (&mut self.cpu, &mut self.cpu_stamps),
        };
        flush_access(pool, stamps, e);
        // The tail first: walking back from the last entry, every distinct block once (the last
        // W entries of a periodic window table are its W distinct blocks).
        let tail = match self.window {
            Some(w) if e.table.len() > w => &e.table[e.table.len() - w..],
            _ => &e.table[..],
        };
        for &b in tail.iter().rev() {
            pool.release(b)?;
        }
        Ok(())
    }

    pub fn reset(&mut self) -> Result<()> {
        let mut entries: Vec<SeqEntry> = self.tables.drain().map(|(_, e)| e).collect();
        entries.sort_by_key(|e| e.order);
        for e in &mut entries {
            self.release_table(e)?;
        }
        Ok(())
    }

    // ---- swapping ------------------------------------------------------------------------

    /// Distinct blocks over the tables of `ids` (all must exist).
    fn distinct_blocks(&self, ids: &[SeqId]) -> Result<usize> {
        let mut seen: HashSet<(Device, BlockId)> = HashSet::new();
        for &id in ids {
            let e = self.entry(id)?;
            for &b in distinct(&e.table, self.window) {
                seen.insert((e.device, b));
            }
        }
        Ok(seen.len())
    }

    /// Free GPU blocks that swapping the tables of `seqs` in and then appending each one's
    /// slots (`append_slots`, in order) takes at most. `seqs`: `(id, target, block_size)`
    /// with `target` the sequence's length plus the lookahead slots. The swap takes the
    /// distinct blocks; each append visits the table positions from its reserved tokens to
    /// `target` and takes one block for a position past its table and one for a block still
    /// shared when it is visited (copy on write: the last holder writes in place). A cached
    /// identical block can make either take none, never more. Those visited blocks are not
    /// full, so they are shared only within `seqs` (forks), with the CPU's reference counts.
    pub fn swap_in_need(&self, seqs: &[(SeqId, usize, usize)]) -> Result<usize> {
        let ids: Vec<SeqId> = seqs.iter().map(|s| s.0).collect();
        let mut need = self.distinct_blocks(&ids)?;
        let mut holders: HashMap<BlockId, u32> = HashMap::new();
        for &(id, target, bs) in seqs {
            let e = self.entry(id)?;
            let (first, last) = (e.reserved / bs, target.div_ceil(bs));
            // Positions past the table take one block each: counted, not visited (time
            // linear in the table, whatever the lookahead).
            let past = last.saturating_sub(first.max(e.table.len()));
            need = need.saturating_add(past);
            for &b in e.table.get(first..last.min(e.table.len())).unwrap_or(&[]) {
                let left = holders.entry(b).or_insert_with(|| self.cpu.ref_count(b));
                if *left > 1 {
                    need += 1;
                    *left -= 1;
                }
            }
        }
        Ok(need)
    }

    /// Whether `swap(ids, Device::Gpu)` fits the CPU pool: its distinct blocks (shared ones
    /// once) against the free CPU blocks (cached free blocks count as free). vLLM passes the
    /// group's unfinished sequences, which for a running group are its running ones. A cached
    /// twin on the CPU can make the swap take fewer blocks, never more.
    pub fn can_swap_out(&self, ids: &[SeqId]) -> Result<bool> {
        Ok(self.distinct_blocks(ids)? <= self.cpu.num_free())
    }

    /// `unfinished`: every unfinished sequence of the group; `num_swapped`: how many are SWAPPED.
    pub fn can_swap_in(
        &self,
        unfinished: &[SeqId],
        num_swapped: usize,
        lookahead: usize,
    ) -> Result<AllocStatus> {
        let blocks = self.distinct_blocks(unfinished)?;
        let per_seq = lookahead.div_ceil(self.cfg.block_size).max(1);
        let required = num_swapped.saturating_mul(per_seq).saturating_add(blocks);
        Ok(if (self.cfg.num_gpu_blocks as usize) < required {
            AllocStatus::Never
        } else if self.gpu.num_free() >= required + self.watermark_blocks {
            AllocStatus::Ok
        } else {
            AllocStatus::Later
        })
    }

    /// Move the tables of `ids` (in order) from `from` to the other device. Returns the mapping
    /// old block -> new block in the order blocks were moved; a shared block moves once.
    pub fn swap(&mut self, ids: &[SeqId], from: Device) -> Result<Vec<(BlockId, BlockId)>> {
        let to = match from {
            Device::Gpu => Device::Cpu,
            Device::Cpu => Device::Gpu,
        };
        for &id in ids {
            let e = self.entry(id)?;
            if e.device != from {
                return Err(Error::invalid(format!(
                    "sequence {id} is on the {}, not the {}",
                    e.device.name(),
                    from.name()
                )));
            }
        }
        let need = self.distinct_blocks(ids)?;
        if need > self.pool(to).num_free() {
            return Err(self.out_of(to, need));
        }
        let window = self.window;
        let (src, dst, src_stamps) = match from {
            Device::Gpu => (&mut self.gpu, &mut self.cpu, &mut self.gpu_stamps),
            Device::Cpu => (&mut self.cpu, &mut self.gpu, &mut self.cpu_stamps),
        };
        let mut mapping: Vec<(BlockId, BlockId)> = Vec::new();
        let mut index: HashMap<BlockId, BlockId> = HashMap::new();
        for &id in ids {
            let e = self.tables.get_mut(&id).ok_or(Error::UnknownSequence(id))?;
            // the access time belongs to the blocks being left behind
            flush_access(src, src_stamps, e);
            for (i, &b) in distinct(&e.table, window).iter().enumerate() {
                if let Some(&d) = index.get(&b) {
                    dst.acquire(d, 1)?;
                } else {
                    let d = match src.key_of(b) {
                        Some(mut key) => {
                            // on the destination the parent is where this table's previous
                            // block went (moved just before, in table order)
                            key.parent = if i > 0 {
                                index.get(&e.table[i - 1]).copied()
                            } else {
                                None
                            };
                            let nht = src.num_hashed_tokens(b);
                            if let Some(c) = dst.lookup(&key) {
                                dst.acquire(c, 1)?;
                                c
                            } else {
                                let d = dst.allocate()?;
                                dst.register(d, &key, nht)?;
                                d
                            }
                        }
                        None => dst.allocate()?,
                    };
                    index.insert(b, d);
                    mapping.push((b, d));
                }
                src.release(b)?;
            }
            for b in e.table.iter_mut() {
                *b = index[b];
            }
            e.device = to;
            self.next_version += 1;
            e.version = self.next_version;
            e.layout = self.next_version;
        }
        Ok(mapping)
    }

    // ---- prefix-caching helpers ----------------------------------------------------------

    /// Set the access time of every block of the sequence (vLLM's semantics). O(1): the time
    /// is kept on the sequence until one of its blocks is released or replaced.
    pub fn access_all_blocks_in_seq(&mut self, id: SeqId, access_time: f64) -> Result<()> {
        if !self.cfg.enable_caching {
            return Ok(());
        }
        if !access_time.is_finite() {
            return Err(Error::invalid("access_time must be a finite number"));
        }
        let e = self.tables.get_mut(&id).ok_or(Error::UnknownSequence(id))?;
        self.access_clock += 1;
        e.access = Some(PendingAccess {
            time: access_time,
            stamp: self.access_clock,
            upto: e.table.len(),
        });
        Ok(())
    }

    /// The access time vLLM's eager bookkeeping would show for a block now (introspection:
    /// O(tables)).
    pub fn last_accessed(&self, device: Device, b: BlockId) -> f64 {
        let (pool, stamps) = match device {
            Device::Gpu => (&self.gpu, &self.gpu_stamps),
            Device::Cpu => (&self.cpu, &self.cpu_stamps),
        };
        let (mut time, mut stamp) = (pool.last_accessed(b), stamps[b as usize]);
        for e in self.tables.values().filter(|e| e.device == device) {
            if let Some(p) = e.access {
                if p.stamp > stamp && e.table[..p.upto.min(e.table.len())].contains(&b) {
                    (time, stamp) = (p.time, p.stamp);
                }
            }
        }
        time
    }

    /// `access_all_blocks_in_seq` for many sequences: all checked, then all applied.
    pub fn access_all_blocks_in_seqs(&mut self, ids: &[SeqId], access_time: f64) -> Result<()> {
        if !self.cfg.enable_caching {
            return Ok(());
        }
        if !access_time.is_finite() {
            return Err(Error::invalid("access_time must be a finite number"));
        }
        for &id in ids {
            self.entry(id)?;
        }
        for &id in ids {
            self.access_all_blocks_in_seq(id, access_time)?;
        }
        Ok(())
    }

    /// vLLM's rule: mark blocks `0..len/bs - 1` computed, walking back until one already is.
    pub fn compute_full_blocks_in_seq(&mut self, id: SeqId, len: usize) {
        let Some(e) = self.tables.get(&id) else {
            return;
        };
        let full = len / self.cfg.block_size;
        if full == 0 {
            return;
        }
        let pool = match e.device {
            Device::Gpu => &mut self.gpu,
            Device::Cpu => &mut self.cpu,
        };
        for i in (0..(full - 1).min(e.table.len())).rev() {
            let b = e.table[i];
            if pool.is_computed(b) {
                break;
            }
            pool.set_computed(b, true);
        }
    }

    /// The leading computed blocks of the table, excluding its last entry.
    pub fn get_all_computed_blocks(&self, id: SeqId) -> Vec<BlockId> {
        let Some(e) = self.tables.get(&id) else {
            return Vec::new();
        };
        e.table[..self.computed_prefix_len(e)].to_vec()
    }

    /// How many leading blocks of the table, excluding its last entry, are computed:
    /// continues from what the last query of the same table version found.
    fn computed_prefix_len(&self, e: &SeqEntry) -> usize {
        let pool = self.pool(e.device);
        let body = e.table.len().saturating_sub(1);
        let (version, known) = e.computed_hint.get();
        let mut k = if version == e.version {
            known.min(body)
        } else {
            0
        };
        while k < body && pool.is_computed(e.table[k]) {
            k += 1;
        }
        e.computed_hint.set((e.version, k));
        k
    }

    /// Longest common prefix of the non-empty computed-block lists of `ids`.
    pub fn get_common_computed_block_ids(&self, ids: &[SeqId]) -> Vec<BlockId> {
        match self.common_computed_prefix(ids) {
            Some(p) => self.tables[&p.seq].table[..p.len].to_vec(),
            None => Vec::new(),
        }
    }

    /// [`Self::get_common_computed_block_ids`] without the copy: the prefix is the first `len`
    /// blocks of `seq`'s table at `version` (None: empty). Table versions are never reused,
    /// so an equal `ComputedPrefix` names the same blocks.
    pub fn common_computed_prefix(&self, ids: &[SeqId]) -> Option<ComputedPrefix> {
        if !self.cfg.enable_caching {
            return None;
        }
        let mut common: Option<(SeqId, &SeqEntry, usize)> = None;
        for &id in ids {
            let Some(e) = self.tables.get(&id) else {
                continue;
            };
            let n = self.computed_prefix_len(e);
            if n == 0 {
                continue;
            }
            common = Some(match common {
                None => (id, e, n),
                Some((cid, c, k)) => {
                    let (a, b) = (&c.table[..k], &e.table[..n]);
                    (cid, c, a.iter().zip(b).take_while(|(x, y)| x == y).count())
                }
            });
        }
        common
            .filter(|&(_, _, n)| n > 0)
            .map(|(seq, e, len)| ComputedPrefix {
                seq,
                version: e.version,
                len,
            })
    }

    /// Check pool invariants and that ref counts equal the references the tables hold.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.gpu.check_invariants()?;
        self.cpu.check_invariants()?;
        for (dev, pool) in [(Device::Gpu, &self.gpu), (Device::Cpu, &self.cpu)] {
            let mut refs = vec![0u32; pool.num_blocks() as usize];
            for e in self.tables.values().filter(|e| e.device == dev) {
                let d = distinct(&e.table, self.window);
                let mut sorted = d.to_vec();
                sorted.sort_unstable();
                if sorted.windows(2).any(|w| w[0] == w[1]) {
                    return Err("a table holds the same block twice".into());
                }
                if let Some(w) = self.window {
                    if e.table
                        .iter()
                        .enumerate()
                        .any(|(i, &b)| b != e.table[i % w])
                    {
                        return Err("window table is not periodic".into());
                    }
                }
                for &b in d {
                    refs[b as usize] += 1;
                }
            }
            for (b, &r) in refs.iter().enumerate() {
                if pool.ref_count(b as BlockId) != r {
                    return Err(format!(
                        "{} block {b}: ref count {} but tables hold {r}",
                        dev.name(),
                        pool.ref_count(b as BlockId)
                    ));
                }
            }
        }
        Ok(())
    }
}
