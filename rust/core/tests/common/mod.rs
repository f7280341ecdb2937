//! A counting global allocator for the integration tests that measure memory: live heap
//! bytes (`live_bytes`, for per-block and per-sequence sizes) and allocation calls
//! (`allocations`, for per-step churn). Each test file installs it with
//! `#[global_allocator] static ALLOC: common::Counting = common::Counting;`. The counters are
//! process-wide, so each such file holds one test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static CALLS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to the system allocator with the caller's own arguments, so
// each of `GlobalAlloc`'s contracts is the system allocator's; the counters are atomics
// updated on the side (no aliasing, no allocation, safe from any thread).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::SeqCst);
        CALLS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::SeqCst);
        CALLS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Ordering::SeqCst);
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
        CALLS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.realloc(p, l, new) }
    }
}

/// Heap bytes currently allocated.
#[allow(dead_code)] // each test file uses one of the two counters
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::SeqCst)
}

/// Allocation calls so far (`alloc`, `alloc_zeroed`, `realloc`).
#[allow(dead_code)]
pub fn allocations() -> usize {
    CALLS.load(Ordering::SeqCst)
}
