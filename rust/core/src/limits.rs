//! Size limits shared by every entry point (bindings and core constructors), so that one rule,
//! with one message, decides what a pool or a sequence may be.

use crate::error::{Error, Result};

/// The largest block size accepted. vLLM uses 8..=32; the bound keeps `block_size * blocks`
/// arithmetic far from overflow and rejects a mistyped argument early.
pub const MAX_BLOCK_SIZE: usize = 1 << 20;

/// The number of slots (`num_blocks * block_size`) a GPU pool may have: slot numbers are
/// written into int32 buffers (`slot_mapping`), and a wrapped negative slot would read as
/// padding to a paged-attention kernel (silently dropping the token's KV).
pub const MAX_GPU_SLOTS: u64 = 1 << 31;

/// Check a block size argument: `1..=MAX_BLOCK_SIZE`.
pub fn check_block_size(block_size: i64) -> Result<usize> {
    if block_size <= 0 || block_size as u64 > MAX_BLOCK_SIZE as u64 {
        return Err(Error::invalid(format!(
            "block_size must be in 1..=2**20, got {block_size}"
        )));
    }
    Ok(block_size as usize)
}

/// Check that every slot of a GPU pool fits an int32 (`num_blocks * block_size <= 2**31`).
pub fn check_gpu_slots(num_blocks: u32, block_size: usize) -> Result<()> {
    let slots = u64::from(num_blocks).saturating_mul(block_size as u64);
    if slots > MAX_GPU_SLOTS {
        return Err(Error::invalid(format!(
            "a GPU pool of {num_blocks} blocks of {block_size} tokens has {slots} slots; \
             slot numbers must fit int32 (at most 2**31 slots)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_bound() {
        assert_eq!(check_block_size(1), Ok(1));
        assert_eq!(check_block_size(1 << 20), Ok(1 << 20));
        for bad in [0, -1, (1 << 20) + 1, i64::MAX, i64::MIN] {
            assert!(matches!(
                check_block_size(bad),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn gpu_slots_bound() {
        assert!(check_gpu_slots(1 << 27, 16).is_ok()); // exactly 2**31 slots
        assert!(check_gpu_slots((1 << 27) + 1, 16).is_err());
        assert!(check_gpu_slots(u32::MAX - 1, 1 << 20).is_err());
        assert!(check_gpu_slots(0, 1 << 20).is_ok());
    }
}
