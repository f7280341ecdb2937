//! Results as Python objects: `AllocStatus` members and `BlockMapping`s of block pairs.

use pagedkv_core::vllm_042::{AllocStatus, BlockId, Copies};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList};

pub fn alloc_status(py: Python<'_>, s: AllocStatus) -> PyResult<Py<PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let cls = CELL.get_or_try_init(py, || {
        Ok::<_, PyErr>(
            py.import("pagedkv.vllm_042.block_manager")?
                .getattr("AllocStatus")?
                .unbind(),
        )
    })?;
    let name = match s {
        AllocStatus::Ok => "OK",
        AllocStatus::Later => "LATER",
        AllocStatus::Never => "NEVER",
    };
    Ok(cls.bind(py).getattr(name)?.unbind())
}

/// `pagedkv.block_manager.BlockMapping` (a read-only dict; the Python manager class turns it
/// into vLLM 0.5's list of pairs when built with `mapping_format="pairs"`), and its shared
/// empty instance: most calls copy nothing, and then cost no allocation.
fn block_mapping_class(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Ok(CELL
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("pagedkv.vllm_042.block_manager")?
                    .getattr("BlockMapping")?
                    .unbind(),
            )
        })?
        .bind(py))
}

fn empty_mapping(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static CELL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Ok(CELL
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(block_mapping_class(py)?.call0()?.unbind())
        })?
        .bind(py)
        .clone())
}

pub fn copies_dict<'py>(py: Python<'py>, copies: &Copies) -> PyResult<Bound<'py, PyAny>> {
    if copies.is_empty() {
        return empty_mapping(py);
    }
    let d = PyDict::new(py);
    for &(src, dst) in copies {
        match d.get_item(src)? {
            Some(list) => list.cast_into::<PyList>()?.append(dst)?,
            None => d.set_item(src, PyList::new(py, [dst])?)?,
        }
    }
    block_mapping_class(py)?.call1((d,))
}

pub fn mapping_dict<'py>(
    py: Python<'py>,
    mapping: &[(BlockId, BlockId)],
) -> PyResult<Bound<'py, PyAny>> {
    if mapping.is_empty() {
        return empty_mapping(py);
    }
    let d = PyDict::new(py);
    for &(a, b) in mapping {
        d.set_item(a, b)?;
    }
    block_mapping_class(py)?.call1((d,))
}
