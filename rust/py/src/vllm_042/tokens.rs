//! Token ids from Python: lists and tuples of ints (with a borrowed-pointer fast path for exact
//! ints), 1-D numpy integer arrays (int32, uint32, int64; read through the `numpy` crate's
//! checked views), or any iterable of integer-like objects.

use crate::args::type_name;
use crate::errors::{invalid, wrong_type};
use numpy::{
    dtype, Element, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::borrow::Cow;

/// The largest token id we store (token ids are kept as u32).
const MAX_TOKEN: i64 = u32::MAX as i64;

fn check_token(v: i64) -> PyResult<u32> {
    if (0..=MAX_TOKEN).contains(&v) {
        Ok(v as u32)
    } else {
        Err(invalid(format!("token id {v} is out of range [0, 2**32)")))
    }
}

/// Token ids from a list/tuple/sequence of ints or a 1-D int array (copied once into Rust).
pub fn extract_tokens<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, [u32]>> {
    // Lists first: probing a list for `__array_interface__` would raise and catch an
    // AttributeError, which costs more than converting a whole block of tokens.
    if let Ok(list) = obj.cast::<PyList>() {
        let n = list.len();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            // Soundness: we hold a reference to the list, and the module requires the GIL
            // (`gil_used`), so no other thread runs while we read. PyList_GetItem returns a
            // borrowed reference or NULL (with IndexError) if the list shrank meanwhile: only an
            // item's __index__ can run Python code, on the slow path, which takes its own
            // reference to the item first (`Bound::from_borrowed_ptr`), so no borrowed item is
            // used after Python code ran. Index i is re-read for every item.
            // SAFETY: by the argument above (GIL held, borrowed item used before any Python
            // code runs, NULL checked below).
            let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as isize) };
            if item.is_null() {
                return Err(PyErr::fetch(obj.py()));
            }
            out.push(token_from_ptr(obj.py(), item)?);
        }
        return Ok(Cow::Owned(out));
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for item in tuple.iter() {
            out.push(token_from_item(&item)?);
        }
        return Ok(Cow::Owned(out));
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return array_tokens(arr).map(Cow::Owned);
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(wrong_type(
            "token_ids must be a sequence of ints, not a string",
        ));
    }
    let seq = obj.try_iter().map_err(|_| {
        wrong_type(format!(
            "token_ids must be a sequence of ints, got {}",
            type_name(obj)
        ))
    })?;
    let mut out = Vec::new();
    for item in seq {
        out.push(token_from_item(&item?)?);
    }
    Ok(Cow::Owned(out))
}

/// `token_from_item` for a borrowed pointer, with a fast path for exact ints (no reference
/// counting, no Python-level checks): the common case of a list of token ids.
fn token_from_ptr(py: Python<'_>, item: *mut pyo3::ffi::PyObject) -> PyResult<u32> {
    // SAFETY: `item` is a valid borrowed reference owned by a list we hold (see the caller);
    // the exact-int path runs no Python code, and the slow path takes a strong reference
    // before anything else runs.
    unsafe {
        if pyo3::ffi::PyLong_CheckExact(item) != 0 {
            let v = pyo3::ffi::PyLong_AsLongLong(item);
            if v == -1 && PyErr::occurred(py) {
                let _ = PyErr::take(py);
                let shown = Bound::from_borrowed_ptr(py, item);
                return Err(invalid(format!(
                    "token id {shown} is out of range [0, 2**32)"
                )));
            }
            return check_token(v);
        }
        token_from_item(&Bound::from_borrowed_ptr(py, item))
    }
}

pub fn token_from_item(item: &Bound<'_, PyAny>) -> PyResult<u32> {
    if item.is_instance_of::<pyo3::types::PyBool>() {
        return Err(invalid("token ids must be ints, not bool"));
    }
    if !item.is_instance_of::<pyo3::types::PyInt>() {
        // integer-like objects (numpy integers) convert through __index__
        return match item.call_method0(pyo3::intern!(item.py(), "__index__")) {
            Ok(idx) if idx.is_instance_of::<pyo3::types::PyInt>() => token_from_item(&idx),
            _ => Err(wrong_type(format!(
                "token ids must be ints, got {}",
                type_name(item)
            ))),
        };
    }
    match item.extract::<i64>() {
        Ok(v) => check_token(v),
        Err(_) => Err(invalid(format!(
            "token id {item} is out of range [0, 2**32)"
        ))),
    }
}

/// Token ids of a 1-D numpy array of int32, uint32 or int64 (any strides).
fn array_tokens(arr: &Bound<'_, PyUntypedArray>) -> PyResult<Vec<u32>> {
    if arr.ndim() != 1 {
        return Err(invalid("token_ids must be one-dimensional"));
    }
    let py = arr.py();
    let dt = arr.dtype();
    if dt.is_equiv_to(&dtype::<u32>(py)) {
        return read_array::<u32>(arr, Ok);
    }
    if dt.is_equiv_to(&dtype::<i32>(py)) {
        return read_array::<i32>(arr, |v| check_token(i64::from(v)));
    }
    if dt.is_equiv_to(&dtype::<i64>(py)) {
        return read_array::<i64>(arr, check_token);
    }
    Err(invalid(format!(
        "token_ids: dtype {} is not supported (use int32, uint32 or int64)",
        dt
    )))
}

fn read_array<T: Element + Copy>(
    arr: &Bound<'_, PyUntypedArray>,
    convert: impl Fn(T) -> PyResult<u32>,
) -> PyResult<Vec<u32>> {
    let view = arr
        .cast::<PyArray1<T>>()?
        .try_readonly()
        .map_err(|_| invalid("token_ids is being written by another call"))?;
    // `as_array` handles any strides and alignment; no Python code runs while it is held.
    view.as_array().iter().map(|&v| convert(v)).collect()
}
