//! `pagedkv._native`: a thin PyO3 layer over `pagedkv-core`. It converts arguments, maps
//! errors to `pagedkv.errors`, and writes into caller-owned buffers; all logic is in the core.

use pyo3::prelude::*;

mod arrays;
mod compat_enum;
mod errors;
mod hashing;
mod manager;
mod pool;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<hashing::PyTokenSeq>()?;
    m.add("CompatEnumBase", compat_enum::make_type(m.py())?)?;
    m.add_class::<hashing::PyBlockHasher>()?;
    m.add_class::<pool::PyBlockPool>()?;
    m.add_class::<manager::PyManager>()?;
    m.add_function(wrap_pyfunction!(hashing::hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::set_default_hasher, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::get_default_hasher, m)?)?;
    Ok(())
}
