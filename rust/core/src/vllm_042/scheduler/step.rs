//! Issue 10's batch step, core half: apply the previous step's sampled tokens (with vLLM
//! 0.4.2's stop checks and forks for `best_of > 1`), free what finished, and, after the
//! ordinary [`Scheduler::schedule`], write the model runner's inputs into caller-owned int32
//! slices. No Python: the token stores are reached through [`TokensMut`].
//!
//! The previous step's batch is a list of [`Row`]s (one per running sequence of a scheduled
//! group, in output order). Each row with `samples > 0` takes that many sampled tokens, in
//! row order: the first `samples - 1` go to new children (forked from the row's sequence
//! before its own token is appended, vLLM's `_process_sequence_group_outputs`), the last to
//! the row's sequence itself.
//!
//! Prefix caching (without chunked prefill): a prompt row's tokens exclude its leading
//! tokens whose blocks are already computed, as vLLM 0.4.2's model runner skips
//! `computed_block_nums` (`cached_tokens` says how many; see [`cached_skip`]).

use super::{Change, Finish, Group, GroupKey, IdMap, Outputs, Scheduled, Scheduler, SeqState};
use super::{Status, StepMeta, Tokens};
use crate::error::{Error, Result};
use crate::vllm_042::manager::{Manager, SeqId};
use crate::vllm_042::pool::BlockId;
use crate::vllm_042::step_buffers::newest_slot;
use crate::vllm_042::token_seq::TokenSeq;

/// Mutable access to token stores (appending sampled tokens).
pub trait TokensMut: Tokens {
    fn with_mut<R>(&self, id: SeqId, f: impl FnOnce(&mut TokenSeq) -> R) -> Result<R>;
}

/// The `SamplingParams` fields vLLM 0.4.2's `StopChecker` reads (stop strings need a
/// detokenizer and are the caller's business), plus the group's prompt length.
#[derive(Clone, Debug, Default)]
pub struct StopRules {
    pub prompt_len: usize,
    pub max_tokens: Option<usize>,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub eos: Option<u32>,
    pub stop_ids: Vec<u32>,
}

impl StopRules {
    /// `StopChecker.maybe_stop_sequence` after a token was appended: `len` tokens in all,
    /// `last` the newest. Same order of checks as vLLM.
    pub fn check(&self, len: usize, last: u32, max_model_len: usize) -> Option<Finish> {
        let out = len.saturating_sub(self.prompt_len);
        if out < self.min_tokens {
            return None;
        }
        if (!self.ignore_eos && self.eos == Some(last)) || self.stop_ids.contains(&last) {
            return Some(Finish::Stopped);
        }
        if len > max_model_len || self.max_tokens == Some(out) {
            return Some(Finish::LengthCapped);
        }
        None
    }
}

/// One running sequence of a scheduled group: one row of the model inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub key: GroupKey,
    pub seq: SeqId,
    /// Tokens the model samples for this row (0: no sampling this step).
    pub samples: usize,
    /// vLLM's `len(computed_block_nums)` for a prompt row without chunked prefill (its
    /// cached prefix, in blocks), else 0.
    pub cached_blocks: usize,
    /// The group's token chunk this step (its `Scheduled::chunk`).
    pub chunk: usize,
}

/// The previous step's batch, as the caller's sampled-token array is laid out.
///
/// `rows` are in buffer-row order. By default that is `schedule()`'s order (`place` empty);
/// with stable rows ([`StableRows`](super::StableRows)) `place[j]` is the buffer row of the
/// `j`-th row in schedule order. Samples are applied in schedule order (children drawn,
/// forked and parents freed as vLLM's output processor does, so block ids and sequence ids
/// match the compat path), each row taking its samples from its buffer row's span.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub groups: Vec<Scheduled>,
    pub rows: Vec<Row>,
    pub place: Vec<usize>,
}

impl Batch {
    /// The buffer rows in schedule order.
    pub fn schedule_order(&self) -> impl Iterator<Item = usize> + '_ {
        let n = if self.place.is_empty() {
            self.rows.len()
        } else {
            0
        };
        (0..n).chain(self.place.iter().copied())
    }

    /// Per buffer row, where its samples start in the sampled array, into `starts` (a
    /// scratch buffer the caller keeps across steps).
    pub fn sample_starts(&self, starts: &mut Vec<usize>) {
        starts.clear();
        let mut at = 0;
        starts.extend(self.rows.iter().map(|r| {
            at += r.samples;
            at - r.samples
        }));
    }

    pub fn num_samples(&self) -> usize {
        self.rows.iter().map(|r| r.samples).sum()
    }
    /// Children the samples fork: one per extra sample of a row whose group is still here
    /// (the rows of groups aborted since the batch fork nothing, `drop_groups`).
    pub fn num_children(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.key != GroupKey::MAX)
            .map(|r| r.samples.saturating_sub(1))
            .sum()
    }
    /// Forget groups that left the scheduler between steps (aborted): their rows still take
    /// their samples (the caller's array has them) but nothing is applied.
    pub fn drop_groups(&mut self, keys: &[GroupKey]) {
        self.groups.retain(|s| !keys.contains(&s.key));
        for r in &mut self.rows {
            if keys.contains(&r.key) {
                r.key = GroupKey::MAX;
            }
        }
    }
}

/// What applying the sampled tokens did.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    /// Sequences whose block tables were freed (finished).
    pub freed: Vec<SeqId>,
    /// Finished groups, out of the running queue (the caller releases them).
    pub finished: Vec<GroupKey>,
}

impl Scheduler {
    /// Apply the previous step: computed tokens, sampled tokens, stop checks, forks (child
    /// ids in `children`, their stores already copies of their parents'), frees. Everything
    /// the caller passes is checked before anything changes.
    pub fn apply_sampled<T: TokensMut>(
        &mut self,
        mgr: &mut Manager,
        toks: &T,
        prev: &Batch,
        rules: &IdMap<GroupKey, StopRules>,
        sampled: &[i32],
        children: &[SeqId],
    ) -> Result<Applied> {
        self.check_sampled(prev, rules, sampled)?;
        if children.len() != prev.num_children() {
            return Err(Error::invalid("wrong number of child sequence ids"));
        }
        if let Some(c) = children.iter().find(|c| self.by_seq.contains_key(c)) {
            return Err(Error::invalid(format!("sequence {c} already exists")));
        }
        for s in &prev.groups {
            self.add_computed(toks, s.key, s.chunk)?;
        }
        let mut next_child = 0;
        let mut forks = Vec::new();
        let mut freed = Vec::new();
        let mut starts = std::mem::take(&mut self.scratch.sample_starts);
        prev.sample_starts(&mut starts);
        for i in prev.schedule_order() {
            let (r, at) = (&prev.rows[i], starts[i]);
            let toks_of_row = &sampled[at..at + r.samples];
            if r.key == GroupKey::MAX || r.samples == 0 {
                continue;
            }
            let rule = &rules[&r.key];
            let kids = &children[next_child..next_child + r.samples - 1];
            next_child += r.samples - 1;
            for (&child, &tok) in kids.iter().zip(toks_of_row) {
                self.add_child(r.key, r.seq, child);
                if self.append_checked(toks, r.key, child, tok as u32, rule)? {
                    forks.push((r.seq, child));
                }
            }
            let last = *toks_of_row.last().expect("samples > 0");
            if !self.append_checked(toks, r.key, r.seq, last as u32, rule)? {
                freed.push(r.seq);
            }
        }
        self.scratch.sample_starts = starts;
        for &(parent, child) in &forks {
            mgr.fork(parent, child)?;
        }
        for &id in &freed {
            mgr.free(id)?;
        }
        let finished = self.free_finished();
        Ok(Applied { freed, finished })
    }

    /// Is `sampled` what the previous batch `prev` needs?
    pub fn check_sampled(
        &self,
        prev: &Batch,
        rules: &IdMap<GroupKey, StopRules>,
        sampled: &[i32],
    ) -> Result<()> {
        if sampled.len() != prev.num_samples() {
            return Err(Error::invalid(format!(
                "the previous step sampled {} tokens; got {}",
                prev.num_samples(),
                sampled.len()
            )));
        }
        if let Some(t) = sampled.iter().find(|&&t| t < 0) {
            return Err(Error::invalid(format!("sampled token id {t} is negative")));
        }
        for r in prev.rows.iter().filter(|r| r.key != GroupKey::MAX) {
            if self.group(r.key).is_none() || !rules.contains_key(&r.key) {
                return Err(Error::invalid(
                    "the previous batch names a group that is gone",
                ));
            }
        }
        Ok(())
    }

    /// vLLM's `SequenceGroup.update_num_computed_tokens`: every unfinished sequence.
    fn add_computed<T: Tokens>(&mut self, toks: &T, key: GroupKey, chunk: usize) -> Result<()> {
        let Some(g) = self.groups.get_mut(key as usize).and_then(|g| g.as_mut()) else {
            return Ok(());
        };
        for s in g.seqs.iter_mut().filter(|s| !s.status.is_finished()) {
            let len = toks.with(s.id, |t| t.len())?;
            s.num_computed = (s.num_computed + chunk).min(len);
            if s.num_computed == len {
                s.decode = true;
            }
        }
        Ok(())
    }

    /// A new child of `parent` with the parent's progress (its store is the caller's copy).
    fn add_child(&mut self, key: GroupKey, parent: SeqId, child: SeqId) {
        let g: &mut Group = self.gm(key);
        let st = g.seqs.iter().find(|s| s.id == parent).cloned();
        let st = st.expect("a row names a sequence of its group");
        g.seqs.push(SeqState { id: child, ..st });
        g.num_seqs += 1;
        self.by_seq.insert(child, key);
    }

    /// Append a sampled token and run the stop checks; false if the sequence finished.
    fn append_checked<T: TokensMut>(
        &mut self,
        toks: &T,
        key: GroupKey,
        id: SeqId,
        tok: u32,
        rule: &StopRules,
    ) -> Result<bool> {
        let len = toks.with_mut(id, |t| {
            t.push(tok);
            t.len()
        })?;
        let Some(fin) = rule.check(len, tok, self.cfg.max_model_len) else {
            return Ok(true);
        };
        let g = self.gm(key);
        let s = g
            .seqs
            .iter_mut()
            .find(|s| s.id == id)
            .expect("sequence of its group");
        s.status = Status::Finished(fin);
        self.changes.push(Change {
            key,
            seq: id,
            status: Status::Finished(fin),
            reset: false,
        });
        Ok(false)
    }

    /// The rows of this step's batch (scheduled groups in `order`), with their sample counts:
    /// `best_of` for a sampling group that has one sequence (its first sample), else 1; and
    /// a prompt row's cached prefix (none with chunked prefill: vLLM 0.4.2's model runner
    /// refuses prefix caching there, and the computed marks, set for the whole prompt when
    /// its first chunk is scheduled, run ahead of the chunks actually computed).
    pub fn batch_rows(&self, out: &Outputs, metas: &[StepMeta], order: &[usize]) -> Batch {
        let mut b = Batch::default();
        self.batch_rows_into(out, metas, order, &mut b);
        b
    }

    /// [`Self::batch_rows`] into `b` (cleared first), reusing its buffers across steps.
    pub fn batch_rows_into(
        &self,
        out: &Outputs,
        metas: &[StepMeta],
        order: &[usize],
        b: &mut Batch,
    ) {
        b.groups.clear();
        b.rows.clear();
        b.place.clear();
        b.groups.reserve(order.len());
        b.rows
            .reserve(order.iter().map(|&i| metas[i].running.len()).sum());
        for &i in order {
            let (s, m) = (out.scheduled[i], &metas[i]);
            b.groups.push(s);
            let g = self.g(s.key);
            let samples = match (m.do_sample, g.seqs.len()) {
                (false, _) => 0,
                (true, 1) => g.best_of,
                (true, _) => 1,
            };
            let cached_blocks = match m.is_prompt && !self.cfg.chunked_prefill {
                true => m.computed.map_or(0, |p| p.len),
                false => 0,
            };
            b.rows.extend(m.running.iter().map(|&seq| Row {
                key: s.key,
                seq,
                samples,
                cached_blocks,
                chunk: s.chunk,
            }));
        }
    }

    /// The progress of a sequence (computed tokens, decode stage).
    pub fn progress(&self, id: SeqId) -> Option<(usize, bool)> {
        let key = self.by_seq.get(&id)?;
        let g = self.group(*key)?;
        g.seqs
            .iter()
            .find(|s| s.id == id)
            .map(|s| (s.num_computed, s.decode))
    }
}

/// Caller-owned int32 model inputs of one step (see `docs/scheduler.md`, batch step).
pub struct ModelInputs<'a> {
    /// Per token: its id, position and KV slot (`[num_batched_tokens]`).
    pub input_tokens: &'a mut [i32],
    pub positions: &'a mut [i32],
    pub slot_mapping: &'a mut [i32],
    /// Per row: token offsets (`[rows + 1]`), length after this step, samples, and the
    /// leading tokens of its chunk left out because the prefix cache holds them.
    pub query_start_loc: &'a mut [i32],
    pub context_lens: &'a mut [i32],
    pub num_samples: &'a mut [i32],
    pub cached_tokens: &'a mut [i32],
    pub seq_ids: &'a mut [i64],
    /// `[rows, cols]` row-major, padded with 0 (vLLM's padding).
    pub block_tables: &'a mut [i32],
    pub cols: usize,
    /// Incremental mode: `block_tables` is kept across steps from this step's delta
    /// (`Manager::write_block_tables`); `None`: rows written whole.
    pub held: Option<(&'a TableDelta, &'a mut HeldTables)>,
    /// Flattened pairs `(src, dst)`.
    pub copies: &'a mut [i32],
    pub swap_in: &'a mut [i32],
    pub swap_out: &'a mut [i32],
}

/// What was written: the used lengths.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub rows: usize,
    pub tokens: usize,
    pub copies: usize,
    pub swap_in: usize,
    pub swap_out: usize,
}

fn too_small(name: &str, have: usize, need: usize) -> Error {
    Error::invalid(format!(
        "{name} holds {have} entries; this step needs {need}"
    ))
}

/// `pairs` as vLLM's dict would hold them: one entry per source block, in first-insertion
/// order, holding the last destination set (sequences of a group share blocks, so a shared
/// block is swapped once).
fn as_mapping(pairs: &[(u32, u32)]) -> Vec<(u32, u32)> {
    let mut at: IdMap<u32, usize> = IdMap::default();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(pairs.len());
    for &(a, b) in pairs {
        match at.get(&a) {
            Some(&i) => out[i].1 = b,
            None => {
                at.insert(a, out.len());
                out.push((a, b));
            }
        }
    }
    out
}

fn put_pairs(name: &str, dst: &mut [i32], pairs: &[(u32, u32)]) -> Result<usize> {
    if dst.len() < 2 * pairs.len() {
        return Err(too_small(name, dst.len() / 2, pairs.len()));
    }
    for (d, &(a, b)) in dst.chunks_exact_mut(2).zip(pairs) {
        d[0] = a as i32;
        d[1] = b as i32;
    }
    Ok(pairs.len())
}

/// How many leading tokens of a prompt chunk `[start, start + chunk)` are left out of the
/// model inputs when the first `cached` tokens of the sequence are in computed blocks.
/// vLLM 0.4.2's model runner (`_prepare_prompt`) starts at `len(computed_block_nums) *
/// block_size` (its prompts are whole, `start == 0`, and the computed blocks exclude the
/// table's last block, so at least one token is left); at least the chunk's last token is
/// always computed.
pub fn cached_skip(cached: usize, start: usize, chunk: usize) -> usize {
    cached.saturating_sub(start).min(chunk.saturating_sub(1))
}

fn as_i32(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::invalid(format!("{x} does not fit int32")))
}

impl Manager {
    /// Block-table columns the rows of `batch` need (the widest table).
    pub fn batch_cols(&self, batch: &Batch) -> Result<usize> {
        let mut cols = 0;
        for r in &batch.rows {
            cols = cols.max(self.block_table(r.seq)?.len());
        }
        Ok(cols)
    }

    /// Write the model inputs of `batch` (rows of this step, chunk per group). Sizes are
    /// checked before the first write.
    pub fn write_model_inputs<T: Tokens>(
        &self,
        sched: &Scheduler,
        toks: &T,
        batch: &Batch,
        out: &Outputs,
        buf: ModelInputs<'_>,
    ) -> Result<Written> {
        let mut tokens = 0;
        for r in &batch.rows {
            let sp = self.row_span(sched, r)?;
            tokens += sp.len - sp.skip;
        }
        check_sizes(&buf, batch.rows.len(), tokens)?;
        for r in &batch.rows {
            let need = self.block_table(r.seq)?.len();
            if need > buf.cols {
                return Err(too_small("a block_tables row", buf.cols, need));
            }
        }
        let copies: Vec<(u32, u32)> = out
            .copies
            .iter()
            .flat_map(|(s, ds)| ds.iter().map(move |&d| (*s, d)))
            .collect();
        let written = Written {
            rows: batch.rows.len(),
            tokens,
            copies: put_pairs("copies", buf.copies, &copies)?,
            swap_in: put_pairs("swap_in", buf.swap_in, &as_mapping(&out.swap_in))?,
            swap_out: put_pairs("swap_out", buf.swap_out, &as_mapping(&out.swap_out))?,
        };
        let bs = self.config().block_size;
        let mut t = 0;
        buf.query_start_loc[0] = 0;
        for (i, r) in batch.rows.iter().enumerate() {
            let sp = self.row_span(sched, r)?;
            let table = self.block_table(r.seq)?;
            let (from, end) = (sp.start + sp.skip, sp.start + sp.len);
            toks.with(r.seq, |ts| -> Result<()> {
                let ids = ts.tokens().get(from..end).ok_or_else(|| {
                    Error::invalid(format!("sequence {} has no tokens {from}..{end}", r.seq))
                })?;
                for (j, &id) in ids.iter().enumerate() {
                    let p = from + j;
                    buf.input_tokens[t + j] = as_i32(id as usize)?;
                    buf.positions[t + j] = as_i32(p)?;
                    buf.slot_mapping[t + j] = newest_slot(table, p + 1, bs)?;
                }
                Ok(())
            })??;
            t += end - from;
            buf.query_start_loc[i + 1] = as_i32(t)?;
            buf.context_lens[i] = as_i32(end)?;
            buf.num_samples[i] = as_i32(r.samples)?;
            buf.cached_tokens[i] = as_i32(sp.skip)?;
            buf.seq_ids[i] = i64::try_from(r.seq).map_err(|_| Error::invalid("seq id over i64"))?;
        }
        self.write_block_tables(batch, buf.block_tables, buf.cols, buf.held)?;
        Ok(written)
    }

    /// A row's chunk: where it starts, its length and the cached tokens it leaves out
    /// (computed twice per step, to size and to write, rather than kept in a list).
    fn row_span(&self, sched: &Scheduler, r: &Row) -> Result<Span> {
        let bs = self.config().block_size;
        let len = r.chunk;
        let (start, _) = sched.progress(r.seq).ok_or(Error::UnknownSequence(r.seq))?;
        let skip = cached_skip(r.cached_blocks * bs, start, len);
        Ok(Span { start, len, skip })
    }
}

/// A row's chunk: tokens `[start, start + len)`, of which the first `skip` are cached.
struct Span {
    start: usize,
    len: usize,
    skip: usize,
}

/// Every per-row and per-token output can hold `rows` rows and `tokens` tokens.
fn check_sizes(buf: &ModelInputs<'_>, rows: usize, tokens: usize) -> Result<()> {
    let per_row = [
        ("context_lens", buf.context_lens.len()),
        ("num_samples", buf.num_samples.len()),
        ("cached_tokens", buf.cached_tokens.len()),
        ("seq_ids", buf.seq_ids.len()),
        (
            "block_tables rows",
            buf.block_tables.len().checked_div(buf.cols).unwrap_or(0),
        ),
    ];
    for (name, have) in per_row {
        if have < rows {
            return Err(too_small(name, have, rows));
        }
    }
    if buf.query_start_loc.len() < rows + 1 {
        return Err(too_small(
            "query_start_loc",
            buf.query_start_loc.len(),
            rows + 1,
        ));
    }
    for (name, have) in [
        ("input_tokens", buf.input_tokens.len()),
        ("positions", buf.positions.len()),
        ("slot_mapping", buf.slot_mapping.len()),
    ] {
        if have < tokens {
            return Err(too_small(name, have, tokens));
        }
    }
    Ok(())
}

/// How a row's block table changed since the last step (incremental updates, the way vLLM
/// v1 hands its workers only new block ids).
pub const ROW_SAME: u8 = 0;
/// Same sequence in the same row; blocks were only appended (the new ids follow).
pub const ROW_APPENDED: u8 = 1;
/// A new row, or blocks replaced (copy-on-write, swap, recompute): the whole table follows.
pub const ROW_REWRITTEN: u8 = 2;
/// The sequence was in another row of the last batch (`from`; rows move when an earlier row
/// leaves or a new one enters before it); its table there, plus the new ids that follow.
pub const ROW_MOVED: u8 = 3;

/// `TableDelta::from` of a rewritten row (no earlier row to start from).
pub const NO_ROW: usize = usize::MAX;

/// Per row: its state and the block ids the caller applies (`blocks[loc[i]..loc[i + 1]]`).
#[derive(Clone, Debug, Default)]
pub struct TableDelta {
    /// Which delta this is (`SentTables` counts them): a persistent buffer that reflects delta
    /// `number - 1` can apply this one.
    pub number: u64,
    pub state: Vec<u8>,
    /// Per row: its row in the last batch (`NO_ROW` when rewritten).
    pub from: Vec<usize>,
    pub loc: Vec<usize>,
    pub blocks: Vec<BlockId>,
}

/// What the caller was last sent for one sequence, in the buffer row that still holds it.
#[derive(Clone, Copy, Debug)]
struct SentRow {
    row: usize,
    version: u64,
    layout: u64,
    len: usize,
}

/// The tables a caller's persistent buffer holds, and how many deltas were made. A buffer
/// row keeps what it was last sent until another sequence's table is written there, so a
/// sequence that sat out some steps (vLLM 0.4.2 runs prompts in steps of their own) still
/// finds its table in its row, or moves it from there.
#[derive(Clone, Debug, Default)]
pub struct SentTables {
    /// Per sequence whose table a buffer row still holds.
    rows: IdMap<SeqId, SentRow>,
    /// Per buffer row: the sequence last sent there (`SeqId::MAX`: none).
    occupant: Vec<SeqId>,
    deltas: u64,
    /// Scratch: this delta's rows, recorded once every row was read.
    pending: Vec<(SeqId, SentRow)>,
}

impl SentTables {
    /// Forget what was sent: the next delta rewrites every row, and a persistent buffer that
    /// reflects an earlier delta is written whole.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.occupant.clear();
        self.deltas += 1;
    }

    /// Row `i` was sent `row`'s sequence's table: the sequence it held loses it.
    fn record(&mut self, seq: SeqId, row: SentRow) {
        let i = row.row;
        if self.occupant.len() <= i {
            self.occupant.resize(i + 1, SeqId::MAX);
        }
        let old = std::mem::replace(&mut self.occupant[i], seq);
        if old != seq && self.rows.get(&old).is_some_and(|s| s.row == i) {
            self.rows.remove(&old);
        }
        self.rows.insert(seq, row);
    }
}

impl Manager {
    /// The block-table changes of `batch` relative to `sent` (updated). O(1) per row plus
    /// the entries written: a table that only grew (its `layout` unchanged) sends its new
    /// entries, in the row that holds it or moved from the row that holds it (as the
    /// buffer was before this delta); one created, moved to the other device, with entries
    /// replaced, or whose row another sequence took sends all of them.
    pub fn table_delta(&self, batch: &Batch, sent: &mut SentTables) -> Result<TableDelta> {
        let mut d = TableDelta::default();
        self.table_delta_into(batch, sent, &mut d)?;
        Ok(d)
    }

    /// [`Self::table_delta`] into `d` (overwritten), reusing its buffers across steps.
    pub fn table_delta_into(
        &self,
        batch: &Batch,
        sent: &mut SentTables,
        d: &mut TableDelta,
    ) -> Result<()> {
        sent.deltas += 1;
        d.number = sent.deltas;
        d.state.clear();
        d.from.clear();
        d.loc.clear();
        d.blocks.clear();
        d.loc.push(0);
        let mut now = std::mem::take(&mut sent.pending);
        now.clear();
        for (i, r) in batch.rows.iter().enumerate() {
            let table = self.block_table(r.seq)?;
            let (version, layout) = self.table_versions(r.seq)?;
            let (state, from) = match sent.rows.get(&r.seq) {
                Some(s) if s.row == i && s.version == version => (ROW_SAME, i),
                Some(s) if s.layout == layout && s.len <= table.len() => {
                    d.blocks.extend_from_slice(&table[s.len..]);
                    (if s.row == i { ROW_APPENDED } else { ROW_MOVED }, s.row)
                }
                _ => {
                    d.blocks.extend_from_slice(table);
                    (ROW_REWRITTEN, NO_ROW)
                }
            };
            d.state.push(state);
            d.from.push(from);
            d.loc.push(d.blocks.len());
            let len = table.len();
            let row = SentRow {
                row: i,
                version,
                layout,
                len,
            };
            now.push((r.seq, row));
        }
        // recorded after every row was read against the buffer as it was before the delta
        for &(seq, row) in &now {
            sent.record(seq, row);
        }
        sent.pending = now;
        Ok(())
    }
}

/// A `block_tables` buffer kept up to date across steps from the deltas (incremental mode):
/// which delta it reflects, and per buffer row how far it may hold non-zero entries (so a
/// rewritten row is padded up to its previous length, not to the full width).
#[derive(Clone, Debug, Default)]
pub struct HeldTables {
    synced: Option<u64>,
    filled: Vec<usize>,
}

impl HeldTables {
    /// The buffer is another one (or was changed by someone else): write it whole next time.
    pub fn forget(&mut self) {
        self.synced = None;
    }
}

impl Manager {
    /// Write the block-table rows of `batch` into `bt` (`[rows, cols]` row-major, padded
    /// with 0). Without `held`: every row whole, padded to `cols`. With `held = (delta,
    /// state)` for a buffer that reflects the previous delta: only what changed (appended
    /// entries; rewritten and moved rows, padded up to their previous length), so the step
    /// costs the changed entries and moved rows, not the rows' width; otherwise the rows are
    /// written whole. A moved row is written from its table (as cheap as moving it, and a
    /// batch's moves can form cycles). Row widths are checked by the caller
    /// (`write_model_inputs`).
    pub fn write_block_tables(
        &self,
        batch: &Batch,
        bt: &mut [i32],
        cols: usize,
        held: Option<(&TableDelta, &mut HeldTables)>,
    ) -> Result<()> {
        let rows = bt.len().checked_div(cols).unwrap_or(0);
        let Some((d, h)) = held else {
            return self.write_whole_rows(batch, bt, cols, None);
        };
        let in_step = h.synced.is_some_and(|n| n + 1 == d.number)
            && h.filled.len() == rows
            && d.state.len() == batch.rows.len();
        h.synced = None; // until this write is done
        if !in_step {
            h.filled = vec![cols; rows]; // unknown contents
            self.write_whole_rows(batch, bt, cols, Some(&mut h.filled))?;
            h.synced = Some(d.number);
            return Ok(());
        }
        for (i, r) in batch.rows.iter().enumerate() {
            let table = self.block_table(r.seq)?;
            let row = &mut bt[i * cols..(i + 1) * cols];
            let from = match d.state[i] {
                ROW_SAME => continue,
                ROW_APPENDED => table
                    .len()
                    .checked_sub(d.loc[i + 1] - d.loc[i])
                    .ok_or_else(|| Error::invalid("the table delta is stale"))?,
                _ => 0,
            };
            for (dst, &b) in row[from..table.len()].iter_mut().zip(&table[from..]) {
                *dst = b as i32;
            }
            let filled = &mut h.filled[i];
            if d.state[i] != ROW_APPENDED && *filled > table.len() {
                row[table.len()..*filled].fill(0);
            }
            *filled = table.len().max(if d.state[i] == ROW_APPENDED {
                *filled
            } else {
                0
            });
        }
        h.synced = Some(d.number);
        Ok(())
    }

    /// Every row of `batch` whole, padded with 0 to `cols` (`filled[i]`: the table length).
    fn write_whole_rows(
        &self,
        batch: &Batch,
        bt: &mut [i32],
        cols: usize,
        mut filled: Option<&mut Vec<usize>>,
    ) -> Result<()> {
        for (i, r) in batch.rows.iter().enumerate() {
            let table = self.block_table(r.seq)?;
            let row = &mut bt[i * cols..(i + 1) * cols];
            for (d, &b) in row.iter_mut().zip(table) {
                *d = b as i32;
            }
            row[table.len()..].fill(0);
            if let Some(f) = filled.as_deref_mut() {
                f[i] = table.len();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> StopRules {
        StopRules {
            prompt_len: 4,
            max_tokens: Some(3),
            min_tokens: 2,
            ignore_eos: false,
            eos: Some(7),
            stop_ids: vec![9],
        }
    }

    #[test]
    fn stop_checks_in_vllm_order() {
        let r = rules();
        // min_tokens holds everything back, even the length limit.
        assert_eq!(r.check(5, 7, 4), None);
        assert_eq!(r.check(6, 7, 100), Some(Finish::Stopped));
        assert_eq!(r.check(6, 9, 100), Some(Finish::Stopped));
        // EOS and stop tokens win over the length checks.
        assert_eq!(r.check(7, 7, 5), Some(Finish::Stopped));
        assert_eq!(r.check(7, 1, 100), Some(Finish::LengthCapped));
        assert_eq!(r.check(6, 1, 5), Some(Finish::LengthCapped));
        assert_eq!(r.check(6, 1, 6), None); // len == max_model_len is not over it
        let ignore = StopRules {
            ignore_eos: true,
            ..rules()
        };
        assert_eq!(ignore.check(6, 7, 100), None);
    }

    fn manager() -> (Manager, crate::vllm_042::hash::Hasher) {
        use crate::vllm_042::hash::{HashAlgo, Hasher};
        let h = Hasher {
            algo: HashAlgo::Xxh3,
            seed: 1,
        };
        let cfg = crate::vllm_042::manager::ManagerConfig {
            block_size: 2,
            num_gpu_blocks: 32,
            num_cpu_blocks: 0,
            watermark: 0.0,
            sliding_window: None,
            enable_caching: false,
            strict: false,
            hasher: h,
        };
        (Manager::new(cfg).unwrap(), h)
    }

    fn batch(ids: &[SeqId]) -> Batch {
        let rows = ids.iter().map(|&seq| Row {
            key: 0,
            seq,
            samples: 1,
            cached_blocks: 0,
            chunk: 1,
        });
        Batch {
            groups: Vec::new(),
            rows: rows.collect(),
            place: Vec::new(),
        }
    }

    /// Rows equal the tables, zero-padded up to `upto` (or the width).
    fn rows_hold(m: &Manager, bt: &[i32], cols: usize, ids: &[SeqId], upto: usize) {
        for (i, &id) in ids.iter().enumerate() {
            let t: Vec<i32> = m
                .block_table(id)
                .unwrap()
                .iter()
                .map(|&b| b as i32)
                .collect();
            let row = &bt[i * cols..(i + 1) * cols];
            assert_eq!(&row[..t.len()], &t[..], "row {i}");
            assert!(
                row[t.len()..upto.max(t.len())].iter().all(|&x| x == 0),
                "row {i} pad"
            );
        }
    }

    #[test]
    fn persistent_tables_take_appends_moves_and_rewrites() {
        use crate::vllm_042::hash::HashExtra;
        let (mut m, h) = manager();
        let mut a = TokenSeq::new(2, &[1, 2, 3], HashExtra::default(), h).unwrap();
        let b = TokenSeq::new(2, &[4, 5, 6, 7, 8], HashExtra::default(), h).unwrap();
        m.allocate(&[(1, &a)]).unwrap();
        m.allocate(&[(2, &b)]).unwrap();
        let cols = 8;
        let mut bt = vec![-9; 3 * cols]; // unknown contents: the first write is whole
        let (mut sent, mut held) = (SentTables::default(), HeldTables::default());
        let mut step = |m: &Manager, bt: &mut Vec<i32>, ids: &[SeqId]| {
            let d = m.table_delta(&batch(ids), &mut sent).unwrap();
            m.write_block_tables(&batch(ids), bt, cols, Some((&d, &mut held)))
                .unwrap();
            d
        };
        step(&m, &mut bt, &[1, 2]);
        rows_hold(&m, &bt, cols, &[1, 2], cols);
        bt[cols - 1] = 77; // past every table: only a whole-row write would clear it
        for t in [9, 10] {
            a.push(t);
        }
        m.append_slots(1, &a, 0, &mut Vec::new()).unwrap();
        let d = step(&m, &mut bt, &[1, 2]);
        assert_eq!(
            (d.state.as_slice(), d.from.as_slice()),
            (&[ROW_APPENDED, ROW_SAME][..], &[0, 1][..])
        );
        assert_eq!(d.blocks, &m.block_table(1).unwrap()[2..]);
        rows_hold(&m, &bt, cols, &[1, 2], 3);
        assert_eq!(bt[cols - 1], 77);
        let d = step(&m, &mut bt, &[2, 1]); // both moved, no new ids to send
        assert_eq!(
            (d.state.as_slice(), d.from.as_slice()),
            (&[ROW_MOVED, ROW_MOVED][..], &[1, 0][..])
        );
        assert!(d.blocks.is_empty());
        rows_hold(&m, &bt, cols, &[2, 1], 3);
        // sequence 1 recomputed: a new table (new layout), sent whole; its row is padded
        // up to what the row held before
        m.free(1).unwrap();
        let short = TokenSeq::new(2, &[1], HashExtra::default(), h).unwrap();
        m.allocate(&[(1, &short)]).unwrap();
        let d = step(&m, &mut bt, &[2, 1]);
        assert_eq!((d.state[1], d.from[1]), (ROW_REWRITTEN, NO_ROW));
        rows_hold(&m, &bt, cols, &[2, 1], 3);
        assert_eq!(bt[cols - 1], 77, "padding stops at a row's previous length");
    }

    #[test]
    fn a_row_keeps_its_table_while_its_sequence_sits_out() {
        use crate::vllm_042::hash::HashExtra;
        let (mut m, h) = manager();
        for (id, n) in [(1, 3), (2, 5), (3, 1)] {
            let t = TokenSeq::new(2, &vec![1; n], HashExtra::default(), h).unwrap();
            m.allocate(&[(id, &t)]).unwrap();
        }
        let cols = 4;
        let mut bt = vec![0; 3 * cols];
        let (mut sent, mut held) = (SentTables::default(), HeldTables::default());
        let mut step = |m: &Manager, bt: &mut Vec<i32>, ids: &[SeqId]| {
            let d = m.table_delta(&batch(ids), &mut sent).unwrap();
            m.write_block_tables(&batch(ids), bt, cols, Some((&d, &mut held)))
                .unwrap();
            rows_hold(m, bt, cols, ids, cols);
            (d.state, d.from)
        };
        step(&m, &mut bt, &[1, 2]);
        // a step of its own for sequence 3 (a prompt): it takes row 0; row 1 keeps 2's table
        assert_eq!(step(&m, &mut bt, &[3]), (vec![ROW_REWRITTEN], vec![NO_ROW]));
        // 2 is back in row 1: nothing to send; 1 lost its row; 3 moves from row 0
        let (state, from) = step(&m, &mut bt, &[1, 2, 3]);
        assert_eq!(state, [ROW_REWRITTEN, ROW_SAME, ROW_MOVED]);
        assert_eq!(from, [NO_ROW, 1, 0]);
        // 2 and 3 sit out; back, 2 finds row 1 again and 3 moves from row 2 to row 0
        step(&m, &mut bt, &[1]);
        let (state, from) = step(&m, &mut bt, &[3, 2]);
        assert_eq!((state, from), (vec![ROW_MOVED, ROW_SAME], vec![2, 1]));
    }

    #[test]
    fn swap_pairs_collapse_like_a_dict() {
        let pairs = [(10, 3), (28, 18), (10, 3), (5, 1), (5, 2)];
        assert_eq!(as_mapping(&pairs), vec![(10, 3), (28, 18), (5, 2)]);
    }
}
