//! vLLM's KV cache event objects (`BlockRemoved`, `BlockStored`) built natively from the
//! pool's event log, with the contents `pagedkv.vllm_v1._events.EventBuilder` (and vLLM's
//! `BlockPool`) give them. Only where the fields are plain: a `BlockStored` for a request with
//! extra hash keys (LoRA, multimodal inputs, a cache salt, prompt embeddings) or of another
//! class than vLLM's `Request` is left to the Python builder, which calls vLLM's helpers.

use pagedkv_core::vllm_v1::{Event, HashKey};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

/// A block hash as events publish it: its last 8 bytes read as a big-endian unsigned integer
/// (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` conversion) when `int_hashes`, else the bytes.
fn published<'py>(py: Python<'py>, bytes: &[u8], int_hashes: bool) -> PyResult<Bound<'py, PyAny>> {
    if !int_hashes {
        return Ok(PyBytes::new(py, bytes).into_any());
    }
    let mut last = [0u8; 8];
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    last[8 - tail.len()..].copy_from_slice(tail);
    Ok(u64::from_be_bytes(last).into_pyobject(py)?.into_any())
}

/// How `take_events` builds vLLM's `BlockRemoved` itself (set by `bind_removed_events`).
pub struct RemovedEvents {
    /// vLLM's `BlockRemoved`, whose first fields are `block_hashes`, `medium`, `group_idx`.
    pub cls: Py<PyAny>,
    pub medium: Py<PyAny>,
    pub int_hashes: bool,
}

impl RemovedEvents {
    fn build<'py>(&self, py: Python<'py>, k: &HashKey) -> PyResult<Bound<'py, PyAny>> {
        let hashes = PyList::new(py, [published(py, k.as_bytes(), self.int_hashes)?])?;
        self.cls
            .bind(py)
            .call1((hashes, self.medium.bind(py), 0u32))
    }
}

/// How `take_events(request)` builds vLLM's `BlockStored` itself (set by
/// `bind_stored_events`): `BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
/// lora_id=None, medium, lora_name=None, extra_keys=[None] * n, group_idx=0,
/// kv_cache_spec_kind, kv_cache_spec_sliding_window, locality=None, ownership=None,
/// session_id)`, positionally (vLLM 0.33's trailing `lookahead_token_ids` keeps its default,
/// `None`).
pub struct StoredEvents {
    pub cls: Py<PyAny>,
    pub medium: Py<PyAny>,
    pub int_hashes: bool,
    pub spec_kind: Py<PyAny>,
    pub sliding_window: Py<PyAny>,
    pub block_size: usize,
    /// vLLM's `Request`, whose `all_token_ids` views `_all_token_ids`.
    pub request_cls: Py<PyAny>,
}

impl StoredEvents {
    /// `BlockStored` for blocks `first..end` of `request`; `None` when the Python builder
    /// must build it (see the module's notes).
    fn build<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        first: usize,
        end: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = request.py();
        if !request.get_type().is(self.request_cls.bind(py)) || has_extra_keys(request)? {
            return Ok(None);
        }
        let hashes = request.getattr(intern!(py, "block_hashes"))?;
        let Ok(hashes) = hashes.cast::<PyList>() else {
            return Ok(None);
        };
        if end > hashes.len() || first >= end {
            return Ok(None);
        }
        let mut published_hashes = Vec::with_capacity(end - first);
        let mut parent = py.None().into_bound(py);
        for i in first.saturating_sub(1)..end {
            let item = hashes.get_item(i)?;
            let Ok(bytes) = item.cast::<PyBytes>() else {
                return Ok(None);
            };
            let h = published(py, bytes.as_bytes(), self.int_hashes)?;
            if i < first {
                parent = h;
            } else {
                published_hashes.push(h);
            }
        }
        let bs = self.block_size;
        let tokens = request.getattr(intern!(py, "_all_token_ids"))?;
        let Ok(tokens) = tokens.cast::<PyList>() else {
            return Ok(None);
        };
        let args = [
            PyList::new(py, published_hashes)?.into_any(),
            parent,
            tokens.get_slice(first * bs, end * bs).into_any(),
            bs.into_pyobject(py)?.into_any(),
            py.None().into_bound(py),
            self.medium.bind(py).clone(),
            py.None().into_bound(py),
            PyList::new(
                py,
                std::iter::repeat_n(py.None().into_bound(py), end - first),
            )?
            .into_any(),
            0u32.into_pyobject(py)?.into_any(),
            self.spec_kind.bind(py).clone(),
            self.sliding_window.bind(py).clone(),
            py.None().into_bound(py),
            py.None().into_bound(py),
            request.getattr(intern!(py, "session_id"))?,
        ];
        let event = self.cls.bind(py).call1(PyTuple::new(py, args)?)?;
        Ok(Some(event))
    }
}

/// A LoRA adapter, multimodal inputs, a cache salt or prompt embeddings: extra hash keys,
/// which events publish (vLLM's helpers compute them; the Python builder calls them).
fn has_extra_keys(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = request.py();
    Ok(crate::vllm_v1::hash::extra_keys_past_first_block(request)?
        || request.getattr(intern!(py, "cache_salt"))?.is_truthy()?)
}

/// The event objects one `take_events` call can build natively.
pub struct EventObjects<'a, 'py> {
    pub removed: Option<&'a RemovedEvents>,
    /// With the request the events concern.
    pub stored: Option<(&'a StoredEvents, &'a Bound<'py, PyAny>)>,
}

impl<'py> EventObjects<'_, 'py> {
    /// The event's vLLM object when it is built here (`None`: built in Python).
    pub fn object(&self, py: Python<'py>, e: &Event) -> PyResult<Option<Bound<'py, PyAny>>> {
        match (e, self.removed, self.stored) {
            (Event::Removed(k), Some(r), _) => r.build(py, k).map(Some),
            (Event::Stored { first, end }, _, Some((s, request))) => {
                s.build(request, *first as usize, *end as usize)
            }
            _ => Ok(None),
        }
    }

    /// The pool's record as a tuple: `("stored", first, end)`, `("removed", hash, 0)`,
    /// `("cleared", 0, 0)`.
    pub fn raw(&self, py: Python<'py>, e: &Event) -> PyResult<Bound<'py, PyTuple>> {
        match e {
            Event::Stored { first, end } => ("stored", *first, *end).into_pyobject(py),
            Event::Removed(k) => {
                ("removed", PyBytes::new(py, k.as_bytes()), 0u32).into_pyobject(py)
            }
            Event::Cleared => ("cleared", 0u32, 0u32).into_pyobject(py),
            // Only pools of several groups log these (the hybrid manager's own binding).
            Event::StoredIn { first, end, .. } => ("stored", *first, *end).into_pyobject(py),
            Event::RemovedIn(k, _) => {
                ("removed", PyBytes::new(py, k.as_bytes()), 0u32).into_pyobject(py)
            }
        }
    }

    /// The event as `take_events` returns it: `("event", object, 0)` when built here, else
    /// [`Self::raw`].
    pub fn tuple(&self, py: Python<'py>, e: &Event) -> PyResult<Bound<'py, PyTuple>> {
        match self.object(py, e)? {
            Some(obj) => ("event", obj, 0u32).into_pyobject(py),
            None => self.raw(py, e),
        }
    }
}

/// Where calls that log KV events put vLLM's event objects (`bind_event_sink`): the
/// manager's event list, and the Python builder for the kinds not built natively.
pub struct EventSink {
    pub events: Py<PyList>,
    pub build: Py<PyAny>,
}
