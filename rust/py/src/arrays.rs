//! Reading token ids from Python, and writing into caller-owned numpy buffers.
//!
//! The wheel targets the stable ABI back to Python 3.9, where the buffer protocol is not part
//! of the limited API. Arrays are therefore reached through numpy's `__array_interface__`
//! (the data pointer, dtype, shape and strides of the array). The caller's array stays alive
//! for the whole call because we hold a reference to it, and we only touch it while attached to
//! the interpreter, so the pointer stays valid. torch CPU tensors are passed as `t.numpy()`,
//! which shares the tensor's memory.

use crate::errors::invalid;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::borrow::Cow;

/// The largest token id we store (token ids are kept as u32).
const MAX_TOKEN: i64 = u32::MAX as i64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dtype {
    I32,
    I64,
    U32,
}

impl Dtype {
    fn parse(typestr: &str) -> Option<Self> {
        // '<' little endian, '|' not applicable, '=' native (we only build for little endian)
        let t = typestr.trim_start_matches(['<', '=', '|']);
        match t {
            "i4" => Some(Dtype::I32),
            "i8" => Some(Dtype::I64),
            "u4" => Some(Dtype::U32),
            _ => None,
        }
    }
    fn size(self) -> usize {
        match self {
            Dtype::I32 | Dtype::U32 => 4,
            Dtype::I64 => 8,
        }
    }
}

/// A C-contiguous array seen through `__array_interface__`.
pub struct ArrayView {
    pub ptr: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub readonly: bool,
}

impl ArrayView {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// numpy's C-level array interface (`__array_struct__`, version 3 of the array interface
/// protocol): a capsule around this struct. Reading it costs a fraction of building the
/// `__array_interface__` dict, which matters for per-step calls.
#[repr(C)]
struct ArrayInterfaceStruct {
    two: std::os::raw::c_int,
    nd: std::os::raw::c_int,
    typekind: std::os::raw::c_char,
    itemsize: std::os::raw::c_int,
    flags: std::os::raw::c_int,
    shape: *const isize,
    strides: *const isize,
    data: *mut std::ffi::c_void,
    descr: *mut pyo3::ffi::PyObject,
}

const ARR_C_CONTIGUOUS: i32 = 0x1;
const ARR_ALIGNED: i32 = 0x100;
const ARR_NOTSWAPPED: i32 = 0x200;
const ARR_WRITEABLE: i32 = 0x400;

fn array_struct_view(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<ArrayView>> {
    let Ok(capsule) = obj.getattr(pyo3::intern!(obj.py(), "__array_struct__")) else {
        return Ok(None);
    };
    // SAFETY: numpy's capsule is unnamed and points at an ArrayInterfaceStruct that lives as
    // long as the capsule, which we hold for the whole read.
    let ptr = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) };
    if ptr.is_null() {
        let _ = PyErr::take(obj.py());
        return Ok(None);
    }
    let st = unsafe { &*(ptr as *const ArrayInterfaceStruct) };
    if st.two != 2 || st.nd < 0 {
        return Ok(None);
    }
    let nd = st.nd as usize;
    let shape: Vec<usize> = (0..nd)
        .map(|i| unsafe { *st.shape.add(i) } as usize)
        .collect();
    let dtype = match (st.typekind as u8, st.itemsize) {
        (b'i', 4) => Dtype::I32,
        (b'i', 8) => Dtype::I64,
        (b'u', 4) => Dtype::U32,
        (kind, size) => {
            return Err(invalid(format!(
                "{what}: dtype {}{size} is not supported (use int32, uint32 or int64)",
                kind as char
            )))
        }
    };
    let n: usize = shape.iter().product();
    if n > 1 && st.flags & ARR_C_CONTIGUOUS == 0 {
        return Err(invalid(format!("{what}: array must be C-contiguous")));
    }
    if st.flags & (ARR_ALIGNED | ARR_NOTSWAPPED) != (ARR_ALIGNED | ARR_NOTSWAPPED) {
        return Err(invalid(format!(
            "{what}: array must be aligned and in native byte order"
        )));
    }
    if st.data.is_null() && n > 0 {
        return Err(invalid(format!("{what}: array has no data")));
    }
    Ok(Some(ArrayView {
        ptr: st.data as usize,
        dtype,
        shape,
        readonly: st.flags & ARR_WRITEABLE == 0,
    }))
}

/// Look at `obj` as an array, if it exposes `__array_struct__` or `__array_interface__`.
pub fn array_view(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<ArrayView>> {
    if let Some(v) = array_struct_view(obj, what)? {
        return Ok(Some(v));
    }
    let Ok(iface) = obj.getattr(pyo3::intern!(obj.py(), "__array_interface__")) else {
        return Ok(None);
    };
    let iface = iface
        .cast_into::<PyDict>()
        .map_err(|_| invalid(format!("{what}: bad __array_interface__")))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        iface
            .get_item(k)?
            .ok_or_else(|| invalid(format!("{what}: __array_interface__ lacks '{k}'")))
    };
    let typestr: String = get("typestr")?.extract()?;
    let dtype = Dtype::parse(&typestr).ok_or_else(|| {
        invalid(format!(
            "{what}: dtype {typestr} is not supported (use int32, uint32 or int64)"
        ))
    })?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let data = get("data")?.cast_into::<PyTuple>().map_err(|_| {
        invalid(format!(
            "{what}: array data is not a (pointer, readonly) pair"
        ))
    })?;
    let ptr: usize = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    if let Some(strides) = iface.get_item("strides")? {
        if !strides.is_none() {
            let strides: Vec<isize> = strides.extract()?;
            let mut expect = dtype.size() as isize;
            for (s, &n) in strides.iter().zip(&shape).rev() {
                if n > 1 && *s != expect {
                    return Err(invalid(format!("{what}: array must be C-contiguous")));
                }
                expect *= n as isize;
            }
        }
    }
    if ptr == 0 && shape.iter().product::<usize>() > 0 {
        return Err(invalid(format!("{what}: array has no data")));
    }
    Ok(Some(ArrayView {
        ptr,
        dtype,
        shape,
        readonly,
    }))
}

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
            // SAFETY: we hold the list. PyList_GetItem returns a borrowed reference or NULL
            // (with IndexError) if the list shrank meanwhile (only an item's __index__ could
            // run Python code, on the slow path, which takes its own reference first).
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
    if let Some(view) = array_view(obj, "token_ids")? {
        if view.shape.len() != 1 {
            return Err(invalid("token_ids must be one-dimensional"));
        }
        let n = view.len();
        let mut out = Vec::with_capacity(n);
        // SAFETY: `obj` keeps the array alive; pointer and length come from the array itself.
        unsafe {
            match view.dtype {
                Dtype::U32 => {
                    out.extend_from_slice(std::slice::from_raw_parts(view.ptr as *const u32, n))
                }
                Dtype::I32 => {
                    for &v in std::slice::from_raw_parts(view.ptr as *const i32, n) {
                        out.push(check_token(v as i64)?);
                    }
                }
                Dtype::I64 => {
                    for &v in std::slice::from_raw_parts(view.ptr as *const i64, n) {
                        out.push(check_token(v)?);
                    }
                }
            }
        }
        return Ok(Cow::Owned(out));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(crate::errors::wrong_type(
            "token_ids must be a sequence of ints, not a string",
        ));
    }
    let seq = obj.try_iter().map_err(|_| {
        crate::errors::wrong_type(format!(
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
    // SAFETY: `item` is a valid borrowed reference owned by a list we hold.
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
            _ => Err(crate::errors::wrong_type(format!(
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

/// An integer argument (`what` names it in messages): bool and non-ints are type errors,
/// ints outside i64 are invalid arguments (never an OverflowError).
pub fn int_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() || !obj.is_instance_of::<pyo3::types::PyInt>() {
        if let Ok(idx) = obj.call_method0(pyo3::intern!(obj.py(), "__index__")) {
            if !obj.is_instance_of::<pyo3::types::PyBool>() {
                return int_arg(&idx, what);
            }
        }
        return Err(crate::errors::wrong_type(format!(
            "{what} must be an int, got {}",
            type_name(obj)
        )));
    }
    obj.extract::<i64>()
        .map_err(|_| invalid(format!("{what} is out of range: {obj}")))
}

/// A block hash argument (an int in [0, 2**128)).
pub fn hash_arg(obj: &Bound<'_, PyAny>) -> PyResult<u128> {
    if obj.is_instance_of::<pyo3::types::PyBool>() || !obj.is_instance_of::<pyo3::types::PyInt>() {
        return Err(crate::errors::wrong_type(format!(
            "block_hash must be an int, got {}",
            type_name(obj)
        )));
    }
    obj.extract::<u128>()
        .map_err(|_| invalid(format!("block_hash must be in [0, 2**128), got {obj}")))
}

pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// A writable int32 array with the given number of dimensions, as a raw slice.
pub struct I32Out {
    pub ptr: *mut i32,
    pub shape: Vec<usize>,
}

pub fn writable_i32(obj: &Bound<'_, PyAny>, what: &str, ndim: usize) -> PyResult<I32Out> {
    let view = array_view(obj, what)?.ok_or_else(|| {
        invalid(format!(
            "{what} must be a numpy int32 array (torch: pass tensor.numpy())"
        ))
    })?;
    if view.dtype != Dtype::I32 {
        return Err(invalid(format!("{what} must have dtype int32")));
    }
    if view.readonly {
        return Err(invalid(format!("{what} is read-only")));
    }
    if view.shape.len() != ndim {
        return Err(invalid(format!(
            "{what} must be {ndim}-dimensional, got shape {:?}",
            view.shape
        )));
    }
    Ok(I32Out {
        ptr: view.ptr as *mut i32,
        shape: view.shape,
    })
}

/// A non-negative integer argument: wrong types raise `ArgumentTypeError`, negative or
/// too-large values `InvalidArgumentError` (never a bare OverflowError).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for Count {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<pyo3::types::PyInt>()
            && !obj.is_instance_of::<pyo3::types::PyBool>()
        {
            // the whole u64 range (hash seeds use all of it)
            return obj
                .extract::<u64>()
                .map(Count)
                .map_err(|_| invalid(format!("expected an int in [0, 2**64), got {}", &*obj)));
        }
        let v = int_arg(&obj, "argument")?;
        u64::try_from(v)
            .map(Count)
            .map_err(|_| invalid(format!("expected a non-negative int, got {v}")))
    }
}

impl Count {
    pub fn usize(self) -> usize {
        self.0 as usize
    }
    /// The value as a `u32`, or an InvalidArgumentError naming `what`.
    pub fn u32(self, what: &str) -> PyResult<u32> {
        u32::try_from(self.0).map_err(|_| invalid(format!("{what} is too large: {}", self.0)))
    }
}

/// A real-number argument (int or float): other types raise `ArgumentTypeError`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Real(pub f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Real {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<pyo3::types::PyBool>() {
            return Err(crate::errors::wrong_type("expected a number, got bool"));
        }
        obj.extract::<f64>().map(Real).map_err(|_| {
            crate::errors::wrong_type(format!("expected a number, got {}", type_name(&obj)))
        })
    }
}

/// An `i32` argument (pad values): other types or out-of-range values raise our errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Int32(pub i32);

impl<'a, 'py> FromPyObject<'a, 'py> for Int32 {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let v = int_arg(&obj, "argument")?;
        i32::try_from(v)
            .map(Int32)
            .map_err(|_| invalid(format!("expected an int32 value, got {v}")))
    }
}

/// An `i64` argument: other types raise `ArgumentTypeError`, ints beyond i64
/// `InvalidArgumentError`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Int64(pub i64);

impl<'a, 'py> FromPyObject<'a, 'py> for Int64 {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        int_arg(&obj, "argument").map(Int64)
    }
}
