//! A request as the native loop sees it ([`PyReq`]: vLLM's `Request` object and its fixed
//! fields, read once and kept across calls in the loop's map), its counters read and written
//! in place, and its `status` compared with and set to vLLM's `RequestStatus` objects (with
//! the stop's `stop_reason` or `resumable`), for `crate::vllm_v1::engine_impl`.

use crate::vllm_v1::engine::{get_u64, PyEngine};
use crate::vllm_v1::loop_::Fixed;
use pagedkv_core::vllm_v1::engine::Status;
use pagedkv_core::vllm_v1::policy::Stop;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyString;
use std::sync::Arc;

/// A request: the object and its fixed fields (read once, see [`Fixed`]).
#[derive(Clone)]
pub struct PyReq<'py> {
    pub obj: Bound<'py, PyAny>,
    pub f: Arc<Fixed>,
}

impl PartialEq for PyReq<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.obj.is(&other.obj)
    }
}

impl<'py> PyEngine<'_, 'py> {
    /// The request with its fixed fields (read now if the last call did not see it).
    pub(super) fn req(&mut self, obj: Bound<'py, PyAny>) -> PyResult<PyReq<'py>> {
        let key = obj.as_ptr() as usize;
        if let Some(f) = self.map.get(&key) {
            return Ok(PyReq { f: f.clone(), obj });
        }
        let f = Arc::new(Fixed::read(&obj, &self.lp.objs)?);
        self.sessions |= f.session;
        self.map.insert(key, f.clone());
        Ok(PyReq { obj, f })
    }

    pub(super) fn get(&self, r: &PyReq<'py>, name: &Bound<'py, PyString>) -> PyResult<u64> {
        get_u64(&r.obj, name)
    }

    pub(super) fn set(&self, r: &PyReq<'py>, name: &Bound<'py, PyString>, v: u64) -> PyResult<()> {
        r.obj.setattr(name, v)
    }
}

/// The request's status as the walk tells them apart (vLLM's `RequestStatus` objects, and
/// the finished ones by their value).
pub fn status<'py>(e: &PyEngine<'_, 'py>, r: &PyReq<'py>) -> PyResult<Status> {
    let py = e.py();
    let o = &e.lp.objs;
    let s = r.obj.getattr(intern!(py, "status"))?;
    Ok(if s.is(o.running.bind(py)) {
        Status::Running
    } else if s.is(o.waiting.bind(py)) {
        Status::Waiting
    } else if s.is(o.preempted.bind(py)) {
        Status::Preempted
    } else if s.extract::<i64>()? > o.preempted_value {
        Status::Finished
    } else {
        Status::OtherWaiting
    })
}

/// A stopped request's finishing status, with vLLM's `stop_reason` (a stop token, a
/// repetition) or `resumable = False` (an error).
pub fn set_stopped<'py>(e: &PyEngine<'_, 'py>, r: &PyReq<'py>, stop: Stop) -> PyResult<()> {
    let py = e.py();
    let o = &e.lp.objs;
    let status = match stop {
        Stop::Length => &o.length_capped,
        Stop::Eos | Stop::StopToken(_) | Stop::Pooled => &o.stopped,
        Stop::Repetition => &o.finished_repetition,
        Stop::Error => &o.finished_error,
    };
    r.obj.setattr(intern!(py, "status"), status.bind(py))?;
    match stop {
        Stop::StopToken(t) => r.obj.setattr(intern!(py, "stop_reason"), t),
        Stop::Repetition => r
            .obj
            .setattr(intern!(py, "stop_reason"), "repetition_detected"),
        Stop::Error => r.obj.setattr(intern!(py, "resumable"), false),
        Stop::Eos | Stop::Length | Stop::Pooled => Ok(()),
    }
}
