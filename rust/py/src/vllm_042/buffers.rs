//! Views of caller-owned numpy arrays: the int32 outputs of the batch step API, and integer
//! token arrays to read.
//!
//! Only real numpy arrays are accepted (`numpy.ndarray` and subclasses, checked by numpy's own
//! type check): an object merely claiming an array interface could name any address. Views go
//! through the `numpy` crate's borrow-tracked types, which check dtype, dimensions, alignment
//! and contiguity, refuse read-only arrays, and refuse a second writable view that overlaps
//! one already taken (so two output arguments can never alias). A view is taken only after
//! every Python callback of the call, and dropped before the next one, so no Python code runs
//! while we hold a pointer into an array (that code could resize or free it).
//!
//! torch CPU tensors are passed as `t.numpy()`, which shares the tensor's memory.

use crate::errors::{invalid, wrong_type};
use numpy::{
    dtype, BorrowError, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadwriteArray1,
    PyReadwriteArray2, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

/// One output argument of a step call: its name, the object (if given) and its rank.
pub struct OutputArg<'a, 'py> {
    name: &'static str,
    obj: Option<&'a Bound<'py, PyAny>>,
}

impl<'a, 'py> OutputArg<'a, 'py> {
    pub fn table(obj: &'a Bound<'py, PyAny>) -> Self {
        OutputArg {
            name: "block_tables",
            obj: Some(obj),
        }
    }
    pub fn vec(name: &'static str, obj: Option<&'a Bound<'py, PyAny>>) -> Self {
        OutputArg { name, obj }
    }
}

fn borrow_error(what: &str, e: BorrowError) -> PyErr {
    match e {
        BorrowError::NotWriteable => invalid(format!("{what} is read-only")),
        _ => invalid(format!(
            "{what} overlaps another output buffer of this call (or is being written by another \
             call); pass separate arrays"
        )),
    }
}

/// The writable views of one step call's outputs, taken together: numpy's borrow tracking
/// refuses any pair that overlaps.
pub struct StepViews<'py> {
    table: PyReadwriteArray2<'py, i32>,
    vecs: Vec<(&'static str, Option<PyReadwriteArray1<'py, i32>>)>,
}

/// Borrow the outputs of a step call (`[block_tables, 1-D outputs...]`) for writing.
pub fn step_outputs<'py>(args: &[OutputArg<'_, 'py>]) -> PyResult<StepViews<'py>> {
    let (first, rest) = args.split_first().expect("block_tables comes first");
    let obj = first.obj.expect("block_tables is required");
    let table = typed_array::<i32>(obj, first.name, 2)?
        .cast::<PyArray2<i32>>()?
        .try_readwrite()
        .map_err(|e| borrow_error(first.name, e))?;
    let mut vecs = Vec::with_capacity(rest.len());
    for arg in rest {
        let view = match arg.obj {
            Some(obj) if !obj.is_none() => Some(
                typed_array::<i32>(obj, arg.name, 1)?
                    .cast::<PyArray1<i32>>()?
                    .try_readwrite()
                    .map_err(|e| borrow_error(arg.name, e))?,
            ),
            _ => None,
        };
        vecs.push((arg.name, view));
    }
    Ok(StepViews { table, vecs })
}

impl<'py> StepViews<'py> {
    pub fn table_shape(&self) -> (usize, usize) {
        let s = self.table.shape();
        (s[0], s[1])
    }

    /// `(name, length)` of each 1-D output that was given.
    pub fn vec_lens(&self) -> Vec<(&'static str, usize)> {
        self.vecs
            .iter()
            .filter_map(|(name, v)| v.as_ref().map(|v| (*name, v.len())))
            .collect()
    }

    /// The table (row-major) with its column count, then the 1-D outputs in argument order
    /// (`context_lens`, `slot_mapping`).
    #[allow(clippy::type_complexity)]
    pub fn slices(
        &mut self,
    ) -> PyResult<(&mut [i32], usize, Option<&mut [i32]>, Option<&mut [i32]>)> {
        // (contiguity and alignment were checked when the views were taken; an error here
        // would mean numpy changed the flags under a borrow)
        let not_contiguous = |_| invalid("an output buffer is not contiguous and aligned");
        let cols = self.table.shape()[1];
        let table = self.table.as_slice_mut().map_err(not_contiguous)?;
        let mut out = [None, None];
        for (slot, (_, v)) in out.iter_mut().zip(self.vecs.iter_mut()) {
            if let Some(v) = v.as_mut() {
                *slot = Some(v.as_slice_mut().map_err(not_contiguous)?);
            }
        }
        let [a, b] = out;
        Ok((table, cols, a, b))
    }
}

/// A writable view of a 1-D numpy array of `T` (`what` names it in errors). Overlap with any
/// view the caller already holds is refused by numpy's borrow tracking.
pub fn writable_1d<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadwriteArray1<'py, T>> {
    typed_array::<T>(obj, what, 1)?
        .cast::<PyArray1<T>>()?
        .try_readwrite()
        .map_err(|e| borrow_error(what, e))
}

/// A writable view of a 2-D C-contiguous int32 numpy array.
pub fn writable_2d_i32<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadwriteArray2<'py, i32>> {
    typed_array::<i32>(obj, what, 2)?
        .cast::<PyArray2<i32>>()?
        .try_readwrite()
        .map_err(|e| borrow_error(what, e))
}

/// A numpy array of rank `ndim` and dtype `T` (C-contiguous, aligned), or a clear error.
fn typed_array<'a, 'py, T: numpy::Element>(
    obj: &'a Bound<'py, PyAny>,
    what: &str,
    ndim: usize,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    let want = dtype::<T>(obj.py());
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        wrong_type(format!(
            "{what} must be a numpy {want} array (torch: pass tensor.numpy()), got {}",
            crate::args::type_name(obj)
        ))
    })?;
    if !arr.dtype().is_equiv_to(&want) {
        return Err(invalid(format!("{what} must have dtype {want}")));
    }
    if arr.ndim() != ndim {
        return Err(invalid(format!(
            "{what} must be {ndim}-dimensional, got shape {:?}",
            arr.shape()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(invalid(format!("{what} must be C-contiguous")));
    }
    if !arr.is_aligned() {
        return Err(invalid(format!("{what} must be aligned for {want}")));
    }
    Ok(arr)
}
