//! Argument types of the bindings: integers, reals and device names checked with pagedkv's
//! errors (wrong types raise `ArgumentTypeError`, bad values `InvalidArgumentError`, never a
//! bare OverflowError or TypeError).

use crate::errors::{invalid, wrong_type};
use pagedkv_core::vllm_042::Device;
use pyo3::prelude::*;

/// An integer argument (`what` names it in messages): bool and non-ints are type errors,
/// ints outside i64 are invalid arguments (never an OverflowError).
pub fn int_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() || !obj.is_instance_of::<pyo3::types::PyInt>() {
        if let Ok(idx) = obj.call_method0(pyo3::intern!(obj.py(), "__index__")) {
            if !obj.is_instance_of::<pyo3::types::PyBool>() {
                return int_arg(&idx, what);
            }
        }
        return Err(wrong_type(format!(
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
        return Err(wrong_type(format!(
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

/// A device name: "gpu" (or "GPU", "cuda") or "cpu" (or "CPU").
pub fn device_arg(device: &str) -> PyResult<Device> {
    match device {
        "gpu" | "GPU" | "cuda" => Ok(Device::Gpu),
        "cpu" | "CPU" => Ok(Device::Cpu),
        other => Err(invalid(format!(
            "device must be 'gpu' or 'cpu', got {other:?}"
        ))),
    }
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
            return Err(wrong_type("expected a number, got bool"));
        }
        obj.extract::<f64>()
            .map(Real)
            .map_err(|_| wrong_type(format!("expected a number, got {}", type_name(&obj))))
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

/// A non-negative count where "more than any u64" means the same as `u64::MAX`: a token or
/// block count vLLM only compares or caps (`min(..., max_model_len)`), so Python's unbounded
/// ints saturate instead of failing. Wrong types raise `ArgumentTypeError`, negative values
/// `InvalidArgumentError`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SatCount(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for SatCount {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if obj.is_instance_of::<pyo3::types::PyInt>()
            && !obj.is_instance_of::<pyo3::types::PyBool>()
        {
            if let Ok(v) = obj.extract::<u64>() {
                return Ok(SatCount(v));
            }
            // Not a u64: negative, or at least 2**64 (saturates).
            return if obj.lt(0)? {
                Err(invalid(format!(
                    "expected a non-negative int, got {}",
                    &*obj
                )))
            } else {
                Ok(SatCount(u64::MAX))
            };
        }
        let v = int_arg(&obj, "argument")?;
        u64::try_from(v)
            .map(SatCount)
            .map_err(|_| invalid(format!("expected a non-negative int, got {v}")))
    }
}

impl SatCount {
    /// The value as a `usize`, saturated.
    pub fn usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

/// A flag read as Python reads it in an `if` (its truth value): vLLM's manager takes
/// `delay_cache_blocks` and its kin that way, and a connector may hand the scheduler an int
/// for "load asynchronously", which the scheduler passes on as is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flag(pub bool);

impl<'a, 'py> FromPyObject<'a, 'py> for Flag {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.is_truthy().map(Flag)
    }
}

/// A text argument (a device name, say): anything but a `str` raises `ArgumentTypeError`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Text(pub String);

impl<'a, 'py> FromPyObject<'a, 'py> for Text {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.cast::<pyo3::types::PyString>()
            .map_err(|_| wrong_type(format!("expected a str, got {}", type_name(&obj))))?
            .to_str()
            .map(|s| Text(s.to_owned()))
    }
}
