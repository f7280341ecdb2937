//! vLLM's KV cache event objects (`BlockRemoved`, `BlockStored`) built natively from the
//! pool's event log, with the contents vLLM's `BlockPool` (and `KVCacheManager.take_events`)
//! give them, for the one-group manager and the hybrid one alike. Only where the fields are
//! plain: a `BlockStored` for a request with extra hash keys (LoRA, multimodal inputs, a
//! cache salt, prompt embeddings) or of another class than vLLM's `Request` is left to the
//! Python builder (`pagedkv.vllm_v1._events.EventBuilder`, the hybrid manager's
//! `_build_events`), which calls vLLM's helpers.
//!
//! With vLLM 0.33's lookahead block hashes (`num_hash_lookahead_tokens`, L > 0) a plain
//! request's extra keys stay `None` per block (vLLM's lookahead helper finds none over the
//! block and its next L tokens either) and the trailing `lookahead_token_ids` lists, per
//! published block `i`, the tokens `(i + 1) * block_size ..+ L` (fewer where the request ends
//! sooner, as a slice gives).
//!
//! Invariants: a group's block is `scale = block_size / hash_block_size` hash blocks (checked
//! at bind time), so group block `i` publishes hash `(i + 1) * scale - 1` and the parent of a
//! range starting at `first > 0` is hash `first * scale - 1`; any field that does not read as
//! expected (hashes or tokens not a list, a hash not `bytes`, an index out of range, an unknown
//! group) sends the event to the Python builder instead of raising.

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

/// How `BlockRemoved` is built natively (set by `bind_removed_events`).
pub struct RemovedEvents {
    /// vLLM's `BlockRemoved`, whose first fields are `block_hashes`, `medium`, `group_idx`.
    pub cls: Py<PyAny>,
    pub medium: Py<PyAny>,
    pub int_hashes: bool,
}

impl RemovedEvents {
    /// `BlockRemoved([hash], medium, group)`.
    fn build<'py>(&self, py: Python<'py>, k: &HashKey, group: u32) -> PyResult<Bound<'py, PyAny>> {
        let hashes = PyList::new(py, [published(py, k.as_bytes(), self.int_hashes)?])?;
        self.cls
            .bind(py)
            .call1((hashes, self.medium.bind(py), group))
    }
}

/// One KV cache group as its `BlockStored` events describe it (vLLM's
/// `kv_cache_event_metadata` entry and the group's block size).
struct StoredGroup {
    spec_kind: Py<PyAny>,
    sliding_window: Py<PyAny>,
    /// Tokens per block of the group: a positive multiple of the hash block size.
    block_size: usize,
}

/// How `BlockStored` is built natively for a plain request (set by `bind_stored_events`):
/// `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id=None, medium,
/// lora_name=None, extra_keys=[None] * n or None, group_idx, kv_cache_spec_kind,
/// kv_cache_spec_sliding_window, locality=None, ownership=None, session_id)`, positionally;
/// vLLM 0.33's trailing `lookahead_token_ids` keeps its default, `None`, unless `lookahead`.
pub struct StoredEvents {
    cls: Py<PyAny>,
    medium: Py<PyAny>,
    int_hashes: bool,
    /// Per group, in vLLM's group order (one for the one-group manager).
    groups: Vec<StoredGroup>,
    hash_block_size: usize,
    /// vLLM's `Request`, whose `all_token_ids` views `_all_token_ids`.
    request_cls: Py<PyAny>,
    /// vLLM 0.33's `num_hash_lookahead_tokens` (0: no `lookahead_token_ids` argument).
    lookahead: usize,
}

/// A range of group blocks through caching: `first..end`, and the positions really cached
/// (`None`: all of them, as the one-group pool logs).
#[derive(Clone, Copy)]
pub struct StoredRange<'a> {
    pub group: u32,
    pub first: usize,
    pub end: usize,
    pub cached: Option<&'a [u32]>,
}

impl StoredRange<'_> {
    fn positions(&self) -> Vec<usize> {
        match self.cached {
            Some(c) => c.iter().map(|&i| i as usize).collect(),
            None => (self.first..self.end).collect(),
        }
    }
}

impl StoredEvents {
    /// `groups`: `(spec_kind, sliding_window, block_size)` per group, in vLLM's order.
    /// Checked: at least one group, a positive hash block size dividing every group's.
    pub fn new(
        cls: Py<PyAny>,
        medium: Py<PyAny>,
        int_hashes: bool,
        groups: Vec<(Py<PyAny>, Py<PyAny>, usize)>,
        hash_block_size: usize,
        request_cls: Py<PyAny>,
    ) -> PyResult<Self> {
        let groups: Vec<StoredGroup> = groups
            .into_iter()
            .map(|(spec_kind, sliding_window, block_size)| StoredGroup {
                spec_kind,
                sliding_window,
                block_size,
            })
            .collect();
        if groups.is_empty() || hash_block_size == 0 {
            return Err(crate::errors::invalid(
                "stored events need a group and a positive hash block size",
            ));
        }
        if let Some(g) = groups
            .iter()
            .find(|g| g.block_size == 0 || g.block_size % hash_block_size != 0)
        {
            return Err(crate::errors::invalid(format!(
                "group block size {} is not a multiple of the hash block size {hash_block_size}",
                g.block_size
            )));
        }
        Ok(StoredEvents {
            cls,
            medium,
            int_hashes,
            groups,
            hash_block_size,
            request_cls,
            lookahead: 0,
        })
    }

    /// The same, publishing `lookahead_token_ids` for `lookahead` > 0 tokens past each block.
    pub fn with_lookahead(mut self, lookahead: usize) -> Self {
        self.lookahead = lookahead;
        self
    }

    /// `lookahead_token_ids`: per published block at `positions`, the `lookahead` tokens
    /// after it (of `tokens`, the request's `_all_token_ids`).
    fn lookahead_ids<'py>(
        &self,
        tokens: &Bound<'py, PyList>,
        positions: &[usize],
        block_size: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = self.lookahead;
        let slices = positions.iter().map(|i| {
            let end = (i + 1) * block_size;
            tokens.get_slice(end, end + n)
        });
        Ok(PyList::new(tokens.py(), slices)?.into_any())
    }

    /// The published hashes of `indices` in `hashes` (`None`: one is missing or not bytes).
    fn hashes_at<'py>(
        &self,
        hashes: &Bound<'py, PyList>,
        indices: impl Iterator<Item = usize>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let py = hashes.py();
        let mut out = Vec::new();
        for i in indices {
            if i >= hashes.len() {
                return Ok(None);
            }
            let item = hashes.get_item(i)?;
            let Ok(bytes) = item.cast::<PyBytes>() else {
                return Ok(None);
            };
            out.push(published(py, bytes.as_bytes(), self.int_hashes)?);
        }
        Ok(Some(out))
    }

    /// `BlockStored` for `r` of `request`; `None` when the Python builder must build it (see
    /// the module's notes).
    fn build<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        r: StoredRange<'_>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = request.py();
        let Some(g) = self.groups.get(r.group as usize) else {
            return Ok(None);
        };
        if r.first > r.end
            || !request.get_type().is(self.request_cls.bind(py))
            || has_extra_keys(request)?
        {
            return Ok(None);
        }
        let hashes = request.getattr(intern!(py, "block_hashes"))?;
        let tokens = request.getattr(intern!(py, "_all_token_ids"))?;
        let (Ok(hashes), Ok(tokens)) = (hashes.cast::<PyList>(), tokens.cast::<PyList>()) else {
            return Ok(None);
        };
        let scale = g.block_size / self.hash_block_size;
        let positions = r.positions();
        let parent = match r.first {
            0 => Some(py.None().into_bound(py)),
            first => self
                .hashes_at(hashes, std::iter::once(first * scale - 1))?
                .and_then(|mut h| h.pop()),
        };
        let published_hashes =
            self.hashes_at(hashes, positions.iter().map(|i| (i + 1) * scale - 1))?;
        let (Some(parent), Some(published_hashes)) = (parent, published_hashes) else {
            return Ok(None);
        };
        let extra_keys = match positions.len() {
            0 => py.None().into_bound(py),
            n => PyList::new(py, std::iter::repeat_n(py.None().into_bound(py), n))?.into_any(),
        };
        let bs = g.block_size;
        let mut args = vec![
            PyList::new(py, published_hashes)?.into_any(),
            parent,
            tokens.get_slice(r.first * bs, r.end * bs).into_any(),
            bs.into_pyobject(py)?.into_any(),
            py.None().into_bound(py),
            self.medium.bind(py).clone(),
            py.None().into_bound(py),
            extra_keys,
            r.group.into_pyobject(py)?.into_any(),
            g.spec_kind.bind(py).clone(),
            g.sliding_window.bind(py).clone(),
            py.None().into_bound(py),
            py.None().into_bound(py),
            request.getattr(intern!(py, "session_id"))?,
        ];
        if self.lookahead > 0 {
            args.push(self.lookahead_ids(tokens, &positions, bs)?);
        }
        Ok(Some(self.cls.bind(py).call1(PyTuple::new(py, args)?)?))
    }
}

/// A LoRA adapter, multimodal inputs, a cache salt or prompt embeddings: extra hash keys,
/// which events publish (vLLM's helpers compute them; the Python builder calls them).
fn has_extra_keys(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = request.py();
    Ok(crate::vllm_v1::hash::extra_keys_past_first_block(request)?
        || request.getattr(intern!(py, "cache_salt"))?.is_truthy()?)
}

/// The event objects one call can build natively.
pub struct EventObjects<'a, 'py> {
    pub removed: Option<&'a RemovedEvents>,
    /// With the request the events concern.
    pub stored: Option<(&'a StoredEvents, &'a Bound<'py, PyAny>)>,
}

impl<'py> EventObjects<'_, 'py> {
    /// The event's vLLM object when it is built here (`None`: built in Python).
    pub fn object(&self, py: Python<'py>, e: &Event) -> PyResult<Option<Bound<'py, PyAny>>> {
        let range = match (e, self.removed) {
            (Event::Removed(k), Some(r)) => return r.build(py, k, 0).map(Some),
            (Event::RemovedIn(k, g), Some(r)) => return r.build(py, k, *g).map(Some),
            (Event::Stored { first, end }, _) => StoredRange {
                group: 0,
                first: *first as usize,
                end: *end as usize,
                cached: None,
            },
            (
                Event::StoredIn {
                    group,
                    first,
                    end,
                    cached,
                },
                _,
            ) => StoredRange {
                group: *group,
                first: *first as usize,
                end: *end as usize,
                cached: Some(cached),
            },
            _ => return Ok(None),
        };
        match self.stored {
            Some((s, request)) => s.build(request, range),
            None => Ok(None),
        }
    }

    /// The pool's record as a tuple: `("stored", first, end)`, `("removed", hash, 0)`,
    /// `("cleared", 0, 0)`; a pool of several groups (the hybrid manager's) logs
    /// `("stored", group, first, end, cached_positions)` and `("removed", hash, group)`.
    pub fn raw(&self, py: Python<'py>, e: &Event) -> PyResult<Bound<'py, PyTuple>> {
        match e {
            Event::Stored { first, end } => ("stored", *first, *end).into_pyobject(py),
            Event::Removed(k) => {
                ("removed", PyBytes::new(py, k.as_bytes()), 0u32).into_pyobject(py)
            }
            Event::Cleared => ("cleared", 0u32, 0u32).into_pyobject(py),
            Event::StoredIn {
                group,
                first,
                end,
                cached,
            } => ("stored", *group, *first, *end, cached.clone()).into_pyobject(py),
            Event::RemovedIn(k, g) => {
                ("removed", PyBytes::new(py, k.as_bytes()), *g).into_pyobject(py)
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

impl EventSink {
    /// Append `events`' objects to the list, in the pool's order: each built by `built`
    /// where it can, else by `build([raw], request)` (`request` `None` after calls that
    /// concern no request: evictions, resets).
    pub fn publish<'py>(
        &self,
        py: Python<'py>,
        built: &EventObjects<'_, 'py>,
        events: &[Event],
        request: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        let list = self.events.bind(py);
        for e in events {
            match built.object(py, e)? {
                Some(obj) => list.append(obj)?,
                None => {
                    let raw = PyList::new(py, [built.raw(py, e)?])?;
                    for obj in self.build.bind(py).call1((raw, request))?.try_iter()? {
                        list.append(obj?)?;
                    }
                }
            }
        }
        Ok(())
    }
}
