//! Typed errors of the core. The bindings map each kind to one Python exception class
//! (`pagedkv.errors`); nothing in the core panics on bad input.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Not enough free blocks on a device for the requested operation.
    OutOfBlocks {
        device: &'static str,
        needed: usize,
        free: usize,
    },
    /// A sequence id the manager has no block table for.
    UnknownSequence(u64),
    /// A block id outside `0..num_blocks`.
    BlockOutOfRange { block: i64, num_blocks: u32 },
    /// Dropping a reference to a block whose ref count is already 0.
    DoubleFree(u32),
    /// Any other argument that breaks a precondition (message says which).
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::OutOfBlocks {
                device,
                needed,
                free,
            } => write!(f, "out of {device} blocks: {needed} needed, {free} free"),
            Error::UnknownSequence(id) => write!(f, "unknown sequence id {id}"),
            Error::BlockOutOfRange { block, num_blocks } => write!(
                f,
                "block id {block} is out of range (pool has {num_blocks} blocks)"
            ),
            Error::DoubleFree(b) => write!(f, "block {b} freed while its ref count is already 0"),
            Error::InvalidArgument(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Error {}
