//! `CompatEnumBase`: the native base of `pagedkv._enum.CompatEnum`, so that comparing two
//! members costs what it costs for a plain `enum.Enum` (a C-level identity test), while a
//! member still equals the same-named member of a *foreign* enum class with the same class
//! name (vLLM's own `SequenceStatus`, say). A Python `__eq__` runs a Python frame on every
//! comparison (vLLM's scheduler compares statuses several times per group per step), and a
//! `#[pymethods] __richcmp__` still pays PyO3's trampoline, so the comparison is a plain C
//! function installed as the type's `tp_richcompare`: two members of one enum never leave it;
//! only a comparison with an object of another type goes on to look at names.
//! Hashes are `hash(member._name_)`, as `enum.Enum`'s, so both kinds meet in sets and dicts.
//!
//! The type holds no data (it has `object`'s layout), so `enum.Enum` keeps treating its members
//! as plain objects with a `_value_`.

use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyType;
use std::os::raw::{c_int, c_void};

/// Whether `other` (of a different type than `ours`) is a member of an enum class named like
/// `ours`' class, with the same member name (`None`: not comparable).
fn foreign_equal(ours: &Bound<'_, PyAny>, other: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
    let py = ours.py();
    let enum_base = enum_class(py)?;
    let (our_type, other_type) = (ours.get_type(), other.get_type());
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

/// A new reference to `True`, `False` or `NotImplemented`.
fn answer(py: Python<'_>, eq: Option<bool>, want_eq: bool) -> *mut ffi::PyObject {
    let obj = match eq {
        Some(e) => pyo3::types::PyBool::new(py, e == want_eq)
            .to_owned()
            .into_any(),
        None => py.NotImplemented().into_bound(py),
    };
    obj.into_ptr()
}

/// `tp_richcompare`.
///
/// SAFETY (of the body): CPython calls this slot with the GIL held (the thread is attached),
/// with two valid, borrowed, non-null object pointers that stay alive for the call, so
/// `assume_attached` and `from_borrowed_ptr` are sound; we never store them. Pointer equality
/// and `Py_TYPE` read only the object headers. Any Python code run on the foreign path
/// (`__eq__` of the names, attribute lookups) may call back into Python, but we hold no Rust
/// borrow of anything across it. Errors are restored as the Python exception and signalled
/// with NULL; a panic is caught before it can unwind across the C boundary. No alignment
/// assumption is made beyond what CPython guarantees for `PyObject`; no state is shared
/// between threads (the only static is a `PyOnceLock`).
unsafe extern "C" fn richcompare(
    a: *mut ffi::PyObject,
    b: *mut ffi::PyObject,
    op: c_int,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls tp_richcompare only from an attached thread (GIL held).
    let py = unsafe { Python::assume_attached() };
    if op != ffi::Py_EQ && op != ffi::Py_NE {
        return answer(py, None, true);
    }
    let want_eq = op == ffi::Py_EQ;
    if a == b {
        return answer(py, Some(true), want_eq);
    }
    // SAFETY: `a` and `b` are valid objects for the call; reading `ob_type` is a plain load.
    if unsafe { ffi::Py_TYPE(a) == ffi::Py_TYPE(b) } {
        return answer(py, Some(false), want_eq); // two members of one enum
    }
    let result = std::panic::catch_unwind(|| {
        // SAFETY: borrowed, non-null, alive for this call; the `Bound`s do not outlive it.
        let (ours, other) = unsafe {
            (
                Bound::from_borrowed_ptr(py, a),
                Bound::from_borrowed_ptr(py, b),
            )
        };
        foreign_equal(&ours, &other)
    });
    match result {
        Ok(Ok(eq)) => answer(py, eq, want_eq),
        Ok(Err(err)) => {
            err.restore(py);
            std::ptr::null_mut()
        }
        Err(_) => {
            pyo3::exceptions::PySystemError::new_err("panic in CompatEnum comparison").restore(py);
            std::ptr::null_mut()
        }
    }
}

/// `tp_hash`: `hash(self._name_)`, as `enum.Enum.__hash__`.
///
/// SAFETY (of the body): as for `richcompare`: called attached, with a valid borrowed
/// pointer; errors are restored and signalled with -1, panics caught.
unsafe extern "C" fn hash(a: *mut ffi::PyObject) -> ffi::Py_hash_t {
    // SAFETY: CPython calls tp_hash only from an attached thread (GIL held).
    let py = unsafe { Python::assume_attached() };
    let result = std::panic::catch_unwind(|| {
        // SAFETY: borrowed, non-null, alive for this call; the `Bound` does not outlive it.
        let ours = unsafe { Bound::from_borrowed_ptr(py, a) };
        ours.getattr(intern!(py, "_name_"))?.hash()
    });
    match result {
        Ok(Ok(h)) => h as ffi::Py_hash_t,
        Ok(Err(err)) => {
            err.restore(py);
            -1
        }
        Err(_) => {
            pyo3::exceptions::PySystemError::new_err("panic in CompatEnum hash").restore(py);
            -1
        }
    }
}

/// Create the `CompatEnumBase` type (once per module initialisation).
pub fn make_type(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    // The spec and its slots must outlive the type (CPython may keep pointers into them):
    // leak them (a few dozen bytes, once per process).
    let slots: &'static mut [ffi::PyType_Slot] = Box::leak(Box::new([
        ffi::PyType_Slot {
            slot: ffi::Py_tp_richcompare,
            pfunc: richcompare as *mut c_void,
        },
        ffi::PyType_Slot {
            slot: ffi::Py_tp_hash,
            pfunc: hash as *mut c_void,
        },
        ffi::PyType_Slot::default(),
    ]));
    let spec: &'static mut ffi::PyType_Spec = Box::leak(Box::new(ffi::PyType_Spec {
        name: c"pagedkv._native.CompatEnumBase".as_ptr(),
        basicsize: 0, // object's layout: no data of its own
        itemsize: 0,
        flags: (ffi::Py_TPFLAGS_DEFAULT | ffi::Py_TPFLAGS_BASETYPE) as _,
        slots: slots.as_mut_ptr(),
    }));
    // SAFETY: attached (we hold `py`); the spec is a valid, 'static, zero-terminated slot
    // table whose functions have the signatures CPython expects for these slots; the result
    // is a new reference or NULL with an exception set, which `from_owned_ptr_or_err` handles.
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyType_FromSpec(spec)) }
}
