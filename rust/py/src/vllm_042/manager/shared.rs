//! The bodies several of the manager's methods share: the batch step (`append_slots_batch`
//! and `fill_block_tables`), a swap in either direction (`swap_in`, `swap_out`) and marking
//! full blocks computed (`compute_full_blocks_in_seq(s)`, `mark_blocks_as_computed`).
//!
//! Invariants: each takes the manager's lock once (never waiting) and makes its core calls
//! under it; the step checks every buffer and, when it appends, that every sequence gets its
//! slot before anything changes, and takes its buffer views after the last Python callback.
//!
//! Costs: the core's, plus resolving each sequence to its token store (one registry lookup,
//! new tokens read from Python).

use super::args::with_status;
use super::PyManager;
use crate::errors::IntoPyResult;
use crate::vllm_042::buffers::{step_outputs, OutputArg};
use crate::vllm_042::results::mapping_dict;
use crate::vllm_042::seqs::{items, Status};
use pagedkv_core::vllm_042::{Copies, Device, StepRows};
use pyo3::prelude::*;

impl PyManager {
    /// The shared body of `append_slots_batch` and `fill_block_tables`: resolve, check the
    /// buffers, (append), write rows. Buffer views are taken after every Python callback.
    pub(super) fn step<'py>(
        &self,
        seqs: &Bound<'py, PyAny>,
        outputs: &[OutputArg<'_, 'py>],
        pad_value: i32,
        append: bool,
    ) -> PyResult<Copies> {
        let seqs = items(seqs)?;
        let mut st = self.lock()?;
        let r = st.resolve(&seqs)?;
        let mut views = step_outputs(outputs)?;
        let hasher = self.cfg.hasher;
        {
            let b = r.borrow()?;
            let pairs = b.pairs();
            let (rows, cols) = views.table_shape();
            st.inner
                .check_step_buffers(&pairs, rows, cols, &views.vec_lens(), append)
                .py()?;
            if append {
                st.inner.check_append_batch(&pairs, 0).py()?;
            }
        }
        let b = r.borrow_adopted(hasher)?;
        let pairs = b.pairs();
        let mut copies = Copies::new();
        if append {
            st.inner.append_slots_batch(&pairs, 0, &mut copies).py()?;
        }
        let (block_tables, cols, context_lens, slot_mapping) = views.slices()?;
        st.inner
            .write_step_rows(
                &pairs,
                StepRows {
                    block_tables,
                    cols,
                    pad_value,
                    context_lens,
                    slot_mapping,
                },
            )
            .py()?;
        Ok(copies)
    }

    pub(super) fn swap<'py>(
        &self,
        py: Python<'py>,
        seq_group: &Bound<'py, PyAny>,
        status: Status,
        from: Device,
    ) -> PyResult<Bound<'py, PyAny>> {
        let seqs = with_status(seq_group, |s| s == status)?;
        let mapping = {
            let mut st = self.lock()?;
            let ids = st.registry.ids(&seqs)?;
            st.inner.swap(&ids, from).py()?
        };
        mapping_dict(py, &mapping)
    }

    pub(super) fn compute_full_blocks(&self, seqs: &[Bound<'_, PyAny>]) -> PyResult<()> {
        let mut st = self.lock()?;
        let r = st.resolve(seqs)?;
        let lens: Vec<usize> = r.borrow()?.pairs().iter().map(|(_, s)| s.len()).collect();
        for (&id, len) in r.ids.iter().zip(lens) {
            st.inner.compute_full_blocks_in_seq(id, len);
        }
        Ok(())
    }
}
