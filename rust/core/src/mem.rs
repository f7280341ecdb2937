//! Heap accounting: the bytes a structure holds, from its containers' capacities (checked
//! against a counting allocator in `tests/memory.rs`).

use std::collections::HashMap;

/// Heap bytes of a `Vec`'s buffer.
pub fn vec_bytes<T>(v: &Vec<T>) -> usize {
    v.capacity() * std::mem::size_of::<T>()
}

/// Heap bytes of a `HashMap`'s table (hashbrown: per bucket one `(K, V)` slot and one control
/// byte, plus a group of trailing control bytes). `capacity()` is `buckets - 1` below 8
/// buckets and `buckets / 8 * 7` from 8 on, which gives the bucket count back.
pub fn map_bytes<K, V, S>(m: &HashMap<K, V, S>) -> usize {
    table_bytes(m.capacity(), std::mem::size_of::<(K, V)>())
}

/// Heap bytes of a hashbrown table of `capacity()` `cap` holding `slot`-byte entries.
pub fn table_bytes(cap: usize, slot: usize) -> usize {
    let buckets = match cap {
        0 => return 0,
        c if c < 7 => c + 1,
        c => c / 7 * 8,
    };
    const GROUP: usize = 16;
    (buckets * slot).next_multiple_of(GROUP) + buckets + GROUP
}

/// `vec![value; n]`, or an error when the memory cannot be had: a pool sized by a caller's
/// count must refuse a count it cannot hold (an infallible `vec!` aborts the process).
pub fn try_filled<T: Clone>(value: T, n: usize, what: &str) -> crate::error::Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        crate::error::Error::invalid(format!(
            "cannot allocate {what} for {n} blocks ({} bytes)",
            n.saturating_mul(std::mem::size_of::<T>())
        ))
    })?;
    v.resize(n, value);
    Ok(v)
}

/// Refuse a structure of `bytes` the process cannot allocate (its tables would abort the
/// process when allocated infallibly): the memory is reserved once, then given back.
pub fn check_fits(bytes: usize, what: &str) -> crate::error::Result<()> {
    Vec::<u8>::new().try_reserve_exact(bytes).map_err(|_| {
        crate::error::Error::invalid(format!("cannot allocate {what} ({bytes} bytes)"))
    })
}
