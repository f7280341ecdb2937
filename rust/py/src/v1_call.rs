//! vLLM's `KVCacheManager.allocate_slots(request, num_new_tokens, ...)` arguments, parsed
//! from the call's tuple and dict directly.
//!
//! The scheduler passes `num_lookahead_tokens=` by keyword on every call. PyO3's generated
//! argument parsing copies each keyword's text out of its `str` (an allocation per keyword
//! under the stable ABI for Python 3.9); here a keyword is matched by identity against the
//! interned parameter names (the names in vLLM's source are interned by Python), by equality
//! only when that fails. `V1Manager.vllm_allocate_slots_function()` hands the scheduler a
//! callable built on this.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

/// vLLM's parameter names, in its positional order.
pub const PARAMS: [&str; 12] = [
    "request",
    "num_new_tokens",
    "num_new_computed_tokens",
    "new_computed_blocks",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "delay_cache_blocks",
    "num_encoder_tokens",
    "full_sequence_must_fit",
    "reserved_blocks",
    "has_scheduled_reqs",
    "skip_zeroing_group_ids",
];

/// The interned parameter names (made once per manager).
pub struct ParamNames([Py<PyString>; 12]);

impl ParamNames {
    pub fn new(py: Python<'_>) -> Self {
        ParamNames(PARAMS.map(|n| PyString::intern(py, n).unbind()))
    }

    fn index(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<usize> {
        if let Some(i) = self.0.iter().position(|n| n.bind(py).is(key)) {
            return Ok(i);
        }
        for (i, n) in self.0.iter().enumerate() {
            if n.bind(py).as_any().eq(key)? {
                return Ok(i);
            }
        }
        Err(PyTypeError::new_err(format!(
            "allocate_slots() got an unexpected keyword argument {key}"
        )))
    }
}

/// One call's arguments after `request` (vLLM's defaults filled in).
pub struct SlotArgs<'py> {
    pub num_new_tokens: u64,
    pub num_new_computed_tokens: u64,
    pub new_computed_blocks: Option<Bound<'py, PyAny>>,
    pub num_lookahead_tokens: u64,
    pub num_external_computed_tokens: u64,
    pub delay_cache_blocks: bool,
    pub num_encoder_tokens: u64,
    pub full_sequence_must_fit: bool,
    pub reserved_blocks: u64,
    pub has_scheduled_reqs: bool,
}

/// `(request, arguments)` of a call `allocate_slots(*args, **kwargs)`.
pub fn parse<'py>(
    names: &ParamNames,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<(Bound<'py, PyAny>, SlotArgs<'py>)> {
    let py = args.py();
    if args.len() > PARAMS.len() {
        return Err(PyTypeError::new_err(format!(
            "allocate_slots() takes at most {} arguments ({} given)",
            PARAMS.len(),
            args.len()
        )));
    }
    let mut slots: [Option<Bound<'py, PyAny>>; 12] = Default::default();
    for (slot, v) in slots.iter_mut().zip(args.iter()) {
        *slot = Some(v);
    }
    for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
        let i = names.index(py, &k)?;
        if slots[i].replace(v).is_some() {
            return Err(PyTypeError::new_err(format!(
                "allocate_slots() got multiple values for argument '{}'",
                PARAMS[i]
            )));
        }
    }
    let [request, num_new_tokens, rest @ ..] = slots;
    let (Some(request), Some(num_new_tokens)) = (request, num_new_tokens) else {
        return Err(PyTypeError::new_err(
            "allocate_slots() needs request and num_new_tokens",
        ));
    };
    let [a, b, c, d, e, f, g, h, i, _skip_zeroing] = rest;
    let int = |v: Option<Bound<'py, PyAny>>| v.map_or(Ok(0), |v| v.extract::<u64>());
    let flag =
        |v: Option<Bound<'py, PyAny>>, default| v.map_or(Ok(default), |v| v.extract::<bool>());
    let args = SlotArgs {
        num_new_tokens: num_new_tokens.extract()?,
        num_new_computed_tokens: int(a)?,
        new_computed_blocks: b,
        num_lookahead_tokens: int(c)?,
        num_external_computed_tokens: int(d)?,
        delay_cache_blocks: flag(e, false)?,
        num_encoder_tokens: int(f)?,
        full_sequence_must_fit: flag(g, false)?,
        reserved_blocks: int(h)?,
        has_scheduled_reqs: flag(i, true)?,
    };
    Ok((request, args))
}
