//! The batch step API's output: block tables, context lengths and slot numbers written into
//! caller-owned int32 buffers (what a paged-attention kernel reads). The bindings hand in
//! plain slices; every rule about shapes, padding and slot numbers lives here.

use crate::error::{Error, Result};
use crate::vllm_042::manager::{Manager, SeqId};
use crate::vllm_042::pool::BlockId;
use crate::vllm_042::token_seq::TokenSeq;

/// `slot_mapping` entry of a sequence with no tokens (vLLM's padding slot id).
pub const PAD_SLOT: i32 = -1;

/// Caller-owned int32 outputs of one step. `block_tables` is row-major `[rows, cols]`.
pub struct StepRows<'a> {
    pub block_tables: &'a mut [i32],
    pub cols: usize,
    pub pad_value: i32,
    pub context_lens: Option<&'a mut [i32]>,
    pub slot_mapping: Option<&'a mut [i32]>,
}

/// The slot of token `len - 1` (the newest): `block * block_size + offset`, or [`PAD_SLOT`]
/// when `len == 0`. An error if the table does not cover that token or the slot is not an
/// int32 (a manager's GPU pool never has such slots; see `limits::check_gpu_slots`).
pub fn newest_slot(table: &[BlockId], len: usize, block_size: usize) -> Result<i32> {
    let Some(p) = len.checked_sub(1) else {
        return Ok(PAD_SLOT);
    };
    let block = *table.get(p / block_size).ok_or_else(|| {
        Error::invalid(format!(
            "the block table has {} blocks; token {p} needs block {}",
            table.len(),
            p / block_size
        ))
    })?;
    let slot = block as u64 * block_size as u64 + (p % block_size) as u64;
    i32::try_from(slot).map_err(|_| Error::invalid(format!("slot {slot} does not fit int32")))
}

impl Manager {
    /// Entries the row of `id` needs: its table length now, or (`after_append`) after an
    /// `append_slots` of `seq` with no lookahead.
    pub fn row_len(&self, id: SeqId, seq: &TokenSeq, after_append: bool) -> Result<usize> {
        let cur = self.block_table(id)?.len();
        Ok(if after_append {
            cur.max(seq.len().div_ceil(self.config().block_size))
        } else {
            cur
        })
    }

    /// Check buffer shapes for a step over `seqs` before anything changes: `rows`/`cols` of
    /// `block_tables`, and the length of each named 1-D buffer. Lengths and block numbers must
    /// fit int32.
    pub fn check_step_buffers(
        &self,
        seqs: &[(SeqId, &TokenSeq)],
        rows: usize,
        cols: usize,
        vecs: &[(&str, usize)],
        after_append: bool,
    ) -> Result<()> {
        let n = seqs.len();
        if rows < n {
            return Err(Error::invalid(format!(
                "block_tables has {rows} rows for {n} sequences"
            )));
        }
        for &(name, len) in vecs {
            if len < n {
                return Err(Error::invalid(format!(
                    "{name} has {len} entries for {n} sequences"
                )));
            }
        }
        for &(id, seq) in seqs {
            self.check_slot_units(seq)?;
            let need = self.row_len(id, seq, after_append)?;
            if need > cols {
                return Err(Error::invalid(format!(
                    "block_tables has {cols} columns but sequence {id} needs {need}"
                )));
            }
            if seq.len() > i32::MAX as usize {
                return Err(Error::invalid("sequence too long for int32 buffers"));
            }
        }
        Ok(())
    }

    /// Write row `i` of the block tables (padded with `pad_value`), `context_lens[i]` (the
    /// sequence length) and `slot_mapping[i]` (the newest token's slot) for each sequence.
    /// Everything is checked before the first write, so an error leaves the buffers as they
    /// were.
    pub fn write_step_rows(
        &self,
        seqs: &[(SeqId, &TokenSeq)],
        mut out: StepRows<'_>,
    ) -> Result<()> {
        let cols = out.cols;
        // (a table with no columns fits any number of sequences with empty tables)
        let rows = out
            .block_tables
            .len()
            .checked_div(cols)
            .unwrap_or(seqs.len());
        let mut vecs = Vec::with_capacity(2);
        if let Some(cl) = out.context_lens.as_deref() {
            vecs.push(("context_lens", cl.len()));
        }
        if let Some(sm) = out.slot_mapping.as_deref() {
            vecs.push(("slot_mapping", sm.len()));
        }
        self.check_step_buffers(seqs, rows, cols, &vecs, false)?;
        let bs = self.config().block_size;
        let mut slots = Vec::with_capacity(seqs.len());
        if out.slot_mapping.is_some() {
            for &(id, seq) in seqs {
                slots.push(newest_slot(self.block_table(id)?, seq.len(), bs)?);
            }
        }
        for (r, &(id, seq)) in seqs.iter().enumerate() {
            let table = self.block_table(id)?;
            let row = &mut out.block_tables[r * cols..(r + 1) * cols];
            for (dst, &b) in row.iter_mut().zip(table) {
                *dst = b as i32;
            }
            row[table.len()..].fill(out.pad_value);
            if let Some(cl) = out.context_lens.as_deref_mut() {
                cl[r] = seq.len() as i32;
            }
        }
        if let Some(sm) = out.slot_mapping {
            sm[..slots.len()].copy_from_slice(&slots);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm_042::hash::{HashAlgo, HashExtra, Hasher};
    use crate::vllm_042::manager::ManagerConfig;

    const H: Hasher = Hasher {
        algo: HashAlgo::Xxh3,
        seed: 1,
    };

    fn manager(bs: usize, gpu: u32) -> Manager {
        Manager::new(ManagerConfig {
            block_size: bs,
            num_gpu_blocks: gpu,
            num_cpu_blocks: 0,
            watermark: 0.0,
            sliding_window: None,
            enable_caching: false,
            strict: false,
            hasher: H,
        })
        .unwrap()
    }

    fn seq(n: u32, bs: usize) -> TokenSeq {
        TokenSeq::new(bs, &(0..n).collect::<Vec<_>>(), HashExtra::default(), H).unwrap()
    }

    #[test]
    fn newest_slot_rules() {
        assert_eq!(newest_slot(&[], 0, 4), Ok(PAD_SLOT));
        assert_eq!(newest_slot(&[7, 3], 5, 4), Ok(3 * 4));
        assert_eq!(newest_slot(&[7, 3], 4, 4), Ok(7 * 4 + 3));
        assert!(
            newest_slot(&[7], 5, 4).is_err(),
            "table does not cover the token"
        );
        // block 2**28 of 16 tokens: slot 2**32 - 1 wraps in int32; refused, not wrapped
        assert!(newest_slot(&[1 << 28], 16, 16).is_err());
    }

    #[test]
    fn rows_are_written_and_padded() {
        let mut m = manager(4, 8);
        let (a, b) = (seq(5, 4), seq(1, 4));
        m.allocate(&[(1, &a)]).unwrap();
        m.allocate(&[(2, &b)]).unwrap();
        let seqs = [(1, &a), (2, &b)];
        let (mut t, mut cl, mut sm) = (vec![9; 3 * 3], vec![9; 3], vec![9; 3]);
        m.write_step_rows(
            &seqs,
            StepRows {
                block_tables: &mut t,
                cols: 3,
                pad_value: -7,
                context_lens: Some(&mut cl),
                slot_mapping: Some(&mut sm),
            },
        )
        .unwrap();
        assert_eq!(&t[..6], &[7, 6, -7, 5, -7, -7]);
        assert_eq!(
            &t[6..],
            &[9, 9, 9],
            "rows past the sequences are left alone"
        );
        assert_eq!(cl, [5, 1, 9]);
        assert_eq!(sm, [6 * 4, 5 * 4, 9]);
    }

    #[test]
    fn bad_shapes_write_nothing() {
        let mut m = manager(4, 8);
        let a = seq(9, 4);
        m.allocate(&[(1, &a)]).unwrap();
        let seqs = [(1, &a)];
        let mut t = vec![9; 2];
        let mut sm = vec![9; 1];
        let err = m.write_step_rows(
            &seqs,
            StepRows {
                block_tables: &mut t,
                cols: 2,
                pad_value: 0,
                context_lens: None,
                slot_mapping: Some(&mut sm),
            },
        );
        assert!(matches!(err, Err(Error::InvalidArgument(_))));
        assert_eq!((&t, &sm), (&vec![9, 9], &vec![9]));
        let mut empty: Vec<i32> = Vec::new();
        let err = m.write_step_rows(
            &seqs,
            StepRows {
                block_tables: &mut t.clone(),
                cols: 3,
                pad_value: 0,
                context_lens: Some(&mut empty),
                slot_mapping: None,
            },
        );
        assert!(
            err.is_err(),
            "a context_lens shorter than the batch is refused"
        );
    }

    #[test]
    fn after_append_length_counts_the_new_block() {
        let mut m = manager(4, 8);
        let mut a = seq(4, 4);
        m.allocate(&[(1, &a)]).unwrap();
        a.push(4);
        assert_eq!(m.row_len(1, &a, false), Ok(1));
        assert_eq!(m.row_len(1, &a, true), Ok(2));
        assert!(m.check_step_buffers(&[(1, &a)], 1, 1, &[], true).is_err());
        assert!(m.check_step_buffers(&[(1, &a)], 1, 2, &[], true).is_ok());
        assert!(m.check_step_buffers(&[(1, &a)], 0, 2, &[], true).is_err());
        assert!(m
            .check_step_buffers(&[(1, &a)], 1, 2, &[("slot_mapping", 0)], true)
            .is_err());
    }
}
