//! `CompatEnumBase`: the native base of `pagedkv._enum.CompatEnum`, so that comparing two
//! members costs what it costs for a plain `enum.Enum` (a C-level identity test), while a
//! member still equals the same-named member of a *foreign* enum class with the same class
//! name (vLLM's own `SequenceStatus`, say). A Python `__eq__` would run a Python frame on every
//! comparison, and vLLM's scheduler compares statuses several times per group per step.
//! Hashes are `hash(member._name_)`, as `enum.Enum`'s, so both kinds meet in sets and dicts.

use pyo3::basic::CompareOp;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};

#[pyclass(subclass, module = "pagedkv._native", name = "CompatEnumBase")]
pub struct CompatEnumBase;

/// Whether `other` is a member of a different enum class named like `ours`' class, with the
/// same member name (`None`: not comparable, so Python tries the reflected operation).
fn foreign_equal(ours: &Bound<'_, PyAny>, other: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
    let py = ours.py();
    let (our_type, other_type) = (ours.get_type(), other.get_type());
    if our_type.is(&other_type) {
        return Ok(Some(false)); // two members of one enum: equal only if identical
    }
    let enum_base = enum_class(py)?;
    if !other.is_instance(enum_base)? || !our_type.name()?.as_any().eq(other_type.name()?)? {
        return Ok(None);
    }
    let name = intern!(py, "_name_");
    Ok(Some(ours.getattr(name)?.eq(other.getattr(name)?)?))
}

fn enum_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static CELL: pyo3::sync::PyOnceLock<Py<PyType>> = pyo3::sync::PyOnceLock::new();
    CELL.import(py, "enum", "Enum")
}

#[pymethods]
impl CompatEnumBase {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        CompatEnumBase
    }

    fn __richcmp__(
        slf: &Bound<'_, Self>,
        other: &Bound<'_, PyAny>,
        op: CompareOp,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let want = matches!(op, CompareOp::Eq);
        let eq = match op {
            CompareOp::Eq | CompareOp::Ne if slf.is(other) => Some(true),
            CompareOp::Eq | CompareOp::Ne => foreign_equal(slf.as_any(), other)?,
            _ => None,
        };
        Ok(match eq {
            Some(e) => pyo3::types::PyBool::new(py, e == want)
                .to_owned()
                .into_any()
                .unbind(),
            None => py.NotImplemented(),
        })
    }

    fn __hash__(slf: &Bound<'_, Self>) -> PyResult<isize> {
        slf.getattr(intern!(slf.py(), "_name_"))?.hash()
    }
}
