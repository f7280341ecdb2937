//! Reading the manager's arguments off Python objects: a group's sequences of some status
//! ([`with_status`]) and the constructor's block counts and sliding window, checked.
//!
//! Invariants: a count is in `0..2**32-1`, a window positive; a bad value raises
//! `InvalidArgumentError` before anything is built or changed. Nothing here takes the
//! manager's lock (reading a group calls into Python).
//!
//! Costs: one pass over the group's sequences (one `status` read each).

use crate::args::int_arg;
use crate::errors::invalid;
use crate::vllm_042::seqs::{group_seqs, status_of, Status};
use pyo3::prelude::*;

pub(super) fn with_status<'py>(
    group: &Bound<'py, PyAny>,
    pred: impl Fn(Status) -> bool,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let mut out = Vec::new();
    for s in group_seqs(group)? {
        if pred(status_of(&s)?) {
            out.push(s);
        }
    }
    Ok(out)
}

pub(super) fn count_arg(o: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    let v = int_arg(o, what)?;
    if !(0..u32::MAX as i64).contains(&v) {
        return Err(invalid(format!("{what} must be in 0..2**32-1, got {v}")));
    }
    Ok(v as u32)
}

pub(super) fn window_arg(sliding_window: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    match sliding_window {
        Some(o) if !o.is_none() => {
            let v = int_arg(o, "sliding_window")?;
            if v <= 0 {
                return Err(invalid(format!("sliding_window must be positive, got {v}")));
            }
            Ok(Some(v as usize))
        }
        _ => Ok(None),
    }
}
