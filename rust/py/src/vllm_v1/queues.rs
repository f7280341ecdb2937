//! The scheduler's queues as vLLM's `update_from_output` leaves them after stops: stopped
//! running requests out of `running` (vLLM's `remove_all`), the others out of the waiting
//! queues and `deferred_waiting`.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PySet};

/// `remove_all` for stopped running requests (one: in place; several: a new list, as vLLM
/// does), and the queues for stopped requests that were not running.
pub fn remove_stopped<'py>(
    sched: &Bound<'py, PyAny>,
    running_stopped: &[Bound<'py, PyAny>],
    other: &[Bound<'py, PyAny>],
) -> PyResult<()> {
    let py = sched.py();
    let running = sched
        .getattr(intern!(py, "running"))?
        .cast_into::<PyList>()?;
    match running_stopped {
        [] => {}
        [one] => {
            if let Ok(k) = running.index(one) {
                running.del_item(k)?;
            }
        }
        many => {
            let kept = PyList::empty(py);
            for r in running.iter() {
                if !many.iter().any(|m| m.is(&r)) {
                    kept.append(r)?;
                }
            }
            sched.setattr(intern!(py, "running"), kept)?;
        }
    }
    if !other.is_empty() {
        let set = PySet::new(py, other)?;
        for queue in ["waiting", "kv_holding_waiting"] {
            sched
                .getattr(queue)?
                .call_method1(intern!(py, "remove_requests"), (&set,))?;
        }
        sched
            .getattr(intern!(py, "deferred_waiting"))?
            .call_method1(intern!(py, "difference_update"), (&set,))?;
    }
    Ok(())
}
