//! The structured-output bitmask of a native step in the plain case (vLLM's own manager, no
//! reasoning parser, the serial fill; `pagedkv.vllm_v1._grammar._plain_bitmask` decides),
//! filled row by row as vLLM's `grammar_bitmask` fills it, with vLLM's grammar objects: one
//! Python call from the step for every request's rows instead of two Python frames per row.
//!
//! Also [`grammar_of`], the request's grammar as vLLM's `grammar` property returns it, which
//! the update's grammar advance reads too.
//!
//! Per request: a row per scheduled draft (the mask before that draft; the grammar then
//! advanced through it) and a bonus row; from a `-1` padding draft on the rows are the full
//! mask; after a draft the grammar rejects (or once it terminated) vLLM logs an error and
//! every later row of the request copies the failed row. The advances are rolled back.
//! Rows start at `k * stride` for the `k`-th request with vLLM 0.33's fixed stride, packed
//! on vLLM 0.32. Cost per row: the grammar's `is_terminated` and `fill_bitmask` calls (or one
//! tensor fill or copy), as vLLM's loop makes them; per draft, one `accept_tokens` call.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyType};

static FUTURE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static STRUCTURED_REQUEST: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `structured.grammar`, as vLLM's `StructuredOutputRequest.grammar` property returns it:
/// for vLLM's own class, whose property returns its `_grammar` slot unless that holds a
/// `Future` (which the property resolves), the slot read directly; anything else (a Future,
/// a subclass, another class) through the property.
pub fn grammar_of<'py>(structured: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = structured.py();
    // Without vLLM (a caller outside an engine) nothing is vLLM's class: the property.
    let own = STRUCTURED_REQUEST.import(
        py,
        "vllm.v1.structured_output.request",
        "StructuredOutputRequest",
    );
    if own.is_ok_and(|own| structured.get_type().is(own)) {
        let slot = structured.getattr(intern!(py, "_grammar"))?;
        if !slot.is_instance(FUTURE.import(py, "concurrent.futures", "Future")?)? {
            return Ok(slot);
        }
    }
    structured.getattr(intern!(py, "grammar"))
}

/// Where the rows go and what fills them: vLLM's preallocated bitmask and full mask.
struct Rows<'a, 'py> {
    bitmask: &'a Bound<'py, PyAny>,
    full_mask: &'a Bound<'py, PyAny>,
}

impl<'py> Rows<'_, 'py> {
    /// vLLM's `_fill_bitmasks` for one row without reasoning masks: the grammar's mask while
    /// it constrains and has not terminated, else the full mask.
    fn fill(&self, grammar: &Bound<'py, PyAny>, row: usize, constrained: bool) -> PyResult<()> {
        let py = grammar.py();
        if constrained && !terminated(grammar)? {
            grammar.call_method1(intern!(py, "fill_bitmask"), (self.bitmask, row))?;
        } else {
            let target = self.bitmask.get_item(row)?;
            target.call_method1(intern!(py, "fill_"), (self.full_mask,))?;
        }
        Ok(())
    }

    /// Row `row` a copy of row `from`.
    fn copy(&self, row: usize, from: usize) -> PyResult<()> {
        let source = self.bitmask.get_item(from)?;
        let target = self.bitmask.get_item(row)?;
        target.call_method1(intern!(self.bitmask.py(), "copy_"), (source,))?;
        Ok(())
    }

    /// One request's rows from `row` on (see the module's text); the row after them.
    fn request(
        &self,
        grammar: &Bound<'py, PyAny>,
        req_id: &Bound<'py, PyAny>,
        drafts: &[i64],
        mut row: usize,
    ) -> PyResult<usize> {
        let py = grammar.py();
        let (mut advanced, mut padded, mut failed) = (0usize, false, None);
        for &token in drafts {
            if let Some(from) = failed {
                self.copy(row, from)?;
                row += 1;
                continue;
            }
            self.fill(grammar, row, !padded)?;
            if token == -1 {
                padded = true;
            } else if !padded {
                if accepts(grammar, req_id, token)? {
                    advanced += 1;
                } else {
                    failed = Some(row);
                    log_rejected_draft(py, token, req_id)?;
                }
            }
            row += 1;
        }
        match failed {
            Some(from) => self.copy(row, from)?,
            None => self.fill(grammar, row, !padded)?,
        }
        if advanced > 0 {
            grammar.call_method1(intern!(py, "rollback"), (advanced,))?;
        }
        Ok(row + 1)
    }
}

/// The grammar's `is_terminated()`.
fn terminated(grammar: &Bound<'_, PyAny>) -> PyResult<bool> {
    grammar
        .call_method0(intern!(grammar.py(), "is_terminated"))?
        .is_truthy()
}

/// The grammar has not terminated and accepts `token` (vLLM's check, in its order).
fn accepts(grammar: &Bound<'_, PyAny>, req_id: &Bound<'_, PyAny>, token: i64) -> PyResult<bool> {
    let py = grammar.py();
    if terminated(grammar)? {
        return Ok(false);
    }
    let tokens = PyList::new(py, [token])?;
    grammar
        .call_method1(intern!(py, "accept_tokens"), (req_id, tokens))?
        .is_truthy()
}

/// vLLM's error on a draft the grammar rejected during the fill, on its logger (none
/// without vLLM).
fn log_rejected_draft(py: Python<'_>, token: i64, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
    let Ok(module) = py.import("vllm.v1.structured_output") else {
        return Ok(());
    };
    let logger = module.getattr("logger")?;
    let message = "Unexpected: grammar terminated or rejected draft token %s for request %s \
                   during bitmask fill.";
    logger.call_method1("error", (message, token, req_id))?;
    Ok(())
}

/// vLLM's serial `grammar_bitmask` fill in the plain case (see the module's text): the rows
/// of each of `req_ids` (in `requests`, its drafts in `drafts`) written into `bitmask`,
/// request `k` from row `k * stride` on (`stride` `None`: packed); the row after the last
/// request's rows.
#[pyfunction]
#[pyo3(signature = (bitmask, full_mask, requests, req_ids, drafts, stride))]
pub fn fill_plain_grammar_rows<'py>(
    bitmask: &Bound<'py, PyAny>,
    full_mask: &Bound<'py, PyAny>,
    requests: &Bound<'py, PyDict>,
    req_ids: &Bound<'py, PyList>,
    drafts: &Bound<'py, PyDict>,
    stride: Option<usize>,
) -> PyResult<usize> {
    let py = bitmask.py();
    let rows = Rows { bitmask, full_mask };
    let mut row = 0;
    for (k, req_id) in req_ids.iter().enumerate() {
        if let Some(stride) = stride {
            row = k.checked_mul(stride).ok_or_else(|| {
                pyo3::exceptions::PyOverflowError::new_err("bitmask row out of range")
            })?;
        }
        let request = requests.as_any().get_item(&req_id)?;
        let structured = request.getattr(intern!(py, "structured_output_request"))?;
        let grammar = grammar_of(&structured)?;
        let tokens: Vec<i64> = match drafts.get_item(&req_id)? {
            Some(d) => d.extract()?,
            None => Vec::new(),
        };
        row = rows.request(&grammar, &req_id, &tokens, row)?;
    }
    Ok(row)
}
