//! Core errors -> the Python classes of `pagedkv.errors` (looked up once, then cached).

use pagedkv_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

fn class(
    py: Python<'_>,
    cell: &'static PyOnceLock<Py<PyType>>,
    name: &str,
) -> PyResult<Py<PyType>> {
    cell.get_or_try_init(py, || {
        let m = py.import("pagedkv.errors")?;
        Ok::<_, PyErr>(m.getattr(name)?.cast_into::<PyType>()?.unbind())
    })
    .map(|t| t.clone_ref(py))
}

macro_rules! error_class {
    ($fn_name:ident, $py_name:literal) => {
        pub fn $fn_name(py: Python<'_>) -> PyResult<Py<PyType>> {
            static CELL: PyOnceLock<Py<PyType>> = PyOnceLock::new();
            class(py, &CELL, $py_name)
        }
    };
}

error_class!(invalid_argument, "InvalidArgumentError");
error_class!(unknown_sequence, "UnknownSequenceError");
error_class!(double_free, "DoubleFreeError");
error_class!(out_of_blocks, "OutOfBlocksError");
error_class!(argument_type, "ArgumentTypeError");
error_class!(in_use, "InUseError");

fn make(py: Python<'_>, cls: PyResult<Py<PyType>>, msg: String) -> PyErr {
    match cls {
        Ok(cls) => PyErr::from_type(cls.into_bound(py), msg),
        Err(e) => e,
    }
}

/// Convert a core error into the matching Python exception.
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| {
        let msg = err.to_string();
        let cls = match err {
            Error::OutOfBlocks { .. } => out_of_blocks(py),
            Error::UnknownSequence(_) => unknown_sequence(py),
            Error::DoubleFree(_) => double_free(py),
            Error::BlockOutOfRange { .. } | Error::InvalidArgument(_) => invalid_argument(py),
        };
        make(py, cls, msg)
    })
}

/// An `InvalidArgumentError` with a message (for checks done in the bindings).
pub fn invalid(msg: impl Into<String>) -> PyErr {
    Python::attach(|py| make(py, invalid_argument(py), msg.into()))
}

pub trait IntoPyResult<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for pagedkv_core::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// An `ArgumentTypeError` (InvalidArgumentError and TypeError) with a message.
pub fn wrong_type(msg: impl Into<String>) -> PyErr {
    Python::attach(|py| make(py, argument_type(py), msg.into()))
}

/// An `InUseError` (also a RuntimeError): `what` is being used by another call right now (another
/// thread's, or a Python callback's re-entering it).
pub fn busy(what: &str) -> PyErr {
    Python::attach(|py| {
        make(
            py,
            in_use(py),
            format!("{what} is in use by another call (a pagedkv object serves one call at a time; use it from one thread, or serialise calls)"),
        )
    })
}
