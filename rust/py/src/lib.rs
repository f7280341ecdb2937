//! `pagedkv._native`: a thin PyO3 layer over `pagedkv-core`. It converts arguments, maps
//! errors to `pagedkv.errors`, and writes into caller-owned buffers; all logic is in the core.

use pyo3::prelude::*;

mod arrays;
mod errors;
mod hashing;
mod manager;
mod pool;
mod scheduler;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<hashing::PyTokenSeq>()?;
    m.add_class::<hashing::PyBlockHasher>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<manager::PyManager>()?;
    m.add_class::<scheduler::PySchedulerCore>()?;
    m.add_function(wrap_pyfunction!(hashing::hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::set_default_hasher, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::get_default_hasher, m)?)?;
    Ok(())
}
